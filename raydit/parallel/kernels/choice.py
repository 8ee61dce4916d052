"""Which local attention kernel runs, per (device, dtype, head dim, attention mode).

No kernel runs before it passed a check against float64 math on this (device, dtype, head
dim) (`check_kernel`): one that fails is dropped with one logged line and the next one is used.

Which kernel runs (`kernel_choice`), per (device, dtype, head dim): the fastest of the
kernels that passed the check, by measured rate. Rates come from `raydit doctor --calibrate`
(the runtime seeds them with `use_measured_rates`) or, without a calibration, from one
bounded probe per process (`measure_kernels` on a small fixed problem, a few iterations;
skipped where one kernel is left, as on a CPU). The rule itself is `choose_kernel`, pure.

Where no LSE is needed (ring degree 1), `plain_kernel` gives torch's
scaled_dot_product_attention, which picks its fastest backend itself (cuDNN on Hopper) and
may use kernels that cannot return the LSE.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from raydit.parallel.kernels import dense, lowbit
from raydit.parallel.kernels.dense import HALF_DTYPES, AttentionKernel, KernelFn, _exact, lse_dtype
from raydit.parallel.kernels.dense import _flash_attn_installed, _installed
from raydit.parallel.timing import _seconds

log = logging.getLogger(__name__)

# The head dims the video DiTs use (CogVideoX 64; Wan, HunyuanVideo 128): doctor and
# calibration report these; any other head dim is checked and chosen when first used.
HEAD_DIMS = (64, 128)
DEFAULT_HEAD_DIM = 128

# The probe a worker runs without a calibration: one (1, 2048 / D, PROBE_TOKENS, D) problem,
# PROBE_WARMUP + PROBE_ITERS calls per kernel (about 0.3 ms a call on a Hopper GPU at 400
# TFLOP/s, first-call setup such as cuDNN's graph build included: well under a second). A CPU
# has one candidate and is not probed; where it is (tests), 256 tokens keep it to ~0.1 s.
PROBE_TOKENS = 4096
CPU_PROBE_TOKENS = 256
PROBE_HIDDEN = 2048
PROBE_WARMUP = 2
PROBE_ITERS = 5


# The attention modes a request / Engine / CLI may name (`--attention`), listed once.
from raydit.planner.modes import ATTENTION_MODES, DEFAULT_ATTENTION_MODE  # noqa: E402


KERNELS: dict[str, KernelFn] = {**dense.KERNELS, **lowbit.KERNELS}


def check_mode(mode: str) -> str:
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode {mode!r} is unknown; choose one of {', '.join(ATTENTION_MODES)}")
    return mode


def candidate_kernels(device: torch.device | str, dtype: torch.dtype | None = None,
                      mode: str = DEFAULT_ATTENTION_MODE) -> list[str]:
    """The LSE kernels that may run on `device` for `dtype` (all dtypes: None) in attention
    `mode`, in the order preferred when no rate tells them apart. Installed is not working:
    each one still has to pass `check_kernel` (FlashAttention-3 needs a Hopper GPU, cuDNN's
    SDPA a recent cuDNN). 8-bit kernels: raydit.parallel.kernels.lowbit.candidates."""
    device = torch.device(device)
    if check_mode(mode) in lowbit.MODES:
        return lowbit.candidates(device, dtype, (mode,))
    half = dtype is None or dtype in HALF_DTYPES
    names: list[str] = []
    if device.type == "cuda":
        if half and _installed("flash_attn_interface"):
            names.append("fa3")
        if half and _flash_attn_installed():
            names.append("flash-attn")
        if half and torch.backends.cudnn.is_available():
            names.append("torch-cudnn")
        if half:
            names.append("torch-flash")
        if dtype is None or dtype in (*HALF_DTYPES, torch.float32):
            names.append("torch-efficient")
    elif device.type == "cpu":
        names.append("torch-cpu")
    if mode == "auto":  # the 8-bit kernels that can be fast here (emulations never are)
        names += [n for n in lowbit.candidates(device, dtype, lowbit.MODES) if not n.endswith("-torch")]
    return names


def available_kernels(device: torch.device | str) -> list[str]:
    """Kernel names that can run on `device` (any dtype), best first; 'reference' last."""
    names = candidate_kernels(device)
    if torch.device(device).type == "cuda":
        names.append("torch-cuda")
    return names + ["reference"]


# -- the float64 check ------------------------------------------------------------------------
# (out atol = rtol, lse atol = rtol) against float64 math on the same (rounded) inputs. Half
# precision: the kernels multiply softmax weights rounded to the dtype with v (bf16 keeps 8
# bits: ~0.4% a weight); the lse comes from float32 accumulators of exact products, so it is
# held 10x tighter than the output (a log-base-2 or zero lse is off by O(1)).
CHECK_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.bfloat16: (2e-2, 2e-3),
    torch.float16: (5e-3, 2e-3),
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-6, 1e-5),
}
# A small problem with Sq != Sk and neither a multiple of 32, 64 or 128 (tile edges, padded lse).
CHECK_SHAPE = (1, 2, 77, 133)

_lock = threading.RLock()
_verdicts: dict[tuple, str | None] = {}


def _device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}".rstrip(": ")


def _compare(dtype: torch.dtype, out: Tensor, lse: Tensor, ref_out: Tensor, ref_lse: Tensor) -> str | None:
    """Why (out, lse) is not the float64 result, or None."""
    if out.shape != ref_out.shape or out.dtype != dtype:
        return f"output {tuple(out.shape)} {out.dtype}, expected {tuple(ref_out.shape)} {dtype}"
    if lse.shape != ref_lse.shape or lse.dtype != lse_dtype(dtype):
        return f"lse {tuple(lse.shape)} {lse.dtype}, expected {tuple(ref_lse.shape)} {lse_dtype(dtype)}"
    out_tol, lse_tol = CHECK_TOLERANCE.get(dtype, (2e-2, 2e-3))
    d_out = (out.double().cpu() - ref_out).abs()
    d_lse = (lse.double().cpu() - ref_lse).abs()
    if not bool(torch.isfinite(d_out).all()) or bool((d_out > out_tol + out_tol * ref_out.abs()).any()):
        return f"output off by {d_out.max().item():.3g} (tolerance {out_tol:g})"
    if not bool(torch.isfinite(d_lse).all()) or bool((d_lse > lse_tol + lse_tol * ref_lse.abs()).any()):
        return f"lse off by {d_lse.max().item():.3g} (tolerance {lse_tol:g})"
    return None


def _check_inputs(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[Tensor, Tensor, Tensor, float]:
    B, H, Sq, Sk = CHECK_SHAPE
    g = torch.Generator().manual_seed(head_dim)
    # Drawn on the CPU so every device checks the same numbers; q scaled up a little so the
    # softmax is not flat (a flat one hides an lse or a scale applied twice).
    q = (torch.randn(B, H, Sq, head_dim, generator=g) * 2.0).to(device=device, dtype=dtype)
    k, v = (torch.randn(B, H, Sk, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    return q, k, v, 1.0 / math.sqrt(head_dim)


def check_kernel(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when kernel `name` matches float64 math on (device, dtype, head_dim) within
    CHECK_TOLERANCE (output and lse, on a CHECK_SHAPE problem); else why not. Decided once
    per process; a failure is logged once, as one line."""
    key = (name, _device_key(device), dtype, int(head_dim))
    with _lock:
        if key in _verdicts:
            return _verdicts[key]
        why: str | None
        try:
            if name in lowbit.KERNELS:  # held to the 8-bit mode's own tolerance, on keys with an offset
                q, k, v, scale = lowbit.check_inputs(torch.device(device), dtype, int(head_dim))
                out, lse = AttentionKernel(name, KERNELS[name])(q, k, v, scale)
                why = lowbit.compare(name, dtype, out, lse, *_exact(q.cpu(), k.cpu(), v.cpu(), scale))
            else:
                q, k, v, scale = _check_inputs(torch.device(device), dtype, int(head_dim))
                out, lse = AttentionKernel(name, KERNELS[name])(q, k, v, scale)
                why = _compare(dtype, out, lse, *_exact(q.cpu(), k.cpu(), v.cpu(), scale))
        except Exception as exc:  # unsupported dtype / head dim / GPU, missing symbol: all drop it
            why = _short(exc)
        if why is not None:
            log.warning("attention kernel %r dropped on %s %s head dim %d: %s",
                        name, key[1], str(dtype).removeprefix("torch."), head_dim, why)
        _verdicts[key] = why
        return why


# -- choosing -----------------------------------------------------------------------------------
def choose_kernel(rates: Mapping[str, float], verified: Sequence[str]) -> str:
    """The kernel to run, given measured rates (TFLOP/s, any kernel) and the kernels that
    passed the check, in preference order. The fastest verified kernel with a rate; a
    verified kernel without one ranks below every measured one; equal rates, or none at
    all, go to the earlier in `verified`. ValueError when nothing is verified."""
    if not verified:
        raise ValueError("no attention kernel passed the float64 check")

    def measured(name: str) -> float | None:
        r = rates.get(name)
        return float(r) if isinstance(r, (int, float)) and math.isfinite(r) and r > 0 else None

    order = {name: i for i, name in enumerate(verified)}
    return min(verified, key=lambda n: (measured(n) is None, -(measured(n) or 0.0), order[n]))


@dataclass(frozen=True)
class KernelChoice:
    """Which LSE kernel runs on (device, dtype, head_dim), and why.

    why: 'calibration' (rates from `raydit doctor --calibrate`), 'probe' (timed at start in
    this process), 'only candidate', 'preferred' (asked for by name) or 'fallback' (every
    candidate dropped: float64 reference math). rates: TFLOP/s of each timed kernel;
    dropped: kernel -> why the float64 check dropped it.
    """

    name: str
    device: str
    dtype: torch.dtype
    head_dim: int
    why: str
    rates: Mapping[str, float] = field(default_factory=dict)
    dropped: Mapping[str, str] = field(default_factory=dict)
    plain_rate: float | None = None  # TFLOP/s of torch's SDPA (the ring-1 kernel), where timed

    @property
    def kernel(self) -> AttentionKernel:
        return AttentionKernel(self.name, KERNELS[self.name])

    def describe(self) -> str:
        """'torch-cudnn (calibration: torch-cudnn 585, torch-flash 352 TFLOP/s; fa3 dropped: ...)'."""
        detail = []
        if self.rates:
            ranked = sorted(self.rates.items(), key=lambda kv: -kv[1])
            detail.append(f"{self.why}: " + ", ".join(f"{n} {r:.3g}" for n, r in ranked) + " TFLOP/s")
        else:
            detail.append(self.why)
        detail += [f"{n} dropped: {w}" for n, w in self.dropped.items()]
        return f"{self.name} ({'; '.join(detail)})"


def _split_verified(names: Sequence[str], device, dtype, head_dim) -> tuple[list[str], dict[str, str]]:
    verified, dropped = [], {}
    for name in names:
        why = check_kernel(name, device, dtype, head_dim)
        if why is None:
            verified.append(name)
        else:
            dropped[name] = why
    return verified, dropped


def time_kernels(names: Sequence[str], device: torch.device | str, dtype: torch.dtype, head_dim: int, *,
                 tokens: int = PROBE_TOKENS, heads: int | None = None, batch: int = 1,
                 warmup: int = PROBE_WARMUP, iters: int = PROBE_ITERS, plain: bool = False,
                 timer: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """TFLOP/s (4 B H S^2 D FLOP a call) of each named kernel on one (batch, heads, tokens,
    head_dim) problem laid out as a projection's output viewed as heads, (B, S, H, D) ->
    (B, H, S, D), the strides diffusers hands a kernel. A kernel that raises here is left out
    (and logged). plain: time torch's scaled_dot_product_attention too, as 'sdpa'. timer: the
    clock read around each call on a CPU (call_seconds; tests pass one that counts work)."""
    device = torch.device(device)
    B, H, S = batch, heads or max(1, PROBE_HIDDEN // head_dim), tokens
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, S, H, head_dim, device=device, dtype=dtype, generator=g).transpose(1, 2)
               for _ in range(3))
    flop = 4 * B * H * S * S * head_dim
    scale = 1.0 / math.sqrt(head_dim)
    fns: dict[str, Callable[[], object]] = {
        n: functools.partial(AttentionKernel(n, KERNELS[n]), q, k, v, scale) for n in names}
    if plain:
        fns["sdpa"] = functools.partial(F.scaled_dot_product_attention, q, k, v, scale=scale)
    rates = {}
    with torch.no_grad():
        for name, fn in fns.items():
            try:
                rates[name] = flop / _seconds(fn, device, warmup, iters, timer) / 1e12
            except Exception as exc:  # passed the small check, fails at this size: not a candidate here
                log.warning("attention kernel %r not timed on %s %s head dim %d: %s",
                            name, device, str(dtype).removeprefix("torch."), head_dim, _short(exc))
    return rates


def measure_kernels(device: torch.device | str, dtype: torch.dtype, head_dim: int, *,
                    names: Sequence[str] | None = None, **timing) -> KernelChoice:
    """Check every candidate LSE kernel for (device, dtype, head_dim) against float64, time
    those that pass (`time_kernels`, keyword arguments passed on: tokens, heads, batch,
    warmup, iters, plain, timer) and choose the fastest. What calibration and benchmarks call; the
    choice is not remembered (`use_measured_rates` does that), the check's verdicts are."""
    names = list(candidate_kernels(device, dtype) if names is None else names)
    verified, dropped = _split_verified(names, device, dtype, head_dim)
    rates = time_kernels(verified, device, dtype, head_dim, **timing)
    plain_rate = rates.pop("sdpa", None)
    timed = [n for n in verified if n in rates]
    if not timed:
        return _fallback(device, dtype, head_dim, dropped)
    return KernelChoice(choose_kernel(rates, timed), _device_key(device), dtype, int(head_dim), "measured",
                        rates, dropped, plain_rate)


def _fallback(device, dtype, head_dim, dropped) -> KernelChoice:
    log.warning("no attention kernel passed the float64 check on %s %s head dim %d; running float64 "
                "reference math (slow)", _device_key(device), str(dtype).removeprefix("torch."), head_dim)
    return KernelChoice("reference", _device_key(device), dtype, int(head_dim), "fallback", {}, dropped)


_choices: dict[tuple[str, torch.dtype, int, str], KernelChoice] = {}


def _default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def kernel_choice(device: torch.device | str, dtype: torch.dtype | None = None,
                  head_dim: int | None = None, mode: str = DEFAULT_ATTENTION_MODE, *,
                  timer: Callable[[], float] = time.perf_counter) -> KernelChoice:
    """The LSE kernel that runs on (device, dtype, head_dim) in attention `mode`, decided once
    per process: the candidates that pass the float64 check, then the fastest by the rates
    seeded from a calibration (`use_measured_rates`) or else by one bounded probe; no probe
    where one candidate is left. dtype None: bf16 on CUDA, float32 on a CPU; head_dim None:
    128. An 8-bit mode with no kernel that passed is a ValueError (never the slow fallback).
    timer: the probe's clock on a CPU (time_kernels)."""
    dtype = dtype or _default_dtype(device)
    head_dim = int(head_dim or DEFAULT_HEAD_DIM)
    key = (_device_key(device), dtype, head_dim, check_mode(mode))
    hit = _choices.get(key)
    if hit is not None:
        return hit
    with _lock:
        if key not in _choices:
            verified, dropped = _split_verified(candidate_kernels(device, dtype, mode), device, dtype, head_dim)
            if not verified and mode in lowbit.MODES:
                raise ValueError(lowbit.no_kernel_message(mode, key[0], dtype, head_dim, dropped))
            if not verified:
                choice = _fallback(device, dtype, head_dim, dropped)
            elif len(verified) == 1:
                choice = KernelChoice(verified[0], key[0], dtype, head_dim, "only candidate", {}, dropped)
            else:
                tokens = PROBE_TOKENS if torch.device(device).type == "cuda" else CPU_PROBE_TOKENS
                rates = time_kernels(verified, device, dtype, head_dim, tokens=tokens, timer=timer)
                choice = KernelChoice(choose_kernel(rates, verified), key[0], dtype, head_dim, "probe",
                                      rates, dropped)
            _choices[key] = choice
        return _choices[key]


def use_measured_rates(device: torch.device | str, dtype: torch.dtype, head_dim: int,
                       rates: Mapping[str, float], why: str = "calibration",
                       names: Sequence[str] | None = None) -> KernelChoice:
    """Decide (device, dtype, head_dim) by rates measured elsewhere (the calibration cache)
    instead of a probe; the kernels still pass the float64 check here first. A verified
    candidate the rates do not name ranks below the measured ones. names: the candidates
    (default candidate_kernels(device, dtype))."""
    names = candidate_kernels(device, dtype) if names is None else list(names)
    verified, dropped = _split_verified(names, device, dtype, head_dim)
    if not verified:
        choice = _fallback(device, dtype, head_dim, dropped)
    else:
        known = {n: float(r) for n, r in rates.items() if n in verified}
        choice = KernelChoice(choose_kernel(known, verified), _device_key(device), dtype, int(head_dim),
                              why, known, dropped)
    with _lock:
        _choices[(choice.device, dtype, int(head_dim), DEFAULT_ATTENTION_MODE)] = choice
    return choice


def forget_choices() -> None:
    """Drop every verdict and choice of this process (tests; after a driver update)."""
    with _lock:
        _verdicts.clear()
        _choices.clear()
        _plain.clear()


def select_kernel(device: torch.device | str, dtype: torch.dtype | None = None, prefer: str | None = None,
                  head_dim: int | None = None) -> AttentionKernel:
    """The kernel for (device, dtype, head_dim) (`kernel_choice`); `prefer` forces one by name,
    which must still pass the float64 check."""
    if prefer is None:
        return kernel_choice(device, dtype, head_dim).kernel
    names = available_kernels(device)
    if prefer not in KERNELS:
        raise ValueError(f"attention kernel {prefer!r} is unknown; choose one of {', '.join(KERNELS)}")
    if prefer not in names:
        raise ValueError(
            f"attention kernel {prefer!r} cannot run on {torch.device(device)}; available: {', '.join(names)}"
        )
    dtype = dtype or _default_dtype(device)
    usable = candidate_kernels(device, dtype) + lowbit.candidates(device, dtype, lowbit.MODES) + ["reference"]
    if torch.device(device).type == "cuda":
        usable.append("torch-cuda")
    if prefer not in usable:
        raise ValueError(f"attention kernel {prefer!r} does not run {str(dtype).removeprefix('torch.')} on "
                         f"{torch.device(device)}; use one of {', '.join(usable)}")
    if prefer != "reference":
        why = check_kernel(prefer, device, dtype, int(head_dim or DEFAULT_HEAD_DIM))
        if why is not None:
            raise ValueError(f"attention kernel {prefer!r} failed the float64 check on {torch.device(device)} "
                             f"{str(dtype).removeprefix('torch.')}: {why}; leave the kernel unset to use a working one")
    return AttentionKernel(prefer, KERNELS[prefer])


def default_kernel(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None,
                   mode: str = DEFAULT_ATTENTION_MODE) -> AttentionKernel:
    """The kernel sp_attention uses when given none: decided once per (device, dtype, head dim, mode)."""
    return kernel_choice(device, dtype, head_dim, mode).kernel


# -- without an lse ------------------------------------------------------------------------------
PlainFn = Callable[[Tensor, Tensor, Tensor, float], Tensor]
_plain: dict[tuple[str, torch.dtype, int], PlainFn | None] = {}


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def plain_kernel(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> PlainFn | None:
    """torch's scaled_dot_product_attention, (q_BHSD, k_BHSD, v_BHSD, scale) -> out_BHSD, for
    where no lse is needed; None when it fails the float64 check on (device, dtype, head_dim)
    (then the LSE kernel runs). SDPA picks its fastest backend itself, cuDNN on Hopper."""
    key = (_device_key(device), dtype, int(head_dim))
    if key in _plain:
        return _plain[key]
    with _lock:
        if key not in _plain:
            try:
                q, k, v, scale = _check_inputs(torch.device(device), dtype, int(head_dim))
                ref_out, ref_lse = _exact(q.cpu(), k.cpu(), v.cpu(), scale)
                # The output alone is checked: the reference's lse stands in for the missing one.
                why = _compare(dtype, _sdpa(q, k, v, scale), ref_lse.to(lse_dtype(dtype)), ref_out, ref_lse)
            except Exception as exc:
                why = _short(exc)
            if why is not None:
                log.warning("torch scaled_dot_product_attention dropped on %s %s head dim %d: %s; the LSE "
                            "kernel runs instead", key[0], str(dtype).removeprefix("torch."), head_dim, why)
            _plain[key] = None if why else _sdpa
        return _plain[key]
