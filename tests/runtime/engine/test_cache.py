"""Step caching through the Ray engine: every layout of 2 ranks equals one process.

One 2-rank engine on the tiny CogVideoX pipeline with `cache="fbcache"` as its default. Each
request's final latents equal the one-process Runner's with the same request (rtol 1e-4,
atol 1e-4 in float32, as tests/runtime/engine/test_engine.py) and `timings["cached_steps"]` equals
the one-process count exactly. The thresholds cache 1 of the 4 steps of this request (the
decision quantities of one process are fbcache 1.55, 1.11, 1.52 against 1.3 and teacache
1.88, 0.94 against 1.3: every one at least 15% from its threshold, so float32 rounding of a
plan cannot flip a decision; checked below). Per-request choices (`generate(cache=...)`)
override the engine's for that request only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydit.models.cache import CACHED_STEPS
from raydit.models.requests import GenerationRequest
from raydit.models.loading import load_pipeline
from raydit.models.runner import Runner

RTOL, ATOL = 1e-4, 1e-4
PROMPT = "a red fox running through fresh snow"
GEN = dict(num_frames=5, height=32, width=32, num_inference_steps=4, guidance_scale=6.0, seed=7)
THRESHOLD = 1.3
CHOICES = {"fbcache": ("fbcache", THRESHOLD), "teacache": ("teacache", THRESHOLD), "off": (None, None)}


@pytest.fixture(scope="module")
def references():
    """One process, per cache choice: the final latents, the cached steps and every step's
    decision quantity (fbcache: the relative change; teacache: the accumulated one)."""
    from raydit.models import cache as cache_mod

    quantities: list[float] = []
    original = cache_mod._Run._ratio

    def recording(self, sums):
        value = original(self, sums)
        quantities.append(value if self.method == "fbcache" else self._accumulated + value)
        return value

    runner = Runner(load_pipeline("tiny"))
    out = {}
    cache_mod._Run._ratio = recording
    try:
        for key, (method, threshold) in CHOICES.items():
            quantities.clear()
            state = runner.prepare(GenerationRequest(prompt=PROMPT, **GEN, cache=method, cache_threshold=threshold))
            while not state.done:
                state = runner.step(state)
            out[key] = dict(latents=state.latents.numpy(), cached=int(state.carry.get(CACHED_STEPS, 0)),
                            quantities=list(quantities))
    finally:
        cache_mod._Run._ratio = original
    return out


@pytest.fixture(scope="module")
def engine(ray_local):
    from raydit.runtime.engine import Engine

    engine = Engine(model="tiny", workers=2, device="cpu", show_plan=False, cache="fbcache",
                    cache_threshold=THRESHOLD, frames=GEN["num_frames"], height=GEN["height"], width=GEN["width"])
    yield engine
    engine.shutdown()


def _gen(engine, **kw):
    return engine.generate(PROMPT, progress=False, **{**GEN, **kw})


def _same(result, ref, what):
    assert result.timings["cached_steps"] == ref["cached"], (
        f"{what}: {result.timings['cached_steps']} cached steps, one process {ref['cached']}")
    torch.testing.assert_close(torch.from_numpy(result.latents), torch.from_numpy(ref["latents"]), rtol=RTOL,
                               atol=ATOL, msg=lambda m: f"{what}: {m}")


def test_thresholds_cache_some_steps_with_margin(references):
    for key in ("fbcache", "teacache"):
        ref = references[key]
        assert ref["cached"] == 1, f"{key}: {ref['cached']} cached steps of {GEN['num_inference_steps']}"
        assert all(abs(q - THRESHOLD) > 0.1 * THRESHOLD for q in ref["quantities"]), (key, ref["quantities"])
        # Caching changed the result: the test would not see a cache that never skipped.
        assert not np.array_equal(ref["latents"], references["off"]["latents"])
    assert references["off"]["cached"] == 0


def test_every_layout_of_2_ranks_caches_as_one_process(engine, references):
    """The engine's default (fbcache) on ulysses 2, ring 2 and cfg 2: the latents and the
    cached steps of one process. The decision is all-reduced over the sequence-parallel group
    (and the cfg pair): were it rank-local, the ranks would skip different steps."""
    from raydit.verify import feasible_layouts

    layouts = [d for d in feasible_layouts(engine.spec.heads, 2) if d[0] * d[1] * d[2] == 2]
    assert {(2, 1, 1), (1, 2, 1), (1, 1, 2)} <= set(layouts)
    for ulysses, ring, cfg in layouts:
        engine.regroup(ulysses=ulysses, ring=ring, cfg=cfg)
        _same(_gen(engine), references["fbcache"], f"fbcache on ulysses {ulysses} x ring {ring} x cfg {cfg}")


def test_a_request_chooses_its_own_cache_and_nothing_leaks(engine, references):
    """Per-request choices on the same warm workers, no regroup: teacache, then caching off
    (equal to the uncached reference: no residual of the cached request is reused), then the
    engine's default again."""
    engine.regroup(ulysses=2, ring=1, cfg=1)
    plan = engine.plan
    _same(_gen(engine, cache="teacache", cache_threshold=THRESHOLD), references["teacache"], "teacache request")
    off = _gen(engine, cache=None)
    _same(off, references["off"], "uncached request after a cached one")
    _same(_gen(engine), references["fbcache"], "the engine's default after per-request choices")
    assert engine.plan is plan  # nothing re-planned


def test_a_bad_request_cache_is_one_line_and_the_engine_keeps_serving(engine):
    for kw, message in (
        (dict(cache="fbcash"), "cache 'fbcash' is not a step-cache method; use one of: fbcache, teacache"),
        (dict(cache=None, cache_threshold=0.5), "cache_threshold 0.5 needs a cache method"),
        (dict(cache_threshold=-1.0), "cache_threshold -1.0 must be a finite number > 0"),
    ):
        with pytest.raises(ValueError, match=message) as info:
            _gen(engine, **kw)
        assert "\n" not in str(info.value)


def test_a_frame_count_the_vae_changes_is_said(engine, caplog):
    """5 frames of the tiny CogVideoX are 2 latent frames, which its VAE (as diffusers' pipeline
    runs it) decodes into 8: the video has 8 frames, and the Engine says so in one logged line
    rather than hand back another count than asked without a word."""
    import logging

    with caplog.at_level(logging.WARNING, logger="raydit"):
        result = _gen(engine, cache=None)
    assert result.frames.shape[0] == 8
    assert "num_frames 5 gave 8 frames, as diffusers' CogVideoXPipeline does" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="raydit"):
        assert _gen(engine, cache=None, num_frames=1).frames.shape[0] == 1  # as asked: nothing said
    assert "gave" not in caplog.text
