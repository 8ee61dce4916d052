"""The CPU block-sparse kernel's time against its density (issue 55): is the block skipping real?

One Wan-1.3B-like attention problem (12 heads, head dim 128, float32) on a video grid of a few
thousand tokens, each mask timed by the same kernel (raydit.parallel.kernels.sparse) with the
fastest of --iters calls: dense (every window covers its axis), STA windows and radial.
Reported per mask: density (raydit.planner.sparse.density), seconds, and
    ratio = seconds / (density x dense seconds)
which the issue wants at most 1.5. torch's own CPU flash attention (dense) is timed beside it.
Written to --out (JSON) and printed.

    python bench/bench_sparse_kernel.py [--grid 6,16,32] [--iters 3] [--out docs/benchmarks/sparse_kernel.json]
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

from raydit.parallel.kernels.sparse import VideoMask, block_sparse_attention
from raydit.planner.sparse import SparseConfig, density


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least-disturbed call: on a shared host the median follows the neighbours' load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="6,16,32", help="frames,rows,columns of video tokens after patching")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared host more threads than free cores spin and swamp the timings)")
    ap.add_argument("--query-block", type=int, default=None, help="default: the kernel's (STA: one tile)")
    ap.add_argument("--out", default="docs/benchmarks/sparse_kernel.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    grid = tuple(int(x) for x in args.grid.split(","))
    S = grid[0] * grid[1] * grid[2]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, S, args.head_dim, generator=g) for _ in range(3))
    pos = torch.arange(S)
    tile = (2, 8, 8)
    masks = {
        "dense (sta, whole windows)": SparseConfig("sta", tile=tile, window=(99, 99, 99)),
        "sta window 2,2,2": SparseConfig("sta", tile=tile, window=(2, 2, 2)),
        "sta window 2,1,2": SparseConfig("sta", tile=tile, window=(2, 1, 2)),
        "sta window 1,1,1": SparseConfig("sta", tile=tile, window=(1, 1, 1)),
        "radial block 64": SparseConfig("radial", block=64),
    }
    rows = []
    sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), args.iters)
    dense_s = None
    for name, cfg in masks.items():
        mask = VideoMask(cfg, grid)
        secs = timed(lambda: block_sparse_attention(q, k, v, pos, pos, mask, query_block=args.query_block), args.iters)
        d = density(cfg, grid)
        dense_s = secs if dense_s is None else dense_s
        rows.append({"mask": name, "density": round(d, 4), "seconds": round(secs, 4),
                     "ratio_to_density_x_dense": round(secs / (d * dense_s), 3),
                     "ratio_to_density_x_sdpa": round(secs / (d * sdpa), 3)})
        print(rows[-1], flush=True)
    result = {"grid": grid, "tokens": S, "heads": args.heads, "head_dim": args.head_dim, "dtype": "float32", "query_block": args.query_block,
              "threads": torch.get_num_threads(), "torch_sdpa_dense_seconds": round(sdpa, 4), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"torch_sdpa_dense_seconds": result["torch_sdpa_dense_seconds"]}))


if __name__ == "__main__":
    main()
