"""Issue 39 item 5: Ray's gc request to the driver racing ray.shutdown() (no GPU needed).

A raylet asks every process on its node, the driver included, to run Python's gc (LocalGC RPC).
In the driver, Ray's Cython callback `gc_collect` calls `global_worker.core_worker.trigger_gc()`,
which `ray.shutdown()` breaks for a moment (CoreWorker.shutdown_driver drops the PythonGCThread
before the core worker stops serving RPCs): a request then raises AttributeError inside the
callback, whose error path on Python 3.12 is PyTraceBack_Here -> PyException_GetTraceback (the
frame of the SIGSEGV seen on the H200). See raydit/runtime/raygc.py.

Each mode runs in its own process, so that a crash ends only that mode: `ray` (a plain local
ray.init) and `raydit` (the private cluster raydit's Engine starts), both with Ray's requests
made as frequent as Ray allows through the environment (RAY_local_gc_interval_s=0,
RAY_local_gc_min_interval_s=0, RAY_raylet_check_gc_period_milliseconds=10). Each process runs
--iters rounds of connect, --hold-s seconds, shutdown. With --probe (default) a thin proxy on
`global_worker.core_worker` counts the requests that reach gc_collect and those that raised in
it during shutdown; --no-probe runs Ray untouched and only reports how each process ended
(a negative code is the signal that killed it: -11 is SIGSEGV).

    python bench/ray_gc_race.py [--iters 6] [--hold-s 1] [--modes ray,raydit] [--no-probe]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, sys, time
import ray
import ray._private.worker as W

mode, iters, hold_s, probe = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"


class Probe:
    # Every attribute is the real core worker's; trigger_gc (what gc_collect calls) and
    # shutdown_driver (what ray.shutdown calls) are counted on their way through.
    def __init__(self, real):
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "stopping", False)
        object.__setattr__(self, "counts", {"before_shutdown": 0, "in_shutdown": 0, "raised_before_shutdown": 0,
                                            "raised_in_shutdown": 0})

    def __getattr__(self, name):
        return getattr(self._real, name)

    def shutdown_driver(self):
        object.__setattr__(self, "stopping", True)
        return self._real.shutdown_driver()

    def trigger_gc(self):
        key = "in_shutdown" if self.stopping else "before_shutdown"
        self.counts[key] += 1
        try:
            self._real.trigger_gc()
        except Exception:
            self.counts["raised_in_shutdown" if self.stopping else "raised_before_shutdown"] += 1
            raise


rounds = []
for _ in range(iters):
    if mode == "raydit":
        from raydit.runtime.cluster import RayCluster

        cluster = RayCluster.connect(want_workers=1)
    else:
        ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False, object_store_memory=128 * 1024 * 1024)
    p = Probe(W.global_worker.core_worker) if probe else None
    if p is not None:
        W.global_worker.core_worker = p
    time.sleep(hold_s)
    if mode == "raydit":
        cluster.close()
    else:
        ray.shutdown()
    rounds.append(p.counts if p is not None else {})
print(json.dumps(rounds))
"""


def run_mode(mode: str, iters: int, hold_s: float, probe: bool, timeout_s: float) -> dict:
    env = dict(os.environ, RAY_local_gc_interval_s="0", RAY_local_gc_min_interval_s="0",
               RAY_raylet_check_gc_period_milliseconds="10")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, mode, str(iters), str(hold_s), "1" if probe else "0"],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "returncode": None, "error": f"timed out after {timeout_s:g} s"}
    out = {"mode": mode, "returncode": done.returncode}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        rounds = json.loads(lines[-1])
        out["rounds"] = rounds
        if probe:
            out["requests_before_shutdown"] = sum(r["before_shutdown"] for r in rounds)
            out["requests_in_shutdown"] = sum(r["in_shutdown"] for r in rounds)
            out["raised_in_gc_collect"] = sum(r["raised_in_shutdown"] + r["raised_before_shutdown"] for r in rounds)
    else:
        out["stderr_tail"] = done.stderr[-2000:]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=6, help="connect/shutdown rounds per mode")
    ap.add_argument("--hold-s", type=float, default=1.0, help="seconds connected in each round")
    ap.add_argument("--modes", default="ray,raydit", help="comma-separated: ray, raydit")
    ap.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                    help="count gc_collect's calls and errors through a proxy (default on)")
    ap.add_argument("--timeout-s", type=float, default=540.0, help="limit per mode")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ray", "raydit")]
    if bad:
        print(f"ray_gc_race: unknown mode {bad[0]!r}; use ray, raydit or both", file=sys.stderr)
        return 2
    results = {"python": sys.version.split()[0], "iters": args.iters, "probe": args.probe, "modes": []}
    for mode in modes:
        r = run_mode(mode, args.iters, args.hold_s, args.probe, args.timeout_s)
        results["modes"].append(r)
        line = f"{mode:<7} exit {r['returncode']}"
        if "requests_in_shutdown" in r:
            line += (f"; gc requests before shutdown {r['requests_before_shutdown']}, during shutdown "
                     f"{r['requests_in_shutdown']}, raised in gc_collect {r['raised_in_gc_collect']}")
        if r.get("error") or r.get("stderr_tail"):
            line += f"; {r.get('error') or r['stderr_tail'].strip().splitlines()[-1]}"
        print(line, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
