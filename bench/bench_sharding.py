"""Sharded transformer weights (issue 42): parameter bytes each rank holds, unsharded and
sharded over N = 2 and 4 CPU ranks (gloo).

Model: a Wan 2.1-shaped transformer (random weights, diffusers' WanTransformer3DModel) of
`--layers` blocks, `--heads` x `--head-dim` wide, in float32 or bf16; one forward of a small
video (batch 2, 2 x 8 x 8 latents) on Ulysses N (the blocks' gathers go over the whole
replica, here the Ulysses group). Per rank it records

- resident: the bytes of the distinct storages behind the transformer's parameters and
  buffers (raydit.parallel.shard_weights.resident_parameter_bytes), counted independently of
  the sharding's own bookkeeping, at rest and inside every block's forward (the peak: the
  running block and the next one gathered, plus every shard and the unsharded parameters
  outside the blocks);
- the handle's own count of shard + gathered bytes at its peak;
- the block weights' share: what 1/N of them plus two gathered blocks predicts.

    python bench/bench_sharding.py [--layers 8] [--heads 8] [--head-dim 16] [--dtype float32] \
        [--out docs/benchmarks/sharding.json]
    python bench/bench_sharding.py --smoke     # 2 layers, N = 2 only, nothing written

Writes the JSON and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))


def measure(rank: int, world_size: int, layers: int, heads: int, head_dim: int, dtype_name: str) -> dict:
    import torch

    from raydit.models.families.wan.tiny import tiny_transformer
    from raydit.models.registry import load_families, parallelize
    from raydit.models.sharded import shard_transformer
    from raydit.parallel.mesh import build_mesh
    from raydit.parallel.shard_weights import resident_parameter_bytes

    load_families()
    dtype = getattr(torch, dtype_name)
    transformer = tiny_transformer(5, num_layers=layers, num_attention_heads=heads, attention_head_dim=head_dim,
                                   ffn_dim=4 * heads * head_dim).to(dtype)
    g = torch.Generator().manual_seed(7)
    kwargs = dict(hidden_states=torch.randn(2, 4, 2, 16, 16, generator=g).to(dtype),
                  encoder_hidden_states=torch.randn(2, 13, 32, generator=g).to(dtype),
                  timestep=torch.tensor([999.0, 421.0]))
    model_bytes = resident_parameter_bytes(transformer)
    blocks = list(transformer.blocks)
    block_bytes = sum(resident_parameter_bytes(b) for b in blocks)
    handles, sharded = [], None
    if world_size > 1:
        mesh = build_mesh(ulysses=world_size)
        handles.append(parallelize(transformer, mesh))
        sharded = shard_transformer(transformer, mesh)
    at_rest = resident_parameter_bytes(transformer)
    peak = [0]

    def probe(module, args):
        # + the next block's gather in flight (posted, not yet attached to its parameters)
        pending = sum(flat.numel() for flat, _, _ in sharded.handle._pending.values()) if sharded else 0
        peak[0] = max(peak[0], resident_parameter_bytes(transformer) + pending)

    hooks = [b.register_forward_pre_hook(probe) for b in blocks]
    t0 = time.perf_counter()
    with torch.no_grad():
        out = transformer(**kwargs, return_dict=False)[0]
    seconds = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    row = {"ranks": world_size, "rank": rank, "dtype": dtype_name, "layers": layers,
           "model_bytes": model_bytes, "block_bytes": block_bytes, "outside_blocks_bytes": model_bytes - block_bytes,
           "resident_at_rest": at_rest, "resident_peak": peak[0],
           "handle_peak": sharded.peak_bytes if sharded else None, "forward_seconds": seconds,
           "output_checksum": float(out.double().abs().sum())}
    if sharded is not None:
        sharded.remove()
    for h in handles:
        h.remove()
    return row


def markdown(rows: list[dict], args) -> str:
    lines = [
        "# Sharded transformer weights: parameter bytes per rank (CPU ranks, gloo)",
        "",
        f"`python bench/bench_sharding.py --layers {args.layers} --heads {args.heads} --head-dim {args.head_dim} "
        f"--dtype {args.dtype}`: a Wan 2.1-shaped transformer of {args.layers} blocks, "
        f"{args.heads} x {args.head_dim} wide, random weights, one forward (batch 2, 2 x 16 x 16 latents) on Ulysses N. "
        "Resident: the distinct storages behind the transformer's parameters and buffers on rank 0, counted "
        "independently of the sharding's bookkeeping; peak: the most at the start of any block's forward, plus the "
        "next block's gather buffer already in flight (the running block and the next one are whole). Predicted: outside-block bytes + blocks / N + two blocks (+ padding).",
        "",
        "| N | model MB | at rest MB | at rest / model | peak MB | peak / model | predicted peak MB | forward s | output checksum equal to N=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = next(r for r in rows if r["ranks"] == 1)
    for r in rows:
        block = r["block_bytes"] / r["layers"]
        predicted = r["outside_blocks_bytes"] + (r["block_bytes"] / r["ranks"] + 2 * block if r["ranks"] > 1 else r["block_bytes"])
        mb = 1e6
        lines.append(f"| {r['ranks']} | {r['model_bytes'] / mb:.2f} | {r['resident_at_rest'] / mb:.2f} | "
                     f"{r['resident_at_rest'] / r['model_bytes']:.3f} | {r['resident_peak'] / mb:.2f} | "
                     f"{r['resident_peak'] / r['model_bytes']:.3f} | {predicted / mb:.2f} | {r['forward_seconds']:.3f} | "
                     f"{'yes' if r['output_checksum'] == base['output_checksum'] else 'no (another plan: sums differ in rounding)'} |")
    lines += ["", "Outside the blocks (patch / text / time embeddings, output projection) every rank keeps its "
              "own copy; LoRA adapters too. Timings are one forward on a shared 2-core machine, not a speed claim."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from raydit.parallel.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", dest="head_dim", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--out", default="docs/benchmarks/sharding.json")
    p.add_argument("--smoke", action="store_true", help="2 layers, N = 1 and 2, nothing written")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.ranks = 2, "1,2"
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        rows.append(run_distributed(measure, n, args.layers, args.heads, args.head_dim, args.dtype, timeout=600)[0])
        r = rows[-1]
        print(f"N={n}: model {r['model_bytes']} B, at rest {r['resident_at_rest']} B, peak {r['resident_peak']} B "
              f"(handle {r['handle_peak']})", flush=True)
    if args.smoke:
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, args))
    print(markdown(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
