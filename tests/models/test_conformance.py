"""Conformance of every model family: every feasible plan on 1..6 and 8 gloo ranks == one process.

The cases come from each family's own module (`Family.conformance_cases`): a new family adds
its file and its cases, and this suite runs them. One spawned group runs every world size
the selected tests need on its first ranks: stage one of the suite 1..3 (3 processes), the
`long` stage 4, 5, 6 and 8 (8 processes); the tests then compare each (case, plan) with the
single-process reference computed here.

Tolerances (float32): transformer forward rtol 1e-4, atol 1e-5 for outputs of O(1) and
1e-6 of the output's largest magnitude beyond that (HunyuanVideo's tiny transformer gives
outputs up to ~40: float32 carries ~1.2e-7 of a value, and sums taken in another order
differ by a few units in the last place of their largest terms, so an element near 0 may
differ by 1-2e-5 between plans, or between CPUs with other vector units); latents after
denoising steps rtol 1e-4, atol 1e-4 (latents reach O(30) with random weights, so 1e-4
absolute is ~3e-6 of their range).

bfloat16 (each family's main case, every plan): raydit.models.precision's rule, relative L2
error against float64 on the same inputs at most 2x one process's, at the forward's output
and at every sp_attention call inside it (`harness.bf16_errors`).
"""

from __future__ import annotations

import pytest
import torch

from raydit.models import conformance as harness
from raydit.models.families.cogvideox import cases as cogvideox_cases
from raydit.models.families.cogvideox import tiny as cogvideox_tiny
from raydit.models.families.cogvideox.family import FAMILY as COGVIDEOX
from raydit.models.runner import Runner

NARROW = (1, 2, 3)  # stage one of the suite: Ulysses, ring (3: uneven), cfg
WIDE = (4, 5, 6, 8)  # stage two (`long`): the hybrids, cfg x sp on 4; 8 is the 480p case xDiT refuses
WORLDS = NARROW + WIDE
CFG_WORLDS = (2, 4)  # cfg plans (2; 4 where a family runs four branches) are run on these world sizes
LATENT_TOL = dict(rtol=1e-4, atol=1e-4)


def _marks(world: int) -> list:
    return [pytest.mark.long] if world in WIDE else []


def _selected_worlds(request) -> tuple[int, ...]:
    """The world sizes this session's selected tests of this file need (so stage one, which
    deselects the `long` ones, spawns 3 ranks and runs 1..3 only)."""
    here, worlds = request.node.path, set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.path != here:
            continue
        if "plan" in params:
            worlds.add(params["plan"].world_size)
        worlds.update(params.get("worlds", ()))
    return tuple(sorted(worlds)) or NARROW


def forward_tol(ref: torch.Tensor) -> dict:
    """The forward tolerance for a reference output (module docstring)."""
    return dict(rtol=1e-4, atol=max(1e-5, 1e-6 * float(ref.abs().max())))


LISTED = harness.family_cases(build=False)  # names, heads and plans, for parametrizing
FORWARD_CASES = LISTED["forward"]
MAIN_CASES = LISTED["main"]  # each family's first forward case: run in bfloat16 too


@pytest.fixture(scope="module")
def base_dir() -> str:
    return str(cogvideox_tiny.tiny_pipeline_dir())


@pytest.fixture(scope="module")
def runner_cases():
    return harness.family_cases(build=True)["runner"]


@pytest.fixture(scope="module")
def forward_refs():
    return {case.name: harness.forward_once(*case.make()) for case in FORWARD_CASES}


@pytest.fixture(scope="module")
def runner_refs(runner_cases):
    """Per case: the latents after `steps` steps on one process, and the checkpoint after
    `case.checkpoint_step` steps (1 unless the case says otherwise)."""
    refs, checkpoints = {}, {}
    for case in runner_cases:
        runner = Runner(case.make())
        request = case.make_request()
        checkpoints[case.name] = runner.checkpoint(harness.run_steps(runner, request, case.checkpoint_step))
        refs[case.name] = harness.run_steps(runner, request, case.steps).latents
    return refs, checkpoints


@pytest.fixture(scope="module")
def distributed(request, runner_cases, runner_refs):
    from raydit.parallel.testing import run_distributed

    _, checkpoints = runner_refs
    worlds = _selected_worlds(request)
    return run_distributed(
        harness.conformance_worker, max(worlds), FORWARD_CASES, runner_cases, checkpoints, worlds,
        tuple(w for w in CFG_WORLDS if w in worlds), [case.name for case in MAIN_CASES], timeout=900,
    )


def _forward_params():
    return [
        pytest.param(case.name, plan, id=f"{case.name}-{plan}", marks=_marks(world))
        for case in FORWARD_CASES
        for world in harness.case_worlds(case, WORLDS)
        for plan in harness.feasible_plans(world, case.heads)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case_name, plan", _forward_params())
def test_forward_matches_single_process(distributed, forward_refs, case_name, plan):
    ref = forward_refs[case_name]
    for rank in range(plan.world_size):
        out = distributed[rank]["forward"][(case_name, str(plan))]
        torch.testing.assert_close(out, ref, **forward_tol(ref), msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [NARROW, pytest.param(WIDE, marks=pytest.mark.long)], ids=["narrow", "wide"])
@pytest.mark.parametrize("case", MAIN_CASES, ids=[case.name for case in MAIN_CASES])
def test_bf16_plans_add_no_more_error_than_bf16(distributed, case, worlds):
    """Issue 31 item 2: on every plan, the bfloat16 error against float64 is at most 2x one
    process's bfloat16 error (relative L2 over the tensor), for the forward's output on every
    rank and for every sp_attention call gathered over its ranks. On these tiny cases the
    output cannot see a ring merge done in bf16 (other layers' bf16 rounding dominates it:
    worst ratio 1.0-1.2 with or without); at the attention calls such a merge moves the worst
    ratio from 1.3-1.5 to 1.8-2.1, over 2x for HunyuanVideo 1.5 only (measured, issue 31)."""
    from raydit.models.precision import BF16_ERROR_FACTOR

    rows = harness.bf16_errors(case, distributed, worlds)
    assert {r["plan"] for r in rows} == {str(p) for w in harness.case_worlds(case, worlds)
                                         for p in harness.feasible_plans(w, case.heads)}
    bad = [f"{r['plan']} {r['where']}: {r['error']:.3g} = {r['ratio']:.2f} x one process's {r['one_process_error']:.3g}"
           for r in rows if not r["ok"]]
    assert not bad, f"over {BF16_ERROR_FACTOR:g}x one process's bf16 error:\n" + "\n".join(bad)


def _runner_params():
    return [
        pytest.param(case.name, plan, id=f"{case.name}-{plan}", marks=_marks(world))
        for case in LISTED["runner"]
        for world in harness.case_worlds(case, WORLDS)
        for plan in harness.feasible_plans(world, case.heads, cfg_degrees=case.cfg_degrees(world, CFG_WORLDS))
    ]


def test_every_family_brings_cases():
    from raydit.models.registry import families

    for kind in ("forward", "runner"):
        kind_names = [c.name for c in LISTED[kind]]
        assert len(kind_names) == len(set(kind_names)), f"{kind} case names must be unique across families"
    names = [c.name for c in LISTED["forward"] + LISTED["runner"]]
    for family in families().values():
        assert any(n.startswith(family.name) for n in names), f"family {family.name} has no conformance cases"
        # Its main case (first forward case) runs in bf16 too, on every world size.
        assert [c for c in MAIN_CASES if c.name.startswith(family.name) and c.worlds is None], family.name


@pytest.mark.slow
@pytest.mark.parametrize("case_name, plan", _runner_params())
def test_denoising_steps_match_single_process(distributed, runner_refs, case_name, plan):
    """`steps` steps from the seed, and the same resumed from a 1-process checkpoint."""
    refs, _ = runner_refs
    for kind in ("fresh", "resumed"):
        on_rank0 = distributed[0]["runner"][(case_name, str(plan), kind)]
        torch.testing.assert_close(on_rank0, refs[case_name], **LATENT_TOL, msg=lambda m: f"{kind}: {m}")
        for rank in range(1, plan.world_size):
            # Every rank must hold the same latents bit for bit: any rank may checkpoint.
            latents = distributed[rank]["runner"][(case_name, str(plan), kind)]
            assert torch.equal(latents, on_rank0), f"rank {rank} {kind} differs from rank 0"


def test_plans_cover_the_hard_cases():
    """4 and 8 ranks at 30 heads / 30 rows, and cfg plans, are among those enumerated."""
    plans = {str(p) for w in WORLDS for p in harness.feasible_plans(w, 30, (1, 2))}
    assert {"u2r2c1", "u1r4c1", "u3r2c1", "u5r1c1", "u6r1c1", "u1r2c2", "u2r1c2"} <= plans
    assert "u4r1c1" not in plans  # 4 does not divide 30 heads
    assert [str(p) for p in harness.feasible_plans(8, 30)] == ["u1r8c1", "u2r4c1"]


def max_relative_difference(actual, expected) -> float:
    """max |actual - expected| / max |expected|: the figure the closing notes quote."""
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("case_name", [c.name for c in LISTED["runner"]])
def test_runner_matches_diffusers_pipeline(runner_cases, case_name):
    """On one process the runner reproduces the family's diffusers pipeline called with its
    defaults and the same seed (output_type="latent"): max relative difference <= 1e-5."""
    from raydit.models.registry import family_for_pipeline

    case = next(c for c in runner_cases if c.name == case_name)
    pipe = case.make()
    request = case.make_request()
    family = family_for_pipeline(pipe)
    expected = harness.latent_streams(family.reference_latents(pipe, request))
    state = harness.run_steps(Runner(pipe), request, None)
    # the pipeline's output layout; every stream it returns (LTX-2: video and audio)
    streams = harness.latent_streams(family.output_latents(pipe, state))
    assert len(streams) == len(expected)
    for latents, reference in zip(streams, expected):
        assert latents.shape == reference.shape
        assert max_relative_difference(latents, reference) <= 1e-5
        torch.testing.assert_close(latents, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case_name", [c.name for c in LISTED["runner"]])
def test_runner_matches_diffusers_pipeline_bit_for_bit_in_bf16(runner_cases, case_name, dtype):
    """GPUs run bf16 (fp16 on older ones): there one process must give diffusers' own latents
    exactly, which means following the pipeline's dtype choices between steps (HunyuanVideo's
    latents turn bf16 after the first flow-matching step and the timestep follows them;
    HunyuanVideo 1.5 draws its noise in the transformer's dtype). Resuming from a checkpoint
    taken after step 1 (bf16 latents where init gave float32) gives the same latents too."""
    import torch

    from raydit.models.registry import family_for_pipeline

    dtype = getattr(torch, dtype)
    case = next(c for c in runner_cases if c.name == case_name)
    pipe = case.make(dtype=dtype)
    request = case.make_request()
    family = family_for_pipeline(pipe)
    expected = harness.latent_streams(family.reference_latents(pipe, request))
    assert all(torch.isfinite(e.float()).all() for e in expected)
    runner = Runner(pipe, dtype=dtype)
    streams = harness.latent_streams(family.output_latents(pipe, harness.run_steps(runner, request, None)))
    checkpoint = runner.checkpoint(harness.run_steps(runner, request, 1))
    resumed = harness.latent_streams(family.output_latents(pipe, harness.run_steps(runner, request, None,
                                                                                   checkpoint=checkpoint)))
    assert len(streams) == len(resumed) == len(expected)
    for latents, again, reference in zip(streams, resumed, expected):  # every stream (LTX-2: video, audio)
        assert latents.dtype == reference.dtype, (latents.dtype, reference.dtype)
        assert torch.equal(latents, reference), max_relative_difference(latents.float(), reference.float())
        assert again.dtype == reference.dtype and torch.equal(again, reference)


def test_runner_without_guidance_matches_diffusers_pipeline(base_dir):
    """guidance_scale 1: one branch, no negative prompt (the pipeline's other path)."""
    from raydit.models.requests import GenerationRequest

    pipe = cogvideox_cases.cogvideox_pipeline(base_dir)
    request = GenerationRequest(prompt="still water", num_frames=9, height=64, width=64,
                                num_inference_steps=2, guidance_scale=1.0, seed=9)
    expected = COGVIDEOX.reference_latents(pipe, request)
    state = harness.run_steps(Runner(pipe), request, 2)
    assert len(state.branches) == 1 and state.branches[0]["encoder_hidden_states"].shape[0] == 1
    torch.testing.assert_close(state.latents, expected, rtol=1e-6, atol=1e-6)
