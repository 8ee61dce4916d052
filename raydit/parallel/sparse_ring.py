"""Sparse attention across ranks: global token positions of each block, and the ring that
sends a K/V block only to the ranks whose queries attend it.

Legend: B batch, h heads of one Ulysses rank, T tokens of a Ulysses group (one ring block,
U local sequences), D head dim, R ring degree.

Positions: every rank derives, from the SeqLayout alone, the global position of each token
of every ring block (the parts concatenated unpadded; -1 for pad). The mask
(raydit.parallel.kernels.sparse.VideoMask) is in those coordinates, so what a rank computes
on its queries against one block is exactly that block's share of one-process attention.

Transfer: `needs[o][r]` says whether any query of ring rank r attends any key of ring rank
o's block; every rank computes the same table, so no mask is exchanged. Today's dense ring
passes each block along the ring (a block rank r skips would still transit it); here at step
t the owner o sends its block straight to rank o + t, and only where needs[o][o + t], while
rank r receives from r - t only where needs[r - t][r]. Both sides skip the same pairs.
The block of step t is computed on while step t + 1 is in flight; partial results merge by
their lse in float32 (merge_attention).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from raydit.parallel.kernels.sparse import VideoMask, block_sparse_attention, flex_block_sparse_attention
from raydit.parallel.mesh import ParallelMesh
from raydit.parallel.sharding import SeqLayout


class RingTally:
    """Bytes this process sent on a ring (dense or sparse), for benchmarks and tests."""

    def __init__(self) -> None:
        self.bytes_sent = 0

    def add(self, t: Tensor) -> None:
        self.bytes_sent += t.numel() * t.element_size()


ring_tally = RingTally()


@functools.lru_cache(maxsize=256)
def _positions(layout: SeqLayout, sp_indices: tuple[int, ...]) -> tuple[int, ...]:
    starts = [sum(layout.part_lengths[:p]) for p in range(layout.num_parts)]
    out: list[int] = []
    for s in sp_indices:
        for p, (length, chunk) in enumerate(zip(layout.part_lengths, layout.chunk_lengths)):
            first = s * chunk
            out += [starts[p] + first + i if first + i < length else -1 for i in range(chunk)]
    return tuple(out)


def block_positions(layout: SeqLayout, ulysses: int, ring_rank: int) -> Tensor:
    """Global positions (int64, -1 for pad) of the T = U * local_len tokens of ring rank
    `ring_rank`'s block, in the order the Ulysses all-to-all concatenates them."""
    return torch.tensor(_positions(layout, tuple(range(ring_rank * ulysses, (ring_rank + 1) * ulysses))),
                        dtype=torch.int64)


@functools.lru_cache(maxsize=64)
def needs_table(mask: VideoMask, layout: SeqLayout, ulysses: int, ring: int) -> tuple[tuple[bool, ...], ...]:
    """needs[o][r]: whether a query of ring rank r attends a key of ring rank o's block (from the
    mask's class tables, VideoMask.any_allowed: no token-pair mask)."""
    pos = [block_positions(layout, ulysses, r) for r in range(ring)]
    return tuple(tuple(mask.any_allowed(pos[r], pos[o]) for r in range(ring)) for o in range(ring))


def sparse_kernel(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, mask: VideoMask,
                  scale: float) -> tuple[Tensor, Tensor]:
    """FlexAttention on CUDA, the block-skipping torch kernel elsewhere; (out, lse)."""
    if q.device.type == "cuda":
        return flex_block_sparse_attention(q, k, v, q_pos, k_pos, mask, scale)
    return block_sparse_attention(q, k, v, q_pos, k_pos, mask, scale)


class SparseRingComm:
    """Owner-to-reader point-to-point sends of K/V blocks, one ring distance per step."""

    def __init__(self, mesh: ParallelMesh):
        self._group = mesh.ring_group
        self._ring, self._me = mesh.ring, mesh.ring_rank
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []
        self._in_flight: list[Tensor] = []

    def _peer(self, ring_rank: int) -> int:
        # Ring groups list their ranks ascending, i.e. in ring order (raydit.parallel.mesh).
        return dist.get_global_rank(self._group, ring_rank % self._ring)

    def send(self, block: Tensor, distance: int) -> None:
        block = block.contiguous()
        ring_tally.add(block)
        self._ops.append(dist.P2POp(dist.isend, block, self._peer(self._me + distance), self._group))
        self._in_flight.append(block)

    def recv(self, like: Tensor, distance: int) -> Tensor:
        buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        self._ops.append(dist.P2POp(dist.irecv, buf, self._peer(self._me - distance), self._group))
        self._in_flight.append(buf)
        return buf

    def commit(self) -> None:
        assert not self._reqs, "wait() before the next commit()"
        if self._ops:
            self._reqs = dist.batch_isend_irecv(self._ops)
        self._ops = []

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs, self._in_flight = [], []


def sparse_ring_attention(q_BhTD: Tensor, k_BhTD: Tensor, v_BhTD: Tensor, mesh: ParallelMesh, layout: SeqLayout,
                          mask: VideoMask, scale: float, merge) -> Tensor:
    """Sparse attention of local queries over every ring block that they attend -> (B, h, T, D)."""
    R, me, U = mesh.ring, mesh.ring_rank, mesh.ulysses
    needs = needs_table(mask, layout, U, R)
    q_pos = block_positions(layout, U, me)
    comm = SparseRingComm(mesh)
    out = lse = None

    def post(step: int) -> tuple[Tensor, Tensor] | None:
        # Step `step`: send mine to me + step, receive the block of me - step: where needed.
        if needs[me][(me + step) % R]:
            comm.send(k_BhTD, step)
            comm.send(v_BhTD, step)
        got = None
        if needs[(me - step) % R][me]:
            got = comm.recv(k_BhTD, step), comm.recv(v_BhTD, step)
        comm.commit()
        return got

    current: tuple[Tensor, Tensor] | None = (k_BhTD, v_BhTD) if needs[me][me] else None
    for step in range(R):
        nxt = post(step + 1) if step + 1 < R else None
        if current is not None:
            owner = (me - step) % R
            block_out, block_lse = sparse_kernel(q_BhTD, current[0], current[1], q_pos,
                                                 block_positions(layout, U, owner), mask, scale)
            out, lse = merge(out, lse, block_out, block_lse)
        if step + 1 < R:
            comm.wait()
            current = nxt
    if out is None:  # no local query attends anything (all pad): zeros, as for pad rows
        return torch.zeros_like(q_BhTD)
    return out.to(q_BhTD.dtype)
