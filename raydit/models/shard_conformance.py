"""What spawned ranks run to check weight sharding against the same plan without it.

`shard_worker` runs each runner case (raydit.models.conformance.RunnerCase) on every feasible
plan of the world, unsharded and sharded, in each dtype, and returns the latents of both and
what the sharded runs held of the weights (raydit.models.sharded). A module of its own, so
spawned ranks import it (test modules are not importable there).
"""

from __future__ import annotations

import torch

from raydit.models.conformance import feasible_plans, prefix_mesh, run_steps


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
                    runner = Runner(pipe, mesh, dtype=dtype, parallel_options=case.options, shard_weights=sharded,
                                    compile=compile)
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
