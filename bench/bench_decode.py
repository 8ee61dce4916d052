"""VAE decode on 1 rank and on 2 ranks (raydit.models.vae_parallel.decode_rows), one thread
per process, for diffusers' AutoencoderKLCogVideoX and AutoencoderKLWan at 480 x 720.

Real layer shapes, random weights (diffusers' default initialisation after a fixed seed):
  cogvideox  AutoencoderKLCogVideoX() defaults = CogVideoX-2b/5b's VAE: 16 latent channels,
             decoder channels 512-256-256-128, 3+1 resnets per level, group norm; latents
             60 x 90, decoded in batches of 2 latent frames with conv caches.
  wan2.1     AutoencoderKLWan() defaults = Wan 2.1's VAE: base 96, RMS norm, attention in the
             middle block; latents 60 x 90, decoded frame by frame with feat_cache.
  wan2.2     Wan 2.2 TI2V-5B's 16x VAE (base 160, decoder 256, z 48, residual up blocks,
             patch 2); latents 30 x 45.
`--channels-div D` divides every channel count by D (a smoke run; not real shapes).

Two processes are launched once per case (raydit.parallel.testing.run_distributed, gloo).
Every round runs both configurations back to back, the order alternating by round: the 1-rank
decode on rank 0 while rank 1 blocks in a barrier, and the 2-rank decode (rows split
30/30, frames gathered to rank 0). Before each measurement rank 0 waits (up to `--max-wait`
s) for the machine to go quiet and records the CPU seconds other processes used meanwhile.
The speedup is taken per round (noise shifts both sides alike), then the median. Every
2-rank output is compared with the same round's 1-rank output (torch.testing.assert_close,
atol 1e-4, rtol 0) and the largest difference is recorded.

    python bench/bench_decode.py [--vaes cogvideox wan2.1 wan2.2] [--frames 1 2 3] [--rounds 3]

`--end-to-end` measures a whole generation instead (results `decode-e2e`): a CogVideoXPipeline
with CogVideoX's real VAE (the defaults above), a CogVideoX-2b-shaped transformer cut to
`--layers` layers (30 heads x 64, 480 x 720, one latent frame: 1,350 video tokens), a small T5
and guidance 6 (two branches), run by raydit's Runner for `--steps` steps on 1 rank and on 2
ranks (cfg 2: one branch per rank), each with its own decode (2 ranks: split by rows). Text
encoding, denoising and decode are timed apart; the frames of both runs are compared (uint8,
at most one level apart).

    python bench/bench_decode.py --end-to-end [--layers 2] [--steps 2] [--rounds 2]
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

HEIGHT, WIDTH = 480, 720
TOL = dict(atol=1e-4, rtol=0)
CLEAN = 0.15
VAES = ("cogvideox", "wan2.1", "wan2.2")
TARGET = 1.7


def build_vae(kind: str, channels_div: int = 1):
    import torch
    from diffusers import AutoencoderKLCogVideoX, AutoencoderKLWan

    d = channels_div
    torch.manual_seed(0)
    if kind == "cogvideox":
        vae = AutoencoderKLCogVideoX(block_out_channels=tuple(c // d for c in (128, 256, 256, 512)),
                                     norm_num_groups=32 // d)
    elif kind == "wan2.1":
        vae = AutoencoderKLWan(base_dim=96 // d)
    elif kind == "wan2.2":
        vae = AutoencoderKLWan(base_dim=160 // d, decoder_base_dim=256 // d, z_dim=48, is_residual=True,
                               in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                               temperal_downsample=[False, True, True])
    else:
        raise ValueError(f"unknown VAE {kind!r}; known: {', '.join(VAES)}")
    return vae.eval()


def latent_shape(kind: str, frames: int) -> tuple[int, ...]:
    if kind == "wan2.2":
        return (1, 48, frames, HEIGHT // 16, WIDTH // 16)
    return (1, 16, frames, HEIGHT // 8, WIDTH // 8)


def decode_worker(rank: int, world: int, kind: str, frames: int, rounds: int, warmup: int, max_wait_s: float,
                  channels_div: int) -> dict:
    import torch
    import torch.distributed as dist

    from raydit.models.vae_parallel import decode_rows

    assert world == 2 and torch.get_num_threads() == 1
    vae = build_vae(kind, channels_div)
    z = torch.randn(latent_shape(kind, frames), generator=torch.Generator().manual_seed(1))
    records = []
    for rnd in range(warmup + rounds):
        order = ("1 rank", "2 ranks") if rnd % 2 == 0 else ("2 ranks", "1 rank")
        row = {"round": rnd - warmup, "warmup": rnd < warmup, "order": list(order)}
        outputs = {}
        for name in order:
            dist.barrier()
            waited = torch.tensor([benchlib.wait_for_quiet(max_wait_s) if rank == 0 else 0.0])
            dist.broadcast(waited, 0)
            load = benchlib.loadavg()
            busy0 = benchlib.machine_busy_seconds()
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.no_grad():
                if name == "2 ranks":
                    out = decode_rows(vae, z, dst=0)
                else:
                    out = vae.decode(z).sample if rank == 0 else None
                    dist.barrier()  # rank 1 waits here while rank 0 decodes alone
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            both = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(both, torch.tensor([wall, cpu], dtype=torch.float64))
            busy = benchlib.machine_busy_seconds() - busy0
            foreign = max(0.0, busy - sum(float(b[1]) for b in both))
            seconds = max(float(b[0]) for b in both)
            row[name] = {"seconds": round(seconds, 4), "cpu_seconds": [round(float(b[1]), 3) for b in both],
                         "foreign_cpu_seconds": round(foreign, 3), "waited_s": float(waited),
                         "clean": foreign <= CLEAN * seconds, "load": load}
            outputs[name] = out
        if rank == 0:
            diff = (outputs["2 ranks"] - outputs["1 rank"]).abs().max().item()
            torch.testing.assert_close(outputs["2 ranks"], outputs["1 rank"], **TOL)
            row["max_abs_diff"] = diff
            row["video_shape"] = list(outputs["1 rank"].shape)
            records.append(row)
    return {"records": records} if rank == 0 else {}


def run(vaes: list[str], frames_list: list[int], rounds: int, warmup: int, max_wait_s: float,
        channels_div: int, on_case=None) -> dict:
    """Every case's results; `on_case(partial_results)` after each case, so a run cut short
    keeps what it measured."""
    from raydit.parallel.testing import run_distributed

    cases = []
    for kind in vaes:
        for frames in frames_list:
            t0 = time.perf_counter()
            records = run_distributed(decode_worker, 2, kind, frames, rounds, warmup, max_wait_s, channels_div,
                                      threads=1, timeout=7200)[0]["records"]
            measured = [r for r in records if not r["warmup"]]
            clean = [r for r in measured if r["1 rank"]["clean"] and r["2 ranks"]["clean"]]
            used = clean if len(clean) >= 3 else measured
            one = [r["1 rank"]["seconds"] for r in used]
            two = [r["2 ranks"]["seconds"] for r in used]
            case = {
                "vae": kind, "latent_frames": frames, "latent_shape": list(latent_shape(kind, frames)),
                "video_shape": measured[0]["video_shape"], "channels_div": channels_div,
                "clean_rounds": len(clean), "figures_from": "clean rounds" if used is clean else "all rounds",
                "one_rank_seconds": benchlib.summary(one), "two_rank_seconds": benchlib.summary(two),
                "speedup": benchlib.summary([a / b for a, b in zip(one, two)], 3),
                # Baseline CPU time over the busiest rank's: the split of the work alone (an upper
                # bound of the speedup on an idle machine; blocking in gloo costs no CPU).
                "cpu_speedup": benchlib.summary(
                    [r["1 rank"]["cpu_seconds"][0] / max(r["2 ranks"]["cpu_seconds"]) for r in used], 3),
                "max_abs_diff": max(r["max_abs_diff"] for r in measured),
                "load_1m": benchlib.summary([r["1 rank"]["load"][0] for r in used], 2),
                "rounds": measured, "wall_seconds": round(time.perf_counter() - t0, 1),
            }
            cases.append(case)
            print(f"{kind:<9} {frames} latent frame(s) -> {case['video_shape']}: 1 rank "
                  f"{benchlib.fmt(case['one_rank_seconds'])}, 2 ranks {benchlib.fmt(case['two_rank_seconds'])}, "
                  f"speedup {benchlib.fmt(case['speedup'], 'x', 2)} (CPU-time {case['cpu_speedup']['median']:.2f}x), "
                  f"max |diff| {case['max_abs_diff']:.2g}  [{case['figures_from']}, "
                  f"{len(clean)}/{len(measured)} clean, load {case['load_1m']['median']}]", flush=True)
            if on_case is not None:
                on_case(_results(cases))
    return _results(cases)


def _results(cases: list[dict]) -> dict:
    return {"machine": benchlib.machine(), "target_speedup": TARGET, "clean_fraction": CLEAN,
            "height": HEIGHT, "width": WIDTH, "threads_per_process": 1, "cases": list(cases)}


E2E_LAYERS, E2E_STEPS = 2, 2


def e2e_pipeline_dir(layers: int) -> str:
    """A CogVideoXPipeline: CogVideoX's VAE (diffusers' defaults), a 2b-shaped transformer with
    `layers` layers, a small random T5; written once to the cache."""
    from raydit.models.families.cogvideox.tiny import TINY_VERSION
    from raydit.models.tiny import cache_root, t5_encoder, tokenizer, write_pipeline

    def make():
        import torch
        from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

        torch.manual_seed(0)
        tok = tokenizer(226)
        transformer = CogVideoXTransformer3DModel(
            num_attention_heads=30, attention_head_dim=64, in_channels=16, out_channels=16, text_embed_dim=64,
            num_layers=layers, sample_height=HEIGHT // 8, sample_width=WIDTH // 8).eval()
        return CogVideoXPipeline(tokenizer=tok, text_encoder=t5_encoder(len(tok), 64), vae=build_vae("cogvideox"),
                                 transformer=transformer, scheduler=CogVideoXDDIMScheduler())

    return str(write_pipeline(cache_root() / f"bench-e2e-cogvideox-{layers}l-t{TINY_VERSION}", make))


def e2e_worker(rank: int, world: int, pipe_dir: str, steps: int, rounds: int, warmup: int, max_wait_s: float) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist
    from diffusers import CogVideoXPipeline

    from raydit.models import GenerationRequest, Runner
    from raydit.parallel import build_mesh

    assert world == 2 and torch.get_num_threads() == 1
    request = GenerationRequest(prompt="a red fox running through snow", negative_prompt="blurry", num_frames=1,
                                height=HEIGHT, width=WIDTH, num_inference_steps=steps, guidance_scale=6.0, seed=5)
    mesh = build_mesh(ulysses=1, ring=1, cfg=2, replicas=1)
    two = Runner(CogVideoXPipeline.from_pretrained(pipe_dir), mesh=mesh)
    one = Runner(CogVideoXPipeline.from_pretrained(pipe_dir)) if rank == 0 else None

    def generate(runner, on_ranks: bool) -> tuple[dict, object]:
        t0 = time.perf_counter()
        state = runner.prepare(request)
        t1 = time.perf_counter()
        while state.step_index < state.num_steps:
            state = runner.step(state)
        t2 = time.perf_counter()
        frames = runner.decode(state, on_ranks=on_ranks)
        t3 = time.perf_counter()
        return {"encode": t1 - t0, "denoise": t2 - t1, "decode": t3 - t2, "total": t3 - t0,
                "decode_ranks": runner.decode_ranks}, frames

    records = []
    for rnd in range(warmup + rounds):
        order = ("1 rank", "2 ranks") if rnd % 2 == 0 else ("2 ranks", "1 rank")
        row = {"round": rnd - warmup, "warmup": rnd < warmup, "order": list(order)}
        frames = {}
        for name in order:
            dist.barrier()
            waited = torch.tensor([benchlib.wait_for_quiet(max_wait_s) if rank == 0 else 0.0])
            dist.broadcast(waited, 0)
            load = benchlib.loadavg()
            busy0 = benchlib.machine_busy_seconds()
            c0 = time.process_time()
            with torch.no_grad():
                if name == "2 ranks":
                    times, out = generate(two, on_ranks=True)
                else:
                    times, out = generate(one, on_ranks=False) if rank == 0 else ({}, None)
                    dist.barrier()  # rank 1 waits here while rank 0 generates alone
            cpu = time.process_time() - c0
            totals = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(totals, torch.tensor([times.get("total", 0.0), cpu], dtype=torch.float64))
            busy = benchlib.machine_busy_seconds() - busy0
            seconds = max(float(t[0]) for t in totals)
            foreign = max(0.0, busy - sum(float(t[1]) for t in totals))
            if rank == 0:
                row[name] = {**{k: round(v, 4) if isinstance(v, float) else v for k, v in times.items()},
                             "seconds": round(seconds, 4), "cpu_seconds": [round(float(t[1]), 3) for t in totals],
                             "foreign_cpu_seconds": round(foreign, 3), "waited_s": float(waited),
                             "clean": foreign <= CLEAN * seconds, "load": load}
                frames[name] = out
        if rank == 0:
            a, b = (np.asarray(frames[k]).astype(np.int16) for k in ("1 rank", "2 ranks"))
            row["max_level_diff"] = int(np.abs(a - b).max())
            assert row["max_level_diff"] <= 1, f"2-rank frames differ from 1-rank frames by {row['max_level_diff']} levels"
            row["frames_shape"] = list(a.shape)
            records.append(row)
    return {"records": records} if rank == 0 else {}


def run_e2e(layers: int, steps: int, rounds: int, warmup: int, max_wait_s: float) -> dict:
    from raydit.parallel.testing import run_distributed

    pipe_dir = e2e_pipeline_dir(layers)
    t0 = time.perf_counter()
    records = run_distributed(e2e_worker, 2, pipe_dir, steps, rounds, warmup, max_wait_s, threads=1,
                              timeout=7200)[0]["records"]
    measured = [r for r in records if not r["warmup"]]
    clean = [r for r in measured if r["1 rank"]["clean"] and r["2 ranks"]["clean"]]
    used = clean if len(clean) >= 2 else measured
    part = {}
    for side in ("1 rank", "2 ranks"):
        part[side] = {k: benchlib.summary([r[side][k] for r in used]) for k in ("encode", "denoise", "decode", "seconds")}
        part[side]["decode_ranks"] = used[0][side]["decode_ranks"]
    res = {
        "machine": benchlib.machine(), "height": HEIGHT, "width": WIDTH, "latent_frames": 1, "layers": layers,
        "steps": steps, "plan_2_ranks": "cfg 2 (one guidance branch per rank), decode split by rows",
        "threads_per_process": 1, "clean_rounds": len(clean), "figures_from": "clean rounds" if used is clean else "all rounds",
        "parts": part,
        "speedup": benchlib.summary([r["1 rank"]["seconds"] / r["2 ranks"]["seconds"] for r in used], 3),
        "cpu_speedup": benchlib.summary([r["1 rank"]["cpu_seconds"][0] / max(r["2 ranks"]["cpu_seconds"]) for r in used], 3),
        "max_level_diff": max(r["max_level_diff"] for r in measured),
        "load_1m": benchlib.summary([r["1 rank"]["load"][0] for r in used], 2),
        "rounds": measured, "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"end to end, {layers} layers, {steps} steps, 480x720, 1 latent frame: 1 rank "
          f"{benchlib.fmt(part['1 rank']['seconds'])}, 2 ranks {benchlib.fmt(part['2 ranks']['seconds'])}, "
          f"speedup {benchlib.fmt(res['speedup'], 'x', 2)} (CPU-time {res['cpu_speedup']['median']:.2f}x), "
          f"frames within {res['max_level_diff']} level(s) [{res['figures_from']}, {len(clean)}/{len(measured)} clean]",
          flush=True)
    return res


def markdown_e2e(res: dict, command: str) -> str:
    m = res["machine"]
    lines = [
        "# A whole generation: 1 rank vs 2 ranks (text encoding, denoising, exact parallel decode)",
        "",
        f"`{command}` on {m.get('cpu_count', '?')} CPUs ({m.get('processor', '?')}), one thread per process, gloo. "
        f"CogVideoXPipeline with CogVideoX's VAE, a CogVideoX-2b-shaped transformer cut to {res['layers']} layers, "
        f"{res['height']} x {res['width']}, {res['latent_frames']} latent frame, {res['steps']} steps, guidance 6; "
        f"2 ranks: {res['plan_2_ranks']}.",
        "",
        "| ranks | encode (s) | denoise (s) | decode (s) | total (s) | decode ranks |",
        "|---|---|---|---|---|---|",
    ]
    for side in ("1 rank", "2 ranks"):
        p = res["parts"][side]
        lines.append(f"| {side} | {p['encode']['median']:.2f} | {p['denoise']['median']:.2f} | {p['decode']['median']:.2f} "
                     f"| {p['seconds']['median']:.2f} | {p['decode_ranks']} |")
    lines += [
        "",
        f"Speedup (per-round ratio of totals, median): {res['speedup']['median']:.2f}x "
        f"({res['speedup']['min']:.2f}-{res['speedup']['max']:.2f}, n={res['speedup']['n']}); CPU-time split "
        f"{res['cpu_speedup']['median']:.2f}x; frames within {res['max_level_diff']} uint8 level(s); "
        f"{res['clean_rounds']} clean round(s), figures from {res['figures_from']}; load {res['load_1m']['median']}.",
        "",
    ]
    return "\n".join(lines)


def markdown(res: dict, command: str) -> str:
    m = res["machine"]
    lines = [
        "# VAE decode: 1 rank vs 2 ranks (exact row-parallel decode)",
        "",
        f"`{command}` on {m.get('cpu_count', '?')} CPUs ({m.get('processor', '?')}), one thread per process, "
        f"gloo; {res['height']} x {res['width']}, random weights, float32. Target: {res['target_speedup']}x.",
        "",
        "| VAE | latent frames | video | 1 rank (s) | 2 ranks (s) | speedup | CPU-time speedup | max abs diff | rounds | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["cases"]:
        shape = "x".join(str(v) for v in c["video_shape"][2:])
        name = c["vae"] if c["channels_div"] == 1 else f"{c['vae']} (channels / {c['channels_div']})"
        lines.append(
            f"| {name} "
            f"| {c['latent_frames']} | {shape} | {c['one_rank_seconds']['median']:.2f} "
            f"| {c['two_rank_seconds']['median']:.2f} | {c['speedup']['median']:.2f}x "
            f"| {c['cpu_speedup']['median']:.2f}x | {c['max_abs_diff']:.2g} | {c['one_rank_seconds']['n']} "
            f"({c['figures_from']}) | {c['load_1m']['median']} |")
    lines += [
        "",
        "Speedup: per-round ratio of the 1-rank to the 2-rank wall time, median over rounds. CPU-time "
        "speedup: the 1-rank decode's CPU seconds over the busiest rank's in the 2-rank decode (the work "
        "split alone; what an otherwise idle machine would approach). Wall-clock figures on a shared machine "
        "include time descheduled by other processes; the load column says how busy it was.",
        "Every 2-rank video equals the 1-rank one within atol 1e-4 (max abs diff column).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vaes", nargs="+", default=list(VAES), choices=VAES)
    ap.add_argument("--frames", type=int, nargs="+", default=[1, 2, 3], help="latent frames (1 to 3)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--max-wait", type=float, default=10.0, help="seconds to wait per measurement for a quiet machine")
    ap.add_argument("--channels-div", type=int, default=1, help="divide every channel count (smoke runs only)")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    ap.add_argument("--name", default=None, help="results file stem under --out (decode / decode-e2e)")
    ap.add_argument("--end-to-end", action="store_true", help="a whole generation on 1 vs 2 ranks instead")
    ap.add_argument("--layers", type=int, default=E2E_LAYERS, help="transformer layers (--end-to-end)")
    ap.add_argument("--steps", type=int, default=E2E_STEPS, help="denoising steps (--end-to-end)")
    args = ap.parse_args(argv)
    args.name = args.name or ("decode-e2e" if args.end_to_end else "decode")
    for f in args.frames:
        if not 1 <= f <= 3:
            raise SystemExit(f"--frames {f}: use 1 to 3 latent frames")
    if args.channels_div < 1 or 32 % args.channels_div:
        raise SystemExit(f"--channels-div {args.channels_div}: use a divisor of 32")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    command = "python bench/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    if args.end_to_end:
        if args.layers < 1 or args.steps < 1:
            raise SystemExit(f"--layers {args.layers} / --steps {args.steps}: use at least 1")
        res = run_e2e(args.layers, args.steps, args.rounds, args.warmup, args.max_wait)
        res["command"] = command.strip()
        benchlib.write_json(args.name, res, out)
        (out / f"{args.name}.md").write_text(markdown_e2e(res, res["command"]))
        print(f"wrote {out / (args.name + '.json')} and {out / (args.name + '.md')}")
        return 0

    def write(res: dict) -> None:  # after every case: a run cut short keeps what it measured
        res["command"] = command.strip()
        benchlib.write_json(args.name, res, out)
        (out / f"{args.name}.md").write_text(markdown(res, res["command"]))

    write(run(args.vaes, args.frames, args.rounds, args.warmup, args.max_wait, args.channels_div, on_case=write))
    print(f"wrote {out / (args.name + '.json')} and {out / (args.name + '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
