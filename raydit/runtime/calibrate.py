"""Measure a device type once and let the planner use the figures instead of the table's.

What is measured (seconds in all, on Ray actors pinned to one node of the type):
  - matrix-multiply rate: square matmuls of a few sizes (bf16 on CUDA, fp32 on a CPU slot
    with one thread, as the runtime's CPU ranks run), the median of the per-size rates;
  - a DiT block's two parts, timed apart (`measure_dit`): the linear part (norms,
    projections, FFN with its GELU, residuals) and the attention kernel the runtime selects,
    at head dims 64 and 128. A step is not all GEMM: on a CPU slot the GELU and the
    attention kernel run well below the matmul rate, and how far below changes from run to
    run with the machine (the matmul rate of the development machine has doubled between two
    days while the step got 1.9x faster), so one fixed fraction of the matmul rate cannot
    predict a step;
  - with 2 devices of the type on one node, between 2 actors (NCCL on GPUs, gloo on CPU):
    all-to-all bandwidth (bytes that leave a rank per second, the figure the cost model's
    Ulysses term uses), point-to-point bandwidth (one direction, from a ping-pong) and the
    latency of a tiny all-to-all.
  - with `--model DIR` (`measure_model`): that pipeline's own step on one device of the type,
    through the Runner at a request (default the model's), and its attention kernels at its
    own shape; raydit.planner.cost.fit_model_rates turns them into the model's own linear
    and attention rates, filed under ModelSpec.calibration_key in the entry's "models".
How the figures replace the table's (`calibrated_device_type`):
  tflops <- the measured matmul rate (or the DiT block's faster part, if one outran it);
  efficiency <- the DiT block's linear part over tflops, attention_efficiency <- the
      attention kernel's rate over tflops, per head dim: the planner then predicts each part
      at its measured rate. An entry without the DiT figures (measured before they existed)
      keeps the table's `efficiency`;
  link_gb_s <- all-to-all bandwidth; link_latency_us <- tiny all-to-all latency;
  memory_gb <- the device's total memory (GPUs);
  model_rates <- each calibrated model's rates (used for that model only: DeviceType.rates_for).
Cache: JSON at `$RAYDIT_CACHE/calibration.json` (default `~/.cache/raydit/`), keyed by
device type name (the table's name, e.g. `A100-80GB`, or Ray's name for unknown types).
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from raydit.planner import DeviceType

CACHE_VERSION = 1
CPU_SIZES = (256, 384, 512)
CUDA_SIZES = (2048, 4096, 8192)
CPU_LINK_BYTES = 4 * 2**20
CUDA_LINK_BYTES = 64 * 2**20
REPEATS = 5


# -- cache ----------------------------------------------------------------------------------


def cache_path() -> Path:
    """`$RAYDIT_CACHE/calibration.json`, else `~/.cache/raydit/calibration.json`."""
    root = os.environ.get("RAYDIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "raydit")
    return Path(root) / "calibration.json"


def load_calibration(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """Device type name -> measured entry; {} when there is no cache. A cache that does not
    parse is reported (ValueError names the file and the fix), not silently dropped."""
    p = Path(path) if path is not None else cache_path()
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration cache {str(p)!r} is unreadable ({exc}); "
                         "delete it to measure again") from None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or \
            not isinstance(data.get("devices"), dict):
        raise ValueError(f"calibration cache {str(p)!r} is not version {CACHE_VERSION} raydit calibration; "
                         "delete it to measure again")
    return dict(data["devices"])


def save_calibration(entries: dict[str, dict], path: str | os.PathLike | None = None) -> Path:
    """Write entries (merged over what the file holds) atomically; returns the path."""
    p = Path(path) if path is not None else cache_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    merged = load_calibration(p)
    for name, entry in entries.items():
        # A device measured again keeps the models calibrated on it (their rates are the
        # models' own, not the device's figures), unless the new entry brings them.
        old_models = (merged.get(name) or {}).get("models") or {}
        if old_models:
            entry = dict(entry, models={**old_models, **(entry.get("models") or {})})
        merged[name] = entry
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"version": CACHE_VERSION, "devices": merged}, indent=1, sort_keys=True))
    os.replace(tmp, p)
    return p


def apply_entry(base: DeviceType, entry: dict) -> DeviceType:
    """`base` with the measured fields of a cache entry (module docstring: which, and why).
    Where the type has a priced op table (raydit.planner.devicemodel) the table still prices
    the step: the entry's compute figures then price the decode and the text encoding only (and
    `entry_problem` refuses an entry more than 2x from the table); a model's own rates
    (`models`) still take that model's step."""
    m = entry.get("measured", {})
    fields = {}
    if _positive(m.get("matmul_tflops")):
        fields["tflops"] = float(m["matmul_tflops"])
        attn = _rates_by_dim(m.get("attention_tflops_by_head_dim"))
        plain = _rates_by_dim(m.get("attention_plain_tflops_by_head_dim"))
        if _positive(m.get("dit_linear_tflops")):
            # The DiT block's parts as fractions of the fastest measured rate (a block's large
            # GEMMs can outrun the square matmuls), so that each part's rate is the measured one.
            linear = float(m["dit_linear_tflops"])
            top = fields["tflops"] = max(fields["tflops"], linear, *attn.values(), *plain.values())
            fields["efficiency"] = linear / top
            if attn:
                fields["attention_efficiency"] = tuple(sorted((d, r / top) for d, r in attn.items()))
            if plain:
                fields["plain_attention_efficiency"] = tuple(sorted((d, r / top) for d, r in plain.items()))
    if _positive(m.get("all_to_all_gb_s")):
        fields["link_gb_s"] = float(m["all_to_all_gb_s"])
    if _positive(m.get("latency_us")):
        fields["link_latency_us"] = float(m["latency_us"])
    if _positive(m.get("memory_gb")):
        fields["memory_gb"] = float(m["memory_gb"])
    models = [(key, e["linear_tflops"], e["lse_attention_tflops"], e["plain_attention_tflops"])
              for key, e in sorted((entry.get("models") or {}).items())
              if all(_positive(e.get(k)) for k in ("linear_tflops", "lse_attention_tflops", "plain_attention_tflops"))]
    if models:
        fields["model_rates"] = tuple(models)
    fields["calibrated"] = f"{entry.get('when', '?')} on {entry.get('host', '?')}"
    return replace(base, **fields)


def entry_problem(name: str, entry: dict, torch_version: str | None = None) -> str | None:
    """One line saying why a cached entry must not be used, or None: measured on another GPU
    than its type (`device_name` does not name it), with another torch than `torch_version`
    (default: this process's), or disagreeing with the type's op table by more than
    DISAGREE_FACTOR (raydit.planner.devicemodel; reported, not silently used)."""
    seen = str(entry.get("device_name") or "")
    if entry.get("device") == "cuda" and seen and name.split("-")[0].upper() not in seen.upper():
        return (f"calibration entry {name!r} was measured on {seen!r}, another GPU: not used; "
                f"run `raydit doctor --calibrate --force` on a {name}")
    if torch_version is None:
        try:
            import torch

            torch_version = torch.__version__
        except ImportError:
            torch_version = None
    got = entry.get("torch")
    if got and torch_version and got != torch_version:
        return (f"calibration entry {name!r} was measured with torch {got}, this is torch {torch_version}: "
                "not used; run `raydit doctor --calibrate --force` again")
    from raydit.planner.devicemodel import table_for

    table = table_for(name)
    m = entry.get("measured") or {}
    if table is not None and table.priced and entry.get("device") == "cuda":
        checks = []
        if _positive(m.get("matmul_tflops")):
            checks.append(("matmul", float(m["matmul_tflops"]), table.gemm(4096, 4096, 4096).tflops))
        for d, r in _rates_by_dim(m.get("attention_plain_tflops_by_head_dim")).items():
            checks.append((f"attention d{d}", r, table.attention(d, CUDA_ATTENTION_TOKENS).tflops))
        for what, got_r, want in checks:
            if not 1 / DISAGREE_FACTOR <= got_r / want <= DISAGREE_FACTOR:
                return (f"calibration entry {name!r} disagrees with its op table ({table.describe()}) by more than "
                        f"{DISAGREE_FACTOR:g}x: {what} {got_r:.4g} against {want:.4g} TFLOP/s: not used; the table "
                        "prices the step (measure again with `raydit doctor --calibrate --force`)")
    return None


# A calibration and an op table further apart than this (either way) is a measurement gone wrong.
DISAGREE_FACTOR = 2.0


def calibrated_device_type(name: str, path: str | os.PathLike | None = None,
                           notes: list[str] | None = None) -> DeviceType:
    """The table's entry for `name` (or conservative figures for an unknown type) with the
    cached measurements applied; the table's entry unchanged when nothing is cached, or when
    the entry must not be used (entry_problem: the line goes to `notes`)."""
    from raydit.runtime.devices import table_device

    base, _ = table_device(name)
    entry = load_calibration(path).get(base.name)
    if not entry:
        return base
    problem = entry_problem(base.name, entry)
    if problem:
        if notes is not None:
            notes.append(problem)
        return base
    return apply_entry(base, entry)


def calibrated_device_types(path: str | os.PathLike | None = None,
                            notes: list[str] | None = None) -> dict[str, DeviceType]:
    """Every cached device type that may be used, calibrated (for `read_live_cluster`); the
    others' one-line reasons go to `notes`."""
    from raydit.runtime.devices import table_device

    out = {}
    for name, entry in load_calibration(path).items():
        problem = entry_problem(name, entry)
        if problem:
            if notes is not None:
                notes.append(problem)
            continue
        out[name] = apply_entry(table_device(name)[0], entry)
    return out


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _rates_by_dim(table) -> dict[int, float]:
    return {int(d): float(r) for d, r in (table or {}).items() if _positive(r)}


# -- measurements (run inside an actor, or in-process) ---------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _median_seconds(fn, device: str, repeats: int, after_warmup=None, timer=time.perf_counter) -> float:
    """Median wall time (`timer`'s seconds) of `repeats` calls of `fn` after one warm-up call,
    the device synced around each (`after_warmup`: called once between, e.g. a barrier for a
    collective)."""
    fn()
    _sync(device)
    if after_warmup is not None:
        after_warmup()
    times = []
    for _ in range(repeats):
        t0 = timer()
        fn()
        _sync(device)
        times.append(timer() - t0)
    return statistics.median(times)


def measure_matmul(device: str = "cpu", sizes: tuple[int, ...] | None = None,
                   repeats: int = REPEATS) -> dict:
    """Matmul rate in TFLOP/s: per size the median of `repeats` timed runs after one warm-up,
    then the median over sizes (2 n^3 FLOP per n x n @ n x n)."""
    import torch

    sizes = sizes or (CUDA_SIZES if device == "cuda" else CPU_SIZES)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    per_size = {}
    for n in sizes:
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        per_size[n] = 2 * n**3 / _median_seconds(lambda: torch.matmul(a, b), device, repeats) / 1e12
    return {"matmul_tflops": statistics.median(per_size.values()),
            "matmul_dtype": str(dtype).removeprefix("torch."),
            "matmul_tflops_by_size": {str(k): v for k, v in per_size.items()}}


# The DiT block the calibration times: (tokens, heads x head_dim = hidden, FFN width). A
# CogVideoX-2b-wide block on a CPU slot (about half a second of work at 0.2 TFLOP/s); a
# HunyuanVideo-wide one on a GPU. Attention is timed at each head dim of ATTENTION_HEAD_DIMS
# with the same hidden width.
CPU_DIT_BLOCK = (1024, 1920, 7680)
CUDA_DIT_BLOCK = (8192, 3072, 12288)
ATTENTION_HEAD_DIMS = (64, 128)
# Tokens the attention kernels are timed at on a GPU: a video model's sequence (Wan 1.3B at
# 81x480x832: 32760; CogVideoX-2b 49x480x720: 17776; HunyuanVideo 720p: 119056), not the
# block's 8192. Measured on one H200: cuDNN at head dim 128 ran 676 TFLOP/s at 8192 tokens and
# 561 at Wan's 32760, and the step predicted from the 8192-token rate came out 21% short of the
# measured one (docs/benchmarks/gpu.json).
CUDA_ATTENTION_TOKENS = 32768


def measure_dit(device: str = "cpu", block: tuple[int, int, int] | None = None,
                repeats: int = REPEATS, timer=time.perf_counter) -> dict:
    """Rates in TFLOP/s of the two parts of a DiT block, timed apart (median of `repeats`
    after a warm-up; bf16 on CUDA, float32 on a CPU slot):

      dit_linear_tflops: the block without its attention kernel: adaptive layer norm, the
          q/k/v projections, q/k norm per head, the heads' transposes, output projection,
          gated residual, adaptive layer norm, FFN with tanh-GELU, gated residual; counted as
          the cost model counts it, 2 T (4 h^2 + 2 h f) FLOP (the rest is the elementwise
          work a real block carries beside its GEMMs);
      attention per head dim d (T queries over T keys, h / d heads, laid out as a
          projection's output viewed as heads: 4 T^2 h FLOP): every LSE kernel that passes
          the float64 check (raydit.parallel.kernels.measure_kernels) is timed;
          attention_kernel_by_head_dim names the fastest, attention_tflops_by_head_dim is its
          rate (the planner's), attention_rates_by_head_dim every kernel's,
          attention_dropped_by_head_dim why a kernel was dropped, and
          attention_plain_tflops_by_head_dim torch's scaled_dot_product_attention, the kernel
          that runs where the ring degree is 1 (no lse needed).

    timer: the clock read around each timed call (the attention kernels' on a CPU only: CUDA
    events time them on a GPU).
    """
    import torch
    import torch.nn.functional as F

    from raydit.parallel.kernels import measure_kernels

    tokens, hidden, ffn = block or (CUDA_DIT_BLOCK if device == "cuda" else CPU_DIT_BLOCK)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=dtype, generator=g) * scale)

    x = rand(1, tokens, hidden)
    mod = rand(6, hidden, scale=0.1)  # adaptive-norm shift, scale, gate of each half
    w_qkv, w_out = rand(3 * hidden, hidden, scale=hidden ** -0.5), rand(hidden, hidden, scale=hidden ** -0.5)
    w_up, w_down = rand(ffn, hidden, scale=hidden ** -0.5), rand(hidden, ffn, scale=ffn ** -0.5)
    qk_dim = 64  # the q/k norm's width; the attention kernel is timed at each head dim below
    qk_heads = hidden // qk_dim

    def linear_part():
        # A video DiT block as diffusers builds CogVideoX's, Wan's and HunyuanVideo's: adaptive
        # layer norm, q/k/v, per-head q/k norm, heads moved in front of the tokens for the
        # kernel and back, output projection, gated residual; the same around the FFN.
        h = F.layer_norm(x, (hidden,)) * (1 + mod[1]) + mod[0]
        q, k, v = (t.unflatten(-1, (qk_heads, qk_dim)).transpose(1, 2) for t in F.linear(h, w_qkv).chunk(3, dim=-1))
        q, k = F.layer_norm(q, (qk_dim,)), F.layer_norm(k, (qk_dim,))
        o = (q + k + v).transpose(1, 2).flatten(2)  # stands for the attention output
        y = x + mod[2] * F.linear(o, w_out)
        h = F.layer_norm(y, (hidden,)) * (1 + mod[4]) + mod[3]
        return y + mod[5] * F.linear(F.gelu(F.linear(h, w_up), approximate="tanh"), w_down)

    def timed(fn) -> float:
        with torch.no_grad():
            return _median_seconds(fn, device, repeats, timer=timer)

    linear_flop = 2 * tokens * (4 * hidden * hidden + 2 * hidden * ffn)
    out = {"dit_linear_tflops": linear_flop / timed(linear_part) / 1e12, "dit_dtype": str(dtype).removeprefix("torch."),
           "dit_block": {"tokens": tokens, "hidden": hidden, "ffn": ffn}}
    chosen, rates, plain, dropped = {}, {}, {}, {}
    for head_dim in ATTENTION_HEAD_DIMS:
        # time_kernels lays q, k, v out as a projection's output viewed as heads, (B, T, H, D)
        # -> (B, H, T, D): the strides diffusers' attention processors hand the kernel (15%
        # slower on a CPU slot than contiguous heads).
        choice = measure_kernels(dev, dtype, head_dim, tokens=CUDA_ATTENTION_TOKENS if device == "cuda" else tokens,
                                 heads=hidden // head_dim, warmup=1, iters=repeats, plain=True, timer=timer)
        d = str(head_dim)
        chosen[d] = choice.name
        rates[d] = dict(choice.rates)
        if choice.plain_rate:
            plain[d] = choice.plain_rate
        if choice.dropped:
            dropped[d] = dict(choice.dropped)
    out["attention_kernel_by_head_dim"] = chosen
    # The planner's attention rate: the kernel that will run (a 'reference' fallback was not timed).
    out["attention_tflops_by_head_dim"] = {d: rates[d][k] for d, k in chosen.items() if k in rates[d]}
    out["attention_rates_by_head_dim"] = rates
    out["attention_plain_tflops_by_head_dim"] = plain
    out["attention_dropped_by_head_dim"] = dropped
    # One name where every head dim runs the same kernel (what entries before the split held).
    out["attention_kernel"] = ", ".join(dict.fromkeys(chosen.values()))
    return out


def measure_compute(device: str = "cpu", sizes: tuple[int, ...] | None = None) -> dict:
    """What `raydit doctor --calibrate` measures on one device: the matmul rate and the DiT
    block's two rates (measure_matmul, measure_dit)."""
    return {**measure_matmul(device, sizes), **measure_dit(device)}


# Denoising steps a model calibration runs; the first is dropped (kernel plans, the
# allocator's growth), the median of the rest is the step.
MODEL_STEPS = 4
MODEL_GUIDANCE = 5.0
MODEL_PROMPT = "a red fox in fresh snow"


def measure_model(model_dir, device: str = "cpu", *, frames: int | None = None, height: int | None = None,
                  width: int | None = None, steps: int = MODEL_STEPS, pipe=None, repeats: int = REPEATS) -> dict:
    """A model's own rates on this device (`raydit doctor --calibrate --model`): its pipeline
    (loaded from `model_dir`, or `pipe` already loaded there) runs `steps` denoising steps of
    one request on this one device through raydit's Runner (bf16 on CUDA, float32 on a CPU
    slot), guidance on, at `frames` x `height` x `width` (default: the model's default
    request); its self-attention kernels are timed at the model's own shape (batch, heads,
    tokens, head dim): torch's SDPA, which runs at ring 1, and the LSE kernel a ring would
    choose. raydit.planner.cost.fit_model_rates turns the step and the kernels into the
    rates the planner then uses for this model on this device type (DeviceType.model_rates).
    Returns the entry filed under the spec's calibration_key."""
    import torch

    from raydit.models.family import GenerationRequest, checker_image, image_to_png
    from raydit.models.loading import load_pipeline, takes_image
    from raydit.models.runner import Runner
    from raydit.parallel.kernels import measure_kernels
    from raydit.planner import cost as costmod
    from raydit.planner import model_spec

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps {steps!r} must be an integer >= 2 (the first is dropped)")
    from raydit.models.loading import resolve_model_dir

    model_dir = str(resolve_model_dir(str(model_dir)))
    spec = model_spec(model_dir)
    geo = spec.geometry(frames, height, width)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    own = pipe is None
    if own:
        pipe = load_pipeline(model_dir, device=dev, dtype=dtype)
    image = image_to_png(checker_image(geo.height, geo.width)) if takes_image(model_dir) else None
    request = GenerationRequest(prompt=MODEL_PROMPT, num_frames=geo.frames, height=geo.height, width=geo.width,
                                num_inference_steps=steps, guidance_scale=MODEL_GUIDANCE, seed=0, image=image)
    runner = Runner(pipe, device=dev, dtype=dtype)
    try:
        state = runner.prepare(request)
        seconds = []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            state = runner.step(state)
            _sync(device)
            seconds.append(time.perf_counter() - t0)
    finally:
        runner.close()
        if own:
            del pipe
    step = statistics.median(seconds[1:])
    batch = spec.cfg_branches  # guidance on: every sample of the step, on one device
    tokens = geo.sequence_tokens
    choice = measure_kernels(dev, dtype, spec.head_dim, tokens=tokens, heads=spec.heads, batch=batch,
                             warmup=1, iters=repeats, plain=True)
    flop = 4 * batch * spec.heads * tokens * tokens * spec.head_dim
    lse_rate = dict(choice.rates).get(choice.name)
    plain_rate = choice.plain_rate or lse_rate
    if not plain_rate:
        raise ValueError(f"no attention kernel could be timed on {dev} at head dim {spec.head_dim}")
    plain_s = flop / (plain_rate * 1e12)
    lse_s = flop / (lse_rate * 1e12) if lse_rate else None
    gpu = device == "cuda"  # a CPU slot: no small-shard or wave terms (as the planner plans it)
    rates = costmod.fit_model_rates(spec, geo, batch, step, plain_s, lse_s,
                                    small_rows=costmod.SMALL_SHARD_ROWS if gpu else 0.0,
                                    wave_slots=costmod.WAVE_SLOTS if gpu else 0)
    return {"key": spec.calibration_key, "model": spec.name, "dtype": str(dtype).removeprefix("torch."),
            "request": {"frames": geo.frames, "height": geo.height, "width": geo.width,
                        "guidance_scale": MODEL_GUIDANCE, "batch": batch, "tokens": tokens},
            "step_seconds": step, "step_seconds_all": seconds,
            "attention": {"kernel": choice.name, "lse_seconds_per_layer": lse_s,
                          "plain_seconds_per_layer": plain_s, "lse_tflops": lse_rate, "plain_tflops": plain_rate},
            "linear_tflops": rates.linear / 1e12, "lse_attention_tflops": rates.lse_attention / 1e12,
            "plain_attention_tflops": rates.plain_attention / 1e12}


def measure_links(rank: int, device: str, nbytes: int, repeats: int = REPEATS) -> dict:
    """Between the 2 ranks of the current process group: all-to-all and point-to-point
    bandwidth (GB/s, one direction) and tiny all-to-all latency (us). Collective: both ranks
    call it; every figure is the median of `repeats` runs after a warm-up."""
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    world = dist.get_world_size()
    assert world == 2, world
    n = nbytes // 4 // world * world  # float32 elements, divisible by the world
    x = torch.ones(n, device=dev)
    y = torch.empty_like(x)
    tiny_x, tiny_y = torch.ones(world * 2, device=dev), torch.empty(world * 2, device=dev)

    def timed(fn) -> float:
        return _median_seconds(fn, device, repeats, after_warmup=dist.barrier)

    t_a2a = timed(lambda: dist.all_to_all_single(y, x))
    t_tiny = timed(lambda: dist.all_to_all_single(tiny_y, tiny_x))

    def ping_pong():
        # rank 0 -> 1 then 1 -> 0: two one-way transfers of n floats.
        if rank == 0:
            dist.send(x, 1)
            dist.recv(y, 1)
        else:
            dist.recv(y, 0)
            dist.send(x, 0)

    t_pp = timed(ping_pong)
    leaving = 4 * n * (world - 1) / world  # bytes that leave a rank in one all-to-all
    return {"all_to_all_gb_s": leaving / t_a2a / 1e9, "p2p_gb_s": 4 * n / (t_pp / 2) / 1e9,
            "latency_us": t_tiny * 1e6, "link_bytes": 4 * n}


class CalibrationWorker:
    """One device of the type being measured; wrapped with `ray.remote` by `calibrate_type`."""

    def __init__(self, device: str):
        import torch

        torch.set_num_threads(1)
        self.device = device
        self._store = None

    def usable(self) -> dict:
        import ray
        import torch

        out = {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
               "cuda": torch.cuda.is_available(), "torch": torch.__version__}
        if self.device == "cuda" and out["cuda"]:
            props = torch.cuda.get_device_properties(0)
            out["memory_gb"] = props.total_memory / 1e9
            out["name"] = props.name
        return out

    def compute(self, sizes=None) -> dict:
        return measure_compute(self.device, tuple(sizes) if sizes else None)

    def model(self, model_dir: str, geometry: dict) -> dict:
        return measure_model(model_dir, self.device, **geometry)

    def open_store(self, timeout_s: float) -> tuple[str, int]:
        import ray
        import torch.distributed as dist

        ip = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
        return ip, int(self._store.port)

    def links(self, rank: int, addr: tuple[str, int], nbytes: int, timeout_s: float) -> dict:
        import torch
        import torch.distributed as dist

        store = self._store if rank == 0 else dist.TCPStore(
            addr[0], addr[1], is_master=False, timeout=timedelta(seconds=timeout_s))
        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", 0) if backend == "nccl" else None)
        try:
            return measure_links(rank, self.device, nbytes)
        finally:
            dist.destroy_process_group()


# -- orchestration on Ray ------------------------------------------------------------------


def calibrate_type(name: str, node_id: str, device: str, pair: bool, *,
                   timeout_s: float = 120.0, sizes=None, link_bytes: int | None = None,
                   model: str | None = None, geometry: dict | None = None) -> dict:
    """Measure device type `name` on node `node_id` with 1 actor (2 when `pair`: links too);
    with `model` (a pipeline directory the node can read), that model's own rates too
    (measure_model at `geometry`: frames, height, width; default the model's request).
    Returns a cache entry; ValueError when the device cannot be used there (fake GPUs)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    t_start = time.perf_counter()
    opts = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
            "num_cpus": 1, "max_restarts": 0,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
    if device == "cuda":
        opts.update(num_gpus=1, num_cpus=0)
    cls = ray.remote(CalibrationWorker)
    actors = [cls.options(**opts).remote(device) for _ in range(2 if pair else 1)]
    try:
        infos = ray.get([a.usable.remote() for a in actors], timeout=timeout_s)
        if device == "cuda" and not all(i["cuda"] for i in infos):
            raise ValueError(f"cannot calibrate {name} on node {node_id[:12]}: CUDA is not usable "
                             "in a task there (fake GPUs?)")
        measured = ray.get(actors[0].compute.remote(sizes), timeout=timeout_s)
        notes = []
        if pair:
            nbytes = link_bytes or (CUDA_LINK_BYTES if device == "cuda" else CPU_LINK_BYTES)
            addr = ray.get(actors[0].open_store.remote(timeout_s), timeout=timeout_s)
            outs = ray.get([a.links.remote(r, addr, nbytes, timeout_s) for r, a in enumerate(actors)],
                           timeout=timeout_s)
            # Rank 0's view; both ranks time the same collectives.
            measured.update(outs[0])
        else:
            notes.append("one device of the type on its node: links keep the table's figures")
        if device == "cuda" and infos[0].get("memory_gb"):
            measured["memory_gb"] = infos[0]["memory_gb"]
        models = {}
        if model is not None:
            # Loading and a few steps of a real pipeline take longer than the bare figures.
            got = ray.get(actors[0].model.remote(str(model), dict(geometry or {})), timeout=max(timeout_s, 600.0))
            models[got["key"]] = got
        return {"name": name, "device": device, "measured": measured, "notes": notes, "models": models,
                "node_id": node_id, "host": infos[0]["host"], "device_name": infos[0].get("name", ""),
                "torch": infos[0].get("torch", ""),
                "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "seconds": round(time.perf_counter() - t_start, 2)}
    except ray.exceptions.GetTimeoutError:
        raise ValueError(f"calibrating {name} on node {node_id[:12]} did not finish in {timeout_s:g} s "
                         "(no free device of the type?)") from None
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def calibrate_cluster(device: str, *, force: bool = False, path=None, timeout_s: float = 120.0,
                      model: str | None = None, geometry: dict | None = None) -> list[str]:
    """Measure every device type of the connected cluster that the cache lacks (all with
    `force`), on the node offering the most of it; with `model`, that model's own rates on
    each type too (calibrate_type). Returns notes (skipped types, why)."""
    import ray

    from raydit.runtime.devices import accelerator_type, resolve_device, table_device

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    device = resolve_device(device, nodes)
    key = "GPU" if device == "cuda" else "CPU"
    best: dict[str, tuple[int, str]] = {}
    for n in nodes:
        count = int((n.get("Resources") or {}).get(key, 0))
        name = table_device(accelerator_type(n))[0].name if device == "cuda" else "cpu"
        if count > 0 and count > best.get(name, (0, ""))[0]:
            best[name] = (count, n["NodeID"])
    cached = load_calibration(path)
    notes, new = [], {}
    for name, (count, node_id) in best.items():
        if name in cached and not force:
            continue
        try:
            new[name] = calibrate_type(name, node_id, device, pair=count >= 2, timeout_s=timeout_s,
                                       model=model, geometry=geometry)
        except ValueError as exc:
            notes.append(str(exc))
    if new:
        save_calibration(new, path)
    return notes


def describe_attention(m: dict) -> list[str]:
    """Per head dim, the attention kernel a calibration chose and why: 'attention d64
    torch-cudnn 585 TFLOP/s (fastest of torch-cudnn 585, torch-flash 352; ring 1: sdpa 590;
    fa3 dropped: ...)'. Entries measured before every kernel was timed name one kernel."""
    chosen = m.get("attention_kernel_by_head_dim") or {}
    rates = m.get("attention_tflops_by_head_dim") or {}
    if not chosen:
        attn = ", ".join(f"d{d} {r:.3g}" for d, r in sorted(rates.items(), key=lambda dr: int(dr[0])))
        return [f"attention ({m.get('attention_kernel', '?')}) {attn}"]
    lines = []
    for d in sorted(chosen, key=int):
        table = (m.get("attention_rates_by_head_dim") or {}).get(d) or {}
        why = []
        if len(table) > 1:
            ranked = sorted(table.items(), key=lambda kv: -kv[1])
            why.append("fastest of " + ", ".join(f"{n} {r:.3g}" for n, r in ranked))
        elif table:
            why.append("the only candidate")
        plain = (m.get("attention_plain_tflops_by_head_dim") or {}).get(d)
        if plain:
            why.append(f"ring 1: sdpa {plain:.3g}")
        why += [f"{n} dropped: {w}" for n, w in ((m.get("attention_dropped_by_head_dim") or {}).get(d) or {}).items()]
        rate = f" {rates[d]:.3g} TFLOP/s" if d in rates else ""
        lines.append(f"attention d{d} {chosen[d]}{rate}" + (f" ({'; '.join(why)})" if why else ""))
    return lines


def kernel_rates_for(entries: dict[str, dict], device_name: str) -> dict[int, dict[str, float]]:
    """Head dim -> {kernel: TFLOP/s} of the cached entry measured on a GPU named
    `device_name` (torch.cuda.get_device_name); {} when none was."""
    for entry in entries.values():
        if entry.get("device") == "cuda" and entry.get("device_name") == device_name:
            table = (entry.get("measured") or {}).get("attention_rates_by_head_dim") or {}
            return {int(d): {n: float(r) for n, r in rates.items() if _positive(r)}
                    for d, rates in table.items() if rates}
    return {}


def seed_kernel_choices(path=None) -> dict:
    """Let this process's GPU (CUDA device 0) run the attention kernel its calibration found
    fastest, per head dim, in bf16 (the dtype calibration measures): seeds
    raydit.parallel.kernels.use_measured_rates. Returns head dim -> KernelChoice; {} without
    a GPU or a matching entry (kernels are then probed once in this process)."""
    import torch

    from raydit.parallel.kernels import use_measured_rates

    if not torch.cuda.is_available():
        return {}
    try:
        entries = load_calibration(path)
    except ValueError:
        return {}  # doctor reports an unreadable cache; the kernels are probed instead
    return {d: use_measured_rates("cuda", torch.bfloat16, d, rates)
            for d, rates in kernel_rates_for(entries, torch.cuda.get_device_name(0)).items()}


def describe_calibration(path=None) -> list[str]:
    """Lines for `raydit doctor`: one per cached device type, against the table."""
    from raydit.runtime.devices import table_device

    try:
        entries = load_calibration(path)
    except ValueError as exc:
        return [str(exc)]
    lines = []
    for name, e in sorted(entries.items()):
        m = e.get("measured", {})
        base = table_device(name)[0]
        parts = [f"matmul {m.get('matmul_tflops', float('nan')):.3g} TFLOP/s {m.get('matmul_dtype', '')} "
                 f"(table {base.tflops:g})"]
        if "dit_linear_tflops" in m:
            parts.append(f"DiT block linear part {m['dit_linear_tflops']:.3g} TFLOP/s, "
                         + "; ".join(describe_attention(m)))
        if "all_to_all_gb_s" in m:
            parts.append(f"all-to-all {m['all_to_all_gb_s']:.3g} GB/s (table {base.link_gb_s:g}), "
                         f"p2p {m.get('p2p_gb_s', float('nan')):.3g} GB/s, "
                         f"latency {m.get('latency_us', 0):.0f} us")
        if "memory_gb" in m:
            parts.append(f"memory {m['memory_gb']:.1f} GB")
        lines.append(f"{name}: " + "; ".join(parts) + f" [{e.get('host', '?')}, {e.get('when', '?')}]")
        problem = entry_problem(name, e)
        if problem:
            lines.append(f"{name}: {problem}")
        lines += [f"{name}: model {line}" for line in map(describe_model, (e.get("models") or {}).values())]
    return lines


def describe_model(m: dict) -> str:
    """One line of a model calibration: what ran, the step, and the rates the planner uses."""
    r = m.get("request") or {}
    att = m.get("attention") or {}
    return (f"{m.get('model', '?')} ({m.get('key', '?')}): step {m.get('step_seconds', float('nan')):.4g} s at "
            f"{r.get('frames')}x{r.get('height')}x{r.get('width')}, batch {r.get('batch')}, {m.get('dtype', '?')}; "
            f"linear part {m.get('linear_tflops', float('nan')):.4g} TFLOP/s, attention sdpa "
            f"{att.get('plain_tflops') or float('nan'):.4g} / {att.get('kernel', '?')} "
            f"{att.get('lse_tflops') or float('nan'):.4g} TFLOP/s at its shape")


__all__ = ["CalibrationWorker", "apply_entry", "entry_problem", "cache_path", "calibrate_cluster", "calibrate_type",
           "calibrated_device_type", "calibrated_device_types", "describe_attention", "describe_calibration",
           "kernel_rates_for", "load_calibration", "measure_compute", "measure_dit", "measure_links",
           "measure_matmul", "measure_model", "save_calibration", "seed_kernel_choices", "describe_model"]
