"""What spawned ranks run to check weight sharding against the same plan without it.

`shard_worker` runs each runner case (raydit.models.conformance.RunnerCase) on every feasible
plan of the world, unsharded and sharded, in each dtype, and returns the latents of both and
what the sharded runs held of the weights (raydit.models.sharded). Not a test module: the
tests beside it import it, and spawned ranks import it by name (tests/models is on the path
multiprocessing gives them; a test module is not imported there).
"""

from __future__ import annotations

import torch

from raydit.models.conformance import feasible_plans, prefix_mesh, run_steps
from raydit.planner.runconfig import GroupModes, RunConfig


def shard_worker(rank: int, world_size: int, cases: list, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                 checkpoints: dict | None = None, compile: bool = False, plans: tuple[str, ...] | None = None) -> dict:
    """{(case, plan, dtype, "plain" | "sharded" | "resumed"): latents} and
    {(case, plan, dtype, "held"): (peak parameter bytes the sharded blocks held, their full bytes)}."""
    from raydit.models.runner import Runner
    from raydit.parallel.shard_weights import SHARD_BUFFER

    out = {}
    for case in cases:
        request = case.make_request()
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            pipe = case.make(dtype if dtype != torch.float32 else None)
            degrees = (1,) + (case.branch_degrees if case.cfg else ())
            for plan in feasible_plans(world_size, case.heads, cfg_degrees=degrees):
                if plan.world_size != world_size or (plans is not None and str(plan) not in plans):
                    continue
                mesh = prefix_mesh(plan)
                key = (case.name, str(plan), dtype_name)
                for sharded in (False, True):
                    runner = Runner(pipe, mesh, dtype=dtype, run=RunConfig(shard_weights=sharded, compile=compile),
                                    group=GroupModes(shard_weights=sharded, parallel_options=case.options))
                    try:
                        if sharded:
                            full = sum(h.handle.layouts[i].total for h in runner.sharded
                                       for i in range(len(h.handle.blocks)))
                            held = sum(getattr(b, SHARD_BUFFER).numel() for h in runner.sharded for b in h.handle.blocks)
                            for h in runner.sharded:
                                h.handle.reset_peak()
                        latents = run_steps(runner, request, case.steps).latents
                        out[key + ("sharded" if sharded else "plain",)] = latents
                        if sharded:
                            out[key + ("held",)] = (held, sum(h.peak_bytes for h in runner.sharded), full)
                            if checkpoints and case.name in checkpoints.get(dtype_name, {}):
                                resumed = run_steps(runner, request, case.steps, checkpoint=checkpoints[dtype_name][case.name])
                                out[key + ("resumed",)] = resumed.latents
                    finally:
                        runner.close()
    return out


def mechanism_worker(rank: int, world_size: int) -> dict:
    """raydit.parallel.shard_weights on a plain module: what a rank holds at rest and inside
    each block, the forward against the unsharded one, and remove() giving back the very
    values at the original alignment."""
    import torch.distributed as dist
    from torch import nn

    from raydit.parallel.shard_weights import ALIGN, resident_parameter_bytes, shard_blocks

    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 24)) for _ in range(4)])
    blocks[1].to(torch.bfloat16)  # a block of another dtype: bytes are bytes
    x = torch.randn(3, 24)

    def run(m):
        h = x
        for b in m:
            h = b(h.to(next(b.parameters()).dtype)).float()
        return h

    with torch.no_grad():
        reference = run(blocks)
    before = {n: (p.detach().clone(), p.data_ptr() % ALIGN) for n, p in blocks.named_parameters()}
    full = resident_parameter_bytes(blocks)
    handle = shard_blocks(list(blocks), dist.group.WORLD, root=None)
    at_rest = resident_parameter_bytes(blocks)
    inside = []
    hooks = [b.register_forward_pre_hook(lambda m, a: inside.append(resident_parameter_bytes(blocks))) for b in blocks]
    with torch.no_grad():
        sharded = run(blocks)
    for h in hooks:
        h.remove()
    empty_after = all(p.numel() == 0 for p in blocks.parameters())
    peak = handle.peak_bytes
    handle.remove(None)  # gathered back (collective)
    restored = all(torch.equal(p, before[n][0]) and p.data_ptr() % ALIGN == before[n][1]
                   for n, p in blocks.named_parameters())
    errors = {}
    alone = [dist.new_group([r]) for r in range(world_size)]  # collective: every rank makes every group
    try:
        shard_blocks(list(blocks), alone[rank], root=None)
    except ValueError as exc:
        errors["one rank"] = str(exc)
    return {"equal": torch.equal(reference, sharded), "full": full, "at_rest": at_rest, "inside": inside,
            "empty_after": empty_after, "peak": peak, "restored": restored, "errors": errors}


def late_lora_worker(rank: int, world_size: int, model_dir: str, lora_dir: str) -> dict:
    """A LoRA loaded into a pipeline whose blocks are already sharded (Engine.load_lora
    between requests) gives the latents the unsharded pipeline gives with it; close() then
    rebuilds the weights from the checkpoint files exactly."""
    from raydit.models import lora
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.registry import family_for_pipeline
    from raydit.models.runner import Runner
    from raydit.parallel.mesh import build_mesh

    mesh = build_mesh(ulysses=world_size)
    request = GenerationRequest(prompt="a red fox", num_frames=5, height=48, width=80, num_inference_steps=2,
                                guidance_scale=5.0, seed=3, lora={"late": 0.8})
    out = {}
    for sharded in (False, True):
        pipe = load_pipeline(model_dir)
        before = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
        runner = Runner(pipe, mesh, run=RunConfig(shard_weights=sharded))
        lora.load(pipe, family_for_pipeline(pipe), lora.LoraSpec("late", str(lora.lora_file(lora_dir)), "transformer"))
        out[(sharded, "from files")] = bool(runner.sharded) and runner.sharded[0].source is not None
        try:
            out[sharded] = run_steps(runner, request, 2).latents
        finally:
            runner.close()
        lora.unload(pipe, "late")
        out[(sharded, "rebuilt")] = all(torch.equal(p, before[n.replace(".base_layer.", ".")])
                                        for n, p in pipe.transformer.named_parameters() if "lora_" not in n)
    return out


def batching_shard_worker(rank: int, world_size: int, build: str, kwargs: dict, requests: list[dict],
                          joins: list[int], plan: tuple[int, int, int], runner_kwargs: dict | None = None) -> dict:
    """Step-level batching (Runner.step_batch) on one plan, unsharded and sharded (both with
    `runner_kwargs`, e.g. a quantize mode): {False | True: [final latents per request]}."""
    from raydit.models.conformance import MeshPlan, run_batched
    from raydit.models.requests import GenerationRequest
    from raydit.models.runner import Runner
    from raydit.models.tiny import resolve_builder

    pipe = resolve_builder(build)(**kwargs)
    mesh = prefix_mesh(MeshPlan(*plan))
    modes = dict(runner_kwargs or {})
    dtype = modes.pop("dtype", torch.float32)  # the Runner's own; the rest are the run's modes
    out = {}
    for sharded in (False, True):
        runner = Runner(pipe, mesh, dtype=dtype, run=RunConfig(shard_weights=sharded, **modes))
        try:
            out[sharded] = [s.latents for s in run_batched(runner, [GenerationRequest(**q) for q in requests], joins)]
        finally:
            runner.close()
    return out


def plain_parameters(module) -> dict:
    """{name: tensor} of `module`'s parameters, copied to the CPU as plain tensors (a process's
    result is pickled): a tensor-subclass parameter (torchao's FP8 weight) as its inner
    tensors, `name#qdata`, `name#scale`; an FP8 tensor as its bytes (uint8: torch 2.13 does
    not unpickle float8 tensors; equal bytes are equal values, bit for bit)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    out = {}
    for name, p in module.named_parameters():
        if is_traceable_wrapper_subclass(p):
            for inner in p.__tensor_flatten__()[0]:
                t = getattr(p, inner).detach().cpu().clone()
                out[f"{name}#{inner}"] = t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t
        else:
            out[name] = p.detach().cpu().clone()
    return out


def quantized_shard_worker(rank: int, world_size: int, models: list, quantize: str = "fp8-sim",
                           device: str = "cpu", plans: tuple[str, ...] | None = None) -> dict:
    """Sharded weights under a quantize mode against the same plan unsharded under it, on every
    plan of the world (`plans`: only those named, e.g. ("u1r1c2",)). models: [(model folder,
    request keywords, dtype names)], each loaded from its files (a fresh pipeline per run:
    quantization is in place). Keys (folder, plan,
    dtype, ...):
    - "plain" / "sharded": the final latents; "resumed": the sharded run's pipeline after its
      close (its weights rebuilt from the files, quantized again) sharded once more and resumed
      from the checkpoint after step 1: what the survivors of a lost rank do;
    - "weights" (unsharded) / "rebuilt" (sharded, after close) / "gathered" (sharded, closed
      with the files ignored: gathered back over the group): {name: tensor} of the
      transformer's parameters; "marked": (quantized, skipped) linears the transformer's
      quantized marker names after the close (None: no marker);
    - "from files": the sharded run rebuilds from the checkpoint files;
    - "held": (the block bytes this rank's shards hold, the blocks' full bytes);
    - "side stream": the sharded run posted its gathers from a side stream (CUDA)."""
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.quantize import quantized
    from raydit.models.runner import Runner
    from raydit.parallel.shard_weights import SHARD_BUFFER

    out = {}
    for model_dir, request_kwargs, dtypes in models:
        request = GenerationRequest(**request_kwargs)
        heads = load_pipeline(model_dir).transformer.config.num_attention_heads
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for plan in feasible_plans(world_size, heads, cfg_degrees=(1, 2)):
                if plan.world_size != world_size or (plans is not None and str(plan) not in plans):
                    continue
                mesh = prefix_mesh(plan)
                key = (model_dir, str(plan), dtype_name)
                for sharded in (False, True):
                    pipe = load_pipeline(model_dir)
                    runner = Runner(pipe, mesh, device=device, dtype=dtype,
                                    run=RunConfig(quantize=quantize, shard_weights=sharded))
                    try:
                        if sharded:
                            out[key + ("from files",)] = all(s.source is not None for s in runner.sharded)
                            out[key + ("held",)] = (
                                sum(getattr(b, SHARD_BUFFER).numel() for s in runner.sharded for b in s.handle.blocks),
                                sum(layout.total for s in runner.sharded for layout in s.handle.layouts))
                        checkpoint = runner.checkpoint(run_steps(runner, request, 1))
                        out[key + ("sharded" if sharded else "plain",)] = run_steps(runner, request, None).latents.cpu()
                        if sharded:
                            out[key + ("side stream",)] = any(s.handle._stream is not None for s in runner.sharded)
                    finally:
                        runner.close()
                    out[key + ("rebuilt" if sharded else "weights",)] = plain_parameters(pipe.transformer)
                    if not sharded:
                        continue
                    # The gather-back path (a model built in memory has no files): the quantized
                    # weights come back as they are, not rounded again.
                    gathered = load_pipeline(model_dir)
                    runner = Runner(gathered, mesh, device=device, dtype=dtype,
                                    run=RunConfig(quantize=quantize, shard_weights=True))
                    for s in runner.sharded:
                        s.source = None
                    runner.close()
                    out[key + ("gathered",)] = plain_parameters(gathered.transformer)
                    done = quantized(pipe.transformer)
                    out[key + ("marked",)] = None if done is None else (len(done.names), len(done.skipped))
                    runner = Runner(pipe, mesh, device=device, dtype=dtype,
                                    run=RunConfig(quantize=quantize, shard_weights=True))
                    try:
                        out[key + ("resumed",)] = run_steps(runner, request, None, checkpoint=checkpoint).latents.cpu()
                    finally:
                        runner.close()
    return out
