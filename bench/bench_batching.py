"""Step-level batching on one device, the model layer: a step of N requests of one geometry
as one batch (Runner.step_batch) against the same N requests stepped one after another.

A Wan-2.1-1.3B-shaped transformer (12 x 128, FFN 8960, `--layers`, random weights) behind the
tiny Wan tokenizer / umT5 / VAE (benchlib.wan_bench_dir), guidance 5 (two transformer calls a
step per request), N requests at their own seeds and guidance scales, prepared once. Timed:
seconds of one step of the N one after another (`Runner.step` each) and of one `step_batch`,
median of `--iters` (CUDA synchronised), from the same prepared states; requests per second of
steps both ways and their ratio. Checked on the way, after the 1 + `--iters` steps: float32,
every request's batched latents equal its steps taken alone within 1e-5 of their scale; bf16,
the low-precision rule (raydit.models.precision): each request's batched latents are within
2x the relative L2 error its steps alone have, both against a float32 run of the same steps
from the same start (float32 stands in for float64 here: its error is ~1000x below bf16's and a
float64 30-layer reference would not fit the device's time). No Ray: the Engine's batching adds the driver's round
trip per step, once for the batch instead of once per request.

    python bench/bench_batching.py [--frames 9 --height 480 --width 832] [--layers 30] [--batch 1 2 4 8]
        [--iters 5] [--device cuda|cpu] [--wheels DIR ...] [--name batching]
    python bench/bench_batching.py --smoke   # CPU, 2 layers, 9 x 48 x 80, float32
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


def run(frames: int, height: int, width: int, layers: int, batches: list[int], iters: int, device: str,
        dtype_name: str) -> dict:
    import torch

    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    from raydit.models.conformance import run_steps
    from raydit.models.precision import BF16_ERROR_FACTOR, relative_error

    dtype = getattr(torch, dtype_name)
    model_dir = benchlib.wan_bench_dir(layers=layers, dtype=dtype_name,
                                       defaults={"num_frames": frames, "height": height, "width": width})
    pipe = load_pipeline(model_dir, dtype=dtype)
    runner = Runner(pipe, device=device, dtype=dtype)
    low = dtype != torch.float32
    reference = (Runner(load_pipeline(model_dir, dtype=torch.float32), device=device, dtype=torch.float32,
                        init_dtype=dtype) if low else None)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    rows = []
    steps = iters + 1
    for n in batches:
        requests = [GenerationRequest(prompt="a red fox runs", num_frames=frames, height=height, width=width,
                                      num_inference_steps=steps + 1, guidance_scale=5.0 - 0.25 * i, seed=i)
                    for i in range(n)]
        states = [runner.prepare(r) for r in requests]
        # Warm: one step each way.
        alone = [runner.step(s) for s in states]
        batched = runner.step_batch(states)
        sync()
        t_alone, t_batch = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            alone = [runner.step(s) for s in alone]
            sync()
            t_alone.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            batched = runner.step_batch(batched)
            sync()
            t_batch.append(time.perf_counter() - t0)
        worst = 0.0
        for a, b in zip(alone, batched):
            scale = float(a.latents.float().abs().max())
            worst = max(worst, float((a.latents.float() - b.latents.float()).abs().max()) / max(scale, 1e-12))
        row = {"requests": n, "alone_step_seconds": benchlib.summary(t_alone), "batch_step_seconds": benchlib.summary(t_batch),
               "speedup": round(statistics.median(t_alone) / statistics.median(t_batch), 4),
               "worst_difference_of_scale": worst}
        if low:
            ratios = []
            for request, a, b in zip(requests, alone, batched):
                ref = run_steps(reference, request, a.step_index).latents.float().cpu()
                e_alone, e_batch = relative_error(a.latents.cpu(), ref), relative_error(b.latents.cpu(), ref)
                ratios.append((e_batch, e_alone))
            row["errors_batched_alone"] = ratios
            row["worst_error_ratio"] = max(eb / max(ea, 1e-30) for eb, ea in ratios)
            row["equal"] = all(eb <= BF16_ERROR_FACTOR * ea for eb, ea in ratios)
            check = (f"bf16 error batched / alone {row['worst_error_ratio']:.2f} at worst (rule <= {BF16_ERROR_FACTOR:g}; "
                     f"alone {max(ea for _, ea in ratios):.2e})")
        else:
            row["equal"] = worst <= 1e-5
            check = f"worst difference {worst:.2e} of the latents' scale (bound 1e-5)"
        rows.append(row)
        print(f"{n} request(s): alone {statistics.median(t_alone):.4f} s, batch {statistics.median(t_batch):.4f} s a step "
              f"of all ({row['speedup']:.2f}x); {check}", flush=True)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    return {"machine": benchlib.machine(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "dtype": dtype_name, "request": {"frames": frames, "height": height, "width": width, "guidance_scale": 5.0},
            "model": {"dir": model_dir, **benchlib.WAN_1_3B, "num_layers": layers}, "iters": iters, "rows": rows,
            "peak_gb": peak}


def write_md(result: dict, path: Path, argv: list[str]) -> None:
    r = result["request"]
    lines = [f"# Step-level batching on one {result['device']}: N requests a step, batched or one after another", "",
             f"Command: `python bench/bench_batching.py {' '.join(argv)}` ({result['machine']['date_utc']} UTC), "
             f"{result['dtype']}, {r['frames']} x {r['height']} x {r['width']}, Wan-1.3B-shaped transformer of "
             f"{result['model']['num_layers']} layers, guidance 5. Seconds of one step of all N requests: median "
             f"(min-max, n).", "",
             "| requests | one after another | one batch | speedup | max difference / latents' scale | "
             "bf16 error batched / alone (rule <= 2) | passes |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        ratio = f"{row['worst_error_ratio']:.2f}" if "worst_error_ratio" in row else "(float32)"
        lines.append(f"| {row['requests']} | {benchlib.fmt(row['alone_step_seconds'])} | {benchlib.fmt(row['batch_step_seconds'])} "
                     f"| {row['speedup']:.2f}x | {row['worst_difference_of_scale']:.2e} | {ratio} | {row['equal']} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--wheels", nargs="*", default=[])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default="batching")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = ap.parse_args(argv)
    if args.wheels:
        import bench_gpu

        bench_gpu.install_wheels(args.wheels)
    if args.smoke:
        args.frames, args.height, args.width, args.layers, args.device, args.iters = 9, 48, 80, 2, "cpu", 2
        args.batch = [1, 3]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    result = run(args.frames, args.height, args.width, args.layers, args.batch, args.iters, args.device, dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name if not args.smoke else args.name + "-smoke"
    print("wrote", benchlib.write_json(name, result, out))
    write_md(result, out / f"{name}.md", argv)
    print("wrote", out / f"{name}.md")
    return 0 if all(row["equal"] for row in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
