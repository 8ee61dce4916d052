"""The one script a GPU machine runs: kernels, one step on every side, the planner against it.

Parts, each reported as it finishes (one line a person can read per figure) and written to
docs/benchmarks/gpu.json (`--out`); a part that lacks what it needs (Ray, diffusers, a
CUDA device) says so in one line and the others still run:

1. kernels: every attention kernel raydit can run on the device (raydit.parallel.kernels:
   cuDNN, FlashAttention-3 / -2 when installed, torch's flash and efficient kernels), each
   checked against float64 math at the shape's head dim, and torch's own SDPA, at four
   shapes: (2, 30, 17776, 64) CogVideoX-2b 49x480x720 with its CFG batch; (1, 12, 32760, 128)
   Wan 1.3B 81x480x832; (1, 3, 119056, 128) one rank's heads of HunyuanVideo 720p at
   Ulysses 8; (2, 6, 17776, 64) one rank's heads of CogVideoX-5b at Ulysses 8. bf16, CUDA
   events, median of `--iters`; TFLOP/s = 4 B H S^2 D / s. Also the kernel the runtime's
   bounded probe picks for each head dim.
2. calibration: `raydit doctor --calibrate`'s compute figures of this device, in process.
3. steps: one saved pipeline, a Wan-2.1-1.3B-shaped transformer (12 x 128, 30 layers, FFN
   8960, random weights) behind the tiny Wan tokenizer / umT5 / VAE, 81 x 480 x 832, bf16,
   guidance 5: seconds per step (median of steps 2..N, each synchronised) of diffusers'
   WanPipeline, raydit's bare Runner, the Engine (one Ray worker; also rank 0's own time of
   the step) and the Engine with `compile=True` (its warm-up reported apart); the VAE
   decode's seconds; peak device memory on every side. Every side is warm when measured:
   diffusers after a 2-step call in this process, the Runner after diffusers, each Engine on
   its workers' second request (the first request's steps are reported too).
   model: `raydit doctor --calibrate --model`'s figures of that pipeline (its own step timed
   through the Runner and its attention kernels at its shape, raydit.runtime.measure.
   measure_model) at a SHORTER request, 41 x 480 x 832 (17160 tokens against 32760), so
   the prediction below carries them to another request through the cost model's formulas.
4. prediction: the planner's step, decode and peak GB for that request on one device of
   this type, from the table, from part 2's calibration, and from part 2's with the model's
   own rates (part 3's model), against the measured Engine.

`--smoke` runs the same code on the CPU with tiny shapes, float32 (CI runs it).
`--wheels DIR ...` installs the wheels found there first (pip --no-index --no-deps into a
temporary folder, on sys.path and PYTHONPATH so Ray's workers see it too), for a bare GPU
machine that has torch but not Ray or diffusers; a wheel too large to carry may come split
as NAME.whl.part-aa, NAME.whl.part-ab, ... (joined in name order). raydit is imported from
this repository.

    python bench/bench_gpu.py [--steps 5] [--iters 10] [--smoke] [--wheels DIR ...] [--budget-s 360]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

# (B, H, S, D) and what each stands for.
SHAPES = [
    ((2, 30, 17776, 64), "CogVideoX-2b 49x480x720, CFG batch"),
    ((1, 12, 32760, 128), "Wan 1.3B 81x480x832"),
    ((1, 3, 119056, 128), "HunyuanVideo 720p, one rank's heads at Ulysses 8"),
    ((2, 6, 17776, 64), "CogVideoX-5b, one rank's heads at Ulysses 8"),
]
SMOKE_SHAPES = [((2, 4, 300, 64), "smoke, head dim 64"), ((1, 2, 260, 128), "smoke, head dim 128")]
REQUEST = {"num_frames": 81, "height": 480, "width": 832}
SMOKE_REQUEST = {"num_frames": 9, "height": 64, "width": 64}
# The request the model calibration times (part "model"): shorter than the one predicted.
MODEL_REQUEST = {"frames": 41, "height": 480, "width": 832}
SMOKE_MODEL_REQUEST = {"frames": 5, "height": 64, "width": 64}
GUIDANCE = 5.0
PROMPT = "a red fox running through fresh snow"


class Missing(Exception):
    """A part cannot run here (a package or a device is missing): said in one line."""


def say(line: str) -> None:
    print(line, flush=True)


# -- set-up ----------------------------------------------------------------------------------

def install_wheels(dirs: list[str]) -> str | None:
    """Install every wheel in `dirs` (split ones joined first) into a temporary folder put on
    sys.path and PYTHONPATH; returns that folder (None when there was nothing to install)."""
    wheels, parts = [], {}
    for d in dirs:
        wheels += sorted(glob.glob(os.path.join(d, "*.whl")))
        for p in sorted(glob.glob(os.path.join(d, "*.whl.part-*"))):
            parts.setdefault(os.path.basename(p).split(".part-")[0], []).append(p)
    root = Path(tempfile.mkdtemp(prefix="raydit-bench-gpu-"))
    for name, pieces in parts.items():
        joined = root / name
        with open(joined, "wb") as out:
            for piece in sorted(pieces):
                out.write(Path(piece).read_bytes())
        wheels.append(str(joined))
    if not wheels:
        return None
    site = root / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--target", str(site), *wheels]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        say(f"wheels: pip could not install {len(wheels)} wheel(s): {done.stderr.strip().splitlines()[-1:]}")
        return None
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(benchlib.REPO), os.environ.get("PYTHONPATH", "")])
    say(f"wheels: installed {', '.join(sorted(Path(w).name.split('-')[0] for w in wheels))} into {site}")
    return str(site)


def need(module: str, why: str):
    try:
        return __import__(module)
    except Exception as exc:  # not installed, or broken: either way the part cannot run
        raise Missing(f"needs {module} for {why} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device) -> float:
    import torch

    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0


# -- 1. kernels ------------------------------------------------------------------------------

def part_kernels(ctx: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from raydit.parallel import kernels as K

    device, dtype, iters = ctx["device"], ctx["dtype"], ctx["iters"]
    rows, picks = [], {}
    for (B, H, S, D), what in ctx["shapes"]:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g) for _ in range(3))
        flop = 4 * B * H * S * S * D
        fns = {"torch SDPA (default, no LSE)": lambda: F.scaled_dot_product_attention(q, k, v)}
        checks = {"torch SDPA (default, no LSE)": None}
        for name in K.candidate_kernels(device, dtype):
            if name == "reference":
                continue
            checks[name] = K.check_kernel(name, device, dtype, D)
            if checks[name] is None:
                kernel = K.select_kernel(device, dtype, prefer=name, head_dim=D)
                fns[name] = lambda kernel=kernel: kernel(q, k, v)
        for name, check in checks.items():
            row = {"shape": [B, H, S, D], "what": what, "kernel": name}
            if check is not None:
                row["dropped"] = check
                say(f"kernel {name:<30} {str((B, H, S, D)):<24} dropped by the float64 check: {check}")
                rows.append(row)
                continue
            try:
                secs = K.call_seconds(fns[name], device, warmup=1, iters=iters)
            except Exception as exc:  # an unsupported shape: said, and the others still run
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                say(f"kernel {name:<30} {str((B, H, S, D)):<24} failed: {row['error']}")
                rows.append(row)
                continue
            med = statistics.median(secs)
            row.update(seconds=benchlib.summary(secs, 6), tflops=round(flop / med / 1e12, 1))
            rows.append(row)
            say(f"kernel {name:<30} {str((B, H, S, D)):<24} {med * 1e3:9.3f} ms {row['tflops']:8.1f} TFLOP/s  ({what})")
    for D in sorted({s[0][3] for s in ctx["shapes"]}):
        choice = K.kernel_choice(device, dtype, D)
        picks[str(D)] = {"kernel": choice.name, "why": choice.why, "rates_tflops": dict(choice.rates),
                         "dropped": dict(choice.dropped), "described": choice.describe()}
        fastest_by_shape: dict[tuple, dict] = {}
        for row in rows:
            if row["shape"][3] == D and "tflops" in row and "SDPA" not in row["kernel"]:
                top = fastest_by_shape.get(tuple(row["shape"]))
                if top is None or row["tflops"] > top["tflops"]:
                    fastest_by_shape[tuple(row["shape"])] = row
        best = sorted({row["kernel"] for row in fastest_by_shape.values()})
        picks[str(D)]["fastest_measured"] = best
        say(f"choice at head dim {D}: {choice.describe()}; fastest LSE kernel measured at "
            f"the shapes above: {', '.join(best) or 'none'}")
    return {"rows": rows, "choice": picks}


# -- 2. calibration --------------------------------------------------------------------------

def part_calibration(ctx: dict) -> dict:
    from raydit.runtime.measure import measure_compute, measure_dit, measure_matmul

    if ctx["smoke"]:  # the same measurements at sizes a CPU runs in a second or two
        measured = {**measure_matmul("cpu", (128,)), **measure_dit("cpu", block=(128, 256, 512), repeats=2)}
    else:
        measured = measure_compute("cuda" if ctx["device"].type == "cuda" else "cpu")
    ctx["calibration"] = measured
    attn = measured.get("attention_tflops_by_head_dim", {})
    say(f"calibration: matmul {measured.get('matmul_tflops', 0):.4g} TFLOP/s, DiT linear part "
        f"{measured.get('dit_linear_tflops', 0):.4g}, attention "
        + ", ".join(f"d{d} {r:.4g}" for d, r in attn.items())
        + f" ({measured.get('attention_kernel', '?')})")
    return measured


# -- 3. steps ----------------------------------------------------------------------------------

def part_pipeline(ctx: dict) -> dict:
    need("diffusers", "building the Wan pipeline")
    t0 = time.perf_counter()
    layers = 1 if ctx["smoke"] else 30
    dtype = "float32" if ctx["smoke"] else "bfloat16"
    ctx["model_dir"] = benchlib.wan_bench_dir(layers=layers, dtype=dtype, defaults=ctx["request"], root=ctx["scratch"])
    out = {"dir": ctx["model_dir"], "layers": layers, "dtype": dtype, "seconds": round(time.perf_counter() - t0, 2),
           "transformer": dict(benchlib.WAN_1_3B, num_layers=layers), **ctx["request"]}
    say(f"pipeline: Wan-1.3B-shaped, {layers} layers, {dtype}, built and saved in {out['seconds']:.1f} s")
    return out


def _steps_line(name: str, steps: list[float], peak: float, extra: str = "") -> str:
    return (f"step  {name:<22} {statistics.median(steps):8.4f} s (steps 2..{len(steps) + 1}: "
            f"{min(steps):.4f}-{max(steps):.4f})  peak {peak:6.2f} GB{extra}")


def _load(ctx: dict):
    import torch
    from diffusers import WanPipeline

    if ctx.get("pipe") is None:
        pipe = WanPipeline.from_pretrained(ctx["model_dir"], dtype=ctx["dtype"]).to(ctx["device"])
        pipe.set_progress_bar_config(disable=True)
        ctx["pipe"] = pipe
    torch.manual_seed(0)
    return ctx["pipe"]


def part_diffusers(ctx: dict) -> dict:
    import torch

    need("diffusers", "diffusers' own pipeline")
    device = ctx["device"]
    pipe = _load(ctx)
    marks: list[float] = []

    def stamp(p, i, t, kwargs):
        sync(device)
        marks.append(time.perf_counter())
        return kwargs

    def call(steps: int) -> None:
        with torch.no_grad():
            pipe(prompt=PROMPT, **ctx["request"], num_inference_steps=steps, guidance_scale=GUIDANCE,
                 max_sequence_length=512, generator=torch.Generator("cpu").manual_seed(0), output_type="latent",
                 callback_on_step_end=stamp)

    call(2)  # warm-up: the first request in a process pays kernel plans and the allocator's growth
    marks.clear()
    sync(device)
    reset_peak(device)
    t0 = time.perf_counter()
    call(ctx["steps"])
    steps = [b - a for a, b in zip([t0] + marks[:-1], marks)][1:]
    out = {"step_seconds": benchlib.summary(steps), "peak_gb": round(peak_gb(device), 3)}
    say(_steps_line("diffusers WanPipeline", steps, out["peak_gb"]))
    return out


def part_model(ctx: dict) -> dict:
    from raydit.runtime.calibration_cache import describe_model
    from raydit.runtime.measure import measure_model

    need("diffusers", "the model's own step")
    if "model_dir" not in ctx:
        raise Missing("needs the saved pipeline of part 3")
    geometry = SMOKE_MODEL_REQUEST if ctx["smoke"] else MODEL_REQUEST
    out = measure_model(ctx["model_dir"], ctx["device"].type, pipe=_load(ctx), **geometry)
    ctx["model_calibration"] = out
    say(f"model calibration: {describe_model(out)}")
    return out


def part_runner(ctx: dict) -> dict:
    import torch

    from raydit.models.requests import GenerationRequest
    from raydit.models.runner import Runner

    need("diffusers", "the Runner's pipeline")
    device = ctx["device"]
    runner = Runner(_load(ctx), device=device, dtype=ctx["dtype"])  # warm: diffusers' side ran here first
    reset_peak(device)
    state = runner.prepare(GenerationRequest(prompt=PROMPT, **ctx["request"], num_inference_steps=ctx["steps"],
                                             guidance_scale=GUIDANCE, seed=0))
    steps = []
    for _ in range(ctx["steps"]):
        sync(device)
        t0 = time.perf_counter()
        state = runner.step(state)
        sync(device)
        steps.append(time.perf_counter() - t0)
    steps = steps[1:]
    step_peak = peak_gb(device)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        frames = runner.decode(state)
    sync(device)
    decode_s = time.perf_counter() - t0
    out = {"step_seconds": benchlib.summary(steps), "peak_gb": round(step_peak, 3),
           "decode_seconds": round(decode_s, 4), "decode_peak_gb": round(peak_gb(device), 3),
           "frames": list(frames.shape)}
    say(_steps_line("raydit Runner", steps, out["peak_gb"]))
    say(f"decode raydit Runner           {decode_s:8.4f} s  peak {out['decode_peak_gb']:6.2f} GB  frames {tuple(frames.shape)}")
    runner.close()
    ctx.pop("pipe", None)  # the Engine's workers load their own copy
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _engine(ctx: dict, compile: bool) -> dict:
    need("ray", "the Engine's workers")
    need("diffusers", "the Engine's pipeline")
    import ray

    from raydit.runtime.engine import Engine

    name = "raydit Engine" + (" --compile" if compile else "")
    kwargs = {"compile": True} if compile else {}
    t0 = time.perf_counter()
    with Engine(model=ctx["model_dir"], workers=1, device=ctx["device"].type, show_plan=False, **kwargs) as engine:
        start_s = time.perf_counter() - t0
        actor = engine.group.members[0].actor
        ray.get(actor.device_memory.remote(reset=True))
        request = dict(num_inference_steps=ctx["steps"], guidance_scale=GUIDANCE, seed=0, **ctx["request"])
        # The workers' first request (fresh processes: kernel plans, the allocator's growth,
        # and with compile=True the compilation in its prepare), then the one measured: an
        # Engine's actors stay warm between requests.
        first = engine.generate(PROMPT, **request)
        result = engine.generate(PROMPT, **request)
        mem = ray.get(actor.device_memory.remote())
        plan = engine.plan
    t = dict(result.timings, compile_seconds=first.timings.get("compile_seconds", 0.0))
    steps, rank = t["step_seconds"][1:], t.get("rank_step_seconds", [])[1:]
    first_steps = first.timings["step_seconds"][1:]
    out = {"start_seconds": round(start_s, 2), "step_seconds": benchlib.summary(steps),
           "rank_step_seconds": benchlib.summary(rank) if rank else None,
           "first_request_step_seconds": benchlib.summary(first_steps),
           "prepare_seconds": round(t.get("prepare_seconds", 0.0), 3),
           "compile_seconds": round(t.get("compile_seconds", 0.0), 3),
           "decode_seconds": round(t.get("decode", 0.0), 4), "peak_gb": round(mem["peak_gb"], 3),
           "plan": {"ulysses": plan.ulysses, "ring": plan.ring, "cfg": plan.cfg,
                    "predicted_step_seconds": plan.predicted_step_seconds}}
    extra = (f"  (rank 0's own {statistics.median(rank):.4f} s; the workers' first request "
             f"{statistics.median(first_steps):.4f} s)") if rank else ""
    say(_steps_line(name, steps, out["peak_gb"], extra))
    say(f"start {name:<22} {start_s:8.2f} s (Ray, actor, load)" +
        (f"; warm-up (compile) {out['compile_seconds']:.2f} s, reported apart from the steps" if compile else ""))
    say(f"decode {name:<21} {out['decode_seconds']:8.4f} s")
    return out


def part_engine(ctx: dict) -> dict:
    return _engine(ctx, compile=False)


def part_engine_compile(ctx: dict) -> dict:
    return _engine(ctx, compile=True)


# -- 4. the planner against the measurements ------------------------------------------------

def _device_type_name(device) -> str:
    import torch

    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    for known in ("H200", "H100", "A100", "L40S", "L40", "A10G", "L4", "B200", "4090"):
        if known in name:
            return known
    return name


def part_prediction(ctx: dict, results: dict) -> dict:
    from raydit.planner import ClusterSpec, NodeSpec, device_type, plan
    from raydit.planner import model_spec as planner_spec
    from raydit.runtime.calibration_cache import apply_entry

    if "model_dir" not in ctx:
        raise Missing("needs the saved pipeline of part 3")
    spec = planner_spec(ctx["model_dir"])
    try:
        base = device_type(_device_type_name(ctx["device"]))
    except ValueError as exc:
        raise Missing(f"no table entry for this device ({exc})") from None
    engine = results.get("engine") or {}
    measured_step = (engine.get("step_seconds") or {}).get("median")
    out = {"device_type": base.name}
    kinds = [("table", base)]
    if ctx.get("calibration"):
        kinds.append(("calibrated", apply_entry(base, {"measured": ctx["calibration"]})))
        model = ctx.get("model_calibration")
        if model:
            kinds.append(("model", apply_entry(base, {"measured": ctx["calibration"], "models": {model["key"]: model}})))
    for label, dev in kinds:
        cluster = ClusterSpec(nodes=(NodeSpec("one", dev, 1),))
        best = plan(spec, ctx["request"]["num_frames"], ctx["request"]["height"], ctx["request"]["width"],
                    cluster=cluster, world_size=1).best
        row = {"step_seconds": round(best.predicted_step_seconds, 4), "memory_gb": round(best.memory_gb_per_gpu, 2)}
        if best.decode is not None:
            row["decode_seconds"] = round(best.decode.seconds, 3)
            row["decode_peak_gb"] = round(getattr(best.decode, "peak_gb", 0.0) or 0.0, 2)
        if measured_step:
            row["step_error"] = round(best.predicted_step_seconds / measured_step - 1, 4)
        out[label] = row
        vs = f" against {measured_step:.4f} s measured (Engine): {row['step_error']:+.1%}" if measured_step else ""
        if label == "model":
            r = ctx["model_calibration"]["request"]
            row["model_timed_at"] = f"{r['frames']}x{r['height']}x{r['width']}"
            vs += f" (the model's own rates, timed at {row['model_timed_at']})"
        say(f"predict {label:<10} step {row['step_seconds']:.4f} s{vs}; decode "
            f"{row.get('decode_seconds', float('nan')):.3f} s against {engine.get('decode_seconds', float('nan')):.3f} s; "
            f"peak {row['memory_gb']:.2f} GB against {engine.get('peak_gb', float('nan')):.2f} GB")
    return out


# -- main --------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="denoising steps per side (the first is dropped)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per kernel and shape")
    ap.add_argument("--smoke", action="store_true", help="the same code on the CPU with tiny shapes (CI)")
    ap.add_argument("--wheels", nargs="*", default=[], help="folders of wheels to install first")
    ap.add_argument("--budget-s", type=float, default=360.0, help="parts not started by then are skipped")
    ap.add_argument("--skip", nargs="*", default=[], help="parts to leave out, by name")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    ap.add_argument("--name", default="gpu")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.wheels:
        install_wheels(args.wheels)
    os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
    import torch

    if args.smoke:
        device, dtype, shapes, request = torch.device("cpu"), torch.float32, SMOKE_SHAPES, SMOKE_REQUEST
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        say("bench_gpu: no CUDA device; nothing measured (use --smoke to check the script on the CPU)")
        benchlib.write_json(args.name, {"machine": benchlib.machine(), "skipped": "no CUDA device"}, Path(args.out))
        return 0
    else:
        device, dtype, shapes, request = torch.device("cuda", 0), torch.bfloat16, SHAPES, REQUEST
    scratch = tempfile.mkdtemp(prefix="raydit-bench-gpu-")
    # Calibration and kernel choices this run makes stay in the run's own cache.
    os.environ.setdefault("RAYDIT_CACHE", os.path.join(scratch, "cache"))
    ctx = {"device": device, "dtype": dtype, "shapes": shapes, "request": request, "iters": args.iters,
           "steps": args.steps, "smoke": args.smoke, "scratch": scratch}
    result: dict = {"machine": benchlib.machine(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "dtype": str(dtype), "command": "python bench/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "request": dict(request, steps=args.steps, guidance_scale=GUIDANCE), "parts": {}}
    parts = [("kernels", part_kernels), ("calibration", part_calibration), ("pipeline", part_pipeline),
             ("diffusers", part_diffusers), ("model", part_model), ("runner", part_runner), ("engine", part_engine),
             ("engine_compile", part_engine_compile),
             ("prediction", lambda c: part_prediction(c, result["parts"]))]
    for name, part in parts:
        if name in args.skip:
            result["parts"][name] = {"skipped": "--skip"}
            continue
        if time.perf_counter() - t_start > args.budget_s:
            result["parts"][name] = {"skipped": f"past the {args.budget_s:g} s budget"}
            say(f"{name}: skipped, past the {args.budget_s:g} s budget")
            continue
        t0 = time.perf_counter()
        try:
            result["parts"][name] = part(ctx)
        except Missing as exc:
            result["parts"][name] = {"skipped": str(exc)}
            say(f"{name}: skipped, {exc}")
        except Exception as exc:  # one broken part must not cost the others their figures
            result["parts"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            say(f"{name}: FAILED, {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        result["parts"][name]["part_seconds"] = round(time.perf_counter() - t0, 2) if isinstance(result["parts"][name], dict) else None
    p = result["parts"]
    d, e = (p.get("diffusers") or {}).get("step_seconds"), (p.get("engine") or {}).get("step_seconds")
    r, c = (p.get("runner") or {}).get("step_seconds"), (p.get("engine_compile") or {}).get("step_seconds")
    ratios = {}
    for label, side in (("runner", r), ("engine", e), ("engine_compile", c)):
        if d and side:
            ratios[f"{label}_over_diffusers"] = round(side["median"] / d["median"], 4)
    result["ratios"] = ratios
    if ratios:
        say("ratios per step: " + ", ".join(f"{k} {v:.4f}" for k, v in ratios.items()))
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out) if not args.smoke or args.out != str(benchlib.OUT_DIR) else Path(scratch)
    say(f"wrote {benchlib.write_json(args.name, result, out)} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
