"""Time `raydit.plan` on 8, 64 and 1,024 devices (and a mixed cluster).

Each case runs `--repeats` times after one warm-up; the figures are the median with the
min, max and interquartile range, in milliseconds, of wall time and of the process's CPU
time (the planner is single-threaded: on a shared machine CPU time is its own work, wall
time adds the waiting), plus what the planner chose. Results go
to docs/benchmarks/plan.json and docs/benchmarks/plan.md.

    python bench/bench_plan.py [--repeats 15] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from raydit.planner import ClusterSpec, plan  # noqa: E402

CASES = [
    # name, model, cluster description, kwargs for plan()
    ("8xH100 cogvideox-2b", "cogvideox-2b", "1 node x 8 H100", dict(gpus=8)),
    ("64xH100 cogvideox-2b", "cogvideox-2b", "8 nodes x 8 H100", dict(gpus=64)),
    ("1024xH100 cogvideox-2b", "cogvideox-2b", "64 nodes x 16 H100",
     dict(cluster=ClusterSpec.uniform(1024, "H100", per_node=16))),
    ("1024xH100 cogvideox-2b (8/node)", "cogvideox-2b", "128 nodes x 8 H100", dict(gpus=1024)),
    ("1024xH100 cogvideox-5b", "cogvideox-5b", "64 nodes x 16 H100",
     dict(cluster=ClusterSpec.uniform(1024, "H100", per_node=16))),
    ("1024xH100 cogvideox1.5-5b", "cogvideox1.5-5b", "64 nodes x 16 H100",
     dict(cluster=ClusterSpec.uniform(1024, "H100", per_node=16))),
    ("mixed.yaml cogvideox-5b", "cogvideox-5b", "8 H100 + 4 L40S + 4 A10G (cluster/mixed.yaml)",
     dict(cluster=ClusterSpec.from_yaml(REPO / "cluster" / "mixed.yaml"))),
]


def quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def run_case(model, kwargs, repeats: int) -> dict:
    plan(model, **kwargs)  # warm-up: imports, first-call caches of the interpreter
    times, cpu = [], []
    result = None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        result = plan(model, **kwargs)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    ms = [t * 1e3 for t in times]
    cpu_ms = [t * 1e3 for t in cpu]
    q1, q3 = quartiles(ms)
    c1, c3 = quartiles(cpu_ms)
    best = result.best
    return {
        "median_ms": round(statistics.median(ms), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
        "q1_ms": round(q1, 3),
        "q3_ms": round(q3, 3),
        "cpu_median_ms": round(statistics.median(cpu_ms), 3),
        "cpu_min_ms": round(min(cpu_ms), 3),
        "cpu_max_ms": round(max(cpu_ms), 3),
        "cpu_q1_ms": round(c1, 3),
        "cpu_q3_ms": round(c3, 3),
        "repeats": repeats,
        "devices": result.cluster.total,
        "feasible": len(result.candidates),
        "rejected": len(result.rejected),
        "best": {k: getattr(best, k) for k in ("cfg", "ulysses", "ring", "replicas", "world_size", "split")}
        | {"predicted_step_seconds": round(best.predicted_step_seconds, 5), "kind": best.kind},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    args = ap.parse_args(argv)
    machine = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    rows = []
    for name, model, desc, kwargs in CASES:
        r = run_case(model, kwargs, args.repeats)
        r.update(case=name, model=model, cluster=desc)
        rows.append(r)
        print(f"{name:<34} wall median {r['median_ms']:>8.2f} ms (min {r['min_ms']:.2f}, "
              f"max {r['max_ms']:.2f}, IQR {r['q1_ms']:.2f}-{r['q3_ms']:.2f})  CPU median "
              f"{r['cpu_median_ms']:.2f} ms (min {r['cpu_min_ms']:.2f}, max {r['cpu_max_ms']:.2f})  "
              f"{r['feasible']} feasible, {r['rejected']} rejected", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps({"machine": machine, "cases": rows}, indent=1) + "\n")
    lines = [
        "# Planner timing (`bench/bench_plan.py`)",
        "",
        f"`raydit.plan` wall time, {args.repeats} runs after one warm-up, pure Python "
        f"{machine['python']} on {machine['processor']} ({machine['cpu_count']} CPUs, "
        f"1-min load {machine['load_average_1m']} while measuring, shared machine), {machine['date_utc']} UTC.",
        "A run enumerates every cfg x ulysses x ring layout, judges it (memory, node fit, "
        "cost model, placement) and ranks the feasible ones.",
        "",
        "| case | cluster | wall median ms | wall min-max | wall IQR | CPU median ms | CPU min-max | "
        "feasible | rejected | best (cfg x U x R x replicas) | predicted s/step |",
        "|---|---|---:|---|---|---:|---|---:|---:|---|---:|",
    ]
    for r in rows:
        b = r["best"]
        lines.append(
            f"| {r['case']} | {r['cluster']} | {r['median_ms']:.2f} | {r['min_ms']:.2f}-{r['max_ms']:.2f} | "
            f"{r['q1_ms']:.2f}-{r['q3_ms']:.2f} | {r['cpu_median_ms']:.2f} | "
            f"{r['cpu_min_ms']:.2f}-{r['cpu_max_ms']:.2f} | {r['feasible']} | {r['rejected']} | "
            f"{b['cfg']} x {b['ulysses']} x {b['ring']} x {b['replicas']} ({b['world_size']} devices, "
            f"{b['split']}{', ' + b['kind'] if b['kind'] != 'uniform' else ''}) | {b['predicted_step_seconds']:.4f} |")
    lines += ["", "Reproduce: `python bench/bench_plan.py`. Step times are the planner's model "
              "(H100 table entry, see raydit/planner/cost.py), not measurements."]
    (out / "plan.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'plan.json'} and {out / 'plan.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
