"""One denoising step of a CogVideoX-2b-shaped transformer on 1 rank and on 2 ranks
(Ulysses 2 x ring 1, Ulysses 1 x ring 2), one thread per process, and the planner's
prediction for each of those plans, from a calibration measured in the same round.

The transformer is diffusers' CogVideoXTransformer3DModel with random weights at the scale of
an initialised network (`bench_transformer`: why it matters for the GELU): 30 heads x 64,
`--layers` layers, 16 latent channels, a 480 x 720 latent grid (60 x 90 latents, 30 x 45
patches) of `--frames` latent frames, 226 text tokens. One forward = one denoising step
without classifier-free guidance (batch 1; guidance doubles the batch and every figure).

Two processes are launched once (raydit.parallel.testing.run_distributed, gloo). Every
round runs the configurations back to back, in an order that rotates each round:
the 1-rank baseline runs on rank 0 while rank 1 blocks in a barrier (its CPU time is
recorded to show it stays idle), the Ulysses run (its all-to-all pipelined in head chunks,
raydit.parallel.attention), the same Ulysses run with one chunk (no overlap: what the
pipelining buys), the ring run, and "both alone": each rank runs the whole 1-rank step at
the same time as the other, no communication. Half of that time is what a perfect split
of the work would take with both cores busy, so 2 x baseline / both-alone is the
compute-only ceiling of the 2-rank speedup in this round (it includes what two busy cores
cost each other: shared caches, memory bandwidth, clock).

Calibration at plan time: at the start of every round the ranks run what `raydit doctor
--calibrate` measures (raydit.runtime.measure): on rank 0, one thread, the matmul rate
(matrices of CALIBRATION_SIZES) and a DiT block's linear part and attention kernel timed
apart; between the two ranks, gloo's all-to-all bandwidth and latency. The planner predicts
each plan on a `cpu` device calibrated with them (calibration_cache.apply_entry: each part of the
step at its measured rate, the Ulysses and ring exchanges over the measured link in float32);
the prediction error is paired by
round. The table's fixed `cpu` entry is reported beside it. Before each measurement rank 0
waits (up to `--max-wait` s) for the rest of the machine to go quiet, and every measurement
records the CPU seconds other processes used meanwhile (/proc/stat busy time minus our own);
figures come from the rounds where that stayed under 15% of a core, if there are 3 or more.
For a parallel run the transformer is parallelized on its mesh and undone after the
forward. Speedups are taken per round (the
baseline and the parallel run of the same round) and then their median: noise from other
users of the machine shifts both sides of a ratio alike. Every parallel output is checked
against the same round's 1-rank output with torch.testing.assert_close (rtol 1e-3, atol 1e-3;
float32, different summation order).

    python bench/bench_scaling.py [--frames 1 3] [--layers 2] [--rounds 5] [--warmup 1] [--max-wait 10]
    python bench/bench_scaling.py --frames 1 --layers 30 --rounds 3 --name scaling-30l   # CogVideoX-2b's 30 layers

The bench runs 2 layers by default (a 30-layer step at 1 latent frame takes about a minute
on one core here). Each step also has work outside the blocks that is not split (the
embeddings and the text projection before them, the gather and the final projection after):
its share falls with the layer count, so the 2-layer step understates the speedup of
CogVideoX-2b's 30. Every record keeps the three parts of each rank's step apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

HEADS, HEAD_DIM, LATENT_C, TEXT_TOKENS = 30, 64, 16, 226
LATENT_H, LATENT_W = 60, 90  # 480 x 720 pixels / VAE 8
CONFIGS = ("1 rank", "ulysses 2", "ulysses 2 no overlap", "ring 2", "both alone")  # names in the results
PARALLEL = ("ulysses 2", "ulysses 2 no overlap", "ring 2")
DEGREES = {"1 rank": (1, 1), "ulysses 2": (2, 1), "ring 2": (1, 2)}
HEAD_CHUNKS = {"ulysses 2 no overlap": 1}  # others: the default pipeline depth
TOL = dict(rtol=1e-3, atol=1e-3)
# A step's three parts, seconds per rank (scaling_worker): before the first block, the blocks,
# after the last block.
PARTS = ("before blocks", "blocks", "after blocks")
# A measurement is clean when the rest of the machine used at most this fraction of one core.
CLEAN = 0.15
# The doctor's matmul measurement with larger matrices: about half a second of work, a
# window long enough to see the share of the core this process gets on a shared machine.
CALIBRATION_SIZES = (512, 768, 1024)


def transformer_kwargs(layers: int, text_dim: int) -> dict:
    return dict(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, num_layers=layers,
        in_channels=LATENT_C, out_channels=LATENT_C, text_embed_dim=text_dim, time_embed_dim=512,
        sample_height=LATENT_H, sample_width=LATENT_W, sample_frames=49, max_text_seq_length=TEXT_TOKENS,
    )


def bench_transformer(layers: int, text_dim: int, seed: int = 1):
    """The bench's transformer with weights at the scale of an initialised (and trained)
    network: each matrix drawn with std 1 / sqrt(fan_in), norm weights near 1, small biases.
    The tests' tiny models draw every parameter with std 0.2 (raydit.models.tiny.randomize),
    which at this width puts the FFN's pre-activations near +-9, where the tanh-GELU kernel
    takes a slow path (4x slower than at +-1: 15% of a 1-rank step, none of it in a real
    model), so the step would not be CogVideoX-2b's."""
    import torch

    from raydit.models.families.cogvideox.tiny import tiny_transformer

    model = tiny_transformer(**transformer_kwargs(layers, text_dim))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return model


def _forward(model, inputs):
    return model(**inputs, return_dict=False)[0]


def round_calibration(rank: int, world: int) -> dict:
    """What `raydit doctor --calibrate` measures, at the start of a round: the compute rates on
    rank 0 (one thread, matrices of CALIBRATION_SIZES) and, with 2 ranks, the gloo link
    between them (the doctor measures a pair). Collective; rank 0's figures, {} elsewhere."""
    import torch.distributed as dist

    from raydit.runtime.measure import CPU_LINK_BYTES, measure_compute, measure_links

    calibration = measure_compute("cpu", CALIBRATION_SIZES) if rank == 0 else {}
    if world == 2:
        calibration.update(measure_links(rank, "cpu", CPU_LINK_BYTES))
    dist.barrier()
    return calibration


def scaling_worker(rank: int, world: int, frames: int, layers: int, text_dim: int, rounds: int,
                   warmup: int, max_wait_s: float) -> dict:
    """Runs on each of 2 gloo ranks; rank 0 returns the timings of every round."""
    import torch
    import torch.distributed as dist

    import raydit.parallel.attention as sp_attn
    from raydit.models.registry import parallelize
    from raydit.parallel import build_mesh

    assert world == 2 and torch.get_num_threads() == 1
    model = bench_transformer(layers, text_dim)
    # Where a step's time goes: before the first block (time and patch embeddings, the text
    # projection: every rank does them whole), the blocks (the split, the exchanges inside),
    # and after the last block (the gather, the final norm and projection: whole again).
    # Registered ahead of parallelize's split and gather hooks, so the split counts in the
    # blocks and the gather after them.
    marks: dict[str, float] = {}
    blocks = model.transformer_blocks
    blocks[0].register_forward_pre_hook(lambda m, a: marks.__setitem__("in", time.perf_counter()), prepend=True)
    blocks[-1].register_forward_hook(lambda m, a, o: marks.__setitem__("out", time.perf_counter()), prepend=True)
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, frames, LATENT_C, LATENT_H, LATENT_W, generator=g),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, text_dim, generator=g),
        timestep=torch.tensor([500]),
    )
    u2 = build_mesh(ulysses=2, ring=1)
    meshes = {"ulysses 2": u2, "ulysses 2 no overlap": u2, "ring 2": build_mesh(ulysses=1, ring=2)}
    default_chunks = sp_attn.DEFAULT_HEAD_CHUNKS
    records = []
    for rnd in range(warmup + rounds):
        k = rnd % len(CONFIGS)
        order = CONFIGS[k:] + CONFIGS[:k]
        row = {"round": rnd - warmup, "warmup": rnd < warmup, "order": list(order)}
        calibration = round_calibration(rank, world)
        if rank == 0:
            row["calibration"] = calibration
        reference = None
        for name in order:
            handle = parallelize(model, meshes[name]) if name in meshes else None
            sp_attn.DEFAULT_HEAD_CHUNKS = HEAD_CHUNKS.get(name, default_chunks)
            dist.barrier()
            waited = torch.tensor([benchlib.wait_for_quiet(max_wait_s) if rank == 0 else 0.0])
            dist.broadcast(waited, 0)
            load = benchlib.loadavg()
            busy0 = benchlib.machine_busy_seconds()
            marks.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.no_grad():
                run_here = handle is not None or rank == 0 or name == "both alone"
                out = _forward(model, inputs) if run_here else None
            t1 = time.perf_counter()
            if name == "1 rank":
                dist.barrier()  # rank 1 waits here while rank 0 runs the baseline alone
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            parts = ([marks["in"] - t0, marks["out"] - marks["in"], t1 - marks["out"]] if run_here
                     else [0.0, 0.0, 0.0])
            # A step ends when its slowest rank ends.
            both = [torch.zeros(5, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(both, torch.tensor([wall, cpu, *parts], dtype=torch.float64))
            busy = benchlib.machine_busy_seconds() - busy0
            if handle is not None:
                handle.remove()
            foreign = max(0.0, busy - sum(float(b[1]) for b in both))
            seconds = max(float(b[0]) for b in both)
            row[name] = {"seconds": seconds, "cpu_seconds": [round(float(b[1]), 4) for b in both],
                         "parts": {part: [round(float(b[2 + i]), 4) for b in both] for i, part in enumerate(PARTS)},
                         "foreign_cpu_seconds": round(foreign, 3), "waited_s": float(waited),
                         "clean": foreign <= CLEAN * seconds, "load": load}
            if rank == 0:
                if name == "1 rank":
                    reference = out
                elif name in meshes:
                    row[name]["output"] = out
        sp_attn.DEFAULT_HEAD_CHUNKS = default_chunks
        if rank == 0:
            for name in meshes:
                torch.testing.assert_close(row[name].pop("output"), reference, **TOL)
            records.append(row)
    return {"records": records} if rank == 0 else {}


def _bench_spec(layers: int):
    from raydit.planner import BUILTIN_MODELS

    base = BUILTIN_MODELS["cogvideox-2b"]
    return dataclasses.replace(base, name=f"cogvideox-2b-{layers}l", layers=layers,
                               params=base.params * layers / 30)


def predictions(frames: int, layers: int, device=None) -> dict:
    """The planner's predicted step for each measured plan on 2 `cpu` slots (`device`: a
    calibrated DeviceType; None: the table's entry)."""
    from raydit.planner import ClusterSpec, NodeSpec, plan

    cluster = ClusterSpec(nodes=(NodeSpec("n", device or "cpu", 2),))
    out = {}
    for name, (u, r) in DEGREES.items():
        best = plan(_bench_spec(layers), (frames - 1) * 4 + 1, 480, 720, cluster=cluster, ulysses=u, ring=r,
                    cfg=1, replicas=1, guidance=False).best
        out[name] = {"predicted_step_seconds": round(best.predicted_step_seconds, 4), "split": best.split,
                     "pad_tokens": best.pad_tokens}
    return out


def calibrated_cpu(calibration: dict):
    """The table's `cpu` entry with the round's measured matmul rate (calibration_cache.apply_entry)."""
    from raydit.planner import device_type
    from raydit.runtime.calibration_cache import apply_entry

    return apply_entry(device_type("cpu"), {"measured": calibration})


def _part(row: dict, config: str, part: str) -> float:
    """One part of one configuration's step in one round: the slower rank's seconds."""
    return max(row[config]["parts"][part])


def _outside(row: dict, config: str) -> float:
    return _part(row, config, "before blocks") + _part(row, config, "after blocks")


def run(frames_list: list[int], layers: int, rounds: int, warmup: int, text_dim: int = 4096,
        max_wait_s: float = 10.0) -> dict:
    from raydit.parallel.testing import run_distributed

    cases = []
    for frames in frames_list:
        t0 = time.perf_counter()
        records = run_distributed(scaling_worker, 2, frames, layers, text_dim, rounds, warmup, max_wait_s,
                                  threads=1, timeout=3600)[0]["records"]
        measured = [r for r in records if not r["warmup"]]
        case = summarize(frames, layers, measured)
        case["wall_seconds"] = round(time.perf_counter() - t0, 1)
        cases.append(case)
        ceiling = case["configs"]["both alone"]["ceiling"]["median"]
        for name, e in case["configs"].items():
            extra = (f"  speedup {benchlib.fmt(e['speedup'], 'x', 2)} (CPU-time {e['cpu_speedup']['median']:.2f}x, "
                     f"ceiling {ceiling:.2f}x; blocks alone {e['blocks_speedup']['median']:.2f}x; outside the "
                     f"blocks {e['outside_blocks_seconds']['median']:.3f} s, 1 rank "
                     f"{case['configs']['1 rank']['outside_blocks_seconds']['median']:.3f} s)" if "speedup" in e else "")
            pred = (f"  predicted {e['predicted_step_seconds']:.3f} s ({e['prediction_error']:+.0%}; table cpu "
                    f"{e['table_prediction_error']:+.0%})" if "prediction_error" in e else "")
            print(f"frames {frames} {name:<21} step {benchlib.fmt(e['step_seconds'])}{pred}{extra}  "
                  f"[{case['figures_from']}, {case['clean_rounds']}/{len(measured)} clean]", flush=True)
    return {"machine": benchlib.machine(), "target_speedup": 1.9, "target_prediction_error": 0.15,
            "clean_fraction": CLEAN, "transformer": transformer_kwargs(layers, text_dim), "cases": cases}


def summarize(frames: int, layers: int, measured: list[dict]) -> dict:
    """One frame count's figures from its measured rounds (run; `--resummarize` redoes it
    from a result file's stored rounds)."""
    # Figures over the rounds in which every configuration ran clean, where there are
    # at least 3 of them; otherwise over all rounds (and the record says so).
    clean = [r for r in measured if all(r[n]["clean"] for n in CONFIGS)]
    used = clean if len(clean) >= 3 else measured
    table = predictions(frames, layers)
    for r in measured:  # plan-time prediction of each round, from that round's calibration
        r["predicted"] = {n: v["predicted_step_seconds"] for n, v in
                          predictions(frames, layers, calibrated_cpu(r["calibration"])).items()}
    case = {"latent_frames": frames, "layers": layers, "tokens": TEXT_TOKENS + frames * 30 * 45,
            "clean_rounds": len(clean), "figures_from": "clean rounds" if used is clean else "all rounds",
            "rounds": measured, "configs": {},
            "calibrated_matmul_tflops": benchlib.summary([r["calibration"]["matmul_tflops"] for r in used], 5)}
    base = [r["1 rank"]["seconds"] for r in used]
    for name in CONFIGS:
        secs = [r[name]["seconds"] for r in used]
        entry = {"step_seconds": benchlib.summary(secs),
                 # The busiest rank's CPU time: the step as it would be with no other load.
                 "cpu_seconds": benchlib.summary([max(r[name]["cpu_seconds"]) if name != "1 rank"
                                                  else r[name]["cpu_seconds"][0] for r in used]),
                 "load_1m": benchlib.summary([r[name]["load"][0] for r in used], 2),
                 "foreign_cpu_seconds": benchlib.summary([r[name]["foreign_cpu_seconds"] for r in used], 3)}
        entry["parts_seconds"] = {part: benchlib.summary([_part(r, name, part) for r in used])
                                  for part in PARTS}
        # The work outside the blocks, which is not split (every rank does it whole).
        entry["outside_blocks_seconds"] = benchlib.summary([_outside(r, name) for r in used])
        plan_name = "ulysses 2" if name == "ulysses 2 no overlap" else name
        if plan_name in DEGREES:
            entry.update(table[plan_name])
            entry["table_prediction_error"] = round(
                table[plan_name]["predicted_step_seconds"] / entry["step_seconds"]["median"] - 1, 3)
            # Plan-time calibration: the same round's prediction over the same round's step.
            errs = [r["predicted"][plan_name] / r[name]["seconds"] - 1 for r in used]
            entry["calibrated_predicted_step_seconds"] = benchlib.summary(
                [r["predicted"][plan_name] for r in used])
            entry["calibrated_prediction_error"] = benchlib.summary(errs, 3)
            entry["prediction_error"] = entry["calibrated_prediction_error"]["median"]
            entry["predicted_step_seconds"] = entry["calibrated_predicted_step_seconds"]["median"]
        if name in PARALLEL:
            entry["speedup"] = benchlib.summary([b / s for b, s in zip(base, secs)], 3)
            # The work split alone: baseline CPU time over the busiest rank's CPU time.
            # It leaves out time a rank spends descheduled by other processes, and also
            # time it blocks in gloo (blocking costs no CPU: the idle baseline rank shows
            # ~0 s), so it is an upper bound of the speedup on an otherwise idle machine.
            entry["cpu_speedup"] = benchlib.summary(
                [r["1 rank"]["cpu_seconds"][0] / max(r[name]["cpu_seconds"]) for r in used], 3)
            # The blocks alone, 1 rank over 2: the part of the step that is split.
            entry["blocks_speedup"] = benchlib.summary(
                [_part(r, "1 rank", "blocks") / _part(r, name, "blocks") for r in used], 3)
        elif name == "1 rank":
            entry["idle_rank_cpu_seconds"] = benchlib.summary([r[name]["cpu_seconds"][1] for r in used], 3)
        else:  # both alone: the compute-only ceiling of a 2-rank split, paired by round
            entry["ceiling"] = benchlib.summary([2 * b / s for b, s in zip(base, secs)], 3)
        case["configs"][name] = entry
    return case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, nargs="+", default=[1, 3], help="latent frames (1 to 3)")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers (CogVideoX-2b has 30)")
    ap.add_argument("--text-dim", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-wait", type=float, default=10.0, help="seconds to wait per measurement for a quiet machine")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    ap.add_argument("--name", default="scaling", help="result file NAME.json (scaling-30l: the 30-layer run)")
    ap.add_argument("--resummarize", action="store_true",
                    help="measure nothing: redo the figures of OUT/scaling.json from its stored rounds")
    args = ap.parse_args(argv)
    if args.resummarize:
        result = benchlib.read_json(args.name, Path(args.out))
        if not result:
            raise SystemExit(f"--resummarize: no {args.name}.json in {args.out}")
        for i, case in enumerate(result["cases"]):
            again = summarize(case["latent_frames"], case["layers"], case["rounds"])
            result["cases"][i] = {**again, **{k: case[k] for k in ("wall_seconds", "command") if k in case}}
        print("wrote", benchlib.write_json(args.name, result, Path(args.out)))
        return 0
    if not 1 <= args.layers <= 30:
        raise SystemExit(f"--layers {args.layers}: use 1 to 30 (CogVideoX-2b has 30)")
    for f in args.frames:
        if not 1 <= f <= 3:
            raise SystemExit(f"--frames {f}: use 1 to 3 latent frames")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run(args.frames, args.layers, args.rounds, args.warmup, args.text_dim, args.max_wait)
    for case in result["cases"]:  # each case keeps its own command line (a file may gather cases of several runs)
        case["command"] = " ".join(["python bench/bench_scaling.py", *(sys.argv[1:] if argv is None else argv)])
    print("wrote", benchlib.write_json(args.name, result, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
