"""8-bit attention that returns the log-sum-exp the ring merges: INT8 or FP8 QK^T.

Legend: B batch, H heads, Sq query tokens, Sk key tokens, D head dim. The Triton kernel
works on tiles of QUERY_BLOCK queries x KEY_BLOCK keys.

The scheme (SageAttention's idea, written here for raydit's kernels and ring):
    q8 = round(q * c / sq),  sq = max|q * c| / QMAX over the D values of each token
         (c = scale * log2(e): scores come out in base 2, the kernel uses exp2)
    k  - mean_k: the key mean over tokens is taken out before quantizing ("smoothing"):
         keys of a DiT share a large common offset, which would otherwise eat the 8 bits;
    k8 = round((k - mean_k) / sk), sk per token likewise
    s2 = (q8 . k8) * sq * sk                 the base-2 scores of q against k - mean_k
    out = softmax(s2) v                      (softmax is invariant to the per-row constant)
    lse = ln 2 * logsumexp2(s2) + scale * q . mean_k
The last term puts back what smoothing took out of every score of a query row, so the lse is
that of the true scores and partial results over different key blocks (a ring's) merge.
INT8: QMAX 127, the PV product in the run's dtype (as FlashAttention does). FP8 (e4m3):
QMAX 448 for q and k; P (in [0, 1]) is multiplied by 448 and rounded to e4m3, V is quantized
per channel over all its tokens (sv = max|v| / 448), and the PV product runs in FP8 too:
    out = (P8 . v8) * sv / (448 * l),  l = sum of the unrounded P.

Two implementations of each mode compute the same thing up to accumulation order:
- `*_torch`: plain torch, any device, query rows in chunks (memory bounded): the reference
  of the Triton kernels and what a CPU runs (numerics only, no speed);
- `*_triton`: one Triton kernel, CUDA (online softmax over key blocks, Hopper/Ada MMA).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
QUERY_BLOCK = 128
KEY_BLOCK = 64
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
from raydit.planner.modes import EIGHT_BIT_ATTENTION_MODES as MODES  # noqa: E402
_TINY = 1e-12  # an all-zero block gets scale _TINY / QMAX, its values stay 0


# -- quantization (pure torch) ---------------------------------------------------------------
def quantize(x_BHSD: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """x (float32) -> (x8, scales (B, H, S) float32), one scale per token (max |x| / QMAX over
    its D values): int8 (round to nearest, +-127) or e4m3."""
    qmax = INT8_MAX if mode == "int8" else FP8_MAX
    scales = x_BHSD.abs().amax(-1).float().clamp_min(_TINY) / qmax
    y = x_BHSD / scales.unsqueeze(-1)
    if mode == "int8":
        return torch.round(y).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales
    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def prepare(q: Tensor, k: Tensor, v: Tensor, scale: float, mode: str) -> dict:
    """What both implementations take: quantized q, k (and v in FP8), their scales and the
    lse correction scale * q . mean_k (B, H, Sq) float32."""
    if mode not in MODES:
        raise ValueError(f"8-bit attention mode {mode!r} is unknown; choose one of {', '.join(MODES)}")
    mean_k = k.float().mean(dim=2, keepdim=True)  # (B, H, 1, D)
    q8, sq = quantize(q.float() * (scale * LOG2E), mode)
    k8, sk = quantize(k.float() - mean_k, mode)
    correction = torch.matmul(q.float(), mean_k.transpose(-1, -2)).squeeze(-1) * scale  # (B, H, Sq)
    prepared = {"q8": q8, "sq": sq, "k8": k8, "sk": sk, "correction": correction}
    if mode == "fp8":
        sv = v.abs().amax(dim=2, keepdim=True).float().clamp_min(_TINY) / FP8_MAX  # (B, H, 1, D)
        prepared["v8"] = (v.float() / sv).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        prepared["sv"] = sv
    return prepared


# -- the torch implementation ------------------------------------------------------------------
def attention_torch(q: Tensor, k: Tensor, v: Tensor, scale: float, mode: str,
                    query_chunk: int = 1024) -> tuple[Tensor, Tensor]:
    """(out (B, H, Sq, D) in q's dtype, lse (B, H, Sq) float32) of the 8-bit scheme above."""
    p = prepare(q, k, v, scale, mode)
    Sq, Sk = q.size(2), k.size(2)
    k_scaled = p["k8"].float() * p["sk"].unsqueeze(-1)  # (B, H, Sk, D): k8 * sk
    q_scale = p["sq"].unsqueeze(-1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    pv_dtype = v.dtype if v.dtype in (torch.float16, torch.bfloat16) else torch.float32
    for start in range(0, Sq, query_chunk):
        rows = slice(start, min(start + query_chunk, Sq))
        # Integer products are exact in float32 (|sum| <= D * 127^2 < 2^24 for D <= 1024).
        s2 = torch.matmul(p["q8"][:, :, rows].float(), k_scaled.transpose(-1, -2)) * q_scale[:, :, rows]
        m = s2.amax(-1, keepdim=True)
        w = torch.exp2(s2 - m)  # (B, H, rows, Sk), in [0, 1]
        total = w.sum(-1, keepdim=True)
        if mode == "int8":
            acc = torch.matmul(w.to(pv_dtype).float(), v.to(pv_dtype).float())
        else:
            w8 = (w * FP8_MAX).to(torch.float8_e4m3fn).float()
            acc = torch.matmul(w8, p["v8"].float()) * (p["sv"] / FP8_MAX)
        out[:, :, rows] = (acc / total).to(q.dtype)
        lse[:, :, rows] = (m + torch.log2(total)).squeeze(-1) * LN2 + p["correction"][:, :, rows]
    return out, lse


def int8_torch(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return attention_torch(q, k, v, scale, "int8")


def fp8_torch(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return attention_torch(q, k, v, scale, "fp8")


# -- the Triton implementation -----------------------------------------------------------------
QUANT_ROWS = 32


def _triton_kernels():
    """(attention kernel, quantization kernel) of raydit.parallel.kernels.lowbit_triton, imported on
    first use (Triton is imported only there)."""
    from raydit.parallel.kernels import lowbit_triton

    return lowbit_triton.attn_8bit, lowbit_triton.quant


TRITON_HEAD_DIMS = (64, 128)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def attention_triton(q: Tensor, k: Tensor, v: Tensor, scale: float, mode: str) -> tuple[Tensor, Tensor]:
    """The Triton kernel of `mode`: (out (B, H, Sq, D) in q's dtype, lse (B, H, Sq) float32)."""
    B, H, Sq, D = q.shape
    Sk = k.size(2)
    if D not in TRITON_HEAD_DIMS:
        raise ValueError(f"the 8-bit Triton kernel runs head dims {TRITON_HEAD_DIMS}, not {D}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the 8-bit Triton kernel takes bf16 or fp16, not {q.dtype}")
    attn, _ = _triton_kernels()
    p = prepare_triton(q, k, v, scale, mode)
    fp8 = mode == "fp8"
    vs = p["sv"] if fp8 else p["sq"]  # an unused pointer for INT8
    out = torch.empty(B, H, Sq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    args = (p["q8"], p["k8"], p["v"], p["sq"], p["sk"], vs, out, lse, p["correction"], Sq, Sk)
    if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's CPU interpreter cannot autotune: one tile
        from raydit.parallel.kernels.lowbit_triton import TILES

        m, n, _, _ = TILES[0]
        attn.fn[(triton_cdiv(Sq, m), B * H)](*args, D=D, FP8=fp8, BLOCK_M=m, BLOCK_N=n)
    else:
        attn[lambda meta: (triton_cdiv(Sq, meta["BLOCK_M"]), B * H)](*args, D=D, FP8=fp8)
    return out, lse


def _quantize_triton(x: Tensor, mode: str, pre_scale: float, mean: Tensor | None = None,
                     dot: Tensor | None = None, corr_scale: float = 0.0) -> tuple[Tensor, Tensor, Tensor | None]:
    """Triton's `quantize`, x read once in its own strides: (x8, scales (B, H, S), and with
    `dot` (B, H, D) the lse term corr_scale * x . dot (B, H, S))."""
    _, kernel = _triton_kernels()
    B, H, S, D = x.shape
    fp8 = mode == "fp8"
    y = torch.empty(B, H, S, D, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x.device)
    scales = torch.empty(B, H, S, dtype=torch.float32, device=x.device)
    corr = torch.empty(B, H, S, dtype=torch.float32, device=x.device) if dot is not None else None
    kernel[(triton_cdiv(S, QUANT_ROWS), B * H)](
        x, y, scales, mean if mean is not None else scales, dot if dot is not None else scales,
        corr if corr is not None else scales, S, H, *x.stride(), float(pre_scale), float(corr_scale),
        QMAX=FP8_MAX if fp8 else INT8_MAX, FP8=fp8, HAS_MEAN=mean is not None, HAS_CORR=dot is not None,
        ROWS=QUANT_ROWS, D=D)
    return y, scales, corr


def prepare_triton(q: Tensor, k: Tensor, v: Tensor, scale: float, mode: str) -> dict:
    """`prepare`'s values from Triton kernels that read q and k once each (V of FP8 in torch),
    laid out for the attention kernel: contiguous (B, H, S, D); FP8's V transposed (B, H, D, Sk)."""
    mean_k = k.mean(dim=2, dtype=torch.float32).contiguous()  # (B, H, D)
    q8, sq, corr = _quantize_triton(q, mode, scale * LOG2E, dot=mean_k, corr_scale=scale)
    k8, sk, _ = _quantize_triton(k, mode, 1.0, mean=mean_k)
    p = {"q8": q8, "sq": sq, "k8": k8, "sk": sk, "correction": corr, "v": v.contiguous()}
    if mode == "fp8":
        sv = v.abs().amax(dim=2).float().clamp_min(_TINY) / FP8_MAX  # (B, H, D)
        p["v"] = (v.float() / sv.unsqueeze(2)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).transpose(-1, -2).contiguous()
        p["sv"] = sv.contiguous()
    return p


def int8_triton(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return attention_triton(q, k, v, scale, "int8")


def fp8_triton(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return attention_triton(q, k, v, scale, "fp8")


def fp8_capable(device: torch.device | str) -> bool:
    """FP8 tensor cores: NVIDIA compute capability 8.9 (Ada) and newer."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def relative_l2(x: Tensor, ref: Tensor) -> float:
    """||x - ref|| / ||ref||, in float64."""
    ref = ref.double()
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-300))


__all__ = ["MODES", "attention_torch", "attention_triton", "fp8_capable", "int8_torch", "fp8_torch",
           "int8_triton", "fp8_triton", "prepare", "quantize", "relative_l2", "QUERY_BLOCK", "KEY_BLOCK",
           "TRITON_HEAD_DIMS"]


# -- registration with raydit.parallel.kernels ---------------------------------------------------
KERNELS = {"int8-triton": int8_triton, "fp8-triton": fp8_triton, "int8-torch": int8_torch, "fp8-torch": fp8_torch}
KERNEL_MODE = {name: name.split("-")[0] for name in KERNELS}


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def candidates(device: torch.device | str, dtype: torch.dtype | None, modes) -> list[str]:
    """The 8-bit kernels of `modes` that may run on `device`: the Triton kernels on a CUDA GPU
    (FP8 from compute capability 8.9) for bf16 / fp16; the torch ones anywhere else (a CPU:
    the numerics of the mode, for verification; no speed)."""
    device = torch.device(device)
    names = []
    for mode in modes:
        if device.type == "cuda":
            half = dtype is None or dtype in (torch.float16, torch.bfloat16)
            if half and _triton_installed() and (mode == "int8" or fp8_capable(device)):
                names.append(f"{mode}-triton")
        else:
            names.append(f"{mode}-torch")
    return names


# The float64 check of an 8-bit kernel (raydit.parallel.kernels.check_kernel): its own inputs,
# with a common offset on the keys as DiT keys have (smoothing must take it out, and the lse
# must put it back: a kernel that forgot either fails), and its own tolerance: the relative
# L2 error of the output and the largest lse error. Measured on these inputs with the torch
# kernels (float32 and bf16, head dims 64 and 128): INT8 0.013-0.016 / 0.015-0.045, FP8
# 0.063-0.074 / 0.10-0.20; bf16's own 0.002 / 0.001. The bounds are about twice those, and
# far below what a wrong scale, base or missing lse term gives (O(1)).
CHECK_TOLERANCE = {"int8": (0.04, 0.12), "fp8": (0.15, 0.45)}
KEY_OFFSET = 0.5


def check_inputs(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[Tensor, Tensor, Tensor, float]:
    g = torch.Generator().manual_seed(head_dim)
    q = (torch.randn(1, 2, 77, head_dim, generator=g) * 2.0).to(device=device, dtype=dtype)
    k = (torch.randn(1, 2, 133, head_dim, generator=g) + KEY_OFFSET).to(device=device, dtype=dtype)
    v = torch.randn(1, 2, 133, head_dim, generator=g).to(device=device, dtype=dtype)
    return q, k, v, head_dim ** -0.5


def compare(name: str, dtype: torch.dtype, out: Tensor, lse: Tensor, ref_out: Tensor, ref_lse: Tensor) -> str | None:
    """Why kernel `name`'s (out, lse) is not the float64 result within its mode's tolerance, or None."""
    if out.shape != ref_out.shape or out.dtype != dtype:
        return f"output {tuple(out.shape)} {out.dtype}, expected {tuple(ref_out.shape)} {dtype}"
    if lse.shape != ref_lse.shape or lse.dtype != torch.float32:
        return f"lse {tuple(lse.shape)} {lse.dtype}, expected {tuple(ref_lse.shape)} float32"
    out_tol, lse_tol = CHECK_TOLERANCE[KERNEL_MODE[name]]
    if not bool(torch.isfinite(out).all()) or not bool(torch.isfinite(lse).all()):
        return "non-finite output or lse"
    err = relative_l2(out.cpu(), ref_out)
    if err > out_tol:
        return f"output relative L2 error {err:.3g} (tolerance {out_tol:g})"
    d_lse = float((lse.double().cpu() - ref_lse).abs().max())
    if d_lse > lse_tol:
        return f"lse off by {d_lse:.3g} (tolerance {lse_tol:g})"
    return None


def no_kernel_message(mode: str, device: str, dtype: torch.dtype, head_dim: int, dropped: dict) -> str:
    why = "; ".join(f"{n}: {w}" for n, w in dropped.items()) or "no 8-bit kernel runs there"
    need = " (the Triton kernels take bf16 / fp16, head dims 64 and 128; FP8 needs compute capability 8.9+)"
    return (f"attention mode {mode!r} has no working kernel on {device} {str(dtype).removeprefix('torch.')} "
            f"head dim {head_dim}{need}: {why}; use --attention bf16")
