"""Step caching under every plan up to 4 ranks == one process, same cached steps, resumable.

One spawned group of 4 gloo processes runs every feasible plan of 1..4 ranks (cfg = 2 on 2
and 4; LTX-2 cfg 4 on 4 too) for a CogVideoX case (guidance branches batched in one call), a Wan
case (two calls per step), a HunyuanVideo case (true CFG), an LTX-Video case, LTX-2 (four
passes, two output streams) and a Kandinsky 5 case, with fbcache and teacache; the tests compare each plan with the
single-process run here. The thresholds are chosen so that some steps are cached and no
step's decision quantity lies within 5% of the threshold (checked below), so a plan's
rounding cannot flip a decision.

Tolerances (float32): latents rtol 1e-4, atol 1e-4 (as the conformance suite: latents reach
O(30) with random weights).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raydit.models import conformance as harness
from raydit.models.cache import CACHED_STEPS
from raydit.models.cache_options import check_cache
from raydit.models.requests import GenerationRequest
from raydit.models.runner import Runner
from raydit.planner.runconfig import GroupModes

WORLDS = (1, 2, 3, 4)
CFG_WORLDS = (2, 4)
LATENT_TOL = dict(rtol=1e-4, atol=1e-4)
STEPS = 6
CHECKPOINT_STEP = 3  # mid-way: resumed by every plan; every plan's own checkpoint resumed here


@dataclasses.dataclass(frozen=True)
class CacheCase:
    name: str
    build: str
    build_kwargs: dict
    heads: int
    request: dict
    branch_degrees: tuple = (2,)  # the cfg degrees above 1 its plans take (on CFG_WORLDS)
    options: dict = dataclasses.field(default_factory=dict)  # the Runner's parallel_options

    def make(self):
        return harness._resolve(self.build)(**self.build_kwargs)

    def make_request(self) -> GenerationRequest:
        return GenerationRequest(**self.request)


def _cases() -> list[CacheCase]:
    from raydit.models.families.cogvideox import tiny as cogvideox_tiny
    from raydit.models.families.hunyuanvideo import tiny as hunyuan_tiny
    from raydit.models.families.kandinsky5 import tiny as kandinsky5_tiny
    from raydit.models.families.ltx import tiny as ltx_tiny
    from raydit.models.families.ltx2 import cases as ltx2_cases
    from raydit.models.families.ltx2 import tiny as ltx2_tiny
    from raydit.models.families.mochi import tiny as mochi_tiny
    from raydit.models.families.skyreels import tiny as skyreels_tiny
    from raydit.models.families.wan import tiny as wan_tiny

    ltx2_dir = dict(base_dir=str(ltx2_tiny.tiny_pipeline_dir()))
    ltx2_request = dict(ltx2_cases.TINY_REQUEST, num_inference_steps=STEPS, seed=4)

    cog = dict(base_dir=str(cogvideox_tiny.tiny_pipeline_dir()), max_text_seq_length=13)
    # 3 latent frames x 3 x 2 patches = 18 video tokens, 13 text tokens: padded on 4 and 3 ranks.
    cog_request = dict(prompt="a red fox", negative_prompt="blur", num_frames=9, height=48, width=32,
                       num_inference_steps=STEPS, guidance_scale=6.0, seed=3)
    wan_dir = str(wan_tiny.tiny_pipeline_dir("tiny-wan"))
    # 3 latent frames x 2 x 3 = 18 video tokens: padded on 4 ranks.
    wan_request = dict(prompt="a kite", negative_prompt="blur", num_frames=9, height=32, width=48,
                       num_inference_steps=STEPS, guidance_scale=5.0, seed=4)
    return [
        CacheCase("cogvideox-fbcache", "raydit.models.families.cogvideox.cases:cogvideox_pipeline", cog, 2,
                  dict(cog_request, cache="fbcache", cache_threshold=1.0)),
        CacheCase("cogvideox-teacache", "raydit.models.families.cogvideox.cases:cogvideox_pipeline", cog, 2,
                  dict(cog_request, cache="teacache", cache_threshold=1.5)),
        CacheCase("wan-fbcache", "raydit.models.families.wan.cases:wan_pipeline", dict(base_dir=wan_dir), 6,
                  dict(wan_request, cache="fbcache", cache_threshold=1.1)),
        # HunyuanVideo (issue 18): dual- and single-stream blocks, the masked text whole on every
        # rank, true CFG (two calls per step); 3 latent frames x 2 x 3 = 18 video tokens.
        CacheCase("hunyuanvideo-teacache", "raydit.models.families.hunyuanvideo.cases:hunyuan_pipeline",
                  dict(base_dir=str(hunyuan_tiny.tiny_pipeline_dir())), 6,
                  dict(prompt="a red fox", negative_prompt="blur", true_cfg_scale=4.0, num_frames=9, height=32,
                       width=48, num_inference_steps=STEPS, seed=4, cache="teacache", cache_threshold=1.5)),
        # LTX-Video: latents packed as tokens, 2 latent frames x 2 x 3 = 12 tokens (padded on 4 ranks).
        CacheCase("ltx-fbcache", "raydit.models.families.ltx.cases:ltx_pipeline",
                  dict(base_dir=str(ltx_tiny.tiny_pipeline_dir())),
                  6, dict(prompt="a kite", negative_prompt="blur", num_frames=9, height=64, width=96,
                          num_inference_steps=STEPS, guidance_scale=3.0, seed=4, cache="fbcache", cache_threshold=1.0)),
        # LTX-2 (issue 32): four guidance branches a step (the negative and positive pass as one
        # call, STG, modality), shared out on cfg 2 and cfg 4, video and audio output streams;
        # fbcache with the audio tokens split over the sp ranks too (18 audio, 39 video tokens).
        CacheCase("ltx2-fbcache", "raydit.models.families.ltx2.cases:ltx2_pipeline", ltx2_dir, 6,
                  dict(ltx2_request, cache="fbcache", cache_threshold=1.0), (2, 4), {"audio_split_tokens": 1}),
        CacheCase("ltx2-teacache", "raydit.models.families.ltx2.cases:ltx2_pipeline", ltx2_dir, 6,
                  dict(ltx2_request, cache="teacache", cache_threshold=1.3), (4,)),
        # Kandinsky 5: the visual blocks only (the text blocks run before them), channels-last
        # latents; 3 latent frames x 2 x 3 = 18 video tokens (padded on 4 ranks).
        CacheCase("kandinsky5-fbcache", "raydit.models.families.kandinsky5.cases:kandinsky5_pipeline",
                  dict(base_dir=str(kandinsky5_tiny.tiny_pipeline_dir())), 6,
                  dict(prompt="a kite", negative_prompt="blur", num_frames=9, height=32, width=48,
                       num_inference_steps=STEPS, guidance_scale=5.0, seed=4, cache="fbcache", cache_threshold=1.0)),
        # Mochi 1: the video and the whole text stream are both residual streams of its blocks;
        # the guidance pair batched in one call; 3 latent frames x 2 x 3 = 18 video tokens.
        CacheCase("mochi-teacache", "raydit.models.families.mochi.cases:mochi_pipeline",
                  dict(base_dir=str(mochi_tiny.tiny_pipeline_dir())), 6,
                  dict(prompt="a kite", negative_prompt="blur", num_frames=13, height=32, width=48,
                       num_inference_steps=STEPS, guidance_scale=4.5, seed=4, cache="teacache", cache_threshold=1.0)),
        # SkyReels-V2 diffusion forcing: a timestep per frame, so teacache's temb is [B, 6, L, C],
        # split with the video; 3 latent frames x 2 x 3 = 18 video tokens.
        CacheCase("skyreels-df-teacache", "raydit.models.families.skyreels.cases:skyreels_pipeline",
                  dict(base_dir=str(skyreels_tiny.tiny_pipeline_dir("tiny-skyreels-df"))), 6,
                  dict(wan_request, cache="teacache", cache_threshold=1.4)),
    ]


def _plans(case: CacheCase):
    return [p for w in WORLDS
            for p in harness.feasible_plans(w, case.heads, (1, *case.branch_degrees) if w in CFG_WORLDS else (1,))]


def _record_quantities(into: list):
    """Make every decision append the reduced sums it decided from (change, previous)."""
    from raydit.models import cache as cache_mod

    original = cache_mod._Run._ratio

    def recording(self, sums):
        value = original(self, sums)
        into.append(self.quantity)
        return value

    cache_mod._Run._ratio = recording
    return original


def cache_worker(rank: int, world_size: int, cases, checkpoints) -> dict:
    """Every case under every plan of 1..world_size ranks: fresh run (and the sums each
    decision was made from), its checkpoint at CHECKPOINT_STEP, and the run resumed from the
    one-process checkpoint."""
    quantities: list = []
    _record_quantities(quantities)
    out = {}
    for case in cases:
        pipe = case.make()
        request = case.make_request()
        for plan in _plans(case):
            mesh = harness.prefix_mesh(plan)
            if mesh is None:
                continue
            runner = Runner(pipe, mesh, group=GroupModes(parallel_options=case.options))
            try:
                quantities.clear()
                state = harness.run_steps(runner, request, CHECKPOINT_STEP)
                checkpoint = runner.checkpoint(state)
                while not state.done:
                    state = runner.step(state)
                sums = list(quantities)
                resumed = harness.run_steps(runner, request, STEPS, checkpoint=checkpoints[case.name])
                out[(case.name, str(plan))] = dict(
                    latents=state.latents, cached=state.carry[CACHED_STEPS], checkpoint=checkpoint, sums=sums,
                    resumed=resumed.latents, resumed_cached=resumed.carry[CACHED_STEPS])
            finally:
                runner.close()
    return out


@pytest.fixture(scope="module")
def cases():
    return _cases()


@pytest.fixture(scope="module")
def reference(cases):
    """One process: the final latents, the cached steps, every step's decision quantity and
    the checkpoint at CHECKPOINT_STEP."""
    from raydit.models import cache as cache_mod

    ratios: list[float] = []
    sums: list = []
    original = cache_mod._Run._ratio

    def recording(self, step_sums):
        value = original(self, step_sums)
        ratios.append(value if self.method == "fbcache" else self._accumulated + value)
        sums.append(self.quantity)
        return value

    refs = {}
    for case in cases:
        runner = Runner(case.make())
        request = case.make_request()
        ratios.clear()
        sums.clear()
        cache_mod._Run._ratio = recording
        try:
            state = harness.run_steps(runner, request, CHECKPOINT_STEP)
            checkpoint = runner.checkpoint(state)
            while not state.done:
                state = runner.step(state)
        finally:
            cache_mod._Run._ratio = original
        uncached = harness.run_steps(runner, dataclasses.replace(request, cache=None, cache_threshold=None), STEPS)
        refs[case.name] = dict(latents=state.latents, cached=state.carry[CACHED_STEPS], checkpoint=checkpoint,
                               ratios=list(ratios), sums=list(sums), uncached=uncached.latents, runner=runner)
    return refs


@pytest.fixture(scope="module")
def distributed(cases, reference):
    from raydit.parallel.testing import run_distributed

    checkpoints = {name: ref["checkpoint"] for name, ref in reference.items()}
    return run_distributed(cache_worker, max(WORLDS), cases, checkpoints, timeout=600)


def test_thresholds_cache_some_steps_and_decide_with_margin(cases, reference):
    for case in cases:
        ref = reference[case.name]
        threshold = case.request["cache_threshold"]
        assert 0 < ref["cached"] < STEPS - 1, f"{case.name}: {ref['cached']} cached steps"
        for value in ref["ratios"]:
            assert abs(value - threshold) > 0.05 * threshold, f"{case.name}: quantity {value} too close to {threshold}"
        # Caching changed the result (it is not a no-op), by a bounded amount.
        assert not torch.equal(ref["latents"], ref["uncached"])


@pytest.mark.long  # stage two: every plan's spawned group (~180 s); 2 ranks run in tests/runtime/engine/test_cache.py
@pytest.mark.slow
def test_every_plan_gives_the_one_process_latents_and_cached_steps(cases, reference, distributed):
    for case in cases:
        ref = reference[case.name]
        for plan in _plans(case):
            key = (case.name, str(plan))
            on_rank0 = distributed[0][key]
            for rank in range(plan.world_size):
                got = distributed[rank][key]
                assert got["cached"] == ref["cached"], f"{key} rank {rank}: {got['cached']} cached steps, one process {ref['cached']}"
                assert got["resumed_cached"] == ref["cached"], f"{key} rank {rank} resumed"
                torch.testing.assert_close(got["latents"], ref["latents"], **LATENT_TOL, msg=lambda m: f"{key} rank {rank}: {m}")
                torch.testing.assert_close(got["resumed"], ref["latents"], **LATENT_TOL,
                                           msg=lambda m: f"{key} rank {rank} resumed: {m}")
                assert torch.equal(got["latents"], on_rank0["latents"]), f"{key}: rank {rank} differs from rank 0"
                # Every rank decided from the sums of the whole call (all-reduced over the sp
                # group and the cfg pair): those of one process. A rank-local decision fails here.
                assert len(got["sums"]) == len(ref["sums"]), f"{key} rank {rank}: {len(got['sums'])} decisions"
                torch.testing.assert_close(torch.tensor(got["sums"]), torch.tensor(ref["sums"]), rtol=1e-4, atol=0,
                                           msg=lambda m: f"{key} rank {rank} decision sums: {m}")


@pytest.mark.long  # stage two: the same spawned group
@pytest.mark.slow
def test_a_checkpoint_of_any_plan_resumes_on_one_process(cases, reference, distributed):
    """The cached residuals in the checkpoint are full sequences: a checkpoint written by rank
    0 of a 3- or 4-rank plan resumes on one process to the uninterrupted result."""
    for case in cases:
        ref = reference[case.name]
        runner = ref["runner"]
        request = case.make_request()
        for plan in _plans(case):
            if plan.world_size < 3:
                continue
            checkpoint = distributed[0][(case.name, str(plan))]["checkpoint"]
            assert all(not isinstance(v, torch.Tensor) or v.device.type == "cpu" for v in checkpoint["carry"].values())
            state = harness.run_steps(runner, request, STEPS, checkpoint=checkpoint)
            assert state.carry[CACHED_STEPS] == ref["cached"], f"{case.name} from {plan}"
            torch.testing.assert_close(state.latents, ref["latents"], **LATENT_TOL, msg=lambda m: f"{case.name} from {plan}: {m}")


@pytest.mark.parametrize(
    "method, threshold, message",
    [
        ("fbcash", None, "cache 'fbcash' is not a step-cache method; use one of: fbcache, teacache"),
        ("fbcache", 0, "cache_threshold 0 must be a finite number > 0"),
        ("teacache", float("nan"), "cache_threshold nan must be a finite number > 0"),
        ("fbcache", "0.1", "cache_threshold '0.1' must be a finite number > 0"),
        (None, 0.1, "cache_threshold 0.1 needs a cache method"),
    ],
)
def test_bad_cache_options_are_one_line(method, threshold, message):
    with pytest.raises(ValueError, match=message) as info:
        check_cache(method, threshold)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        GenerationRequest(prompt="x", num_frames=9, height=48, width=32, cache=method, cache_threshold=threshold)


def test_caching_off_is_the_uncached_runner(cases, reference):
    """A runner that served a cached request runs an uncached one exactly as before (the
    hooks pass through), and a checkpoint records the request's cache choice."""
    case = cases[0]
    ref = reference[case.name]
    fresh = harness.run_steps(Runner(case.make()), dataclasses.replace(case.make_request(), cache=None,
                                                                       cache_threshold=None), STEPS)
    assert torch.equal(fresh.latents, ref["uncached"])
    assert ref["checkpoint"]["request"]["cache"] == case.request["cache"]
    with pytest.raises(ValueError, match="checkpoint belongs to request"):
        ref["runner"].prepare(dataclasses.replace(case.make_request(), cache=None, cache_threshold=None),
                              checkpoint=ref["checkpoint"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cache", "fastcache"], "cache 'fastcache' is not a step-cache method; use one of: fbcache, teacache"),
        (["--cache", "fbcache", "--cache-threshold", "-0.1"], "cache_threshold -0.1 must be a finite number > 0"),
        (["--cache", "teacache", "--cache-threshold", "abc"], "--cache-threshold: invalid float value: 'abc'"),
        (["--cache-threshold", "0.1"], "cache_threshold 0.1 needs a cache method"),
    ],
)
def test_cli_bad_cache_exits_2_with_one_line(argv, message, capsys):
    """Refused while reading the options: no Ray start, exit status 2, one line naming the value."""
    from raydit.cli import main

    assert main(["generate", "--prompt", "a fox", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_job_config_takes_cache_keys(tmp_path):
    from raydit.jobconfig import load_job_config

    path = tmp_path / "job.yaml"
    path.write_text("prompt: a fox\ncache: teacache\ncache-threshold: 1\n")
    assert load_job_config(str(path)) == {"prompt": "a fox", "cache": "teacache", "cache_threshold": 1.0}
    path.write_text("prompt: a fox\ncache: 3\n")
    with pytest.raises(ValueError, match="key 'cache' must be str"):
        load_job_config(str(path))
