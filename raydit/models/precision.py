"""The low-precision rule: a parallel plan in bfloat16 adds no more error than bfloat16 itself.

Bit-for-bit equality with one process is a float32 promise only: in bfloat16 (8 bits of
mantissa, ~4e-3 of a value) sums taken in another order differ far more than any fixed
tolerance that also holds in float32, and a tolerance loose enough for bfloat16 would pass
real bugs. So the yardstick is float64: with e(x) = relative_error(x, float64 reference of
the same inputs),

    e(plan in bf16) <= BF16_ERROR_FACTOR * e(one process in bf16)

i.e. splitting the work may cost at most as much error again as bfloat16 costs already.
Used by the conformance suite (raydit.models.conformance) and by `raydit verify` on a GPU.
"""

from __future__ import annotations

import torch

BF16_ERROR_FACTOR = 2.0


def relative_error(actual, reference) -> float:
    """||actual - reference||_2 / ||reference||_2 over every element, computed in float64.

    Tensors or arrays of one shape. A reference of all zeros gives 0 for an exact match and
    inf otherwise (no division by zero).
    """
    a = torch.as_tensor(actual).to(torch.float64)
    r = torch.as_tensor(reference).to(torch.float64)
    if a.shape != r.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} against the reference's {tuple(r.shape)}")
    diff, norm = float(torch.linalg.vector_norm(a - r)), float(torch.linalg.vector_norm(r))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


def error_ratio(plan_error: float, one_process_error: float) -> float:
    """plan_error / one_process_error; 0 / 0 = 0 (both exact), x / 0 = inf."""
    if one_process_error == 0.0:
        return 0.0 if plan_error == 0.0 else float("inf")
    return plan_error / one_process_error


def within_bf16_rule(plan_error: float, one_process_error: float, factor: float = BF16_ERROR_FACTOR) -> bool:
    """The module's rule; NaN errors fail it."""
    return plan_error <= factor * one_process_error


class Float64Stays(torch.overrides.TorchFunctionMode):
    """A float64 run stays float64 inside diffusers' blocks.

    Wan's and SkyReels-V2's blocks (and others') take their norms and modulation as
    `hidden_states.float()` ... `.type_as(hidden_states)`: an upcast from bf16, and in a
    float64 run a round trip through float32. Rounding there turns the 1e-16 by which two
    plans' sums differ into whole float32 ulps (SkyReels-V2 DF in float64: 1.7e-7 after one
    step on 2 ranks, 4.5e-5 after seven). Inside this mode `.float()` of a float64 tensor
    returns it as it is (at least float32 was asked for), and the layers from_pretrained
    kept in float32 (`_keep_in_fp32_modules`: time embeddings, norms) run in float64, their
    float32 weights and inputs widened (exact: every float32 is a float64). Those float32
    GEMMs were the rest of the gap: their rounding depends on the thread count, so one
    process and a worker of another thread count differed there (2.6e-7 in SkyReels-V2's
    time embedding). The model code is untouched and every other call runs as written.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float and len(args) == 1 and not kwargs and args[0].dtype == torch.float64:
            return args[0]
        if func in _WIDENED:
            args = tuple(_wide(a) for a in args)
            kwargs = {k: _wide(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


_F = torch.nn.functional
_WIDENED = (_F.linear, _F.conv1d, _F.conv2d, _F.conv3d, _F.layer_norm, _F.group_norm, _F.rms_norm)


def _wide(value):
    return value.to(torch.float64) if isinstance(value, torch.Tensor) and value.dtype == torch.float32 else value


def run_precision(dtype: torch.dtype):
    """The context a run's transformer calls go in: Float64Stays for float64, else nothing."""
    import contextlib

    return Float64Stays() if dtype == torch.float64 else contextlib.nullcontext()
