"""Row (spatial) parallelism for convolutional decoders: split, halo exchange, group norm, gather.

Legend: B batch, C channels, T frames, H rows (global), h rows held by one rank, W columns,
G norm groups, S a sequence of tokens. Rows are always dim -2 of a tensor laid out
[..., H, W] (Conv2d: B C H W; Conv3d: B C T H W).

Every rank of a group holds a contiguous band of rows, in rank order; bands may differ in size
by one row (`RowSplit.even`). A convolution with a k x k kernel and zero padding p = (k - 1) / 2
along rows computes exactly the global result on its band if it sees p rows of each neighbour
(zero rows at the first and last band, which is what the zero padding would have put there):
`halo_exchange` attaches them, the convolution then runs with no padding along rows. Group
norm statistics are reduced across the bands (`group_norm`), attention gathers the keys and
values of every band (`all_gather_uneven`), and the result is reassembled once (`gather_rows`).
Nothing here knows a model; the band sizes are plain data every rank derives alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

ROW_DIM = -2


@dataclass(frozen=True)
class RowSplit:
    """The size of each rank's band of rows, in rank order (pure)."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        object.__setattr__(self, "sizes", sizes)
        if not sizes:
            raise ValueError("RowSplit needs at least one band")
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise ValueError(f"band size {s!r} in {sizes} must be an integer >= 1")

    @classmethod
    def even(cls, rows: int, parts: int) -> "RowSplit":
        """`rows` cut into `parts` bands as equal as possible; the first `rows % parts` get one more row.

        60 latent rows on 8 ranks: 8, 8, 8, 8, 7, 7, 7, 7.
        """
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"parts {parts!r} must be an integer >= 1")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < parts:
            raise ValueError(
                f"{rows!r} rows cannot be split over {parts} ranks (every rank needs at least one row); "
                f"use at most {rows} ranks for this height"
            )
        base, extra = divmod(rows, parts)
        return cls(tuple(base + (1 if i < extra else 0) for i in range(parts)))

    @property
    def parts(self) -> int:
        return len(self.sizes)

    @property
    def rows(self) -> int:
        return sum(self.sizes)

    def start(self, index: int) -> int:
        return sum(self.sizes[:index])

    def bounds(self, index: int) -> tuple[int, int]:
        start = self.start(index)
        return start, start + self.sizes[index]

    def scaled(self, factor: int) -> "RowSplit":
        """The same bands after an exact upsampling of the rows by an integer `factor`."""
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
            raise ValueError(f"factor {factor!r} must be an integer >= 1")
        return RowSplit(tuple(s * factor for s in self.sizes))

    def shard(self, x: Tensor, index: int, dim: int = ROW_DIM) -> Tensor:
        """Band `index` of a full tensor (a view)."""
        if x.shape[dim] != self.rows:
            raise ValueError(f"tensor has {x.shape[dim]} rows along dim {dim}, the split is for {self.rows}")
        start, stop = self.bounds(index)
        return x.narrow(dim, start, stop - start)


def _rank_world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class HaloExchange:
    """The halo rows of one band, in flight: `start_halo_exchange` posts the sends and receives
    and returns at once, so the caller can compute meanwhile; `wait()` gives (top, bottom),
    the previous rank's last `before` rows and the next rank's first `after` rows (zero rows
    where there is no neighbour)."""

    def __init__(self, top: Tensor, bottom: Tensor, requests: list, sends: list) -> None:
        self.top, self.bottom = top, bottom
        self._requests = requests
        self._sends = sends  # keep the sent slices alive until the transfer is done

    def wait(self) -> tuple[Tensor, Tensor]:
        for request in self._requests:
            request.wait()
        self._requests, self._sends = [], []
        return self.top, self.bottom


def start_halo_exchange(x: Tensor, before: int, after: int, group=None, dim: int = ROW_DIM) -> HaloExchange:
    """Post the exchange of `halo_exchange` without waiting for it (collective, same sizes on every rank)."""
    if before < 0 or after < 0:
        raise ValueError(f"halo sizes before={before}, after={after} must be >= 0")
    rank, world = _rank_world(group)
    rows = x.shape[dim]
    if rows < max(before, after):
        raise ValueError(
            f"rank {rank} holds {rows} rows, fewer than the halo of {max(before, after)} a neighbour needs; "
            f"use fewer ranks for this height"
        )
    shape_before = list(x.shape)
    shape_before[dim] = before
    shape_after = list(x.shape)
    shape_after[dim] = after
    top = torch.zeros(shape_before, dtype=x.dtype, device=x.device)
    bottom = torch.zeros(shape_after, dtype=x.dtype, device=x.device)
    ops, sends = [], []
    if rank > 0:
        prev = _global(group, rank - 1)
        # The previous band needs my first `after` rows as its bottom halo; I need its last `before`.
        if after:
            sends.append(x.narrow(dim, 0, after).contiguous())
            ops.append(dist.P2POp(dist.isend, sends[-1], prev, group))
        if before:
            ops.append(dist.P2POp(dist.irecv, top, prev, group))
    if rank < world - 1:
        nxt = _global(group, rank + 1)
        if before:
            sends.append(x.narrow(dim, rows - before, before).contiguous())
            ops.append(dist.P2POp(dist.isend, sends[-1], nxt, group))
        if after:
            ops.append(dist.P2POp(dist.irecv, bottom, nxt, group))
    requests = dist.batch_isend_irecv(ops) if ops else []
    return HaloExchange(top, bottom, requests, sends)


def halo_exchange(x: Tensor, before: int, after: int, group=None, dim: int = ROW_DIM) -> Tensor:
    """[..., h, W] -> [..., before + h + after, W]: the previous rank's last `before` rows and the
    next rank's first `after` rows attached, zero rows where there is no neighbour.

    Every rank of `group` must call it with the same `before` / `after` (collective).
    """
    if before < 0 or after < 0:
        raise ValueError(f"halo sizes before={before}, after={after} must be >= 0")
    if before == 0 and after == 0:
        return x
    top, bottom = start_halo_exchange(x, before, after, group, dim).wait()
    return torch.cat([top, x, bottom], dim=dim)


def fix_band_edges(out: Tensor, x: Tensor, top: Tensor, bottom: Tensor, conv) -> Tensor:
    """Make a zero-padded convolution's band result exact, in place: `out = conv(x)` was computed
    with the layer's own zero padding of p rows, so only its first and last p rows saw zeros where
    the neighbours' rows belong. Each is recomputed from a slab of 3p rows (the p halo rows of
    `top` / `bottom` and the band's 2p rows next to them) with no row padding. This costs two
    thin convolutions instead of a copy of the whole band with its halo attached, and lets the
    exchange run while the band is convolved.

    `conv(slab)` must run the layer with its row padding set to 0; `x` needs at least 2p rows."""
    p = top.shape[ROW_DIM]
    if p == 0:
        return out
    rows = x.shape[ROW_DIM]
    if rows < 2 * p:
        raise ValueError(f"a band of {rows} rows is too thin to correct its edges in place (needs {2 * p})")
    head = conv(torch.cat([top, x.narrow(ROW_DIM, 0, 2 * p)], dim=ROW_DIM))
    tail = conv(torch.cat([x.narrow(ROW_DIM, rows - 2 * p, 2 * p), bottom], dim=ROW_DIM))
    out.narrow(ROW_DIM, 0, p).copy_(head)
    out.narrow(ROW_DIM, out.shape[ROW_DIM] - p, p).copy_(tail)
    return out


def group_norm(
    x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None, eps: float, group=None
) -> Tensor:
    """torch.nn.functional.group_norm over the rows of every rank of `group` (x: B C ...).

    Each rank normalises its band with its own statistics (torch's fused native group norm,
    which also returns each (B, G)'s mean m_r and 1 / sqrt(var_r + eps)). The ranks then combine
    count n_r, mean m_r and sum of squared deviations M2_r = n_r var_r (Chan et al.):
        n = sum n_r,  m = sum n_r m_r / n,  M2 = sum (M2_r + n_r (m_r - m)^2),  var = M2 / n
    which, unlike sum(x^2)/n - m^2, does not cancel when |m| >> std; the combination runs in
    float64 on B x G numbers. The band's result is turned into the global one in the same
    buffer with one multiply-add per element:
        y = (x - m) / s * w + b = xhat_r * (w s_r / s) + (w (m_r - m) / s + b),
    with xhat_r = (x - m_r) / s_r the local normalisation, s = sqrt(var + eps). Half types are
    normalised in float32, as torch does.
    """
    batch, channels = x.shape[0], x.shape[1]
    if channels % num_groups:
        raise ValueError(f"{channels} channels are not divisible by {num_groups} groups")
    world = dist.get_world_size(group)
    if world == 1:
        return torch.nn.functional.group_norm(x, num_groups, weight, bias, eps)
    if eps <= 0:
        raise ValueError(f"row-parallel group norm needs eps > 0, got {eps}")
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    work = work.contiguous()
    per_channel = work[0, 0].numel()
    xhat, mean_local, rstd_local = torch.ops.aten.native_group_norm(
        work, None, None, batch, channels, per_channel, num_groups, eps)
    n_local = per_channel * (channels // num_groups)
    rstd64 = rstd_local.double().reshape(batch, num_groups)
    mean64 = mean_local.double().reshape(batch, num_groups)
    var_local = (1.0 / rstd64 ** 2 - eps).clamp_min(0.0)
    stats = torch.stack([torch.full_like(mean64, float(n_local)), mean64, var_local * n_local])  # [3, B, G]
    gathered = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats, group=group)
    allstats = torch.stack(gathered)  # [world, 3, B, G]
    n_r, m_r, m2_r = allstats[:, 0], allstats[:, 1], allstats[:, 2]
    n = n_r.sum(0)
    mean = (n_r * m_r).sum(0) / n
    var = (m2_r + n_r * (m_r - mean) ** 2).sum(0) / n
    inv_std = torch.rsqrt(var + eps)  # [B, G]
    per_group = channels // num_groups
    scale = (inv_std / rstd64)[..., None].expand(batch, num_groups, per_group).reshape(batch, channels)
    shift = ((mean64 - mean) * inv_std)[..., None].expand(batch, num_groups, per_group).reshape(batch, channels)
    if weight is not None:
        w = weight.double().reshape(1, channels)
        scale, shift = scale * w, shift * w
    if bias is not None:
        shift = shift + bias.double().reshape(1, channels)
    affine_shape = (batch, channels) + (1,) * (x.dim() - 2)
    scale = scale.to(work.dtype).reshape(affine_shape)
    shift = shift.to(work.dtype).reshape(affine_shape)
    out = xhat.reshape(work.shape)
    torch.addcmul(shift, out, scale, out=out)
    return out.to(x.dtype)


def all_gather_uneven(x: Tensor, dim: int, group=None) -> Tensor:
    """Every rank's `x` concatenated along `dim` in rank order, on every rank; sizes along
    `dim` may differ (they are exchanged first), all other dims must match."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    size = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]
    return _all_gather_padded(x, sizes, dim, group)


def _pad_to(x: Tensor, length: int, dim: int) -> Tensor:
    if x.shape[dim] == length:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _all_gather_padded(x: Tensor, sizes: list[int], dim: int, group) -> Tensor:
    # Collectives want equal shapes (NCCL): pad every piece to the largest, drop the padding after.
    longest = max(sizes)
    padded = _pad_to(x, longest, dim)
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(pieces, sizes)], dim=dim)


def gather_rows(x: Tensor, split: RowSplit, group=None, dst: int | None = 0, dim: int = ROW_DIM) -> Tensor | None:
    """Reassemble the bands of `split` (this rank's band is `x`) along `dim`.

    `dst` is the group rank that receives the whole tensor (others get None); `dst=None`
    gives it to every rank. Bands of unequal size are padded to the largest for the transfer.
    """
    rank, world = _rank_world(group)
    if split.parts != world:
        raise ValueError(f"split has {split.parts} bands for a group of {world} ranks")
    if x.shape[dim] != split.sizes[rank]:
        raise ValueError(f"rank {rank} holds {x.shape[dim]} rows, its band in the split has {split.sizes[rank]}")
    if world == 1:
        return x
    if dst is None:
        return _all_gather_padded(x, list(split.sizes), dim, group)
    padded = _pad_to(x, max(split.sizes), dim)
    pieces = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
    dist.gather(padded, pieces, dst=_global(group, dst), group=group)
    if rank != dst:
        return None
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(pieces, split.sizes)], dim=dim)
