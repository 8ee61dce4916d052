"""Faster modes on one GPU, with what each costs in quality (issue 39): one run, one script.

Modes: raydit's `quantize` (none / fp8: the transformer blocks' linears in FP8 through torchao)
and `attention` (bf16 / int8 / fp8: raydit.parallel.kernels.lowbit), eager or compiled.

Parts, each reported as it finishes and written to docs/benchmarks/modes.json (`--out`):
1. kernels: each attention kernel at real shapes, bf16, (1, 12, 32760, 128) Wan 1.3B and
   (1, 40, 32760, 128) Wan 14B 81x480x832, (2, 30, 17776, 64) CogVideoX-2b: TFLOP/s (median
   of --iters, CUDA events) and the relative L2 error of its output against float64 math on
   1024 query rows (all keys), beside bf16 cuDNN's own.
2. steps: the Wan-1.3B-shaped pipeline (30 layers, random weights, bench_gpu's) at 81 x 480
   x 832, guidance 5, a 4-step request (steps 2..4 timed, each synchronised): diffusers eager,
   diffusers + `transformer.compile_repeated_blocks(fullgraph=True)`, and raydit's Runner in
   each mode, eager and compiled (compile's warm-up reported apart). Every side runs the same
   request from the same noise, and records each transformer call's output.
3. quality: the same request in float32 (diffusers' own pipeline, TF32 off) is the reference:
   per mode, the relative L2 error of the final latents and of every transformer call's output
   (on each side's own trajectory), beside bf16's own (diffusers eager in bf16).
4. width (run second, before the steps): one Wan-14B-width block stack (40 x 128, FFN 13824, --wide-layers layers) at
   81 x 480 x 832, one forward per mode, eager: seconds per layer.

Random weights (scale 0.02) stand in for a checkpoint: no weights can be downloaded where this
runs; the attention of a random network is flatter than a trained one's, so the errors are
those of these weights, said next to every figure.

`--smoke`: the same code on the CPU, tiny shapes, float32, quantize "fp8-sim" and the torch
8-bit kernels (numerics only).

    python bench/bench_modes.py [--wheels DIR] [--budget-s 330] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402
from bench_gpu import GUIDANCE, PROMPT, Missing, install_wheels, need, peak_gb, reset_peak, say, sync  # noqa: E402

KERNEL_SHAPES = [((1, 12, 32760, 128), "Wan 1.3B 81x480x832"), ((1, 40, 32760, 128), "Wan 14B 81x480x832"),
                 ((2, 30, 17776, 64), "CogVideoX-2b 49x480x720, CFG batch")]
SMOKE_KERNEL_SHAPES = [((1, 2, 300, 64), "smoke d64"), ((1, 2, 260, 128), "smoke d128")]
REQUEST = {"num_frames": 81, "height": 480, "width": 832}
SMOKE_REQUEST = {"num_frames": 9, "height": 64, "width": 64}
STEPS = 4
ERROR_ROWS = 1024
WIDE = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, freq_dim=256)
# (label, quantize, attention, compile): the order they run in (the budget cuts from the end).
# "diffusers compiled" is diffusers' own side, run where it stands in this order.
MODES = [
    ("bf16", None, "bf16", False), ("int8-attn", None, "int8", False), ("fp8-linear", "fp8", "bf16", False),
    ("fp8-linear+int8-attn", "fp8", "int8", False), ("fp8-attn", None, "fp8", False),
    ("fp8-linear+int8-attn compiled", "fp8", "int8", True), ("diffusers compiled", None, None, True),
    ("fp8-linear compiled", "fp8", "bf16", True), ("int8-attn compiled", None, "int8", True),
    ("fp8-linear+fp8-attn", "fp8", "fp8", False), ("bf16 compiled", None, "bf16", True),
    ("fp8-attn compiled", None, "fp8", True),
]


def rel(x, ref) -> float:
    ref = ref.double()
    return float((x.double() - ref).norm() / ref.norm())


# -- 1. kernels ----------------------------------------------------------------------------------
def part_kernels(ctx: dict) -> dict:
    import torch

    from raydit.parallel import kernels
    from raydit.parallel.kernels import lowbit

    device, out = ctx["device"], {}
    names = ["torch-cudnn", "int8-triton", "fp8-triton"] if device.type == "cuda" else ["torch-cpu", "int8-torch", "fp8-torch"]
    for (B, H, S, D), label in ctx["kernel_shapes"]:
        g = torch.Generator(device=device).manual_seed(0)
        # Keys with a common offset per channel, as a DiT's have (smoothing takes it out).
        q = torch.randn(B, S, H, D, device=device, generator=g, dtype=ctx["dtype"]).transpose(1, 2)
        k = (torch.randn(B, S, H, D, device=device, generator=g) + 0.5 * torch.randn(1, 1, H, D, device=device, generator=g)
             ).to(ctx["dtype"]).transpose(1, 2)
        v = torch.randn(B, S, H, D, device=device, generator=g, dtype=ctx["dtype"]).transpose(1, 2)
        scale = D ** -0.5
        rows = slice(0, min(ERROR_ROWS, S))
        ref = kernels._exact(q[:, :, rows].cpu() if device.type == "cpu" else q[:, :, rows], k, v, scale)[0]
        flop = 4 * B * H * S * S * D
        row = {}
        for name in names:
            try:
                fn = kernels.KERNELS[name]
                o = fn(q, k, v, scale)[0]
                err = rel(o[:, :, rows], ref)
                secs = statistics.median(kernels.call_seconds(lambda: fn(q, k, v, scale), device, 2, ctx["iters"]))
                row[name] = {"tflops": round(flop / secs / 1e12, 1), "ms": round(secs * 1e3, 3), "rel_l2_vs_f64": float(f"{err:.4g}")}
                say(f"kernel {name:<12} {str((B, H, S, D)):<22} {secs * 1e3:8.3f} ms {flop / secs / 1e12:7.1f} TFLOP/s  "
                    f"rel L2 vs float64 {err:.3g}  ({label})")
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                say(f"kernel {name:<12} {str((B, H, S, D)):<22} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        row["check"] = {n: kernels.check_kernel(n, device, ctx["dtype"], D) for n in names}
        out[f"{B}x{H}x{S}x{D}"] = {"label": label, **row}
        del q, k, v, ref
        gc.collect()
    return out


# -- 2 / 3. steps and quality ----------------------------------------------------------------------
def _pipeline(ctx: dict, dtype):
    import torch
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(ctx["model_dir"], dtype=dtype).to(ctx["device"])
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    return pipe


def _recorder(transformer, outputs: list):
    def hook(module, args, output):
        sample = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
        outputs.append(sample.detach().float().cpu())
    return transformer.register_forward_hook(hook)


def _diffusers_run(ctx: dict, pipe, warm_up: bool = True) -> dict:
    import torch

    device, marks, outputs = ctx["device"], [], []

    bounds: list[int] = []

    def stamp(p, i, t, kwargs):
        sync(device)
        marks.append(time.perf_counter())
        bounds.append(len(outputs))
        return kwargs

    def call():
        with torch.no_grad():
            return pipe(prompt=PROMPT, **ctx["request"], num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                        max_sequence_length=512, generator=torch.Generator("cpu").manual_seed(0), output_type="latent",
                        callback_on_step_end=stamp).frames
    t0 = time.perf_counter()
    if warm_up:
        call()  # warm-up (and compile)
    warm = time.perf_counter() - t0
    marks.clear()
    bounds.clear()
    handle = _recorder(pipe.transformer, outputs)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    latents = call()
    handle.remove()
    steps = [b - a for a, b in zip([t0] + marks[:-1], marks)][1:]
    return {"steps": steps, "latents": latents.float().cpu(), "outputs": _by_step(outputs, bounds), "warm_s": warm,
            "peak": peak_gb(device)}


def _runner_run(ctx: dict, pipe, quantize, attention, compile_: bool) -> dict:
    import torch

    from raydit.models.requests import GenerationRequest
    from raydit.models.runner import Runner

    device, outputs = ctx["device"], []
    kwargs = {"attention": attention, "compile": compile_}
    if quantize:
        kwargs["quantize"] = quantize if device.type == "cuda" else "fp8-sim"
    t0 = time.perf_counter()
    runner = Runner(pipe, device=device, dtype=ctx["dtype"], **kwargs)
    setup = time.perf_counter() - t0
    request = GenerationRequest(prompt=PROMPT, **ctx["request"], num_inference_steps=STEPS, guidance_scale=GUIDANCE, seed=0)
    t0 = time.perf_counter()
    runner.prepare(request)  # warm-up request: compiles where asked, chooses kernels
    warm = time.perf_counter() - t0 + getattr(runner, "warmup_seconds", 0.0)
    handle = _recorder(runner.transformer, outputs)
    reset_peak(device)
    state = runner.prepare(request)
    steps, bounds = [], []
    while not state.done:
        sync(device)
        t = time.perf_counter()
        state = runner.step(state)
        sync(device)
        steps.append(time.perf_counter() - t)
        bounds.append(len(outputs))
    handle.remove()
    latents = state.latents.float().cpu()
    runner.close()
    return {"steps": steps[1:], "latents": latents, "outputs": _by_step(outputs, bounds), "warm_s": warm, "setup_s": setup,
            "peak": peak_gb(device)}


def _by_step(outputs: list, bounds: list[int]) -> list[list]:
    """Each step's transformer outputs, one tensor per sample (a batched call's rows apart)."""
    steps, start = [], 0
    for end in bounds:
        steps.append([row for out in outputs[start:end] for row in out.unbind(0)])
        start = end
    return steps


def _step_errors(run: list[list], ref: list[list]) -> list[float]:
    """Per step: the relative L2 error of the step's transformer outputs against the float32
    run's outputs of the same step. The two sides may call the branches (conditional,
    unconditional) in another order or batched: each output is paired with the reference
    output of its step it is closest to (they differ by guidance's own difference, above
    these errors); the step's error is the root mean square over its outputs."""
    errors = []
    for outs, refs in zip(run, ref):
        pair = [min(rel(o, r) for r in refs if r.shape == o.shape) for o in outs] if outs and refs else []
        errors.append(float(f"{math.sqrt(sum(e * e for e in pair) / len(pair)):.4g}") if pair else float("nan"))
    return errors


def _report(name: str, run: dict, ref: dict | None, base: float | None) -> dict:
    med = statistics.median(run["steps"])
    row = {"step_s": round(med, 4), "steps_s": [round(s, 4) for s in run["steps"]], "peak_gb": round(run["peak"], 2),
           "warmup_s": round(run["warm_s"], 1)}
    text = f"step  {name:<34} {med:8.4f} s"
    if base:
        row["speedup_vs_diffusers"] = round(base / med, 3)
        text += f"  {base / med:5.3f}x diffusers"
    if ref is not None:
        row["latents_rel_l2_vs_f32"] = float(f"{rel(run['latents'], ref['latents']):.4g}")
        row["transformer_out_rel_l2_vs_f32_per_step"] = _step_errors(run["outputs"], ref["outputs"])
        text += (f"  latents rel L2 vs float32 {row['latents_rel_l2_vs_f32']:.3g}; transformer out per step "
                 + " ".join(f"{e:.2g}" for e in row["transformer_out_rel_l2_vs_f32_per_step"]))
    say(text + f"  peak {run['peak']:.2f} GB  warm-up {run['warm_s']:.1f} s")
    return row


def part_steps(ctx: dict) -> dict:
    import torch

    need("diffusers", "the Wan pipeline")
    t0 = time.perf_counter()
    layers = 1 if ctx["smoke"] else 30
    ctx["model_dir"] = benchlib.wan_bench_dir(layers=layers, dtype="float32" if ctx["smoke"] else "bfloat16",
                                              defaults=ctx["request"], root=ctx["scratch"])
    say(f"pipeline: Wan-1.3B-shaped, {layers} layers, built in {time.perf_counter() - t0:.1f} s")
    out: dict = {"layers": layers, "request": dict(ctx["request"], steps=STEPS, guidance_scale=GUIDANCE), "sides": {}}
    # The float32 reference first (TF32 off), then diffusers in bf16.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = None
    if ctx["reference"]:
        pipe = _pipeline(ctx, torch.float32)
        ref = _diffusers_run(ctx, pipe, warm_up=False)  # untimed: only its numbers count
        say(f"float32 reference: {statistics.median(ref['steps']):.3f} s a step")
        del pipe
    gc.collect()
    if ctx["device"].type == "cuda":
        torch.cuda.empty_cache()
    pipe = _pipeline(ctx, ctx["dtype"])
    base_run = _diffusers_run(ctx, pipe)
    base = statistics.median(base_run["steps"])
    out["sides"]["diffusers eager"] = _report("diffusers eager", base_run, ref, None)
    pristine = copy.deepcopy(pipe.transformer)  # each mode quantizes its own copy in place
    for name, quantize, attention, compile_ in MODES:
        if ctx["smoke"] and compile_ and name != "fp8-linear+int8-attn compiled":
            continue
        if ctx["modes"] is not None and name not in ctx["modes"]:
            continue
        if time.perf_counter() - ctx["t_start"] > ctx["budget_s"]:
            out["sides"][name] = {"skipped": "past the budget"}
            say(f"{name}: skipped, past the {ctx['budget_s']:g} s budget")
            continue
        side = name if name.startswith("diffusers") else f"raydit {name}"
        try:
            pipe.transformer = copy.deepcopy(pristine)
            torch._dynamo.reset()
            if side == "diffusers compiled":
                pipe.transformer.compile_repeated_blocks(fullgraph=True)
                run = _diffusers_run(ctx, pipe)
            else:
                run = _runner_run(ctx, pipe, quantize, attention, compile_)
            out["sides"][side] = _report(side, run, ref, base)
        except Exception as exc:
            out["sides"][side] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            say(f"{side}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        gc.collect()
        if ctx["device"].type == "cuda":
            torch.cuda.empty_cache()
    out["bf16_own_latents_rel_l2_vs_f32"] = out["sides"]["diffusers eager"].get("latents_rel_l2_vs_f32")
    del pipe, pristine
    gc.collect()
    return out


# -- 4. a Wan-14B-width stack ---------------------------------------------------------------------
def part_wide(ctx: dict) -> dict:
    import torch
    from diffusers import WanTransformer3DModel

    from raydit.models.quantize import quantize_transformer
    from raydit.models.registry import load_families, parallelize
    from raydit.parallel.mesh import with_attention

    load_families()
    device, dtype, layers = ctx["device"], ctx["dtype"], ctx["wide_layers"]
    cfg = dict(WIDE, num_layers=layers) if not ctx["smoke"] else dict(WIDE, num_attention_heads=2, attention_head_dim=32,
                                                                     ffn_dim=128, num_layers=layers)
    torch.manual_seed(0)
    pristine = WanTransformer3DModel(patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096,
                                     cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, **cfg)
    with torch.no_grad():
        for p in pristine.parameters():
            p.normal_(0, 0.02)
    pristine = pristine.to(device=device, dtype=dtype)
    f = (ctx["request"]["num_frames"] - 1) // 4 + 1
    h, w = ctx["request"]["height"] // 8, ctx["request"]["width"] // 8
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, 16, f, h, w, device=device, dtype=dtype, generator=g)
    text = torch.randn(1, 512, 4096, device=device, dtype=dtype, generator=g) * 0.1
    t = torch.tensor([500.0], device=device)
    out = {"config": cfg, "tokens": f * h * w // 4, "modes": {}}
    ref = None
    for name, quantize, attention in (("bf16", None, "bf16"), ("int8-attn", None, "int8"), ("fp8-linear", "fp8", "bf16"),
                                      ("fp8-linear+int8-attn", "fp8", "int8"), ("fp8-linear+fp8-attn", "fp8", "fp8")):
        try:
            model = copy.deepcopy(pristine)
            handle = None
            if quantize:
                quantize_transformer(model, quantize if device.type == "cuda" else "fp8-sim")
            if attention != "bf16":
                mesh = with_attention(None, attention)
                handle = parallelize(model, mesh)
            with torch.no_grad():
                fn = lambda: model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]  # noqa: E731
                y = fn()
                secs = statistics.median(__import__("raydit.parallel.kernels", fromlist=["call_seconds"]).call_seconds(fn, device, 1, 3))
            ref = y.float() if ref is None else ref
            err = rel(y, ref)
            out["modes"][name] = {"s_per_layer": round(secs / layers, 4), "rel_l2_vs_bf16": float(f"{err:.4g}")}
            say(f"wide  {name:<24} {secs / layers:8.4f} s a layer ({layers} layers, {out['tokens']} tokens)  "
                f"rel L2 vs bf16 {err:.3g}")
            if handle is not None:
                handle.remove()
            del model
        except Exception as exc:
            out["modes"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            say(f"wide  {name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        gc.collect()
    if "bf16" in out["modes"] and "s_per_layer" in out["modes"]["bf16"]:
        b = out["modes"]["bf16"]["s_per_layer"]
        for row in out["modes"].values():
            if "s_per_layer" in row:
                row["speedup_vs_bf16"] = round(b / row["s_per_layer"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--wheels", nargs="*", default=[])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=330.0, help="modes not started by then are skipped")
    ap.add_argument("--wide-layers", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--modes", nargs="*", default=None, help="run only these sides of part 2, by name (default: all)")
    ap.add_argument("--no-reference", action="store_true", help="part 2 without the float32 run: speed only")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    ap.add_argument("--name", default="modes")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.wheels:
        install_wheels(args.wheels)
    os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
    import torch

    if args.smoke:
        device, dtype, shapes, request = torch.device("cpu"), torch.float32, SMOKE_KERNEL_SHAPES, SMOKE_REQUEST
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        say("bench_modes: no CUDA device; nothing measured (use --smoke on the CPU)")
        return 0
    else:
        device, dtype, shapes, request = torch.device("cuda", 0), torch.bfloat16, KERNEL_SHAPES, REQUEST
    scratch = tempfile.mkdtemp(prefix="raydit-bench-modes-")
    os.environ.setdefault("RAYDIT_CACHE", os.path.join(scratch, "cache"))
    ctx = {"device": device, "dtype": dtype, "kernel_shapes": shapes, "request": request, "iters": args.iters,
           "smoke": args.smoke, "scratch": scratch, "t_start": t_start, "budget_s": args.budget_s,
           "wide_layers": args.wide_layers, "modes": args.modes, "reference": not args.no_reference}
    result = {"machine": benchlib.machine(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "command": "python bench/bench_modes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "weights": "random (scale 0.02): a stand-in for a checkpoint", "parts": {}}
    for name, part in (("kernels", part_kernels), ("wide", part_wide), ("steps", part_steps)):
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        try:
            result["parts"][name] = part(ctx)
        except Missing as exc:
            result["parts"][name] = {"skipped": str(exc)}
            say(f"{name}: skipped, {exc}")
        except Exception as exc:
            result["parts"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            say(f"{name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        result["parts"][name]["part_seconds"] = round(time.perf_counter() - t0, 1)
        out_dir = Path(args.out) if not args.smoke or args.out != str(benchlib.OUT_DIR) else Path(scratch)
        benchlib.write_json(args.name, result, out_dir)  # after every part: a cut run keeps what it measured
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    out_dir = Path(args.out) if not args.smoke or args.out != str(benchlib.OUT_DIR) else Path(scratch)
    say(f"wrote {benchlib.write_json(args.name, result, out_dir)} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
