"""Block-sparse attention that returns the log-sum-exp, on any subset of a sequence's tokens.

Legend: B batch, H heads, N = B * H, Sq query tokens, Sk key tokens, D head dim.

The mask (raydit.planner.sparse says which video query attends which video key) is kept in
GLOBAL token positions: position p of the whole joint sequence (parts concatenated,
unpadded), -1 for a pad token. So a ring rank holding any subset of queries and any
subset of keys applies the same mask as one process holding them all, and the partial
results merge by their lse into the one-process result.

    out = softmax(s + M) v, lse = logsumexp(s + M), s = scale * q k^T, M = 0 where allowed, -inf not
A query row with no allowed key gets out 0, lse -inf (what the ring merge expects).

Where the time goes: a schedule, built once per (mask, query positions, key positions) and
cached, since every layer, head and step of a request reuses it, lists fused attention calls.
Tokens fall in classes (STA's tiles, radial's frames, text); query classes that attend the same
key classes share calls. Key classes a group attends whole are one call with no mask (all of
STA: a tile pair is all in or all out, so STA multiplies exactly the pairs it keeps); radial's
bands are taken per key frame, band width and range of in-frame query positions, the queries of
every frame at such a distance against one run of keys, under the token mask, and merged into the
rows by their lse (`_band_tasks`).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from raydit.planner.sparse import SparseConfig, radial_band

# In-frame query positions of one radial band task (`_band_tasks`): each row computes this many
# keys - 1 past its band on either side; fewer queries a call run the fused kernel slower per pair.
# 64 measured best of 49 / 64 / 98 / 128 on the Wan 1.3B shape of bench/bench_sparse.py.
QUERY_BLOCK = 64
# Index sets whose runs average at least this many tokens are copied run by run (see `_as_run`).
MIN_RUN = 16
_Index = Tensor | slice | tuple  # a task's rows or keys: see `_Task`


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

    @cached_property
    def _class_full(self) -> Tensor:
        # (C + 2, C + 2) bool: whether EVERY token of class a attends every token of class b.
        # STA: the tile rule is the token rule, so this is `_class_table`; radial: the sink frame
        # and bands that cover the frame (|i - j| <= P - 1 always); the rest of radial's kept
        # frame pairs are bands, attended in part.
        if self.config.method == "sta":
            return self._class_table
        F, Hp, Wp = self.grid
        frames = torch.arange(F)
        table = self._class_table.clone()
        band = self._radial_bands[(frames[:, None] - frames[None, :]).abs()]
        table[:F, :F] = (frames[None, :] == 0) | (band >= Hp * Wp - 1)
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

    def any_allowed(self, q_pos: Tensor, k_pos: Tensor) -> bool:
        """Whether any query of q_pos attends any key of k_pos (the ring's transfer rule), from
        the class tables: a class pair attended whole answers at once; radial's bands (the only
        pairs attended in part) by the nearest in-frame distance, O(n log n) instead of the
        O(Sq x Sk) token mask."""
        q_cls, k_cls = self.classes(q_pos), self.classes(k_pos)
        qc, kc = torch.unique(q_cls), torch.unique(k_cls)
        if bool(self._class_full[qc][:, kc].any()):
            return True
        part = self._class_table[qc][:, kc] & ~self._class_full[qc][:, kc]
        if not bool(part.any()):
            return False
        # Radial bands: frames a (queries) and b (keys) meet when some |i - j| <= band.
        F, Hp, Wp = self.grid
        P = Hp * Wp
        for a, b in (p.tolist() for p in part.nonzero()):
            fq, fk = int(qc[a]), int(kc[b])
            i = (q_pos[q_cls == fq] - self.video_start) % P
            j = ((k_pos[k_cls == fk] - self.video_start) % P).sort().values
            at = torch.searchsorted(j, i).clamp(max=j.numel() - 1)
            nearest = torch.minimum((j[at] - i).abs(), (j[(at - 1).clamp(min=0)] - i).abs())
            if bool((nearest <= int(self._radial_bands[abs(fq - fk)])).any()):
                return True
        return False


def _coords(v: Tensor, Hp: int, Wp: int) -> tuple[Tensor, Tensor, Tensor]:
    return v // (Hp * Wp), (v // Wp) % Hp, v % Wp


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- the schedule: which query rows meet which keys, built once per (mask, positions) ------------
@dataclass(frozen=True)
class _Task:
    """One fused attention call: queries `rows` against keys `keys` (`_Index`: a slice where the
    indices are one ascending run, so no copy is made; a tuple of slices where they are a few
    long runs; else an index tensor), under `allowed` (Q, K) bool (None: every pair). `merge`:
    the rows already hold another task's result, which this one joins by lse."""

    rows: _Index
    keys: _Index
    allowed: Tensor | None
    merge: bool


@dataclass
class _Schedule:
    tasks: list[_Task]
    biases: dict = field(default_factory=dict)  # (task index, dtype) -> additive float mask, where cached
    bias_bytes: int = 0


# The additive masks of one schedule are kept (in the query's dtype) while they take at most this
# much memory; past it they are rebuilt from the kept bool masks at every call (a pass over the
# masked pairs, small beside the products).
BIAS_CACHE_BYTES = 256 << 20
_SCHEDULE_CACHE_SIZE = 64


class _ScheduleCache:
    """LRU of schedules keyed on (mask, query positions, key positions, query block): the mask is
    the same for every layer, head and step of a request, and so are a rank's positions."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.built = 0  # schedules built, for tests

    def get(self, mask: VideoMask, q_pos: Tensor, k_pos: Tensor, query_block: int) -> _Schedule:
        key = (mask, q_pos.cpu().numpy().tobytes(), k_pos.cpu().numpy().tobytes(), query_block, str(q_pos.device))
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                return found
        schedule = _build_schedule(mask, q_pos, k_pos, query_block)
        with self._lock:
            self.built += 1
            self._items[key] = schedule
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return schedule

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


schedules = _ScheduleCache(_SCHEDULE_CACHE_SIZE)


def _as_run(idx: Tensor) -> _Index:
    """An ascending index tensor as a slice where it is one run (a view instead of a gather), as
    its runs where they are at least MIN_RUN long on average (copied by slices, ~5x faster than
    index_select's gather of whole rows), else itself."""
    n = idx.numel()
    if not n:
        return idx
    breaks = ((idx[1:] - idx[:-1]) != 1).nonzero().flatten() + 1
    if not breaks.numel():
        return slice(int(idx[0]), int(idx[0]) + n)
    if n < MIN_RUN * (breaks.numel() + 1):
        return idx
    starts, stops = [0, *breaks.tolist()], [*breaks.tolist(), n]
    return tuple(slice(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, stops))


def _build_schedule(mask: VideoMask, q_pos: Tensor, k_pos: Tensor, query_block: int) -> _Schedule:
    """The tasks of one (mask, positions): query classes (STA tiles, radial frames, text) with the
    same key classes form a group; a group's keys of classes it attends whole form one task with
    no mask (STA: every key; radial: the sink frame, its own and near frames, text). The frame
    pairs radial attends in part (its bands) follow in `_band_tasks`, merged into those rows."""
    full_t, any_t = mask._class_full, mask._class_table
    q_order = torch.argsort(mask.order(q_pos), stable=True)
    k_order = torch.argsort(mask.order(k_pos), stable=True)
    q_cls, k_cls = mask.classes(q_pos)[q_order], mask.classes(k_pos)[k_order]
    pad = any_t.size(0) - 1
    present_k = torch.zeros(any_t.size(0), dtype=torch.bool)
    present_k[k_cls] = True
    groups: dict[tuple, list[int]] = {}
    for c in torch.unique(q_cls).tolist():
        if c != pad:
            groups.setdefault(tuple((full_t[c] & present_k).tolist()), []).append(c)
    tasks: list[_Task] = []
    for full, members in groups.items():
        in_group = torch.zeros(any_t.size(0), dtype=torch.bool)
        in_group[members] = True
        rows = q_order[in_group[q_cls]]
        # Within a task the order of rows and keys is free: ascending, so runs are views.
        full_keys = k_order[torch.tensor(full)[k_cls]].sort().values
        if full_keys.numel():
            tasks.append(_Task(_as_run(rows.sort().values), _as_run(full_keys), None, merge=False))
    if mask.config.method == "radial":
        tasks += _band_tasks(mask, q_pos, k_pos, query_block)
    return _Schedule(tasks)


def _band_tasks(mask: VideoMask, q_pos: Tensor, k_pos: Tensor, chunk: int) -> list[_Task]:
    """Radial's bands: query frame a meets key frame b where the in-frame distance |i - j| <= w,
    w = band(|a - b|). For key frame b, one band width w and in-frame queries i in [lo, hi) of
    `chunk` positions, every query frame at a distance with that width attends the same keys,
    j in [lo - w, hi + w) of frame b: one task holds those queries of all such frames (rows enough
    for the fused kernel's wide row blocks, ~1.4x faster per pair than one frame's chunk) against
    that one run of keys (a view, no copy), under the token mask; each task's result merges
    into its rows by lse. The wasted pairs are the band's edges, (chunk - 1) per row and side."""
    F, Hp, Wp = mask.grid
    P = Hp * Wp
    table = mask._class_table[:F, :F] & ~mask._class_full[:F, :F]  # frame pairs attended in part
    q_cls, k_cls = mask.classes(q_pos), mask.classes(k_pos)
    q_at, k_at = (q_pos - mask.video_start) % P, (k_pos - mask.video_start) % P  # in-frame position
    n = -(-P // chunk)
    bounds = [P * c // n for c in range(n + 1)]  # equal in-frame ranges, no sliver
    tasks = []
    for b in range(F):
        key_idx = (k_cls == b).nonzero().flatten()
        frames = table[:, b].nonzero().flatten().tolist()
        if not key_idx.numel() or not frames:
            continue
        by_width: dict[int, list[int]] = {}
        for a in frames:
            by_width.setdefault(int(mask._radial_bands[abs(a - b)]), []).append(a)
        for w, members in by_width.items():
            row_idx = torch.isin(q_cls, torch.tensor(members)).nonzero().flatten()
            for lo, hi in zip(bounds, bounds[1:]):
                rows = row_idx[(q_at[row_idx] >= lo) & (q_at[row_idx] < hi)]
                keys = key_idx[(k_at[key_idx] >= lo - w) & (k_at[key_idx] < hi + w)]
                if not rows.numel() or not keys.numel():
                    continue
                allowed = mask.allowed(q_pos[rows][:, None], k_pos[keys][None, :])  # (Q, K)
                cols, live = allowed.any(dim=0), allowed.any(dim=1)
                if not bool(cols.any()):
                    continue
                allowed = allowed[live][:, cols]
                tasks.append(_Task(_as_run(rows[live]), _as_run(keys[cols]),
                                   None if bool(allowed.all()) else allowed, merge=True))
    return tasks


def _bias(schedule: _Schedule, i: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Task i's additive mask (0 allowed, -inf not) in `dtype`, cached within the byte budget."""
    found = schedule.biases.get((i, dtype, device))
    if found is not None:
        return found
    allowed = schedule.tasks[i].allowed.to(device)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, -math.inf)
    size = bias.numel() * bias.element_size()
    if schedule.bias_bytes + size <= BIAS_CACHE_BYTES:
        schedule.biases[(i, dtype, device)] = bias
        schedule.bias_bytes += size
    return bias


def _take(x_NSD: Tensor, idx: _Index) -> Tensor:
    # Gathers on a (B * H, S, D) view, whole rows of D: a run is a view, runs are one cat of views;
    # advanced indexing copies rows ~2.5x faster than index_select (one core, torch 2.13).
    if isinstance(idx, slice):
        return x_NSD[:, idx]
    if isinstance(idx, tuple):
        return torch.cat([x_NSD[:, run] for run in idx], dim=1)
    return x_NSD[:, idx]


def _put(x_NS: Tensor, idx: _Index, value: Tensor) -> None:
    """x_NS[:, idx] = value, `idx` as `_take` takes it."""
    if isinstance(idx, tuple):
        at = 0
        for run in idx:
            n = run.stop - run.start
            x_NS[:, run] = value[:, at: at + n]
            at += n
    elif isinstance(idx, slice):
        x_NS[:, idx] = value
    else:
        x_NS.index_copy_(1, idx, value)


def _on(idx: _Index, device: torch.device) -> _Index:
    return idx.to(device) if isinstance(idx, Tensor) else idx


def block_sparse_attention(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, q_pos: Tensor, k_pos: Tensor,
                           mask: VideoMask, scale: float | None = None, *,
                           query_block: int | None = None) -> tuple[Tensor, Tensor]:
    """(out (B, H, Sq, D) in q's dtype, lse (B, H, Sq) float32 / float64) of attention under
    `mask`, q_pos (Sq,) and k_pos (Sk,) the tokens' global positions (-1: pad). Every head
    shares the mask. Runs on any device; CUDA has `flex_block_sparse_attention` too.
    query_block: the in-frame query positions of one radial band task, QUERY_BLOCK by default.

    The schedule (`_build_schedule`) is built on the first call for these positions and reused
    (`schedules`); the calls then only gather, attend and merge."""
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
        return out.to(q_BHSD.dtype), lse
    schedule = schedules.get(mask, q_pos.cpu(), k_pos.cpu(), query_block or QUERY_BLOCK)
    # (B, H, S, D) -> (N = B * H, S, D): a view, or one copy where the layout does not allow it.
    q_NSD, k_NSD, v_NSD = (x.reshape(B * H, x.size(2), x.size(3)) for x in (q_BHSD, k_BHSD, v_BHSD))
    out_NSD, lse_NS = out.view(B * H, Sq, -1), lse.view(B * H, Sq)
    for i, task in enumerate(schedule.tasks):
        bias = None if task.allowed is None else _bias(schedule, i, q_BHSD.dtype, q_BHSD.device)
        rows, keys = _on(task.rows, q_BHSD.device), _on(task.keys, q_BHSD.device)
        o, l = _attend(*(_take(x, idx).view(B, H, -1, x.size(2)) for x, idx in
                         ((q_NSD, rows), (k_NSD, keys), (v_NSD, keys))), bias, scale, acc)
        o, l = o.reshape(B * H, o.size(2), -1).to(acc), l.reshape(B * H, -1).to(acc)
        if task.merge:
            # In place into the rows' current result: a view where the rows are one run.
            into = _take(out_NSD, rows)
            l = _merge_(into, _take(lse_NS[..., None], rows)[..., 0], o, l)
            if not isinstance(rows, slice):
                _put(out_NSD, rows, into)
        else:
            _put(out_NSD, rows, o)
        _put(lse_NS, rows, l)
    return out.to(q_BHSD.dtype), lse


def _merge_(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Two partial results of the same rows over disjoint keys, lse_b finite (each task's rows
    attend at least one of its keys); lse_a may be -inf (rows no task has written yet: out_a 0),
    which gives out_b, lse_b exactly:
        lse = log(exp(lse_a) + exp(lse_b)),  out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b
    computed with m = max(lse_a, lse_b) subtracted first, so both weights lie in [0, 1]. The
    merged out is written into out_a; returns lse."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    out_a.mul_((w_a / total).unsqueeze(-1)).addcmul_(out_b, (w_b / total).unsqueeze(-1))
    return m + torch.log(total)


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """One task: queries against their keys under the additive (Q, K) mask -> (out, lse); every
    query row has at least one allowed key."""
    if q.device.type == "cpu":
        # torch's fused CPU flash kernel (the 'torch-cpu' LSE kernel), the task's mask if any.
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(acc)
    l = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - l.unsqueeze(-1)), v.to(acc)), l


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


__all__ = ["BIAS_CACHE_BYTES", "QUERY_BLOCK", "VideoMask", "block_sparse_attention", "dense_masked_reference",
           "flex_block_sparse_attention"]
