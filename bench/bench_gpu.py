"""GPU-only measurements (skipped, with a record saying so, where there is no CUDA device):

1. Attention kernels: TFLOP/s of each raydit local kernel (flash-attn when installed,
   torch-cuda) against torch's scaled_dot_product_attention, bf16, CogVideoX-2b's full
   sequence (2 x 30 heads x 17776 tokens x 64: 49 frames at 480 x 720 plus 226 text).
   FLOP = 4 B H S^2 D (QK^T and PV, 2 FLOP per multiply-add); CUDA-event timing, median.
2. One-GPU denoising step, bf16: raydit's `Runner.step` against the plain diffusers
   `CogVideoXPipeline.__call__` (per-step time from its callback), on the same pipeline: the
   built-in tiny pipeline's tokenizer / T5 / VAE with a CogVideoX-2b-shaped transformer
   (30 heads x 64, 30 layers, random weights; text_embed_dim 32 to match the tiny T5),
   49 x 480 x 720, guidance on. No weights are downloaded. Then the same runner with
   `compile=True` (regional torch.compile of the blocks, raydit.models.compile): its warm-up
   (the compile, in prepare) and its step time.

`--smoke` runs the same code on CPU with tiny shapes (float32), to check the script itself.

    python bench/bench_gpu.py [--steps 5] [--iters 20] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

FULL = dict(batch=2, heads=30, tokens=17776, head_dim=64, layers=30, frames=49, height=480, width=720)
SMOKE = dict(batch=2, heads=2, tokens=256, head_dim=16, layers=1, frames=9, height=64, width=64)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters: int) -> list[float]:
    """Seconds per call: CUDA events on GPU, perf_counter on CPU."""
    import torch

    fn()  # warm-up (kernel selection, caches)
    _sync(device)
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def bench_attention(shape: dict, device, dtype, iters: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from raydit.parallel.kernels import available_kernels, select_kernel

    B, H, S, D = shape["batch"], shape["heads"], shape["tokens"], shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g) for _ in range(3))
    flop = 4 * B * H * S * S * D
    candidates = {"torch SDPA (F.scaled_dot_product_attention)": lambda: F.scaled_dot_product_attention(q, k, v)}
    for name in available_kernels(device):
        if name == "reference":
            continue  # float64 yardstick, not a kernel anyone runs
        kernel = select_kernel(device, dtype, prefer=name)
        candidates[f"raydit {name}"] = lambda kernel=kernel: kernel(q, k, v)
    rows = []
    for name, fn in candidates.items():
        secs = _time(fn, device, iters)
        med = statistics.median(secs)
        rows.append({"kernel": name, "seconds": benchlib.summary(secs, 6), "tflops": float(f"{flop / med / 1e12:.4g}")})
        print(f"{name:<48} {med * 1e3:9.3f} ms  {flop / med / 1e12:9.4g} TFLOP/s", flush=True)
    return rows


def _pipeline(shape: dict, device, dtype):
    """The tiny pipeline's tokenizer / T5 / VAE with a 2b-shaped random transformer."""
    import torch
    from diffusers import CogVideoXPipeline, CogVideoXTransformer3DModel

    from raydit.models.families.cogvideox import TINY_TEXT_EMBED_DIM, tiny_pipeline_dir

    base = CogVideoXPipeline.from_pretrained(tiny_pipeline_dir())
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=shape["heads"], attention_head_dim=shape["head_dim"], num_layers=shape["layers"],
        in_channels=base.transformer.config.in_channels, out_channels=base.transformer.config.out_channels,
        text_embed_dim=TINY_TEXT_EMBED_DIM, time_embed_dim=512, sample_height=shape["height"] // 8,
        sample_width=shape["width"] // 8, sample_frames=shape["frames"], max_text_seq_length=226,
    ).to(device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in transformer.parameters():  # diffusers zero-initialises some gates; draw all
            p.copy_(torch.randn(p.shape, device=device, dtype=dtype, generator=g) * 0.02)
    pipe = CogVideoXPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                             transformer=transformer, scheduler=base.scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def bench_step(shape: dict, device, dtype, steps: int) -> dict:
    import torch

    from raydit.models.family import GenerationRequest
    from raydit.models.runner import Runner

    pipe = _pipeline(shape, device, dtype)
    request = dict(prompt="a red fox", num_frames=shape["frames"], height=shape["height"], width=shape["width"],
                   num_inference_steps=steps, guidance_scale=6.0)
    marks: list[float] = []

    def on_step(p, i, t, kwargs):
        _sync(device)
        marks.append(time.perf_counter())
        return kwargs

    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        pipe(**request, generator=torch.Generator("cpu").manual_seed(0), output_type="latent",
             callback_on_step_end=on_step)
    diffusers_steps = [b - a for a, b in zip([t0] + marks[:-1], marks)][1:]  # the first holds prompt encoding

    runner = Runner(pipe, mesh=None, device=device, dtype=dtype)
    state = runner.prepare(GenerationRequest(**request, seed=0))
    raydit_steps = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        state = runner.step(state)
        _sync(device)
        raydit_steps.append(time.perf_counter() - t0)
    raydit_steps = raydit_steps[1:]
    runner.close()
    d, r = statistics.median(diffusers_steps), statistics.median(raydit_steps)
    print(f"step: diffusers {d:.4f} s, raydit runner {r:.4f} s, ratio {r / d:.3f}", flush=True)

    # compile=True: prepare compiles (runner.warmup_seconds); every step then runs compiled.
    compiled = Runner(pipe, mesh=None, device=device, dtype=dtype, compile=True)
    try:
        state = compiled.prepare(GenerationRequest(**request, seed=0))
        compiled_steps = []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            state = compiled.step(state)
            _sync(device)
            compiled_steps.append(time.perf_counter() - t0)
    finally:
        compiled.close()
    c = statistics.median(compiled_steps)
    print(f"step: raydit runner compiled {c:.4f} s ({r / c:.3f}x eager), warm-up {compiled.warmup_seconds:.1f} s",
          flush=True)
    return {"diffusers_step_seconds": benchlib.summary(diffusers_steps), "raydit_step_seconds": benchlib.summary(raydit_steps),
            "ratio": round(r / d, 4), "request": request,
            "compiled_step_seconds": benchlib.summary(compiled_steps), "compile_speedup": round(r / c, 4),
            "compile_warmup_seconds": round(compiled.warmup_seconds, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="run on CPU with tiny shapes (checks the script)")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = ap.parse_args(argv)
    import torch

    if args.smoke:
        device, dtype, shape = torch.device("cpu"), torch.float32, SMOKE
        out = Path(tempfile.mkdtemp(prefix="raydit-bench-gpu-smoke-"))
    elif not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; skipped (GPU-only measurements)")
        benchlib.write_json("gpu", {"machine": benchlib.machine(), "skipped": "no CUDA device"}, Path(args.out))
        return 0
    else:
        device, dtype, shape, out = torch.device("cuda", 0), torch.bfloat16, FULL, Path(args.out)
    result = {"machine": benchlib.machine(), "dtype": str(dtype), "shape": shape,
              "attention": bench_attention(shape, device, dtype, args.iters),
              "step": bench_step(shape, device, dtype, args.steps)}
    print("wrote", benchlib.write_json("gpu", result, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
