"""Measure one device: what a calibration times, inside a Ray actor (raydit.runtime.calibrate)
or in-process (benchmarks). Every figure is a median of timed runs after a warm-up.

What a calibration measures (seconds in all):
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
"""

from __future__ import annotations

import statistics
import time

CPU_SIZES = (256, 384, 512)
CUDA_SIZES = (2048, 4096, 8192)
CPU_LINK_BYTES = 4 * 2**20
CUDA_LINK_BYTES = 64 * 2**20
REPEATS = 5


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed_steps(runner, state, steps: int, device: str):
    """Run `steps` denoising steps of `state` through `runner`, each timed on its own and
    synchronised on a GPU (`device` "cuda" or "cpu"): (the last state, seconds per step)."""
    seconds = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        state = runner.step(state)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    return state, seconds


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

    from raydit.models.requests import GenerationRequest, checker_image, image_to_png
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
        state, seconds = timed_steps(runner, runner.prepare(request), steps, device)
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


__all__ = ["ATTENTION_HEAD_DIMS", "CPU_DIT_BLOCK", "CPU_LINK_BYTES", "CPU_SIZES", "CUDA_ATTENTION_TOKENS",
           "CUDA_DIT_BLOCK", "CUDA_LINK_BYTES", "CUDA_SIZES", "MODEL_GUIDANCE", "MODEL_PROMPT", "MODEL_STEPS",
           "REPEATS", "measure_compute", "measure_dit", "measure_links", "measure_matmul", "measure_model"]
