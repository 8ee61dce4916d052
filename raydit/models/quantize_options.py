"""The run's precision options, `quantize` and `attention`: what a run may ask for, checked
where the run is made (the Engine, `raydit generate`, `raydit serve`, the Runner) without
importing torch or the quantization itself (raydit.models.quantize).

quantize:
- None / "none": every layer in the run's dtype (the default);
- "fp8": the transformer blocks' linear layers as FP8 (e4m3) GEMMs with dynamic activation
  scales, through torchao, on NVIDIA GPUs of compute capability 8.9 or newer;
- "fp8-sim": the same numbers emulated in float math on any device (numerics only, no speed):
  weights and activations rounded to FP8 with the "fp8" mode's scales, then dequantized and
  multiplied in the run's dtype. CPU tests check the wiring with it.

attention: the local attention kernel's mode. Both lists: raydit.planner.modes.

full_precision_steps: N >= 0; the first N and the last N steps of every request run without
the quantized modes (the FP8 linears on their unquantized weights, kept for it; attention on
the run dtype's kernels), the rest as asked. 0 (the default): every step as asked.
"""

from __future__ import annotations

from raydit.planner.modes import ATTENTION_MODES, DEFAULT_ATTENTION_MODE, QUANTIZE_MODES

# FP8 tensor-core GEMMs (torch._scaled_mm): Ada (8.9), Hopper (9.0) and later.
FP8_MIN_CAPABILITY = (8, 9)


def check_quantize(mode) -> str | None:
    """The quantize mode a run asked for -> None (no quantization), "fp8" or "fp8-sim";
    ValueError (one line listing the modes) for anything else."""
    if mode is None or mode == "none":
        return None
    if not isinstance(mode, str) or mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize {mode!r} is not a mode; use one of: {', '.join(QUANTIZE_MODES)} "
                         "(fp8-sim: FP8 numerics emulated on any device, no speed)")
    return mode


def check_quantize_device(mode: str | None, device: str, capability: tuple[int, int] | None = None,
                          name: str | None = None) -> None:
    """Refuse (one line naming the device and what works there) "fp8" where FP8 GEMMs do not
    run: a CPU, or a GPU before compute capability 8.9. `device`: "cpu" or "cuda";
    `capability` / `name`: the GPU's (torch.cuda.get_device_capability / _name), when known."""
    if mode != "fp8":
        return
    works = "use quantize fp8-sim to check FP8 numerics (no speed), or no quantize"
    if device != "cuda":
        raise ValueError(f"quantize 'fp8' runs FP8 GEMMs on NVIDIA GPUs of compute capability "
                         f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer, not on {device}; there {works}")
    if capability is not None and tuple(capability) < FP8_MIN_CAPABILITY:
        raise ValueError(f"quantize 'fp8' needs compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                         f"or newer (Ada, Hopper, Blackwell); {name or 'this GPU'} has {capability[0]}.{capability[1]}: "
                         f"on it {works}")


def quantize_lora_refusal(mode: str | None, switching: list[str]) -> str | None:
    """The one-line refusal of per-request LoRA switching under a quantize mode (None: fine).
    `switching`: what asks for it (e.g. "--lora without --fuse-lora"). A fused LoRA is plain
    weights, quantized with them; a switched one would add its unquantized product to FP8
    layers, which no peer's FP8 path defines, so it is refused rather than approximated."""
    if mode is None or not switching:
        return None
    return (f"quantize {mode!r} cannot switch LoRA adapters per request, but {' and '.join(switching)} asks for it; "
            "fuse the one LoRA into the weights (fuse_lora / --fuse-lora: it is quantized with them) or drop quantize")


def check_attention(mode) -> str:
    """The attention mode a run asked for (None: the default) -> one of
    raydit.planner.modes.ATTENTION_MODES; ValueError (one line listing them) otherwise."""
    if mode is None:
        return DEFAULT_ATTENTION_MODE
    if not isinstance(mode, str) or mode not in ATTENTION_MODES:
        raise ValueError(f"attention {mode!r} is not a mode; use one of: {', '.join(ATTENTION_MODES)} "
                         f"(default {DEFAULT_ATTENTION_MODE})")
    return mode


def check_full_precision_steps(steps, quantize: str | None, attention: str | None,
                               shard_weights: bool | None = False) -> int:
    """full_precision_steps (None: 0) -> an int >= 0; ValueError (one line) where it is not one,
    where no quantized mode runs (nothing to run in full precision), or with quantize and
    sharded weights (the unquantized weights it keeps would be the whole model on every rank)."""
    if steps is None:
        return 0
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"full_precision_steps {steps!r} must be a whole number >= 0 (the first and last N steps "
                         "of a request run without the quantized modes)")
    if steps and check_quantize(quantize) is None and check_attention(attention) == DEFAULT_ATTENTION_MODE:
        raise ValueError(f"full_precision_steps {steps} needs a quantized mode to leave (quantize fp8 / fp8-sim, or "
                         "attention auto / int8 / fp8); every step already runs in full precision: drop it")
    if steps and check_quantize(quantize) is not None and shard_weights:
        raise ValueError(f"full_precision_steps {steps} keeps every FP8 linear's unquantized weight on its rank, "
                         "which sharded weights do not hold; drop full_precision_steps or shard_weights")
    return steps


def check_precision_options(opts: dict) -> None:
    """`raydit generate` / `raydit serve`'s --quantize and --attention (resolved options),
    before Ray starts: the modes, fp8 on an explicit --device cpu, per-request LoRAs under
    quantize. A GPU without FP8 is refused when its ranks start (they know their device)."""
    quantize = check_quantize(opts.get("quantize"))
    check_attention(opts.get("attention"))
    check_full_precision_steps(opts.get("full_precision_steps"), quantize, opts.get("attention"),
                               opts.get("shard_weights"))
    if opts.get("device") == "cpu":
        check_quantize_device(quantize, "cpu")
    switching = [flag for flag, on in (("--lora without --fuse-lora", opts.get("lora_table") and not opts.get("fuse_lora")),
                                       ("--lora-dir", opts.get("lora_dir") is not None)) if on]
    refusal = quantize_lora_refusal(quantize, switching)
    if refusal:
        raise ValueError(refusal)


def block_linear_params(spec, square: float, ffn: float) -> float:
    """Weight elements of `spec.layers` blocks whose linear layers hold `square` h^2 + `ffn` h f
    each (h: spec.hidden, f: spec.ffn_hidden): a family's Family.fp8_weight_params where its
    blocks are all alike (the linears quantize "fp8" selects)."""
    h, f = spec.hidden, spec.ffn_hidden
    return float(spec.layers * (square * h * h + ffn * h * f))
