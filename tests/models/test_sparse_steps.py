"""Sparse attention in the Runner's steps (issue 55 phase 2; raydit.models.sparse_steps).

The kernel against dense attention with an independently built boolean mask is
tests/parallel/test_sparse_attention.py's; here, the request's setting through the Runner:
- dense steps = all steps: the dense result bit for bit (no processor is even installed);
- the sparse steps change the result, dense_layers keeps the first blocks dense;
- every plan (Ulysses, ring, hybrid, cfg; 45 video tokens, which 4 ranks do not divide) equals
  one worker within rtol/atol 1e-4 (float32), as the conformance suite's latents;
- step-level batching: requests of other sparse settings never share a step; one setting's
  requests at a dense and a sparse step share none either, and each equals its run alone;
- refusals, one line each: unknown method or option, dense steps above the steps, tiles that
  do not divide the token grid (naming the divisors), a family without a token grid.
Tiny Wan 2.1: 9 frames 48 x 80 -> a (3, 3, 5) token grid, 6 heads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raydit.models import conformance as harness
from raydit.models.families.wan import cases as wan_cases
from raydit.models.families.wan import tiny as wan_tiny
from raydit.models.requests import GenerationRequest
from raydit.models.runner import Runner

BUILD = "raydit.models.families.wan.cases:wan_pipeline"
BASE = dict(prompt="a red fox runs", num_frames=9, height=48, width=80, seed=5, num_inference_steps=3,
            guidance_scale=5.0)
# STA on 1 x 1 x 1 tiles, window 1 frame x 3 rows x 3 columns: density 1/3 x 1 x 3/5 = 0.2.
STA = {"method": "sta", "tile": (1, 1, 1), "window": (1, 3, 3), "dense_steps": 1}
# Radial with a 4-token block (the published 128 would keep only the sink frame at 15 tokens a
# frame) and its first block dense.
RADIAL = {"method": "radial", "block": 4, "dense_layers": 1, "dense_steps": 0}
TOL = dict(rtol=1e-4, atol=1e-4)


def kwargs() -> dict:
    return dict(base_dir=str(wan_tiny.tiny_pipeline_dir("tiny-wan")))


@pytest.fixture(scope="module")
def runner():
    r = Runner(wan_cases.wan_pipeline(**kwargs()))
    yield r
    r.close()


def run(runner, **over):
    return harness.run_steps(runner, GenerationRequest(**{**BASE, **over}), None).latents


@pytest.fixture(scope="module")
def dense(runner):
    return run(runner)


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("setting", [STA, RADIAL], ids=["sta", "radial"])
def test_dense_steps_equal_to_all_steps_is_dense_bit_for_bit(runner, dense, setting):
    got = run(runner, sparse_attention={**setting, "dense_steps": BASE["num_inference_steps"]})
    assert torch.equal(got, dense)


@pytest.mark.parametrize("setting", [STA, RADIAL], ids=["sta", "radial"])
def test_sparse_steps_change_the_result(runner, dense, setting):
    assert rel(run(runner, sparse_attention=setting), dense) > 1e-3


def test_dense_layers_keep_the_first_blocks_dense(runner, dense):
    blocks = len(runner.transformer.blocks)
    every = run(runner, sparse_attention={**RADIAL, "dense_layers": blocks})
    torch.testing.assert_close(every, dense, rtol=1e-5, atol=1e-5)  # the one-rank processors' SDPA
    first = run(runner, sparse_attention=RADIAL)
    none = run(runner, sparse_attention={**RADIAL, "dense_layers": 0})
    assert rel(first, none) > 1e-4 and rel(first, dense) > 1e-4


def test_the_published_fraction_scales_to_the_request(runner, dense):
    # STA's 0.3 of 3 steps is 0 dense steps; of 4 it is 1: the request's first step is dense.
    from raydit.planner.sparse import SparseConfig

    assert SparseConfig("sta").dense_step_count(3) == 0 and SparseConfig("sta").dense_step_count(4) == 1
    one = run(runner, sparse_attention={**STA, "dense_steps": None}, num_inference_steps=4)
    explicit = run(runner, sparse_attention={**STA, "dense_steps": 1}, num_inference_steps=4)
    assert torch.equal(one, explicit)


@pytest.mark.slow
@pytest.mark.long
def test_every_plan_equals_one_worker(runner):
    from raydit.parallel.testing import run_distributed

    requests = [{**BASE, "sparse_attention": STA}, {**BASE, "seed": 6, "sparse_attention": RADIAL}]
    refs = [run(runner, **{k: v for k, v in q.items() if k not in BASE or q[k] != BASE[k]}) for q in requests]
    plans = [(2, 1, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2)]  # Ulysses, ring (uneven), hybrid, cfg x ring
    for i, (request, ref) in enumerate(zip(requests, refs)):
        out = run_distributed(harness.batching_worker, 4, BUILD, kwargs(), [request], [0], plans, timeout=900)
        for plan in plans:
            name = str(harness.MeshPlan(*plan))
            got = out[0][name][0]
            torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"request {i} {name}: {m}")
            for rank in range(1, plan[0] * plan[1] * plan[2]):
                assert torch.equal(out[rank][name][0], got)


def test_other_sparse_settings_never_share_a_step(runner):
    family, pipe = runner.family, runner.pipe
    a = GenerationRequest(**BASE, sparse_attention=STA)
    b = GenerationRequest(**BASE, sparse_attention={**STA, "window": (1, 1, 1)})
    plain = GenerationRequest(**BASE)
    keys = {family.batch_key(pipe, r) for r in (a, b, plain)}
    assert len(keys) == 3 and None not in keys
    with pytest.raises(ValueError, match="cannot share a step"):
        runner.step_batch([runner.prepare(a), runner.prepare(b)])


def test_one_setting_at_a_dense_and_a_sparse_step_equals_each_alone(runner):
    # The second request joins after one step: the first is then at a sparse step, the second
    # at its dense first step; they share no call, and each equals its run alone.
    requests = [GenerationRequest(**BASE, sparse_attention=STA), GenerationRequest(**{**BASE, "seed": 9},
                                                                                    sparse_attention=STA)]
    batched = harness.run_batched(runner, requests, [0, 1])
    for request, state in zip(requests, batched):
        alone = harness.run_steps(runner, request, None).latents
        torch.testing.assert_close(state.latents, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting, needle", [
    ({"method": "dense-ish"}, "sparse attention method 'dense-ish' is unknown; choose one of sta, radial"),
    ({"method": "sta", "windw": 3}, "sparse option(s) windw unknown"),
    ({"method": "sta", "dense_steps": 4}, "dense steps 4 is above the request's 3 steps; give 0..3"),
    ({"method": "sta", "dense_steps": -1}, "dense steps -1 must be an integer >= 0"),
])
def test_bad_settings_are_refused_in_one_line(setting, needle):
    with pytest.raises(ValueError) as err:
        GenerationRequest(**BASE, sparse_attention=setting)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_tiles_that_do_not_divide_the_grid_are_refused_naming_the_divisors(runner):
    request = GenerationRequest(**BASE, sparse_attention={"method": "sta", "tile": (1, 2, 5)})
    with pytest.raises(ValueError, match=r"sta tile 2 does not divide the 3 tokens of axis h; tile sizes that do: "
                                         r"1, 3 \(--sparse-option tile=t,h,w\)"):
        runner.prepare(request)


@pytest.mark.parametrize("case_name", ["kandinsky5-t2v", "skyreels-df-causal"])
def test_a_family_without_a_token_grid_refuses_sparse_requests(case_name):
    (case,) = [c for c in harness.family_cases(build=True)["runner"] if c.name == case_name]
    r = Runner(case.make())
    try:
        request = GenerationRequest(**dict(case.request, sparse_attention="sta"))
        with pytest.raises(ValueError, match=r"sparse attention is not available for \w+ \(family .*\) yet; it runs "
                                             r"on Wan.*HunyuanVideo.*: drop sparse_attention") as err:
            r.prepare(request)
        assert "\n" not in str(err.value)
    finally:
        r.close()


# -- the other families' token grids -------------------------------------------------------------
# Each family's main case, and the ones whose video sits elsewhere in the call: CogVideoX's text
# comes first, HunyuanVideo's and Mochi's after the video, LTX-Video packs its latents, CogVideoX
# 1.5 patches two frames a token, HunyuanVideo's image-to-video replaces frame 0.
FAMILY_CASES = ["hunyuanvideo-embedded", "hunyuanvideo-i2v", "cogvideox-2b-h30-rows30", "cogvideox-1.5-patch_t2-dpm",
                "mochi-t2v", "ltx-t2v", "ltx-i2v", "skyreels-t2v", "wan-t2v"]
FAMILY_STA = {"method": "sta", "tile": (1, 1, 1), "window": (1, 3, 3), "dense_steps": 0}


def _family_case(name):
    (case,) = [c for c in harness.family_cases(build=True)["runner"] if c.name == name]
    return case


@pytest.mark.parametrize("case_name", FAMILY_CASES)
def test_every_video_self_attention_call_gets_the_mask_at_the_video(monkeypatch, case_name):
    """Through the family's own layout: every sp_attention call of a sparse step is masked (none
    left dense because its video part is not the grid's tokens), the mask sits where the video
    does in the joint sequence (the text before it, CogVideoX; after it, HunyuanVideo, Mochi),
    the sparse steps change the result, and dense steps = all steps is dense bit for bit."""
    from raydit.models import sparse_steps

    seen = []

    class Recording(sparse_steps._Source):
        def __call__(self, layout):
            mask = super().__call__(layout)
            seen.append((tuple(layout.part_lengths), mask))
            return mask

    monkeypatch.setattr(sparse_steps, "_Source", Recording)
    case = _family_case(case_name)
    runner = Runner(case.make())
    try:
        request = case.make_request()
        steps = request.num_inference_steps
        dense = harness.run_steps(runner, request, None).latents
        assert seen == []
        same = harness.run_steps(runner, request.__class__(**{**request.to_dict(), "sparse_attention":
                                                              {**FAMILY_STA, "dense_steps": steps}}), None).latents
        assert torch.equal(same, dense) and seen == []
        sparse = harness.run_steps(runner, request.__class__(**{**request.to_dict(), "sparse_attention": FAMILY_STA}),
                                   None).latents
        assert rel(sparse, dense) > 1e-3
        state = runner.prepare(request)
        F, Hp, Wp = runner.family.token_grid(runner.pipe, state)
        video = sparse_steps._video_part(runner.family)
        assert seen and all(mask is not None for _, mask in seen), [p for p, m in seen if m is None][:3]
        for parts, mask in seen:
            assert mask.grid == (F, Hp, Wp) and parts[video] == F * Hp * Wp
            assert mask.video_start == sum(parts[:video]) and mask.total_tokens == sum(parts)
        if case_name.startswith("cogvideox"):
            assert video == 1 and seen[0][1].video_start > 0  # the text first
    finally:
        runner.close()


@pytest.mark.slow
@pytest.mark.long
def test_every_plan_of_the_other_families_equals_one_worker():
    """HunyuanVideo (video then text), CogVideoX (text then video), Mochi and LTX-Video under STA
    on Ulysses 2, ring 4 (uneven), hybrid 2 x 2 and cfg 2 x ring 2 (where the case has cfg): one
    worker within rtol/atol 1e-4 (float32)."""
    from raydit.parallel.testing import run_distributed

    names = ["hunyuanvideo-embedded", "cogvideox-2b-h30-rows30", "mochi-t2v", "ltx-t2v"]
    cases = []
    for name in names:
        case = _family_case(name)
        cases.append(dataclasses.replace(case, request={**case.request, "sparse_attention": FAMILY_STA},
                                         worlds=(2, 4)))
    runners = {c.name: Runner(c.make()) for c in cases}
    refs = {c.name: harness.run_steps(runners[c.name], c.make_request(), c.steps).latents for c in cases}
    out = run_distributed(harness.conformance_worker, 4, [], cases, {}, (2, 4), (4,), timeout=900)
    seen = 0
    for case in cases:
        for world in (2, 4):
            for plan in harness.feasible_plans(world, case.heads, cfg_degrees=case.cfg_degrees(world, (4,))):
                got = out[0]["runner"][(case.name, str(plan), "fresh")]
                torch.testing.assert_close(got, refs[case.name], **TOL, msg=lambda m: f"{case.name} {plan}: {m}")
                seen += 1
    assert seen >= 4 * len(cases)
