"""The dense local attention kernels: each returns the log-sum-exp the ring merge needs.

Legend: B batch, H heads, Sq query tokens, Sk key tokens, D head dim.

Every LSE kernel computes, for scores s = scale * q k^T (no mask, no dropout),
    out = softmax(s) v            (B, H, Sq, D), dtype of q
    lse = logsumexp(s, over keys) (B, H, Sq), float32 (float64 for float64 inputs)
A kernel that returned anything else for lse (yunchang's torch path returns zeros; a kernel
may use log base 2, or pad the lse) would be silently wrong on a ring, so no kernel runs
before it passed a check against float64 math (raydit.parallel.kernels.choice).
Padding is never masked here: sp_attention drops pad keys before calling a kernel, so
flash-attn (which takes no arbitrary mask) and the others mean the same thing.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

KernelFn = Callable[[Tensor, Tensor, Tensor, float], "tuple[Tensor, Tensor]"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionKernel:
    """A named local attention kernel: (q_BHSD, k_BHSD, v_BHSD, scale) -> (out_BHSD, lse_BHS f32)."""

    name: str
    fn: KernelFn = field(repr=False, compare=False)

    def __call__(self, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
        if scale is None:
            scale = 1.0 / math.sqrt(q_BHSD.size(-1))
        B, H, Sq, D = q_BHSD.shape
        if Sq == 0 or k_BHSD.size(2) == 0:
            # Native kernels crash (SIGFPE on CPU) on empty inputs. No key: out 0, lse -inf.
            out = q_BHSD.new_zeros(B, H, Sq, v_BHSD.size(-1))
            return out, torch.full((B, H, Sq), -math.inf, dtype=lse_dtype(q_BHSD.dtype), device=q_BHSD.device)
        return self.fn(q_BHSD, k_BHSD, v_BHSD, float(scale))


# -- the kernels -----------------------------------------------------------------------------
def _exact(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    # Plain float64 math: the yardstick of the check and the tests, never fast.
    s_BHQK = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    lse_BHQ = torch.logsumexp(s_BHQK, dim=-1)
    return torch.matmul(torch.exp(s_BHQK - lse_BHQ.unsqueeze(-1)), v.double()), lse_BHQ


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype for inputs of `dtype`: float32, float64 for float64 (a float64
    run is float64 throughout; its ring merge too)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reference(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = _exact(q, k, v, scale)
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))


def _torch_cpu_flash(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    # aten op returns (out_BHSD, lse_BHS); lse is float32 for every input dtype (float64 for float64).
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    return out, lse.to(lse_dtype(q.dtype))


def _torch_flash(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    # FlashAttention-2 inside torch: (out, logsumexp_BHS f32, cum_q, cum_k, max_q, max_k, rng, unused, debug).
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=scale
    )
    return res[0], res[1].float()


def _torch_efficient(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    # Memory-efficient kernel (also float32); its lse is padded along S to a multiple of 32.
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, dropout_p=0.0, is_causal=False, scale=scale
    )
    return res[0], res[1][..., : q.size(2)].float()


def _torch_cudnn(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask)
    # -> (out, logsumexp, ...); torch 2.5+ gives the lse as (B, H, Sq, 1).
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    lse = res[1]
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return res[0], lse.float()


def _torch_cuda(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    # What the name 'torch-cuda' ran before the kernels were told apart: torch's flash kernel
    # in half precision, the efficient kernel otherwise. Kept for configs that name it.
    if q.dtype in HALF_DTYPES and q.size(-1) <= 256:
        return _torch_flash(q, k, v, scale)
    return _torch_efficient(q, k, v, scale)


def _flash_attn(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_func  # imported lazily: optional dependency

    # flash-attn works on (B, S, H, D); it returns (out_BSHD, softmax_lse_BHS f32, None).
    out_BSHD, lse_BHS, _ = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=0.0, softmax_scale=scale, causal=False, return_attn_probs=True,
    )
    return out_BSHD.transpose(1, 2), lse_BHS.float()


@functools.lru_cache(maxsize=None)
def _fa3_lse_flag() -> str | None:
    """The keyword that makes FlashAttention-3's flash_attn_func return the lse: releases
    since mid 2025 return `out` alone unless `return_attn_probs=True`; the first (beta)
    releases always returned (out, lse) and take no such flag."""
    from flash_attn_interface import flash_attn_func

    params = inspect.signature(flash_attn_func).parameters
    for flag in ("return_attn_probs", "return_softmax_lse", "return_lse"):
        if flag in params:
            return flag
    return None


def _fa3(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    from flash_attn_interface import flash_attn_func  # FlashAttention-3 (Hopper), optional

    flag = _fa3_lse_flag()
    res = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          causal=False, **({flag: True} if flag else {}))
    if not isinstance(res, (tuple, list)) or len(res) < 2:
        raise RuntimeError("flash_attn_interface.flash_attn_func returned no lse (unknown FlashAttention-3 API)")
    # (out_BSHD, softmax_lse_BHS f32, ...)
    return res[0].transpose(1, 2), res[1].float()

KERNELS: dict[str, KernelFn] = {
    "fa3": _fa3,
    "flash-attn": _flash_attn,
    "torch-cudnn": _torch_cudnn,
    "torch-flash": _torch_flash,
    "torch-efficient": _torch_efficient,
    "torch-cuda": _torch_cuda,
    "torch-cpu": _torch_cpu_flash,
    "reference": _reference,
}


@functools.lru_cache(maxsize=None)
def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _flash_attn_installed() -> bool:
    return _installed("flash_attn")

