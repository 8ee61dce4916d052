"""Block-sparse attention that returns the log-sum-exp, on any subset of a sequence's tokens.

Legend: B batch, H heads, Sq query tokens, Sk key tokens, D head dim, Q / K tokens of one
query / key block.

The mask (raydit.planner.sparse says which video query attends which video key) is kept in
GLOBAL token positions: position p of the whole joint sequence (parts concatenated,
unpadded), -1 for a pad token. So a ring rank holding any subset of queries and any
subset of keys applies the same mask as one process holding them all, and the partial
results merge by their lse into the one-process result.

    out = softmax(s + M) v, lse = logsumexp(s + M), s = scale * q k^T, M = 0 where allowed, -inf not
A query row with no allowed key gets out 0, lse -inf (what the ring merge expects).

Where the time goes: tokens are sorted into the method's block order (STA: tile order, so
a tile's tokens are one block and a block pair is all in or all out; radial: raster order),
cut into query blocks of Q and key blocks of K tokens; per query block only the key blocks
with at least one allowed pair are gathered and multiplied, so the work falls with the
density. The token mask is applied only to block pairs that are partly allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from raydit.planner.sparse import SparseConfig, radial_band

QUERY_BLOCK = 128
KEY_BLOCK = 64


@dataclass(frozen=True)
class VideoMask:
    """A sparse setting placed in a joint sequence: the video part's token grid, where it
    starts (global position), the sequence's length. Tokens outside the video are text:
    their rows and columns stay whole."""

    config: SparseConfig
    grid: tuple[int, int, int]
    video_start: int = 0
    total_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", self.config.check_grid(self.grid))
        total = self.video_start + self.video_tokens if self.total_tokens is None else self.total_tokens
        if self.video_start < 0 or total < self.video_start + self.video_tokens:
            raise ValueError(f"the video's {self.video_tokens} tokens from position {self.video_start} do not fit "
                             f"a sequence of {total} tokens; give the video part's grid and offset")
        object.__setattr__(self, "total_tokens", total)

    @property
    def video_tokens(self) -> int:
        F, Hp, Wp = self.grid
        return F * Hp * Wp

    @cached_property
    def _radial_bands(self) -> Tensor:
        # band[d] for key frames other than 0; -1: the frame pair is skipped.
        F, Hp, Wp = self.grid
        bands = [radial_band(self.config, Hp * Wp, d) for d in range(F)]
        return torch.tensor([-1 if b is None else b for b in bands], dtype=torch.int64)

    def allowed(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Bool mask of broadcast int64 positions (e.g. (Sq, 1) and (1, Sk)): q attends k."""
        F, Hp, Wp = self.grid
        start, n = self.video_start, self.video_tokens
        qv, kv = q_pos - start, k_pos - start
        q_in, k_in = (qv >= 0) & (qv < n), (kv >= 0) & (kv < n)
        qv, kv = qv.clamp(0, n - 1), kv.clamp(0, n - 1)
        if self.config.method == "sta":
            rule = None
            for coord_q, coord_k, size, tile, window in zip(
                    _coords(qv, Hp, Wp), _coords(kv, Hp, Wp), self.grid, self.config.tile, self.config.window):
                tiles = size // tile
                w = min(window, tiles)
                s = (coord_q // tile - w // 2).clamp(0, max(tiles - w, 0))
                kt = coord_k // tile
                axis = (kt >= s) & (kt < s + w)
                rule = axis if rule is None else rule & axis
        else:
            P = Hp * Wp
            fq, fk = qv // P, kv // P
            band = self._radial_bands.to(q_pos.device)[(fq - fk).abs()]
            rule = (fk == 0) | ((band >= 0) & ((qv % P - kv % P).abs() <= band))
        real = (q_pos >= 0) & (k_pos >= 0)
        return real & torch.where(q_in & k_in, rule, torch.ones_like(rule))

    def order(self, pos: Tensor) -> Tensor:
        """Sort keys that put a token set into block order: STA's video tokens in tile order
        (each tile contiguous), text in place, pad last; radial: raster order."""
        key = torch.where(pos >= 0, pos, torch.full_like(pos, self.total_tokens))
        if self.config.method != "sta":
            return key
        F, Hp, Wp = self.grid
        Tt, Th, Tw = self.config.tile
        v = pos - self.video_start
        inside = (v >= 0) & (v < self.video_tokens)
        f, r, c = _coords(v.clamp(0, self.video_tokens - 1), Hp, Wp)
        tile = ((f // Tt) * (Hp // Th) + r // Th) * (Wp // Tw) + c // Tw
        within = ((f % Tt) * Th + r % Th) * Tw + c % Tw
        return torch.where(inside, self.video_start + tile * (Tt * Th * Tw) + within, key)

    def any_allowed(self, q_pos: Tensor, k_pos: Tensor, chunk: int = 1024) -> bool:
        """Whether any query of q_pos attends any key of k_pos (the ring's transfer rule)."""
        for i in range(0, q_pos.numel(), chunk):
            if bool(self.allowed(q_pos[i:i + chunk, None], k_pos[None, :]).any()):
                return True
        return False


def _coords(v: Tensor, Hp: int, Wp: int) -> tuple[Tensor, Tensor, Tensor]:
    return v // (Hp * Wp), (v // Wp) % Hp, v % Wp


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_sparse_attention(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, q_pos: Tensor, k_pos: Tensor,
                           mask: VideoMask, scale: float | None = None, *, query_block: int = QUERY_BLOCK,
                           key_block: int = KEY_BLOCK) -> tuple[Tensor, Tensor]:
    """(out (B, H, Sq, D) in q's dtype, lse (B, H, Sq) float32 / float64) of attention under
    `mask`, q_pos (Sq,) and k_pos (Sk,) the tokens' global positions (-1: pad). Every head
    shares the mask. Runs on any device; CUDA has `flex_block_sparse_attention` too."""
    B, H, Sq, D = q_BHSD.shape
    Sk = k_BHSD.size(2)
    if q_pos.shape != (Sq,) or k_pos.shape != (Sk,):
        raise ValueError(f"positions {tuple(q_pos.shape)}, {tuple(k_pos.shape)} do not match {Sq} queries and "
                         f"{Sk} keys; give one global position per token")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    acc = _acc_dtype(q_BHSD.dtype)
    out = q_BHSD.new_zeros(B, H, Sq, v_BHSD.size(-1), dtype=acc)
    lse = torch.full((B, H, Sq), -math.inf, dtype=acc, device=q_BHSD.device)
    if Sq == 0 or Sk == 0:
        return out.to(q_BHSD.dtype), lse.to(torch.float64 if acc == torch.float64 else torch.float32)
    q_pos, k_pos = q_pos.to(q_BHSD.device), k_pos.to(q_BHSD.device)
    q_perm = torch.argsort(mask.order(q_pos), stable=True)
    k_perm = torch.argsort(mask.order(k_pos), stable=True)
    qp, kp = q_pos[q_perm], k_pos[k_perm]
    # Keys in block order, padded to whole key blocks with pad positions (never allowed).
    n_kb = -(-Sk // key_block)
    pad = n_kb * key_block - Sk
    kp_padded = torch.cat([kp, kp.new_full((pad,), -1)])
    k_sorted, v_sorted = k_BHSD[:, :, k_perm], v_BHSD[:, :, k_perm]
    for start in range(0, Sq, query_block):
        rows = q_perm[start:start + query_block]
        allowed = mask.allowed(qp[start:start + query_block, None], kp_padded[None, :])  # (Q, Sk + pad)
        per_block = allowed.view(allowed.size(0), n_kb, key_block)
        live = per_block.any(dim=(0, 2))  # (n_kb,)
        if not bool(live.any()):
            continue
        partial = bool((per_block[:, live].logical_not().any()))
        keys = live.repeat_interleave(key_block)[:Sk].nonzero().squeeze(1)
        q_blk = q_BHSD[:, :, rows].to(acc)
        s_BHQK = torch.matmul(q_blk, k_sorted[:, :, keys].to(acc).transpose(-1, -2)) * scale
        if partial:
            s_BHQK.masked_fill_(~allowed[:, keys], -math.inf)
        blk_lse = torch.logsumexp(s_BHQK, dim=-1)  # (B, H, Q); -inf on rows with no key
        finite = torch.isfinite(blk_lse)
        p = torch.exp(s_BHQK - torch.where(finite, blk_lse, torch.zeros_like(blk_lse)).unsqueeze(-1))
        out[:, :, rows] = torch.matmul(p, v_sorted[:, :, keys].to(acc))
        lse[:, :, rows] = blk_lse
    return out.to(q_BHSD.dtype), lse


def dense_masked_reference(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, q_pos: Tensor, k_pos: Tensor,
                           mask: VideoMask, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """The same result by dense float64 math with the whole boolean mask (small problems)."""
    scale = 1.0 / math.sqrt(q_BHSD.size(-1)) if scale is None else scale
    allowed = mask.allowed(q_pos[:, None], k_pos[None, :])
    s = torch.matmul(q_BHSD.double(), k_BHSD.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.matmul(p, v_BHSD.double()), lse


# -- CUDA: FlexAttention ------------------------------------------------------------------------
_flex_compiled = None


def flex_block_sparse_attention(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, q_pos: Tensor, k_pos: Tensor,
                                mask: VideoMask, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """The same on CUDA through torch's FlexAttention, compiled, with a BlockMask built from
    `mask` (its 128 x 128 blocks skipped where no pair is allowed); lse float32."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    q_pos, k_pos = q_pos.to(q_BHSD.device), k_pos.to(q_BHSD.device)

    def mask_mod(b, h, q_idx, kv_idx):
        return mask.allowed(q_pos[q_idx], k_pos[kv_idx])

    block_mask = create_block_mask(mask_mod, None, None, q_BHSD.size(2), k_BHSD.size(2), device=q_BHSD.device)
    try:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = _flex_compiled(q_BHSD, k_BHSD, v_BHSD, block_mask=block_mask, scale=scale,
                                  return_aux=AuxRequest(lse=True))
        lse = aux.lse
    except ImportError:  # torch before AuxRequest: return_lse
        out, lse = _flex_compiled(q_BHSD, k_BHSD, v_BHSD, block_mask=block_mask, scale=scale, return_lse=True)
    return out, lse.float()


__all__ = ["KEY_BLOCK", "QUERY_BLOCK", "VideoMask", "block_sparse_attention", "dense_masked_reference",
           "flex_block_sparse_attention"]
