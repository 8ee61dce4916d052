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

    @cached_property
    def _class_table(self) -> Tensor:
        # (C + 2, C + 2) bool: whether any token of class a attends any token of class b.
        # Classes: STA's tiles / radial's frames (0..C-1), text C (whole), pad C + 1 (never).
        F, Hp, Wp = self.grid
        if self.config.method == "sta":
            from raydit.planner.sparse import sta_tile_mask

            inner = torch.tensor(sta_tile_mask(self.config, self.grid), dtype=torch.bool)
        else:
            frames = torch.arange(F)
            inner = (frames[None, :] == 0) | (self._radial_bands[(frames[:, None] - frames[None, :]).abs()] >= 0)
        C = inner.size(0)
        table = torch.zeros(C + 2, C + 2, dtype=torch.bool)
        table[:C, :C] = inner
        table[C, : C + 1] = True
        table[: C + 1, C] = True
        return table

    def classes(self, pos: Tensor) -> Tensor:
        """Each token's class (int64) in `_class_table`: its tile (STA) or frame (radial)."""
        F, Hp, Wp = self.grid
        C = self._class_table.size(0) - 2
        v = pos - self.video_start
        inside = (v >= 0) & (v < self.video_tokens)
        f, r, c = _coords(v.clamp(0, self.video_tokens - 1), Hp, Wp)
        if self.config.method == "sta":
            Tt, Th, Tw = self.config.tile
            cls = ((f // Tt) * (Hp // Th) + r // Th) * (Wp // Tw) + c // Tw
        else:
            cls = f
        return torch.where(inside, cls, torch.where(pos >= 0, torch.full_like(pos, C), torch.full_like(pos, C + 1)))

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
                           mask: VideoMask, scale: float | None = None, *, query_block: int | None = None,
                           key_block: int = KEY_BLOCK) -> tuple[Tensor, Tensor]:
    """(out (B, H, Sq, D) in q's dtype, lse (B, H, Sq) float32 / float64) of attention under
    `mask`, q_pos (Sq,) and k_pos (Sk,) the tokens' global positions (-1: pad). Every head
    shares the mask. Runs on any device; CUDA has `flex_block_sparse_attention` too.
    query_block None: STA's tile volume (a query block is one tile, whose keys are exactly
    its window's tiles), else QUERY_BLOCK."""
    B, H, Sq, D = q_BHSD.shape
    Sk = k_BHSD.size(2)
    if q_pos.shape != (Sq,) or k_pos.shape != (Sk,):
        raise ValueError(f"positions {tuple(q_pos.shape)}, {tuple(k_pos.shape)} do not match {Sq} queries and "
                         f"{Sk} keys; give one global position per token")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if query_block is None:
        Tt, Th, Tw = mask.config.tile
        query_block = min(max(Tt * Th * Tw, 16), 1024) if mask.config.method == "sta" else QUERY_BLOCK
    acc = _acc_dtype(q_BHSD.dtype)
    out = q_BHSD.new_zeros(B, H, Sq, v_BHSD.size(-1), dtype=acc)
    lse = torch.full((B, H, Sq), -math.inf, dtype=acc, device=q_BHSD.device)
    if Sq == 0 or Sk == 0:
        return out.to(q_BHSD.dtype), lse.to(torch.float64 if acc == torch.float64 else torch.float32)
    q_pos, k_pos = q_pos.to(q_BHSD.device), k_pos.to(q_BHSD.device)
    q_perm = torch.argsort(mask.order(q_pos), stable=True)
    k_perm = torch.argsort(mask.order(k_pos), stable=True)
    # Keys already in block order (radial; a raster range) are used in place when all live.
    ordered = bool((k_perm == torch.arange(Sk, device=k_perm.device)).all())
    whole: tuple[Tensor, Tensor] | None = (k_BHSD, v_BHSD) if ordered else None
    qp, kp = q_pos[q_perm], k_pos[k_perm]
    # Keys in block order, padded to whole key blocks with pad positions (never allowed).
    n_kb = -(-Sk // key_block)
    pad = n_kb * key_block - Sk
    kp_padded = torch.cat([kp, kp.new_full((pad,), -1)])
    # Which key blocks a query block may attend, from the class table (tiles or frames: a
    # bound that holds for every token pair), so the token mask is built only where it may
    # be true and the mask's cost falls with the density like the products'.
    table = mask._class_table.to(q_BHSD.device)
    q_cls, k_cls = mask.classes(qp), mask.classes(kp_padded)
    for start in range(0, Sq, query_block):
        rows = q_perm[start:start + query_block]
        reach = table[torch.unique(q_cls[start:start + query_block])].any(dim=0)  # (C + 2,)
        live = reach[k_cls].view(n_kb, key_block).any(dim=1)  # (n_kb,)
        if not bool(live.any()):
            continue
        keys = live.repeat_interleave(key_block)[:Sk].nonzero().squeeze(1)
        allowed = mask.allowed(qp[start:start + query_block, None], kp[keys][None, :])  # (Q, Ka)
        if not bool(allowed.any()):
            continue
        if keys.numel() == Sk:  # every key block live: one sorted copy at most, shared by the blocks
            if whole is None:
                whole = k_BHSD[:, :, k_perm], v_BHSD[:, :, k_perm]
            k_blk, v_blk = whole
        else:
            k_idx = k_perm[keys]
            k_blk, v_blk = k_BHSD[:, :, k_idx], v_BHSD[:, :, k_idx]
        o, l = _attend(q_BHSD[:, :, rows], k_blk, v_blk, allowed, scale, acc)
        out[:, :, rows] = o.to(acc)
        lse[:, :, rows] = l.to(acc)
    return out.to(q_BHSD.dtype), lse


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """One query block against its gathered keys under the (Q, Ka) token mask -> (out, lse)."""
    bias = None
    if not bool(allowed.all()):
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, -math.inf)
    if q.device.type == "cpu":
        # torch's fused CPU flash kernel (the 'torch-cpu' LSE kernel) with the block's mask.
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
    else:
        s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias.to(acc)
        l = torch.logsumexp(s, dim=-1)
        o = torch.matmul(torch.exp(s - torch.where(torch.isfinite(l), l, torch.zeros_like(l)).unsqueeze(-1)), v.to(acc))
    dead = ~allowed.any(dim=1)  # rows with no key here: out 0, lse -inf (the kernel says lse 0)
    if bool(dead.any()):
        o = o.masked_fill(dead[:, None], 0.0)
        l = l.masked_fill(dead, -math.inf)
    return o, l


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
