"""Sequence-parallel attention speedup on this machine: 1 process against 2 (Ulysses 2x1, ring 1x2).

Geometry: one CogVideoX-2b attention layer, batch 1, 30 heads x 64, 226 text tokens + 2 latent
frames of 30 x 45 patches (2700 video tokens), float32 on CPU, one thread per process.

One spawned group of 2 processes runs everything, interleaved round by round (baseline,
Ulysses, ring, ...) so that load from other users of the machine falls on all configurations
alike. The baseline runs on rank 0 alone (a 1-rank mesh) while rank 1 waits. An iteration's
time is the slowest rank's. Also measured, to explain the result: each configuration's
communication alone and a rank's attention compute alone.

    python bench/bench_attention.py [--rounds 7] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from raydit.parallel import SeqLayout, build_mesh, select_kernel, sp_attention
from raydit.parallel.attention import _all_to_all, head_to_seq_send, seq_to_head_send
from raydit.parallel.testing import run_distributed

HEADS, HEAD_DIM, TEXT, FRAMES, ROWS, COLS = 30, 64, 226, 2, 30, 45
PARTS = (TEXT, FRAMES * ROWS * COLS)
TARGET = 1.85


def _qkv(layout: SeqLayout, sp_index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, 1, HEADS, n, HEAD_DIM, generator=g) for n in PARTS]
    return layout.shard_parts(parts, sp_index, dim=3).contiguous()


def _timed(fn, group=None) -> tuple[float, float]:
    """(wall, cpu) seconds of fn on this rank, wall maxed over `group` (the slowest rank counts)."""
    if group is not None:
        dist.barrier(group=group)
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    if group is not None:
        t = torch.tensor([wall, cpu], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        wall, cpu = t.tolist()
    return wall, cpu


def bench_worker(rank: int, world: int, rounds: int, warmup: int) -> dict:
    kernel = select_kernel("cpu", torch.float32)
    solo = build_mesh(1, ranks=[0])
    meshes = {"ulysses 2x1": build_mesh(2, 1), "ring 1x2": build_mesh(1, 2)}
    world_group = dist.group.WORLD

    layout1 = SeqLayout(PARTS, 1)
    layout2 = SeqLayout(PARTS, 2)
    q1 = _qkv(layout1, 0) if rank == 0 else None
    qkv2 = _qkv(layout2, rank)

    def run_solo():
        if rank == 0:
            sp_attention(q1[0], q1[1], q1[2], solo, layout1, kernel=kernel)

    runs = {"1 process": run_solo}
    for name, mesh in meshes.items():
        runs[name] = lambda mesh=mesh: sp_attention(qkv2[0], qkv2[1], qkv2[2], mesh, layout2, kernel=kernel)

    # Parts, to explain the totals: communication alone and one rank's compute alone.
    U = meshes["ulysses 2x1"]
    ring = meshes["ring 1x2"]
    send_qkv = seq_to_head_send(qkv2, 2)
    out_BhTD = torch.empty(1, HEADS // 2, 2 * layout2.local_len, HEAD_DIM)
    send_out = head_to_seq_send(out_BhTD, 2)
    kv = qkv2[1:].contiguous()
    recv = torch.empty_like(kv)

    def ulysses_comm():
        _all_to_all(send_qkv, U.ulysses_group)
        _all_to_all(send_out, U.ulysses_group)

    def ring_comm():
        ops = [dist.P2POp(dist.isend, kv, ring.ring_next, ring.ring_group),
               dist.P2POp(dist.irecv, recv, ring.ring_prev, ring.ring_group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    def local_compute():
        # A rank's share: its queries (local_len) against all keys, all heads.
        q = qkv2[0]
        k = torch.cat([qkv2[1], qkv2[1]], dim=2)
        kernel(q, k, k, 1 / math.sqrt(HEAD_DIM))

    parts = {"ulysses all-to-all (q,k,v + out)": ulysses_comm, "ring K/V exchange (1 step)": ring_comm,
             "one rank's attention compute": local_compute}

    times: dict[str, list] = {name: [] for name in (*runs, *parts)}
    for i in range(warmup + rounds):
        for name, fn in (*runs.items(), *parts.items()):
            wall_cpu = _timed(fn, world_group)
            if i >= warmup:
                times[name].append(wall_cpu)
    return {"times": times, "local_len": layout2.local_len, "pad_tokens": layout2.pad_tokens}


def _stats(samples: list) -> dict:
    walls = sorted(w for w, _ in samples)
    cpus = sorted(c for _, c in samples)
    q = statistics.quantiles(walls, n=4) if len(walls) >= 2 else [walls[0]] * 3
    return {
        "median_s": statistics.median(walls), "min_s": walls[0], "max_s": walls[-1],
        "p25_s": q[0], "p75_s": q[2], "n": len(walls), "median_cpu_s": statistics.median(cpus),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "benchmarks")
    args = ap.parse_args(argv)

    load_before = os.getloadavg()
    start = time.time()
    result = run_distributed(bench_worker, 2, args.rounds, args.warmup, timeout=3600, threads=1)[0]
    load_after = os.getloadavg()

    stats = {name: _stats(samples) for name, samples in result["times"].items()}
    base = stats["1 process"]["median_s"]
    configs = {}
    for name in ("ulysses 2x1", "ring 1x2"):
        s = stats[name]
        configs[name] = {**s, "speedup": base / s["median_s"], "speedup_cpu": stats["1 process"]["median_cpu_s"] / s["median_cpu_s"]}
    report = {
        "geometry": {"batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "text_tokens": TEXT,
                     "video_tokens": PARTS[1], "dtype": "float32", "local_len_2_ranks": result["local_len"],
                     "pad_tokens_2_ranks": result["pad_tokens"]},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "threads_per_process": 1, "kernel": select_kernel("cpu", torch.float32).name,
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "baseline_1_process": stats["1 process"],
        "two_processes": configs,
        "parts": {k: stats[k] for k in stats if k not in ("1 process", *configs)},
        "target_speedup": TARGET,
        "target_met": {name: c["speedup"] >= TARGET for name, c in configs.items()},
        "seconds_total": time.time() - start,
        "command": "python bench/bench_attention.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "attention.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


def _markdown(r: dict) -> str:
    g, m = r["geometry"], r["machine"]
    lines = [
        "# Sequence-parallel attention on CPU: 1 process vs 2",
        "",
        f"One CogVideoX-2b attention layer: batch 1, {g['heads']} heads x {g['head_dim']}, "
        f"{g['text_tokens']} text + {g['video_tokens']} video tokens, {g['dtype']}, kernel `{m['kernel']}`, "
        f"{m['threads_per_process']} thread per process, {m['cpus']} CPUs, torch {m['torch']}.",
        f"Load average before / after: {', '.join(f'{x:.1f}' for x in m['loadavg_before'])} / "
        f"{', '.join(f'{x:.1f}' for x in m['loadavg_after'])} (the machine is shared).",
        "Time of an iteration = slowest rank; wall seconds; CPU = process CPU seconds (contention-free work).",
        "",
        "| configuration | median s | p25-p75 s | min-max s | n | speedup (wall) | speedup (CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    b = r["baseline_1_process"]
    lines.append(f"| 1 process | {b['median_s']:.3f} | {b['p25_s']:.3f}-{b['p75_s']:.3f} | "
                 f"{b['min_s']:.3f}-{b['max_s']:.3f} | {b['n']} | 1.00 | 1.00 |")
    for name, c in r["two_processes"].items():
        lines.append(f"| {name} | {c['median_s']:.3f} | {c['p25_s']:.3f}-{c['p75_s']:.3f} | "
                     f"{c['min_s']:.3f}-{c['max_s']:.3f} | {c['n']} | {c['speedup']:.2f} | {c['speedup_cpu']:.2f} |")
    lines += ["", "Parts (2 processes):", "", "| part | median s | min-max s |", "|---|---|---|"]
    for name, p in r["parts"].items():
        lines.append(f"| {name} | {p['median_s']:.4f} | {p['min_s']:.4f}-{p['max_s']:.4f} |")
    met = ", ".join(f"{k}: {'met' if v else 'missed'}" for k, v in r["target_met"].items())
    lines += ["", f"Target {r['target_speedup']}x on 2 ranks: {met}.", "", f"Command: `{r['command'].strip()}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
