"""The Triton kernels of raydit.parallel.kernels.lowbit (CUDA; imported only when one runs).

Legend: B batch, H heads, S / Sq / Sk tokens, D head dim; tensors (B, H, S, D) contiguous but
where strides are passed. lowbit's module doc gives the scheme these compute.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Tiles tried once per (head dim, mode) by Triton's autotuner on the first call of a process:
# BLOCK_M, BLOCK_N, warps, stages.
TILES = ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3))


@triton.jit
def quant(X, Y, Scale, Mean, Dot, Corr, S, H, sb, sh, ss, sd, pre_scale, corr_scale,
          QMAX: tl.constexpr, FP8: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_CORR: tl.constexpr,
          ROWS: tl.constexpr, D: tl.constexpr):
    # One program: ROWS tokens of one (b, h) of x (B, H, S, D), any strides, read once:
    # corr = corr_scale * x . dot (the lse term), then x8 = q((x - mean) * pre_scale) per token.
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, D)
    live = rows < S
    x = tl.load(X + b.to(tl.int64) * sb + h.to(tl.int64) * sh + rows[:, None].to(tl.int64) * ss + dims[None, :] * sd,
                mask=live[:, None], other=0.0).to(tl.float32)
    out = bh.to(tl.int64) * S
    if HAS_CORR:
        vec = tl.load(Dot + bh * D + dims)
        tl.store(Corr + out + rows, tl.sum(x * vec[None, :], 1) * corr_scale, mask=live)
    if HAS_MEAN:
        x = x - tl.load(Mean + bh * D + dims)[None, :]
    x = x * pre_scale
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / QMAX
    y = x / scale[:, None]
    if FP8:
        y8 = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(Y.dtype.element_ty)
    else:  # round half away from zero (torch.round: half to even; ties have measure zero)
        y8 = tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int8)
    tl.store(Y + out * D + rows[:, None] * D + dims[None, :], y8, mask=live[:, None])
    tl.store(Scale + out + rows, scale, mask=live)

@triton.jit
def _tile(q, q_scale, m_i, l_i, acc, K8, V, KS, k_base, ks_base, start, Sk, cols, dims,
          BLOCK_N: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr, MASK: tl.constexpr):
    # One tile of BLOCK_N keys; MASK only on the last, partial one. Base-2 scores
    # s_ij = (q8_i . k8_j) sq_i sk_j: the row max is taken on t_ij = (q8_i . k8_j) sk_j and
    # scaled by sq_i > 0 after, so each score costs one fused multiply-add before exp2.
    keys = start + cols
    if MASK:
        live = keys < Sk
        kt = tl.load(K8 + k_base + keys[None, :] * D + dims[:, None], mask=live[None, :], other=0.0 if FP8 else 0)
        k_scale = tl.load(KS + ks_base + keys, mask=live, other=0.0)
    else:
        kt = tl.load(K8 + k_base + keys[None, :] * D + dims[:, None])  # (D, N)
        k_scale = tl.load(KS + ks_base + keys)
    if FP8:
        t = tl.dot(q, kt) * k_scale[None, :]
    else:
        t = tl.dot(q, kt, out_dtype=tl.int32).to(tl.float32) * k_scale[None, :]
    if MASK:
        t = tl.where(live[None, :], t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(t, 1) * q_scale)
    alpha = tl.math.exp2(m_i - m_new)
    w = tl.math.exp2(t * q_scale[:, None] - m_new[:, None])
    l_i = l_i * alpha + tl.sum(w, 1)
    acc = acc * alpha[:, None]
    if FP8:  # V comes transposed, (B, H, D, Sk): FP8 MMAs take both operands K-major
        if MASK:
            vt = tl.load(V + k_base + dims[:, None] * Sk + keys[None, :], mask=live[None, :], other=0.0)
        else:
            vt = tl.load(V + k_base + dims[:, None] * Sk + keys[None, :])  # (D, N)
        acc += tl.dot((w * 448.0).to(vt.dtype), tl.trans(vt))
    else:
        if MASK:
            v = tl.load(V + k_base + keys[:, None] * D + dims[None, :], mask=live[:, None], other=0.0)
        else:
            v = tl.load(V + k_base + keys[:, None] * D + dims[None, :])  # (N, D)
        acc += tl.dot(w.to(v.dtype), v)
    return m_new, l_i, acc

@triton.autotune(configs=[triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
                          for m, n, w, st in TILES], key=["D", "FP8"])
@triton.jit
def attn_8bit(Q8, K8, V, QS, KS, VS, Out, Lse, Corr,
              Sq, Sk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr):
    # One program: BLOCK_M query rows of one (b, h). Tensors contiguous (B, H, S, D).
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    q_base = bh.to(tl.int64) * Sq * D
    k_base = bh.to(tl.int64) * Sk * D
    ks_base = bh.to(tl.int64) * Sk
    q = tl.load(Q8 + q_base + rows[:, None] * D + dims[None, :], mask=rows[:, None] < Sq, other=0.0 if FP8 else 0)
    # A pad row gets scale 1 (its scores are 0, finite), never stored.
    q_scale = tl.load(QS + bh.to(tl.int64) * Sq + rows, mask=rows < Sq, other=1.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full = (Sk // BLOCK_N) * BLOCK_N
    for start in range(0, full, BLOCK_N):
        m_i, l_i, acc = _tile(q, q_scale, m_i, l_i, acc, K8, V, KS, k_base, ks_base, start, Sk, cols, dims,
                              BLOCK_N, D, FP8, False)
    if full < Sk:
        m_i, l_i, acc = _tile(q, q_scale, m_i, l_i, acc, K8, V, KS, k_base, ks_base, full, Sk, cols, dims,
                              BLOCK_N, D, FP8, True)
    if FP8:
        sv = tl.load(VS + bh * D + dims)
        acc = acc * (sv[None, :] / 448.0)
    out = acc / l_i[:, None]
    tl.store(Out + q_base + rows[:, None] * D + dims[None, :], out.to(Out.dtype.element_ty), mask=rows[:, None] < Sq)
    corr = tl.load(Corr + bh.to(tl.int64) * Sq + rows, mask=rows < Sq, other=0.0)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453 + corr
    tl.store(Lse + bh.to(tl.int64) * Sq + rows, lse, mask=rows < Sq)

