"""Sparse attention on the CPU (issue 55): density, attention time and step time against dense,
on 1 and 2 workers, and the bytes the ring sends on 4 ranks against dense.

A Wan 2.1 1.3B-shaped transformer (12 heads x 128, hidden 1536, FFN 8960, text 4096) with
--layers blocks and random weights, float32. Pinned settings (STA's published tile 6,8,8 does
not divide this grid):
    shape   33 frames x 240 x 416 -> 9 x 15 x 26 video tokens (3,510) after patching. Smaller than
            the 81 x 480 x 832 (21 x 30 x 52 = 32,760 tokens) that 24 GiB would hold: one dense
            attention layer there is ~6.6 TFLOP, minutes per layer on this host's CPU slots, and
            the bench must stay within ~6 minutes;
    sta     tile 3,5,13, window 1,3,1 (tiles): density 1/3 x 1 x 1/2;
    radial  block 64 (its published 128 keeps only the sink frame at 390 tokens a frame).
Parts:
- attention: one layer's attention (q, k, v of the model's shape), the block-sparse kernel
  (raydit.parallel.kernels.sparse) per mask against dense attention by torch's SDPA and by the
  same kernel with whole windows; target: sparse seconds <= 1.5 x density x dense seconds;
- step: one transformer call (every block) on 1 worker and on 2 (Ulysses 2, gloo), dense and
  sparse (raydit.models.sparse_steps' source through sp_attention);
- ring: sp_attention on a ring of 4 ranks, the bytes every rank sent (ring_tally), dense and
  sparse; target: fewer than dense.
Timings: the fastest of --iters calls (a shared host: the least disturbed). Written to --out
(JSON) and its .md beside it.

    python bench/bench_sparse.py [--layers 2] [--iters 2] [--parts attention,step,ring] [--out docs/benchmarks/sparse.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# This checkout's raydit, not whichever one the environment installed (editable installs point elsewhere).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

FRAMES, HEIGHT, WIDTH = 33, 240, 416
GRID = (9, 15, 26)
HEADS, HEAD_DIM, FFN, TEXT_DIM, TEXT_TOKENS = 12, 128, 8960, 4096, 512
SETTINGS = {
    "sta": dict(method="sta", tile=(3, 5, 13), window=(1, 3, 1), dense_steps=0),
    "radial": dict(method="radial", block=64, dense_steps=0),
}


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def config(name: str):
    from raydit.planner.sparse import SparseConfig

    return SparseConfig(**SETTINGS[name])


def attention_part(iters: int) -> list[dict]:
    from raydit.parallel.kernels.sparse import VideoMask, block_sparse_attention
    from raydit.planner.sparse import SparseConfig, density

    S = GRID[0] * GRID[1] * GRID[2]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, S, HEAD_DIM, generator=g) for _ in range(3))
    pos = torch.arange(S)
    sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), iters)
    whole = VideoMask(SparseConfig("sta", tile=(3, 5, 13), window=(99, 99, 99)), GRID)
    kernel_dense = timed(lambda: block_sparse_attention(q, k, v, pos, pos, whole), iters)
    rows = [{"mask": "dense (torch sdpa)", "density": 1.0, "seconds": round(sdpa, 4)},
            {"mask": "dense (block kernel, whole windows)", "density": 1.0, "seconds": round(kernel_dense, 4)}]
    for name in SETTINGS:
        cfg = config(name)
        mask = VideoMask(cfg, GRID)
        secs = timed(lambda: block_sparse_attention(q, k, v, pos, pos, mask), iters)
        d = density(cfg, GRID)
        rows.append({"mask": name, "density": round(d, 4), "seconds": round(secs, 4),
                     "vs_density_x_sdpa": round(secs / (d * sdpa), 3),
                     "vs_density_x_kernel_dense": round(secs / (d * kernel_dense), 3)})
        print(rows[-1], flush=True)
    return rows


def _transformer(layers: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=16,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=FFN, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6).eval()


def step_worker(rank: int, world_size: int, layers: int, iters: int) -> dict:
    """One transformer call on `world_size` ranks (Ulysses), dense and per sparse setting."""
    from raydit.models.registry import parallelize
    from raydit.models.sparse_steps import _Source
    from raydit.parallel.attention import sparse_attention
    from raydit.parallel.mesh import build_mesh, with_attention

    model = _transformer(layers)
    mesh = build_mesh(world_size, 1) if world_size > 1 else with_attention(None, "bf16")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, GRID[0], GRID[1] * 2, GRID[2] * 2, generator=g)
    text = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g)
    t = torch.tensor([500.0])
    handle = parallelize(model, mesh)
    out = {}
    with torch.no_grad():
        call = lambda: model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)  # noqa: E731
        out["dense"] = timed(call, iters)
        for name in SETTINGS:
            source = _Source(config(name), GRID, 0)
            with sparse_attention(source):
                out[name] = timed(call, iters)
    handle.remove()
    return out


def ring_worker(rank: int, world_size: int) -> dict:
    """sp_attention on a ring of `world_size`: the bytes this rank sent, dense and sparse."""
    from raydit.parallel.attention import sp_attention
    from raydit.parallel.kernels.sparse import VideoMask
    from raydit.parallel.mesh import build_mesh
    from raydit.parallel.sharding import SeqLayout
    from raydit.parallel.sparse_ring import ring_tally

    mesh = build_mesh(1, world_size)
    S = GRID[0] * GRID[1] * GRID[2]
    layout = SeqLayout((S,), world_size)
    g = torch.Generator().manual_seed(2)
    full = [torch.randn(1, 2, S, HEAD_DIM, generator=g) for _ in range(3)]
    local = [layout.shard(x, 0, mesh.sp_index, dim=2).contiguous() for x in full]
    out = {}
    for name in ("dense", *SETTINGS):
        mask = None if name == "dense" else VideoMask(config(name), GRID, 0, S)
        before = ring_tally.bytes_sent
        sp_attention(*local, mesh, layout, sparse=mask)
        out[name] = ring_tally.bytes_sent - before
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks (Wan 1.3B has 30)")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--parts", default="attention,step,ring",
                    help="comma-separated parts to run (attention: one layer, seconds; step: minutes; ring: seconds)")
    ap.add_argument("--out", default="docs/benchmarks/sparse.json")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"attention", "step", "ring"}:
        ap.error(f"--parts {args.parts!r}: give some of attention, step, ring")
    from raydit.parallel.testing import run_distributed
    from raydit.planner.sparse import density

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result = {"shape": {"frames": FRAMES, "height": HEIGHT, "width": WIDTH, "grid": GRID, "heads": HEADS,
                        "head_dim": HEAD_DIM, "layers": args.layers, "dtype": "float32"},
              "settings": SETTINGS, "density": {n: round(density(config(n), GRID), 4) for n in SETTINGS},
              "threads": args.threads}
    if "attention" in parts:
        result["attention"] = attention_part(args.iters)
    if "step" in parts:
        steps = {}
        for workers in (1, 2):
            got = run_distributed(step_worker, workers, args.layers, args.iters, timeout=1200, threads=args.threads)[0]
            steps[workers] = {k: round(v, 4) for k, v in got.items()}
            print({"workers": workers, **steps[workers]}, flush=True)
        result["step_seconds"] = steps
    if "ring" in parts:
        ring = run_distributed(ring_worker, 4, timeout=600, threads=args.threads)
        result["ring_bytes_4_ranks"] = {name: sum(r[name] for r in ring) for name in ring[0]}
        print(result["ring_bytes_4_ranks"], flush=True)
    result["wall_seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    s = r["shape"]
    lines = [f"# Sparse attention on the CPU (bench/bench_sparse.py)", "",
             f"Wan 2.1 1.3B-shaped, {s['layers']} blocks, {s['frames']} x {s['height']} x {s['width']} -> "
             f"{' x '.join(map(str, s['grid']))} tokens, {s['dtype']}, {r['threads']} thread(s) a process. "
             "Fastest of the repeats.", "",
             "| part | dense | " + " | ".join(SETTINGS) + " |", "|---|---|" + "---|" * len(SETTINGS),
             "| density | 1 | " + " | ".join(f"{r['density'][n]:.3f}" for n in SETTINGS) + " |"]
    att = {row["mask"]: row for row in r.get("attention", [])}
    if att:
        lines.append(f"| attention s (one layer; dense: sdpa / block kernel) | {att['dense (torch sdpa)']['seconds']} / "
                     f"{att['dense (block kernel, whole windows)']['seconds']} | "
                     + " | ".join(f"{att[n]['seconds']} ({att[n]['vs_density_x_sdpa']}x / "
                                  f"{att[n]['vs_density_x_kernel_dense']}x of d x dense)" for n in SETTINGS) + " |")
    for w, row in r.get("step_seconds", {}).items():
        lines.append(f"| step s, {w} worker(s) | {row['dense']} | " + " | ".join(str(row[n]) for n in SETTINGS) + " |")
    if "ring_bytes_4_ranks" in r:
        b = r["ring_bytes_4_ranks"]
        lines.append(f"| ring bytes sent, 4 ranks | {b['dense']:,} | " + " | ".join(f"{b[n]:,}" for n in SETTINGS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
