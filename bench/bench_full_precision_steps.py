"""What full_precision_steps buys: a quantized run's error with its first and last N steps in
full precision (issue 39, item 3: "keeps the first and last steps in bf16 ... if it
measurably helps").

A Wan-1.3B-shaped transformer (12 x 128 heads, FFN 8960; `--layers` of its 30, random weights
at 0.02 scale: benchlib.wan_bench_dir) behind the tiny Wan pipeline's text encoder and VAE, one
request (`--frames` x `--height` x `--width`, `--steps` steps, guidance 5), bf16. The reference
is the same request in float32 from the bf16 run's noise; each row is the relative L2 error of
the final latents against it:

- bf16: the unquantized run (bf16's own error);
- the quantized mode (`--mode`: fp8-sim anywhere, fp8 on an FP8 GPU), full_precision_steps
  N = 0, 1, 2, ... (`--n`): the Runner's option;
- diagnostics stepped by hand with an unquantized and a quantized Runner (not options): only
  the first N steps in full precision, only the last N, and 2N steps in the middle - which end
  the gain comes from, and whether any 2N steps would do.

Rows also give the share of steps run unquantized (what the option costs in speed: those steps
run at bf16's rate). Random weights stand in for a checkpoint; the CPU run is a stand-in for
real shapes (a GPU runs `--layers 30 --frames 81 --height 480 --width 832`).

    python bench/bench_full_precision_steps.py [--layers 4] [--frames 17] [--height 192] \
        [--width 192] [--steps 20] [--mode fp8-sim] [--n 0 1 2 3] [--out DIR]
    python bench/bench_full_precision_steps.py --smoke --out DIR     # 1 layer, 4 steps

Writes full-precision-steps.json and .md (docs/benchmarks unless --out).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402
from raydit.planner.runconfig import RunConfig

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--height", type=int, default=192)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mode", default="fp8-sim", choices=("fp8-sim", "fp8"))
    ap.add_argument("--n", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.frames, args.height, args.width, args.steps, args.n = 1, 5, 32, 32, 4, [0, 1]
    import torch

    from raydit.models import conformance as harness
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.precision import relative_error
    from raydit.models.runner import Runner

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = benchlib.wan_bench_dir(layers=args.layers, dtype="float32",
                                   defaults={"num_frames": args.frames, "height": args.height, "width": args.width})
    request = GenerationRequest(prompt="a red fox running through fresh snow, cinematic light", num_frames=args.frames,
                                height=args.height, width=args.width, num_inference_steps=args.steps, seed=3,
                                guidance_scale=5.0)
    bf16 = torch.bfloat16

    def latents(runner):
        return harness.run_steps(runner, request, None).latents.float().cpu()

    reference = latents(Runner(load_pipeline(model, dtype=torch.float32), device=device, dtype=torch.float32,
                               init_dtype=bf16))
    plain = Runner(load_pipeline(model, dtype=bf16), device=device, dtype=bf16)
    rows = [{"run": "bf16", "full_steps": args.steps, "error": relative_error(latents(plain), reference)}]
    print(f"bf16 (its own error): {rows[0]['error']:.4f}", flush=True)
    for n in args.n:
        runner = Runner(load_pipeline(model, dtype=bf16), device=device, dtype=bf16,
                        run=RunConfig(quantize=args.mode, full_precision_steps=n))
        full = min(2 * n, args.steps)
        rows.append({"run": f"{args.mode}, full_precision_steps {n}", "full_steps": full,
                     "error": relative_error(latents(runner), reference)})
        print(f"{rows[-1]['run']}: {rows[-1]['error']:.4f} ({full} of {args.steps} steps unquantized)", flush=True)
        del runner
    quantized = Runner(load_pipeline(model, dtype=bf16), device=device, dtype=bf16, run=RunConfig(quantize=args.mode))
    S = args.steps
    for n in [n for n in args.n if n > 0]:
        middle = set(range(S // 2 - n, S // 2 + n))
        for name, full in ((f"first {n} only", set(range(n))), (f"last {n} only", set(range(S - n, S))),
                           (f"middle {2 * n}", middle)):
            error = relative_error(harness.run_switching(plain, quantized, request, full).float().cpu(), reference)
            rows.append({"run": f"{args.mode}, by hand: {name}", "full_steps": len(full), "error": error})
            print(f"{rows[-1]['run']}: {error:.4f}", flush=True)
    for row in rows:
        row["error"] = round(float(row["error"]), 5)
    seconds = time.perf_counter() - t0
    if args.out is None and args.smoke:
        return 0
    out = args.out or benchlib.OUT_DIR
    shape = dict(layers=args.layers, frames=args.frames, height=args.height, width=args.width, steps=args.steps)
    benchlib.write_json("full-precision-steps", {"machine": benchlib.machine(), "device": device, "mode": args.mode,
                                                 "shape": shape, "seconds": round(seconds, 1), "rows": rows}, out)
    lines = ["# full_precision_steps: the final latents' error against float32", "",
             f"`python bench/bench_full_precision_steps.py --layers {args.layers} --frames {args.frames} --height "
             f"{args.height} --width {args.width} --steps {args.steps} --mode {args.mode}` on {device}, "
             f"{benchlib.machine().get('date_utc')} ({seconds:.0f} s). Wan-1.3B-shaped transformer, {args.layers} "
             "layers, random weights; guidance 5; relative L2 of the final latents against a float32 run of the "
             "same request (same noise).", "",
             "| run | steps unquantized | error vs float32 |", "|---|---|---|"]
    lines += [f"| {r['run']} | {r['full_steps']} of {args.steps} | {r['error']} |" for r in rows]
    (out / "full-precision-steps.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
