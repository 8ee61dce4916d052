"""Regional torch.compile (raydit.models.compile) == eager, with no graph break in a block.

Cost on 2 CPU cores is what shaped this module: Dynamo traces one block class in ~2-5 s and
Inductor then builds C++ for ~10 s more. So:
- the distributed check runs every family's main forward case on a Ulysses plan (u2r1) and a
  ring plan (u1r2) of 2 gloo ranks, compiled with fullgraph=True (a graph break in a block is
  an error) on the "eager" backend: Dynamo's whole trace of each block, with the fake
  implementations of raydit's custom ops, run as captured (~1-2 s a block class; "aot_eager"
  costs ~3 s more and Inductor ~10 s more). Wan's case runs through Inductor instead, on
  both plans: generated code calling the ops (which checks, e.g., the strides the fakes promise).
  It also counts graphs: one per block class (blocks share it), and none for a regroup;
- the runner check compiles the tiny pipeline once, with Inductor, in this process, and the
  engine check compiles the same graph in a Ray worker, which finds the C++ in Inductor's
  cache: one temporary directory for the session's processes (tests/conftest.py).

Tolerance: the conformance suite's forward tolerance (tests/models/test_conformance.py) and
its latent tolerance after denoising steps.
"""

from __future__ import annotations

import pytest
import torch

from raydit.models import conformance as harness
from raydit.planner.runconfig import RunConfig

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
def _compile_here():
    # Inductor's cache directory and compile threads come from tests/conftest.py's
    # environment; in this process the config may have been read before it was set.
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        yield


def compiled_vs_eager_worker(rank: int, world_size: int, cases, plans, inductor_cases):
    """Per (case, plan, backend): the parallel forward eager and with compiled blocks; and
    under "regroups", the graphs compiled by each of 9 fresh meshes of one plan in turn."""
    from torch._dynamo.utils import counters

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
                backends = ("inductor",) if case.name in inductor_cases else ("eager",)
                for backend in backends:
                    compiled = compile_blocks(transformer, fullgraph=True, backend=backend)
                    graphs = counters["stats"]["unique_graphs"]
                    try:
                        out[(case.name, str(plan), backend)] = (eager, harness.forward_once(transformer, kwargs))
                    finally:
                        compiled.remove()
                    # Regional compilation: one graph per block class, shared by its blocks (per
                    # kind of block of a class: Mochi's last, context_pre_only, has fewer submodules).
                    classes = {(type(b), tuple(name for name, _ in b.named_children())) for b in compiled.blocks}
                    out[("graphs", case.name, str(plan), backend)] = (
                        counters["stats"]["unique_graphs"] - graphs, len(classes), len(compiled.blocks))
    # A regroup with the same degrees (a fresh mesh, the old one released) reuses the blocks'
    # graphs: a mesh's key is stable. Were it not, each mesh would compile again, and after 8
    # graphs of one block class Dynamo refuses (fullgraph) or falls back to eager.
    transformer, kwargs = next(c for c in cases if c.name in inductor_cases).make()
    out["regroups"] = []
    for _ in range(9):
        with parallelize(transformer, harness.prefix_mesh(plans[0])):
            compiled = compile_blocks(transformer, fullgraph=True, backend="eager")
            graphs = counters["stats"]["unique_graphs"]
            harness.forward_once(transformer, kwargs)
            out["regroups"].append(counters["stats"]["unique_graphs"] - graphs)
            compiled.remove()
    return out


@pytest.mark.slow
@pytest.mark.long  # the second stage (suite time: stage one ran 21:42 at f797430)
def test_compiled_blocks_match_eager_on_ulysses_and_ring_without_graph_breaks():
    """fullgraph=True: compiling a parallelized block with a graph break in it raises, so every
    result here is from blocks compiled whole, collectives included (as custom ops)."""
    from raydit.parallel.testing import run_distributed

    cases = main_cases()
    results = run_distributed(compiled_vs_eager_worker, 2, cases, PLANS, INDUCTOR_CASES, timeout=600)
    expected = {(c.name, str(p), b) for c in cases for p in PLANS if c.heads % p.ulysses == 0
                for b in (("inductor",) if c.name in INDUCTOR_CASES else ("eager",))}
    assert {c.name.split("-")[0] for c in cases} >= {"cogvideox", "wan", "hunyuanvideo", "hunyuanvideo15", "ltx"}
    for rank, outputs in enumerate(results):
        regroups = outputs.pop("regroups")
        assert sum(regroups[1:]) == 0, f"rank {rank}: graphs compiled per regroup {regroups}"
        graphs = {key[1:]: outputs.pop(key) for key in list(outputs) if key[0] == "graphs"}
        for key, (compiled, classes, blocks) in graphs.items():
            assert compiled <= classes, f"rank {rank} {key}: {compiled} graphs for {blocks} blocks of {classes} classes"
        assert set(outputs) == expected
        for key, (eager, compiled) in outputs.items():
            torch.testing.assert_close(compiled, eager, **forward_tol(eager), msg=lambda m: f"rank {rank} {key}: {m}")


# The tiny engine's request of tests/runtime/engine/test_cache.py: fbcache at 1.3 caches 1 of 4
# steps with every decision >= 10% from the threshold, so compiled rounding cannot flip one.
PROMPT = "a red fox running through fresh snow"
GEN = dict(num_frames=5, height=32, width=32, num_inference_steps=4, guidance_scale=6.0)
FIRST = dict(GEN, seed=7, cache="fbcache", cache_threshold=1.3)
SECOND = dict(GEN, seed=8)  # the same shapes, no caching


@pytest.fixture(scope="module")
def eager_refs():
    """The tiny pipeline's latents and cached steps for FIRST and SECOND, eager, one process."""
    from raydit.models.cache import CACHED_STEPS
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    runner = Runner(load_pipeline("tiny"))
    out = []
    for gen in (FIRST, SECOND):
        state = harness.run_steps(runner, GenerationRequest(prompt=PROMPT, **gen), GEN["num_inference_steps"])
        out.append((state.latents, int(state.carry.get(CACHED_STEPS, 0))))
    assert out[0][1] > 0, "the reference must cache a step, or caching under compile is not tested"
    return out


@pytest.mark.long  # stage two: compiles every shape (~65 s)
@pytest.mark.slow
def test_runner_warms_up_once_per_shape_and_matches_eager_with_step_caching(eager_refs):
    """Runner(run=RunConfig(compile=True)): the first request of a shape compiles in prepare (reported as
    `warmup_seconds`, not in a step), a second request of the same shape compiles nothing,
    and both give the eager latents, step caching (fbcache: the first block's compiled
    forward under the cache's wrapper) included. LoRA requests are refused."""
    import dataclasses

    from torch._dynamo.utils import counters

    from raydit.models.cache import CACHED_STEPS
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    runner = Runner(load_pipeline("tiny"), run=RunConfig(compile=True))
    try:
        for i, (gen, (want, cached)) in enumerate(zip((FIRST, SECOND), eager_refs)):
            state = runner.prepare(GenerationRequest(prompt=PROMPT, **gen))
            warmup, graphs = runner.warmup_seconds, counters["stats"]["unique_graphs"]
            assert (warmup > 0) if i == 0 else (warmup == 0.0), f"request {i}: warm-up {warmup} s"
            while not state.done:
                state = runner.step(state)
            assert counters["stats"]["unique_graphs"] == graphs, f"request {i}: a step compiled a graph"
            assert int(state.carry.get(CACHED_STEPS, 0)) == cached
            torch.testing.assert_close(state.latents, want, **LATENT_TOL)
        assert graphs > 0
        with pytest.raises(ValueError, match="LoRA adapters .* cannot run on compiled blocks"):
            runner.prepare(GenerationRequest(prompt=PROMPT, **SECOND, lora=(("style", 1.0),)))
    finally:
        runner.close()
    assert "forward" not in vars(runner.transformer.transformer_blocks[0])  # close() gave the blocks back


@pytest.mark.slow
@pytest.mark.long  # the second stage (suite time: stage one ran 19:07 at 2bd5ed4)
def test_engine_compiles_once_per_worker_in_its_warmup_and_reports_it_apart(ray_local, eager_refs):
    """Engine(compile=True, warmup=True): the worker compiles in the warm-up request the
    Engine runs at its planned size before returning (`compile_seconds` of its event, not a
    step nor `encode`); the users' requests of that size then compile nothing. One worker:
    the graph is the runner test's, compiled C++ found in the session's Inductor cache."""
    import ray

    from raydit.runtime.engine import Engine

    def unique_graphs(worker) -> int:
        # Run in the rank's process by the actor's __ray_call__ (a local function: pickled by
        # value, the workers do not import this module): the graphs dynamo compiled there.
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    engine = Engine(model="tiny", workers=1, device="cpu", show_plan=False, compile=True, warmup=True,
                    frames=GEN["num_frames"], height=GEN["height"], width=GEN["width"])
    try:
        warm = [e for e in engine.events if e["event"] == "warmed_up"]
        [rank] = engine.group.actors
        graphs = ray.get(rank.__ray_call__.remote(unique_graphs), timeout=60)
        results = [engine.generate(PROMPT, progress=False, **gen) for gen in (FIRST, SECOND)]
        graphs_after = ray.get(rank.__ray_call__.remote(unique_graphs), timeout=60)
        warmup_seconds = engine.timings["warmup_seconds"]
    finally:
        engine.shutdown()
    assert [(e["replica"], e["frames"], e["height"], e["width"]) for e in warm] == \
        [(0, GEN["num_frames"], GEN["height"], GEN["width"])]
    assert warm[0]["compile_seconds"] > 0 and warmup_seconds >= warm[0]["seconds"] > warm[0]["compile_seconds"]
    first, second = (r.timings for r in results)
    assert first["compile_seconds"] == 0.0 and second["compile_seconds"] == 0.0
    for timings in (first, second):
        assert len(timings["step_seconds"]) == GEN["num_inference_steps"]
    # The compile is not inside a step: the rank's dynamo compiled every graph in the warm-up
    # (counted, not timed: a step's time against the compile's is the machine's business).
    assert graphs > 0 and graphs_after == graphs, (graphs, graphs_after)
    for result, (want, cached) in zip(results, eager_refs):
        assert result.timings["cached_steps"] == cached
        torch.testing.assert_close(torch.from_numpy(result.latents), want, **LATENT_TOL)


def test_engine_checks_compile_before_ray():
    from raydit.runtime.engine import Engine

    with pytest.raises(ValueError, match="compile .* must be True or False"):
        Engine(model="tiny", workers=1, device="cpu", compile="yes")


def test_generate_and_serve_pass_compile_from_the_command_line_and_config_files_to_the_engine(tmp_path):
    """What `raydit generate` / `raydit serve` construct their Engine with (engine_kwargs)."""
    import inspect

    from raydit.cli import build_parser
    from raydit.commands import engine_kwargs, resolve_generate_options
    from raydit.runtime.engine import Engine
    from raydit.serve import config as serve_config

    parser = build_parser()

    def generate(*argv):
        return engine_kwargs(resolve_generate_options(parser.parse_args(["generate", *argv])))

    def serve(given):
        return serve_config.engine_kwargs(serve_config.resolve_serve_options(given))

    job = tmp_path / "job.yaml"
    job.write_text("prompt: a cat\ncompile: true\n")
    assert generate("--prompt", "x", "--compile")["compile"] is True
    assert generate("--config", str(job))["compile"] is True
    assert generate("--prompt", "x")["compile"] is False
    assert serve(parser.parse_args(["serve", "--compile"]))["compile"] is True
    assert serve({"compile": True})["compile"] is True  # a Serve config's args
    assert serve(parser.parse_args(["serve"]))["compile"] is False
    assert serve(parser.parse_args(["serve", "--warmup"]))["warmup"] is True
    assert serve({"warmup": True, "compile": True})["warmup"] is True
    assert serve(parser.parse_args(["serve"]))["warmup"] is False
    with pytest.raises(ValueError, match="option 'warmup' must be bool, got 'yes'"):
        serve({"warmup": "yes"})
    takes = set(inspect.signature(Engine).parameters)
    assert set(generate("--prompt", "x")) | {"workers"} <= takes and set(serve({})) <= takes


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompt", "x", "--compile", "--lora", "{lora}"], "--compile cannot switch LoRA adapters"),
    (["generate", "--config", "{job}"], "key 'compile' must be bool"),
    (["serve", "--compile", "--lora-dir", "{dir}"], "--compile cannot switch LoRA adapters per request, but --lora-dir"),
])
def test_compile_with_what_it_cannot_do_is_one_line_and_status_2(args, needle, tmp_path, capsys):
    from raydit.cli import main

    lora = tmp_path / "style.safetensors"
    lora.write_bytes(b"")
    job = tmp_path / "job.yaml"
    job.write_text("prompt: a cat\ncompile: yes please\n")
    argv = [a.format(lora=lora, job=job, dir=tmp_path) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raydit: error:"), err
    assert needle in err[0]
