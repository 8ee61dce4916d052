"""What quantizing the FP8 weights costs at load, per Wan-14B block (issue 42 / 39).

One block of Wan 2.1 14B's width (5120, 40 x 128 heads, FFN 13824: 351 M block-linear
weights, 702 MB in bf16, 351 MB in FP8), random bf16 weights, quantized the way the Runner
does it (raydit.models.quantize.quantize_transformer), timed per place:

- host: every linear rounded by the CPU, as the sharded path did before 2026-11-28 on every
  rank (each rank quantized the whole model on the host before laying out its shards), at
  one intra-op thread (a Ray worker's default) and at this machine's threads;
- device, back to host: each linear moved to the GPU, rounded there and brought back (the
  sharded path now), the transfers included;
- device, stays: each linear moved to the GPU and rounded there (the unsharded path now,
  which before moved the whole bf16 transformer to the GPU first).

Times are per block (median of `--repeat`), each place's whole-model figure is 40 x (Wan 2.1
14B; Wan 2.2 A14B's two experts: 80 x). The CPU rows need torchao (the venv's, or
.venv/fp8-site) and lift torchao's hardware check, which refuses the CPU because FP8 GEMMs
are slow there: quantizing is what is timed here, not a product. "fp8-sim" rows use raydit's
emulation (no torchao). The device rows need a CUDA GPU of compute capability 8.9+.

    python bench/bench_quantize_load.py [--modes fp8 fp8-sim] [--repeat 3] [--out DIR]
    python bench/bench_quantize_load.py --smoke [--out DIR]   # a 256-wide block, written only to --out

Writes quantize-load.json and quantize-load.md (docs/benchmarks unless --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

WAN14B = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824)
SMOKE = dict(num_attention_heads=2, attention_head_dim=128, ffn_dim=512)


def torchao_on_cpu() -> bool:
    """torchao importable, its hardware check lifted for this process (CPU rows only), as the
    tests lift it (tests/models/fp8_cpu.py)."""
    sys.path.insert(2, str(Path(__file__).resolve().parent.parent / "tests" / "models"))
    from fp8_cpu import TORCHAO, lift_fp8_gates

    if TORCHAO:
        lift_fp8_gates()
    return TORCHAO


def block(widths: dict, seed: int):
    """A one-block Wan transformer of these widths, bf16."""
    import torch

    from raydit.models.families.wan.tiny import tiny_transformer

    return tiny_transformer(seed, num_layers=1, **widths).to(torch.bfloat16)


def time_place(widths: dict, mode: str, device: str | None, stay: bool, repeat: int) -> dict:
    import torch

    from raydit.models.quantize import quantize_transformer, select_linears

    seconds, peaks = [], []
    for i in range(repeat):
        model = block(widths, i)
        weights = sum(m.weight.numel() for _, m in select_linears(model)[0])
        on_gpu = device == "cuda"
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        done = quantize_transformer(model, mode, device=device, stay=stay)
        if on_gpu:
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - base) / 1e9)
        seconds.append(time.perf_counter() - t0)
        del model
    med = statistics.median(seconds)
    row = {"mode": mode, "weights": weights, "linears": len(done.names), "seconds_per_block": round(med, 4),
           "runs": [round(s, 4) for s in seconds], "wan14b_40_blocks_s": round(40 * med, 2),
           "a14b_80_blocks_s": round(80 * med, 2)}
    if peaks:
        row["device_peak_gb"] = round(max(peaks), 3)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["fp8", "fp8-sim"], choices=["fp8", "fp8-sim"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="default docs/benchmarks (--smoke: nothing written)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    import torch

    widths = SMOKE if args.smoke else WAN14B
    repeat = 1 if args.smoke else args.repeat
    cuda = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    threads = torch.get_num_threads()
    rows = []
    for mode in args.modes:
        host_ok = mode == "fp8-sim" or torchao_on_cpu()
        places = []
        if host_ok:
            places += [("host, 1 thread", None, True, 1), (f"host, {threads} threads", None, True, threads)]
        if cuda:
            places += [("device, back to host", "cuda", False, threads), ("device, stays", "cuda", True, threads)]
        for place, device, stay, n in places:
            torch.set_num_threads(n)
            row = {"place": place, **time_place(widths, mode, device, stay, repeat)}
            torch.set_num_threads(threads)
            print(f"{mode:8s} {place:22s} {row['seconds_per_block']:8.3f} s/block   Wan 14B (40 blocks) "
                  f"{row['wan14b_40_blocks_s']:7.1f} s   A14B (80) {row['a14b_80_blocks_s']:7.1f} s"
                  + (f"   device peak {row['device_peak_gb']} GB" if "device_peak_gb" in row else ""), flush=True)
            rows.append(row)
        if not host_ok:
            print(f"{mode}: no torchao here, host rows skipped", flush=True)
    if args.out is None and args.smoke:
        return 0 if rows else 1
    out = args.out or benchlib.OUT_DIR
    payload = {"machine": benchlib.machine(), "torch": torch.__version__, "widths": widths,
               "device": torch.cuda.get_device_name() if cuda else None, "rows": rows}
    benchlib.write_json("quantize-load", payload, out)
    lines = ["# Quantizing FP8 weights at load, per Wan-14B block", "",
             f"`python bench/bench_quantize_load.py` on {payload['device'] or 'the CPU alone'}, torch {torch.__version__}, "
             f"{benchlib.machine().get('processor', '?')}; one block of 351 M block-linear weights, median of {repeat}.", "",
             "| mode | place | s / block | Wan 14B (40 blocks) | A14B (80) | device peak GB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['place']} | {r['seconds_per_block']} | {r['wan14b_40_blocks_s']} s | "
                     f"{r['a14b_80_blocks_s']} s | {r.get('device_peak_gb', '')} |")
    (out / "quantize-load.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
