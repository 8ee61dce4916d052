"""Recovery: what losing a node mid-generation costs a request.

A Ray cluster of a CPU-less head and 2 worker nodes of 1 CPU each on this machine
(ray.cluster_utils.Cluster, health checks every 0.5 s, a node declared dead after 4 misses:
about 2 s; Ray's default is about 14 s), one rank per node, `Engine(workers=2, grow="always")`
on the benchmark pipeline (benchlib.bench_model_dir()). Each repeat runs

1. an uninterrupted request (the baseline, ulysses 2 on 2 nodes);
2. the same request, in which the node of rank 1 is removed (`remove_node(...,
   allow_graceful=False)`: its raylet and workers are killed) right after step `--kill-after`
   finishes; the engine detects the loss, regroups on the survivor and resumes;
3. a fresh node is added and a warm-up request lets the engine grow back to 2 ranks.

Figures per repeat: detection (kill -> the engine's `failure` event), regrouping (the
`regrouped` event's seconds), kill -> the first resumed step finished (from
callback_on_step_end timestamps), and the delay the failure adds to the request (its total
minus the same repeat's uninterrupted total). The steps after the loss run on 1 rank, so
part of the added delay is the slower step, not recovery; the record gives both.

    python bench/bench_recovery.py [--repeats 3] [--steps 6] [--kill-after 1]
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

PROMPT = "a red fox"  # short: the tiny tokenizer keeps 16 characters
NODE = dict(num_cpus=1, object_store_memory=80 * 1024 * 1024)


def _wait_dead(node_id: str, timeout: float = 60) -> None:
    import ray

    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return
        time.sleep(0.2)
    raise RuntimeError(f"node {node_id} still alive {timeout} s after its removal")


def one_repeat(engine, cluster, nodes: list, steps: int, kill_after: int, seed: int, regrow: bool) -> dict:
    base = engine.generate(PROMPT, num_inference_steps=steps, seed=seed, progress=False)
    victim_id = engine.group.active[1].node_id
    victim = next(n for n in nodes if n.node_id == victim_id)
    step_end: dict[int, float] = {}
    killed: list[float] = []

    def on_step(pipe, step, timestep, kwargs):
        step_end.setdefault(step, time.time())
        if step == kill_after and not killed:
            killed.append(time.time())
            cluster.remove_node(victim, allow_graceful=False)
        return kwargs

    load = benchlib.loadavg()
    hit = engine.generate(PROMPT, num_inference_steps=steps, seed=seed, progress=False, callback_on_step_end=on_step)
    nodes.remove(victim)
    events = hit.events
    failure = next(e for e in events if e["event"] == "failure")
    regrouped = [e for e in events if e["event"] == "regrouped"]
    resumed_at = regrouped[-1]["time"]
    first_resumed = min(t for s, t in step_end.items() if s > kill_after and t >= resumed_at)
    steps_before = [s for i, s in enumerate(base.timings["step_seconds"]) if i > kill_after]
    steps_after = hit.timings["step_seconds"][kill_after + 2:]  # steps run wholly after the regroup
    row = {
        "load": load,
        "baseline_total_seconds": round(base.timings["total_seconds"], 3),
        "interrupted_total_seconds": round(hit.timings["total_seconds"], 3),
        "added_delay_seconds": round(hit.timings["total_seconds"] - base.timings["total_seconds"], 3),
        "detect_seconds": round(failure["time"] - killed[0], 3),
        "regroup_seconds": round(sum(e.get("seconds", 0.0) for e in regrouped), 3),
        "kill_to_first_resumed_step_seconds": round(first_resumed - killed[0], 3),
        "plan_after": hit.plan.world_size,
        "step_seconds_2_ranks": round(sum(steps_before) / max(1, len(steps_before)), 4),
        "step_seconds_1_rank": round(sum(steps_after) / max(1, len(steps_after)), 4) if steps_after else None,
        "events": [{k: v for k, v in e.items() if k in ("event", "time", "seconds", "reason", "resume_step")}
                   for e in events],
    }
    if not regrow:
        return row
    # Put the lost node back and let the engine grow to 2 ranks again before the next repeat.
    nodes.append(cluster.add_node(**NODE))
    cluster.wait_for_nodes()
    engine.generate(PROMPT, num_inference_steps=2, seed=seed, progress=False)
    assert engine.plan.world_size == 2, engine.plan
    return row


def run(repeats: int, steps: int, kill_after: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from raydit.runtime.engine import Engine

    model_dir = benchlib.bench_model_dir()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 100 * 1024 * 1024,
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                           "health_check_failure_threshold": 4},
    })
    rows = []
    try:
        ray.init(address=cluster.address, logging_level="WARNING",
                 runtime_env={"env_vars": {k: os.environ[k] for k in ("RAYDIT_CACHE",) if k in os.environ}})
        nodes = [cluster.add_node(**NODE) for _ in range(2)]
        cluster.wait_for_nodes()
        engine = Engine(model=model_dir, workers=2, device="cpu", grow="always", show_plan=False)
        try:
            engine.generate(PROMPT, num_inference_steps=2, seed=0, progress=False)  # warm-up
            for rep in range(repeats):
                row = one_repeat(engine, cluster, nodes, steps, kill_after, seed=rep, regrow=rep < repeats - 1)
                rows.append(row)
                print(f"repeat {rep}: detect {row['detect_seconds']:.2f} s, regroup {row['regroup_seconds']:.2f} s, "
                      f"kill -> resumed step {row['kill_to_first_resumed_step_seconds']:.2f} s, added delay "
                      f"{row['added_delay_seconds']:.2f} s (total {row['interrupted_total_seconds']:.2f} vs "
                      f"{row['baseline_total_seconds']:.2f} s), load {row['load'][0]}", flush=True)
        finally:
            engine.shutdown()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    keys = ("detect_seconds", "regroup_seconds", "kill_to_first_resumed_step_seconds", "added_delay_seconds",
            "baseline_total_seconds", "interrupted_total_seconds", "step_seconds_2_ranks", "step_seconds_1_rank")
    return {
        "machine": benchlib.machine(),
        "model": {"dir": model_dir, **benchlib.BENCH_MODEL},
        "steps": steps, "kill_after_step": kill_after,
        "health_check": "period 0.5 s, 4 misses",
        **{k: benchlib.summary([r[k] for r in rows if r[k] is not None], 3) for k in keys},
        "repeats": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kill-after", type=int, default=1, help="remove the node after this step (0-based)")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = ap.parse_args(argv)
    if not 0 <= args.kill_after < args.steps - 1:
        raise SystemExit(f"--kill-after {args.kill_after}: must leave at least one step after it (steps {args.steps})")
    os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
    result = run(args.repeats, args.steps, args.kill_after)
    print("wrote", benchlib.write_json("recovery", result, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
