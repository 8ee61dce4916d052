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
