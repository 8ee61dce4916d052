"""Regional torch.compile (raydit.models.compile) == eager, with no graph break in a block.

Cost on 2 CPU cores is what shaped this module: Dynamo traces one block class in ~2-5 s and
Inductor then builds C++ for ~10 s more. So:
- the distributed check runs every family's main forward case on a Ulysses plan (u2r1) and a
  ring plan (u1r2) of 2 gloo ranks, compiled with fullgraph=True (a graph break in a block is
  an error) on the "eager" backend: Dynamo's whole trace of each block, with the fake
  implementations of raydit's custom ops, run as captured (~1-2 s a block class; "aot_eager"
  costs ~3 s more and Inductor ~10 s more). Wan's case also runs through Inductor on both
  plans: generated code calling the ops (which checks, e.g., the strides the fakes promise);
- the runner check compiles one tiny pipeline once, with Inductor, in this process.
Inductor's cache lives in a temporary directory shared by this module's processes.

Tolerance: the conformance suite's forward tolerance (tests/models/test_conformance.py) and
its latent tolerance after denoising steps.
"""

from __future__ import annotations

import os

import pytest
import torch

from raydit.models import conformance as harness

LATENT_TOL = dict(rtol=1e-4, atol=1e-4)
PLANS = (harness.MeshPlan(2, 1), harness.MeshPlan(1, 2))  # Ulysses 2, ring 2
INDUCTOR_CASES = ("wan-t2v-h12",)


def forward_tol(ref: torch.Tensor) -> dict:
    return dict(rtol=1e-4, atol=max(1e-5, 1e-6 * float(ref.abs().max())))


def main_cases() -> list:
    """Each family's first (main) forward case."""
    from raydit.models.registry import families

    return [family.conformance_cases(harness._Unbuilt())["forward"][0] for family in families().values()]


@pytest.fixture(scope="module", autouse=True)
def _inductor_cache(tmp_path_factory):
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))  # spawned ranks inherit it
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def compiled_vs_eager_worker(rank: int, world_size: int, cases, plans, inductor_cases):
    """Per (case, plan, backend): the parallel forward eager and with compiled blocks."""
    from raydit.models.compile import compile_blocks
    from raydit.models.registry import parallelize

    out = {}
    for case in cases:
        transformer, kwargs = case.make()
        for plan in plans:
            if case.heads % plan.ulysses:
                continue
            mesh = harness.prefix_mesh(plan)
            with parallelize(transformer, mesh):
                eager = harness.forward_once(transformer, kwargs)
                backends = ("eager", "inductor") if case.name in inductor_cases else ("eager",)
                for backend in backends:
                    compiled = compile_blocks(transformer, fullgraph=True, backend=backend)
                    try:
                        out[(case.name, str(plan), backend)] = (eager, harness.forward_once(transformer, kwargs))
                    finally:
                        compiled.remove()
    return out


@pytest.mark.slow
def test_compiled_blocks_match_eager_on_ulysses_and_ring_without_graph_breaks():
    """fullgraph=True: compiling a parallelized block with a graph break in it raises, so every
    result here is from blocks compiled whole, collectives included (as custom ops)."""
    from raydit.parallel.testing import run_distributed

    cases = main_cases()
    results = run_distributed(compiled_vs_eager_worker, 2, cases, PLANS, INDUCTOR_CASES, timeout=600)
    expected = {(c.name, str(p), b) for c in cases for p in PLANS if c.heads % p.ulysses == 0
                for b in (("eager", "inductor") if c.name in INDUCTOR_CASES else ("eager",))}
    assert {c.name.split("-")[0] for c in cases} >= {"cogvideox", "wan", "hunyuanvideo", "hunyuanvideo15", "ltx"}
    for rank, outputs in enumerate(results):
        assert set(outputs) == expected
        for key, (eager, compiled) in outputs.items():
            torch.testing.assert_close(compiled, eager, **forward_tol(eager), msg=lambda m: f"rank {rank} {key}: {m}")


@pytest.mark.slow
def test_runner_warms_up_once_per_shape_and_matches_eager_with_step_caching():
    """Runner(compile=True): the first request of a shape compiles in prepare (reported as
    `warmup_seconds`, not in a step), a second request of the same shape compiles nothing,
    and both give the eager latents, step caching (fbcache: first block's compiled forward
    under the cache's wrapper) included."""
    import dataclasses

    from torch._dynamo.utils import counters

    from raydit.models.cache import CACHED_STEPS
    from raydit.models.families import cogvideox
    from raydit.models.family import GenerationRequest
    from raydit.models.runner import Runner

    base_dir = str(cogvideox.tiny_pipeline_dir())
    # The cache suite's CogVideoX case: 6 steps, some cached, no decision near the threshold.
    first = GenerationRequest(prompt="a red fox", negative_prompt="blur", num_frames=9, height=48, width=32,
                              num_inference_steps=6, guidance_scale=6.0, seed=3, cache="fbcache", cache_threshold=1.0)
    second = dataclasses.replace(first, prompt="a grey wolf", seed=8)

    eager = Runner(cogvideox.cogvideox_pipeline(base_dir, max_text_seq_length=13))
    expected = [harness.run_steps(eager, r, 6) for r in (first, second)]
    assert expected[0].carry[CACHED_STEPS] > 0

    runner = Runner(cogvideox.cogvideox_pipeline(base_dir, max_text_seq_length=13), compile=True)
    try:
        for i, (request, want) in enumerate(zip((first, second), expected)):
            state = runner.prepare(request)
            warmup, graphs = runner.warmup_seconds, counters["stats"]["unique_graphs"]
            assert (warmup > 0) if i == 0 else (warmup == 0.0), f"request {i}: warm-up {warmup} s"
            while not state.done:
                state = runner.step(state)
            assert counters["stats"]["unique_graphs"] == graphs, f"request {i}: a step compiled a graph"
            assert state.carry[CACHED_STEPS] == want.carry[CACHED_STEPS]
            torch.testing.assert_close(state.latents, want.latents, **LATENT_TOL)
        assert graphs > 0
        with pytest.raises(ValueError, match="LoRA adapters .* cannot run on compiled blocks"):
            runner.prepare(dataclasses.replace(first, lora=(("style", 1.0),)))
    finally:
        runner.close()
    assert "forward" not in vars(runner.transformer.transformer_blocks[0])  # close() restored the blocks
