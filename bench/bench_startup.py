"""Start-up: time from `Engine(...)` to ready, and to the first finished denoising step, for
1, 2 and 4 workers (the built-in `tiny` pipeline, device cpu).

Each start is cold for raydit: no Ray running, so `Engine` starts a private local Ray (as a
user's first call does), places one actor per rank, loads the pipeline in each and forms
the gloo group; `engine.timings` splits that into Ray start + planning (`plan_seconds`),
actors, loading and group. Then
one request is submitted and the time its first step finishes is taken from
`callback_on_step_end`, and the time its video is done (command to first video). Worker
counts are interleaved (1, 2, 4, 1, 2, 4, ...). Four workers on this 2-core machine
oversubscribe it; the figure is still what a user would see.

`--compare-warmup`: each start is made twice in turn, without and with `Engine(warmup=True)`
(one request at the planned size before the Engine is ready: `warmup_seconds`), so the user's
first request is measured cold and warm, and the start split into Ray start + planning,
actors, weight load, group, warm-up.

    python bench/bench_startup.py [--workers 1 2 4] [--repeats 3] [--compare-warmup]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

PHASES = ("plan_seconds", "placement_seconds", "actors_seconds", "load_seconds", "group_seconds", "warmup_seconds")


def one_start(workers: int, steps: int, engine_warmup: bool = False) -> dict:
    import ray

    from raydit.runtime.engine import Engine

    load = benchlib.loadavg()
    t0 = time.perf_counter()
    engine = Engine(model="tiny", workers=workers, device="cpu", show_plan=False, warmup=engine_warmup)
    ready = time.perf_counter() - t0
    first: list[float] = []

    def on_step(pipe, step, timestep, kwargs):
        if not first:
            first.append(time.perf_counter() - t0)
        return kwargs

    try:
        t_request = time.perf_counter()
        engine.generate("a red fox", num_inference_steps=steps, seed=0, progress=False,
                        callback_on_step_end=on_step)
        done = time.perf_counter()
        timings = engine.timings
        plan = engine.plan
    finally:
        engine.shutdown()
        if ray.is_initialized():
            ray.shutdown()
    return {"ready_seconds": ready, "first_step_seconds": first[0], "load": load, "warmup": engine_warmup,
            "first_video_seconds": done - t0, "request_seconds": done - t_request,
            "plan": f"ulysses {plan.ulysses} x ring {plan.ring} x cfg {plan.cfg}",
            **{k: round(timings[k], 3) for k in PHASES if k in timings}}


def run(worker_counts: list[int], repeats: int, steps: int = 2, warmup: bool = True,
        compare_warmup: bool = False) -> dict:
    if warmup:
        one_start(1, steps)  # builds the tiny pipeline cache, fills the OS file cache
    modes = (False, True) if compare_warmup else (False,)
    runs: dict[tuple, list[dict]] = {(w, m): [] for w in worker_counts for m in modes}
    for rep in range(repeats):
        for w in worker_counts:
            for m in modes:
                r = one_start(w, steps, engine_warmup=m)
                runs[(w, m)].append(r)
                print(f"repeat {rep} workers {w}{' --warmup' if m else ''}: ready {r['ready_seconds']:.2f} s, "
                      f"first step {r['first_step_seconds']:.2f} s, first video {r['first_video_seconds']:.2f} s "
                      f"(its request {r['request_seconds']:.2f} s) ({r['plan']}), load {r['load'][0]}", flush=True)
    rows = []
    for (w, m), rs in runs.items():
        row = {"workers": w, "warmup": m, "plan": rs[0]["plan"],
               "ready_seconds": benchlib.summary([r["ready_seconds"] for r in rs], 3),
               "first_step_seconds": benchlib.summary([r["first_step_seconds"] for r in rs], 3),
               "first_video_seconds": benchlib.summary([r["first_video_seconds"] for r in rs], 3),
               "request_seconds": benchlib.summary([r["request_seconds"] for r in rs], 3),
               "load_1m": benchlib.summary([r["load"][0] for r in rs], 2)}
        for k in PHASES:
            if all(k in r for r in rs):
                row[k] = benchlib.summary([r[k] for r in rs], 3)
        rows.append(row)
    return {"machine": benchlib.machine(), "model": "tiny", "steps": steps, "rows": rows,
            "runs": {f"{w}{' warmup' if m else ''}": rs for (w, m), rs in runs.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true", help="skip the unmeasured first start")
    ap.add_argument("--compare-warmup", action="store_true",
                    help="each start also with Engine(warmup=True): the first request cold and warm")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = ap.parse_args(argv)
    os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
    result = run(args.workers, args.repeats, warmup=not args.no_warmup, compare_warmup=args.compare_warmup)
    print("wrote", benchlib.write_json("startup", result, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
