"""Local attention kernels that return the log-sum-exp the ring merge needs.

Legend: B batch, H heads, Sq query tokens, Sk key tokens, D head dim.

Every kernel computes, for scores s = scale * q k^T (no mask, no dropout),
    out = softmax(s) v            (B, H, Sq, D), dtype of q
    lse = logsumexp(s, over keys) (B, H, Sq), float32
A kernel that returned anything else for lse (yunchang's torch path returns zeros) would be
silently wrong on a ring, so tests check every kernel's lse against float64 math.
Padding is never masked here: sp_attention drops pad keys before calling a kernel, so
flash-attn (which takes no arbitrary mask) and the others mean the same thing.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass, field
from typing import Callable

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
            return out, torch.full((B, H, Sq), -math.inf, dtype=torch.float32, device=q_BHSD.device)
        return self.fn(q_BHSD, k_BHSD, v_BHSD, float(scale))


def _reference(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    # Plain float64 math: the yardstick for tests, never fast.
    s_BHQK = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    lse_BHQ = torch.logsumexp(s_BHQK, dim=-1)
    out = torch.matmul(torch.exp(s_BHQK - lse_BHQ.unsqueeze(-1)), v.double())
    return out.to(q.dtype), lse_BHQ.float()


def _torch_cpu_flash(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    # aten op returns (out_BHSD, lse_BHS); lse is float32 for every input dtype (float64 for float64).
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    return out, lse.float()


def _torch_cuda(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    if q.dtype in HALF_DTYPES and q.size(-1) <= 256:
        # (out, logsumexp_BHS f32, cum_q, cum_k, max_q, max_k, seed, offset, debug_mask)
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=scale
        )
        return res[0], res[1].float()
    # Memory-efficient kernel handles float32; its lse is padded along S to a multiple of 32.
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, dropout_p=0.0, is_causal=False, scale=scale
    )
    return res[0], res[1][..., : q.size(2)].float()


def _flash_attn(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_func  # imported lazily: optional dependency

    # flash-attn works on (B, S, H, D); it returns (out_BSHD, softmax_lse_BHS f32, None).
    out_BSHD, lse_BHS, _ = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=0.0, softmax_scale=scale, causal=False, return_attn_probs=True,
    )
    return out_BSHD.transpose(1, 2), lse_BHS.float()


KERNELS: dict[str, KernelFn] = {
    "flash-attn": _flash_attn,
    "torch-cuda": _torch_cuda,
    "torch-cpu": _torch_cpu_flash,
    "reference": _reference,
}


@functools.lru_cache(maxsize=None)
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def available_kernels(device: torch.device | str) -> list[str]:
    """Kernel names that can run on `device`, best first."""
    device = torch.device(device)
    names: list[str] = []
    if device.type == "cuda":
        if _flash_attn_installed():
            names.append("flash-attn")
        names.append("torch-cuda")
    elif device.type == "cpu":
        names.append("torch-cpu")
    names.append("reference")
    return names


def select_kernel(device: torch.device | str, dtype: torch.dtype | None = None, prefer: str | None = None) -> AttentionKernel:
    """Decide once which kernel runs on `device` for `dtype`; `prefer` forces one by name."""
    names = available_kernels(device)
    if prefer is not None:
        if prefer not in KERNELS:
            raise ValueError(f"attention kernel {prefer!r} is unknown; choose one of {', '.join(KERNELS)}")
        if prefer not in names:
            raise ValueError(
                f"attention kernel {prefer!r} cannot run on {torch.device(device)}; available: {', '.join(names)}"
            )
        if prefer == "flash-attn" and dtype is not None and dtype not in HALF_DTYPES:
            raise ValueError(f"attention kernel 'flash-attn' needs float16 or bfloat16, not {dtype}; use 'torch-cuda'")
        return AttentionKernel(prefer, KERNELS[prefer])
    for name in names:
        if name == "flash-attn" and dtype is not None and dtype not in HALF_DTYPES:
            continue  # flash-attn has no float32 path
        return AttentionKernel(name, KERNELS[name])
    raise AssertionError("unreachable: 'reference' is always available")


@functools.lru_cache(maxsize=None)
def default_kernel(device_type: str, dtype: torch.dtype) -> AttentionKernel:
    """The kernel sp_attention uses when given none: decided once per (device type, dtype)."""
    return select_kernel(device_type, dtype)


def describe_kernels() -> dict:
    """What is available and what would run (for `raydit doctor`)."""
    cuda = torch.cuda.is_available()
    info: dict = {
        "torch": torch.__version__,
        "cuda_available": cuda,
        "flash_attn_installed": _flash_attn_installed(),
        "cpu": {"available": available_kernels("cpu"), "selected": select_kernel("cpu").name},
    }
    if cuda:
        info["cuda"] = {
            "available": available_kernels("cuda"),
            "selected_bf16": select_kernel("cuda", torch.bfloat16).name,
            "selected_fp32": select_kernel("cuda", torch.float32).name,
        }
    return info
