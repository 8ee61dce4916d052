"""Orchestration overhead: the same N-rank denoising step driven by raydit's Ray engine and
by a plain torch.multiprocessing launch with no Ray (what a torchrun user gets).

Both sides run the same pipeline directory (benchlib.bench_model_dir(): a CogVideoX-2b-wide
transformer, ~0.5 s a step here), the same plan (ulysses x ring x cfg) and the same request,
with one thread per rank:

- raydit: `Engine(model=dir, workers=N, device="cpu", ...)`, `generate(...)`; per-step time is
  `result.timings["step_seconds"]` (the driver's round trip: one remote call per rank and
  rank 0's checkpoint back, what the engine's design pays for resumability).
- plain: N processes started once with torch.multiprocessing (spawn), at the niceness Ray gives
  its workers (15 by default; `--plain-nice-0` for nice 0), that join a gloo group
  through a TCPStore, load the pipeline, wrap it in `Runner` on the same mesh and,
  on each command from the parent, run `prepare` and then `step` in a loop; per-step time is
  the slowest rank's wall time around `runner.step`.

Rounds alternate the two (the order flips every round) while both stay warm (the idle side
sleeps: Ray actors in a blocking call, plain processes on their command queue). The first
step of every run is dropped (warm-up); a round's figure is the median of its steps; the
overhead is the median over rounds of raydit / plain - 1, from the same round.

On a shared 2-core machine a 2% difference is below the round-to-round noise of a ~0.5 s
step, so the same comparison also runs on the tiny pipeline (a step of a few ms): there the
difference raydit - plain is the engine's fixed cost per step (remote calls and rank 0's
checkpoint back to the driver), reported as a share of the bench model's step.

    python bench/bench_overhead.py [--workers 2] [--ulysses 2] [--ring 1] [--steps 6] [--rounds 5] [--fixed-steps 10]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

PROMPT = "a red fox"  # short: the tiny tokenizer keeps 16 characters
TARGET = 0.02


def plain_rank(rank: int, world: int, port: int, model_dir: str, degrees: dict, geometry: tuple, nice: int,
               commands, results) -> None:
    """One rank of the plain launch: join, load, then serve (steps, seed) commands."""
    import torch

    os.nice(nice - os.nice(0))  # the priority the Ray workers run at (see PlainLaunch)
    import torch.distributed as dist

    from raydit.models.loading import load_pipeline
    from raydit.models.requests import GenerationRequest
    from raydit.models.runner import Runner
    from raydit.parallel import build_mesh

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    mesh = build_mesh(**degrees) if world > 1 else None
    runner = Runner(load_pipeline(model_dir), mesh=mesh)
    results.put(("ready", rank, None))
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        steps, seed = cmd
        frames, height, width = geometry
        state = runner.prepare(GenerationRequest(prompt=PROMPT, num_frames=frames, height=height, width=width,
                                                 num_inference_steps=steps, seed=seed))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state = runner.step(state)
            times.append(time.perf_counter() - t0)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        # What the engine adds on rank 0 after every step, outside the timed steps above: the
        # checkpoint (a host copy of the latents, scheduler and generator state) serialised for
        # the driver, as Ray does with the step's return value (pickle protocol 5).
        c0 = time.perf_counter()
        blob = pickle.dumps(runner.checkpoint(state), protocol=5) if rank == 0 else b""
        results.put(("steps", rank, (slowest.tolist(), len(blob), time.perf_counter() - c0)))
    dist.destroy_process_group()


class PlainLaunch:
    """N persistent torch.multiprocessing ranks; `run(steps, seed)` returns per-step seconds."""

    def __init__(self, world: int, model_dir: str, degrees: dict, geometry: tuple, nice: int = 0):
        import torch.distributed as dist
        import torch.multiprocessing as tmp

        self.world = world
        self._store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=300))
        ctx = tmp.get_context("spawn")
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(world)]
        os.environ["OMP_NUM_THREADS"] = "1"
        self._procs = [
            ctx.Process(target=plain_rank, daemon=True,
                        args=(r, world, self._store.port, model_dir, degrees, geometry, nice, self._commands[r],
                              self._results))
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        for _ in range(world):
            self._get("ready")

    def _get(self, kind: str):
        got, rank, payload = self._results.get(timeout=600)
        assert got == kind, (got, kind)
        return payload

    def run(self, steps: int, seed: int) -> tuple[list[float], int, float]:
        """Per-step seconds (slowest rank), and rank 0's checkpoint: bytes and seconds to make it."""
        for q in self._commands:
            q.put((steps, seed))
        answers = [self._get("steps") for _ in range(self.world)]
        per_step = answers[0][0]
        nbytes, seconds = max((a[1], a[2]) for a in answers)
        return per_step, nbytes, seconds

    def close(self) -> None:
        for q in self._commands:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def compare(model_dir: str, workers: int, ulysses: int, ring: int, cfg: int, steps: int, rounds: int,
            label: str, match_nice: bool = True) -> dict:
    """Interleaved rounds of Engine.generate and the plain launch on one model and plan."""
    import ray

    from raydit.runtime.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(model=model_dir, workers=workers, device="cpu", ulysses=ulysses, ring=ring, cfg=cfg,
                    show_plan=False)
    engine_start = time.perf_counter() - t0
    plan, spec = engine.plan, engine.spec
    degrees = {"ulysses": plan.ulysses, "ring": plan.ring, "cfg": plan.cfg}
    geometry = (spec.default_frames, spec.default_height, spec.default_width)
    # Ray starts its workers at nice 15 (RAY_worker_niceness); on a shared machine that
    # alone slows them against nice-0 processes. The plain ranks run at the same niceness
    # so the comparison isolates orchestration (what raydit adds), not scheduling priority.
    ray_nice = os.getpriority(os.PRIO_PROCESS, int(engine.group.infos[0]["pid"]))
    plain = PlainLaunch(plan.world_size, engine.model_dir, degrees, geometry, nice=ray_nice if match_nice else 0)
    records = []
    try:
        for rnd in range(rounds):
            row = {"round": rnd, "load": benchlib.loadavg()}
            sides = ("raydit", "plain") if rnd % 2 == 0 else ("plain", "raydit")
            for side in sides:
                busy0, w0 = benchlib.machine_busy_seconds(), time.perf_counter()
                if side == "raydit":
                    result = engine.generate(PROMPT, num_inference_steps=steps, seed=rnd, progress=False)
                    per_step = list(result.timings["step_seconds"])
                else:
                    per_step, ck_bytes, ck_seconds = plain.run(steps, seed=rnd)
                    row["checkpoint"] = {"bytes": ck_bytes, "seconds": round(ck_seconds, 5)}
                row[side] = {"step_seconds": [round(s, 5) for s in per_step],
                             "median_step": statistics.median(per_step[1:]),
                             "busy_share": round((benchlib.machine_busy_seconds() - busy0)
                                                 / (2 * (time.perf_counter() - w0)), 3)}
            row["ratio"] = row["raydit"]["median_step"] / row["plain"]["median_step"]
            row["difference"] = row["raydit"]["median_step"] - row["plain"]["median_step"]
            records.append(row)
            print(f"{label} round {rnd}: raydit {row['raydit']['median_step']:.4f} s/step, plain "
                  f"{row['plain']['median_step']:.4f} s/step, ratio {row['ratio']:.4f}, load {row['load'][0]}",
                  flush=True)
    finally:
        plain.close()
        engine.shutdown()
        if ray.is_initialized():
            ray.shutdown()
    ratios = [r["ratio"] for r in records]
    return {
        "model": {"dir": engine.model_dir, "frames": geometry[0], "height": geometry[1], "width": geometry[2]},
        "plan": {**degrees, "world_size": plan.world_size},
        "ray_worker_niceness": ray_nice, "plain_niceness": ray_nice if match_nice else 0,
        "steps_per_run": steps,
        "engine_start_seconds": round(engine_start, 2),
        "raydit_step_seconds": benchlib.summary([r["raydit"]["median_step"] for r in records], 5),
        "plain_step_seconds": benchlib.summary([r["plain"]["median_step"] for r in records], 5),
        "ratio": benchlib.summary(ratios),
        "difference_seconds": benchlib.summary([r["difference"] for r in records], 5),
        "overhead": round(statistics.median(ratios) - 1, 4),
        # Driver <-> ranks per step: one remote call per rank (method name and a flag) out, and
        # rank 0's checkpoint back; its bytes and the time to make and serialise it, measured
        # on the plain side's rank 0 after its timed steps.
        "driver_bytes_per_step": {
            "checkpoint_from_rank0": records[0]["checkpoint"]["bytes"],
            "call_args_per_rank": len(pickle.dumps(("step", True), protocol=5)),
            "ranks": plan.world_size},
        "checkpoint_seconds": benchlib.summary([r["checkpoint"]["seconds"] for r in records], 5),
        "rounds": records,
    }


def run(workers: int, ulysses: int, ring: int, cfg: int, steps: int, rounds: int, fixed_steps: int,
        match_nice: bool = True) -> dict:
    bench = compare(benchlib.bench_model_dir(), workers, ulysses, ring, cfg, steps, rounds, "bench model",
                    match_nice)
    result = {"machine": benchlib.machine(), "target_overhead": TARGET, **bench,
              "model": {**bench["model"], **benchlib.BENCH_MODEL}}
    if fixed_steps:
        # The same comparison on the tiny pipeline, whose step is a few ms: what is left of
        # the difference is the engine's fixed cost per step (remote calls, the checkpoint
        # back to the driver), measured where machine noise is small in absolute terms.
        tiny = compare("tiny", workers, None, None, 1, fixed_steps, rounds, "tiny model", match_nice)
        fixed = tiny["difference_seconds"]["median"]
        result["fixed_cost"] = {
            "tiny": tiny,
            "seconds_per_step": tiny["difference_seconds"],
            "share_of_bench_step": round(fixed / bench["plain_step_seconds"]["median"], 4),
        }
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ulysses", type=int, default=2)
    ap.add_argument("--ring", type=int, default=1)
    ap.add_argument("--cfg", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plain-nice-0", action="store_true",
                    help="run the plain ranks at nice 0 instead of the Ray workers' niceness")
    ap.add_argument("--fixed-steps", type=int, default=10,
                    help="steps per run of the tiny-model comparison (0: skip it)")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = ap.parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps}: need at least 2 (the first step of a run is dropped)")
    os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
    result = run(args.workers, args.ulysses, args.ring, args.cfg, args.steps, args.rounds, args.fixed_steps,
                 match_nice=not args.plain_nice_0)
    print(f"raydit {benchlib.fmt(result['raydit_step_seconds'])}/step, plain "
          f"{benchlib.fmt(result['plain_step_seconds'])}/step, overhead {result['overhead']:+.2%} "
          f"(target <= {TARGET:.0%})")
    b = result["driver_bytes_per_step"]
    print(f"driver <-> ranks per step: {b['checkpoint_from_rank0']:,} B of checkpoint from rank 0 and "
          f"{b['call_args_per_rank']} B of call arguments to each of {b['ranks']} ranks; making and serialising "
          f"the checkpoint takes {benchlib.fmt(result['checkpoint_seconds'], 's', 4)} "
          f"({result['checkpoint_seconds']['median'] / result['plain_step_seconds']['median']:.2%} of a step)")
    if "fixed_cost" in result:
        fc = result["fixed_cost"]
        print(f"fixed cost per step (tiny model, raydit - plain): {benchlib.fmt(fc['seconds_per_step'], 's', 4)}"
              f" = {fc['share_of_bench_step']:.2%} of the bench model's step")
    print("wrote", benchlib.write_json("overhead", result, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
