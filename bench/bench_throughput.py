"""Throughput: requests per minute through `Engine.submit`'s queue, 1 replica against 2.

On this 2-core machine the fair comparison uses the same 2 CPU slots both ways: one replica
of 2 ranks (ulysses 2) against two replicas of 1 rank each (`Engine(..., replicas=2)`).
Both engines are started up front on one local Ray of 4 CPU slots and stay warm; rounds
alternate which one serves a burst of `--requests` requests submitted at once (the idle one
sleeps). Throughput = requests / (first submit -> last result) x 60. The model is
benchlib.bench_model_dir() (~1 s a step on one rank here).

    python bench/bench_throughput.py [--requests 4] [--steps 4] [--rounds 3]
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

PROMPT = "a red fox"
CONFIGS = {  # name -> Engine keyword arguments
    "1 replica x 2 ranks": dict(workers=2, ulysses=2, ring=1, cfg=1, replicas=1),
    "2 replicas x 1 rank": dict(workers=1, replicas=2),
}


def burst(engine, requests: int, steps: int, seed0: int) -> dict:
    t0 = time.perf_counter()
    futures = [engine.submit(PROMPT, num_inference_steps=steps, seed=seed0 + i) for i in range(requests)]
    results = [f.result(timeout=1800) for f in futures]
    wall = time.perf_counter() - t0
    return {"seconds": wall, "requests_per_minute": requests / wall * 60,
            "replicas_used": sorted({getattr(r, "replica", 0) for r in results}) if results else []}


def run(requests: int, steps: int, rounds: int) -> dict:
    import ray

    from raydit.runtime.engine import Engine

    model_dir = benchlib.bench_model_dir()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING",
             object_store_memory=256 * 1024 * 1024,
             runtime_env={"env_vars": {k: os.environ[k] for k in ("RAYDIT_CACHE",) if k in os.environ}})
    engines = {}
    records = []
    try:
        for name, kwargs in CONFIGS.items():
            engines[name] = Engine(model=model_dir, device="cpu", show_plan=False, grow="never", **kwargs)
            engines[name].generate(PROMPT, num_inference_steps=2, seed=0, progress=False)  # warm-up
        names = list(CONFIGS)
        for rnd in range(rounds):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                load = benchlib.loadavg()
                r = burst(engines[name], requests, steps, seed0=100 * rnd)
                records.append({"round": rnd, "config": name, "load": load, **r})
                print(f"round {rnd} {name}: {r['requests_per_minute']:.2f} requests/min "
                      f"({requests} in {r['seconds']:.1f} s), replicas used {r['replicas_used']}, load {load[0]}",
                      flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
        ray.shutdown()
    rows = []
    for name in CONFIGS:
        rs = [r for r in records if r["config"] == name]
        rows.append({"config": name, "requests_per_minute": benchlib.summary([r["requests_per_minute"] for r in rs], 3),
                     "load_1m": benchlib.summary([r["load"][0] for r in rs], 2)})
    a, b = (records_of := {n: [r["requests_per_minute"] for r in records if r["config"] == n] for n in CONFIGS}).values()
    return {"machine": benchlib.machine(), "model": {"dir": model_dir, **benchlib.BENCH_MODEL},
            "requests_per_burst": requests, "steps": steps, "rows": rows,
            "ratio_2_replicas_over_1": benchlib.summary([y / x for x, y in zip(a, b)], 3),
            "per_config": records_of, "rounds": records}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = ap.parse_args(argv)
    os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
    result = run(args.requests, args.steps, args.rounds)
    print("wrote", benchlib.write_json("throughput", result, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
