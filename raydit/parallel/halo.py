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


def halo_exchange(x: Tensor, before: int, after: int, group=None, dim: int = ROW_DIM) -> Tensor:
    """[..., h, W] -> [..., before + h + after, W]: the previous rank's last `before` rows and the
    next rank's first `after` rows attached, zero rows where there is no neighbour.

    Every rank of `group` must call it with the same `before` / `after` (collective).
    """
    if before < 0 or after < 0:
        raise ValueError(f"halo sizes before={before}, after={after} must be >= 0")
    if before == 0 and after == 0:
        return x
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
    ops = []
    if rank > 0:
        prev = _global(group, rank - 1)
        # The previous band needs my first `after` rows as its bottom halo; I need its last `before`.
        if after:
            ops.append(dist.P2POp(dist.isend, x.narrow(dim, 0, after).contiguous(), prev, group))
        if before:
            ops.append(dist.P2POp(dist.irecv, top, prev, group))
    if rank < world - 1:
        nxt = _global(group, rank + 1)
        if before:
            ops.append(dist.P2POp(dist.isend, x.narrow(dim, rows - before, before).contiguous(), nxt, group))
        if after:
            ops.append(dist.P2POp(dist.irecv, bottom, nxt, group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return torch.cat([top, x, bottom], dim=dim)


def group_norm(
    x: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None, eps: float, group=None
) -> Tensor:
    """torch.nn.functional.group_norm over the rows of every rank of `group` (x: B C ...).

    Each rank computes its count n_r, mean m_r and sum of squared deviations M2_r per (B, G),
    then all ranks combine them (Chan et al.):
        n = sum n_r,  m = sum n_r m_r / n,  M2 = sum (M2_r + n_r (m_r - m)^2),  var = M2 / n
    which, unlike sum(x^2)/n - m^2, does not cancel when |m| >> std. The combination runs in
    float64 on B x G numbers; the data pass stays in x's dtype (float32 for half types, as torch does).
    """
    batch, channels = x.shape[0], x.shape[1]
    if channels % num_groups:
        raise ValueError(f"{channels} channels are not divisible by {num_groups} groups")
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    xg = work.reshape(batch, num_groups, -1)
    n_local = xg.shape[-1]
    var_local, mean_local = torch.var_mean(xg, dim=-1, correction=0)
    stats = torch.stack([
        torch.full_like(mean_local, float(n_local), dtype=torch.float64),
        mean_local.double(),
        var_local.double() * n_local,
    ])  # [3, B, G]
    world = dist.get_world_size(group)
    if world > 1:
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats, group=group)
        allstats = torch.stack(gathered)  # [world, 3, B, G]
    else:
        allstats = stats[None]
    n_r, m_r, m2_r = allstats[:, 0], allstats[:, 1], allstats[:, 2]
    n = n_r.sum(0)
    mean = (n_r * m_r).sum(0) / n
    var = (m2_r + n_r * (m_r - mean) ** 2).sum(0) / n
    inv_std = torch.rsqrt(var + eps)
    out = (xg - mean.to(work.dtype)[..., None]) * inv_std.to(work.dtype)[..., None]
    out = out.reshape(x.shape)
    affine_shape = (1, channels) + (1,) * (x.dim() - 2)
    if weight is not None:
        out = out * weight.to(out.dtype).reshape(affine_shape)
    if bias is not None:
        out = out + bias.to(out.dtype).reshape(affine_shape)
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
