"""Sequence-parallel attention: Ulysses all-to-all inside, ring of K/V blocks across.

Legend: B batch, H all heads, h = H / U heads of one Ulysses rank, c heads of one head chunk
(a slice of the h), S local tokens of one rank (layout.local_len), U ulysses degree, R ring
degree, D head dim, T = U * S tokens of a Ulysses group (one ring block), N tensors stacked
in one exchange (3: q, k, v).

Per rank:  q,k,v (B, H, S, D)  --all-to-all over ulysses_group-->  (B, h, T, D)
           ring over ring_group: keep q, pass each (k, v) block around, merge with lse
           out (B, h, T, D)    --all-to-all back----------------->  (B, H, S, D)
Pad keys are dropped from each block before the kernel (the layout tells every rank which
tokens are pad without communication); pad queries are computed and dropped at gather.

Overlap: the h heads of a Ulysses rank are cut into head chunks (`head_chunks`). q, k and v
of one chunk travel in ONE all-to-all; while chunk i is attended (ring included), the
all-to-all of chunk i+1 is in flight, and the output of chunk i travels back while chunk
i+1 is computed. Only the first chunk's exchange in and the last one's exchange out are
exposed. The collectives are posted with async_op=True: on NCCL they run on NCCL's own
stream and `wait()` orders the compute stream after them; on gloo a background thread
moves the bytes. Every rank posts the collectives in the same order (in 0, in 1, out 0,
in 2, out 1, ...), which is what a process group requires.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist
from torch import Tensor

from raydit.parallel.kernels import KERNELS, AttentionKernel, default_kernel, plain_kernel
from raydit.parallel.kernels.lowbit import KERNELS as LOWBIT_KERNELS
from raydit.parallel.kernels.sparse import VideoMask
from raydit.parallel.mesh import ParallelMesh, check_layout, mesh_key, mesh_of_key
from raydit.parallel.opaque import fresh
from raydit.parallel.sharding import SeqLayout, select_ranges
from raydit.parallel.sparse_ring import block_positions, ring_tally, sparse_kernel, sparse_ring_attention

# Set inside `full_precision_attention()`: sp_attention runs the run dtype's kernels whatever its
# mesh's attention mode (a Runner's full-precision steps). Read when sp_attention runs, also
# under compile (the opaque op runs it eagerly), so a compiled graph serves both.
_FULL_PRECISION: list = []
# Set inside `sparse_attention(source)`: a call given no mask and no kernel asks source(layout)
# for one (a VideoMask, or None: dense). The models layer knows where the video sits in a
# layout and which block runs; the processors stay as they are.
_SPARSE_SOURCE: list = []


# -- pure math -----------------------------------------------------------------------------
def merge_attention(
    out_a: Tensor | None, lse_a: Tensor | None, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets; returns (out, lse) in float32, or in
    float64 where the partials are float64 (a float64 run stays float64 through the ring).

    out_* (B, H, Sq, D), lse_* (B, H, Sq). With a = keys of block a, b = keys of block b:
        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b
    Stable form: subtract m = max(lse_a, lse_b) before exponentiating, so the weights
    w_a = exp(lse_a - m), w_b = exp(lse_b - m) lie in [0, 1] and one of them is 1:
        lse = m + log(w_a + w_b),  out = (w_a out_a + w_b out_b) / (w_a + w_b)
    A row whose both lse are -inf (no key yet) uses m = 0: weights 0, lse -inf, out 0, no NaN.
    `out_a is None` starts the accumulation.
    """
    acc = torch.promote_types(torch.float32, torch.promote_types(out_b.dtype, lse_b.dtype))
    if out_a is None or lse_a is None:
        return out_b.to(acc), lse_b.to(acc)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    lse = m + torch.log(total)
    # total >= 1 wherever a row has a key; clamp only guards the all -inf rows (0 / tiny = 0).
    inv = (1.0 / total.clamp_min(torch.finfo(acc).tiny)).unsqueeze(-1)
    # One new (B, H, Sq, D) tensor, updated in place: out_a * w_a/total + out_b * w_b/total.
    out = (out_a.to(acc) * (w_a.unsqueeze(-1) * inv)).addcmul_(out_b.to(acc), w_b.unsqueeze(-1) * inv)
    return out, lse


def seq_to_head_send(xs_BHSD: list[Tensor] | tuple[Tensor, ...], ulysses: int,
                     heads: tuple[int, int] | None = None) -> Tensor:
    """N tensors (B, H, S, D) -> one buffer (U, N, B, c, S, D): slice j of dim 0 goes to Ulysses rank j.

    N > 1 stacks several tensors (q, k, v) so one all-to-all moves them all. `heads` =
    (start, stop) picks a chunk of the h heads each Ulysses rank will own (default: all h):
    rank j receives heads j*h + start .. j*h + stop - 1.
    """
    B, H, S, D = xs_BHSD[0].shape
    assert H % ulysses == 0, "caller checks head divisibility"
    h = H // ulysses
    start, stop = (0, h) if heads is None else heads
    assert 0 <= start < stop <= h, (start, stop, h)
    send = xs_BHSD[0].new_empty(ulysses, len(xs_BHSD), B, stop - start, S, D)
    for i, x_BHSD in enumerate(xs_BHSD):
        # (B, H, S, D) -> (B, U, h, S, D) -> chunk (B, U, c, S, D) -> (U, B, c, S, D): a view.
        send[:, i].copy_(x_BHSD.unflatten(1, (ulysses, h))[:, :, start:stop].permute(1, 0, 2, 3, 4))
    return send


def seq_to_head_recv(x_UNBhSD: Tensor) -> Tensor:
    """Received (U, N, B, h, S, D), slice j from Ulysses rank j -> (N, B, h, U*S, D).

    Rank j holds sequence chunk j, so concatenating along the sequence in j order gives the
    Ulysses group's tokens in order: [local seq of rank 0 | local seq of rank 1 | ...].
    """
    U, N, B, h, S, D = x_UNBhSD.shape
    return x_UNBhSD.permute(1, 2, 3, 0, 4, 5).reshape(N, B, h, U * S, D)


def head_to_seq_send(x_BhTD: Tensor, ulysses: int) -> Tensor:
    """(B, h, U*S, D) -> (U, B, h, S, D) contiguous: sequence chunk j goes back to Ulysses rank j."""
    B, h, T, D = x_BhTD.shape
    assert T % ulysses == 0, "a Ulysses block is U local sequences"
    return x_BhTD.reshape(B, h, ulysses, T // ulysses, D).permute(2, 0, 1, 3, 4).contiguous()


def head_to_seq_recv(x_UBhSD: Tensor) -> Tensor:
    """Received (U, B, h, S, D), slice j = head slice j of my tokens -> (B, U*h = H, S, D)."""
    U, B, h, S, D = x_UBhSD.shape
    return x_UBhSD.permute(1, 0, 2, 3, 4).reshape(B, U * h, S, D)


def head_chunks_of(h: int, chunks: int) -> list[tuple[int, int]]:
    """Cut h heads into min(chunks, h) contiguous (start, stop) slices whose sizes differ by at
    most one (15 heads in 4: 4, 4, 4, 3)."""
    n = max(1, min(chunks, h))
    base, extra = divmod(h, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


@functools.lru_cache(maxsize=256)
def ring_block_ranges(layout: SeqLayout, ulysses: int, ring: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Real-key ranges of the block of each ring rank r: the local sequences of sp indices
    r*U .. r*U + U - 1, as the Ulysses all-to-all concatenates them (same on every rank)."""
    return tuple(layout.key_ranges(range(r * ulysses, (r + 1) * ulysses)) for r in range(ring))


def feasible_ulysses(heads: int) -> list[int]:
    return [d for d in range(1, heads + 1) if heads % d == 0]


# -- communication ------------------------------------------------------------------------
def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """all_to_all_single along dim 0 (one slice per group rank)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class PendingAllToAll:
    """An all_to_all_single in flight (async_op=True); `wait()` returns the received buffer.

    It holds the send buffer until then: a collective's buffers must outlive it.
    """

    def __init__(self, send: Tensor, group: dist.ProcessGroup):
        self._send = send
        self._recv = torch.empty_like(send)
        self._work = dist.all_to_all_single(self._recv, send, group=group, async_op=True)

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work, self._send = None, None
        return self._recv


class RingComm:
    """Sends a block to the next ring rank while receiving one from the previous.

    Usage per step: `nxt = comm.send_recv(block)` (once per tensor), `comm.commit()`,
    compute on the current block, `comm.wait()`. All sends and receives of a step are posted
    together (batch_isend_irecv) before the compute, so neither side blocks on the other.
    """

    def __init__(self, mesh: ParallelMesh):
        self._group = mesh.ring_group
        self._prev, self._next = mesh.ring_prev, mesh.ring_next
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []
        self._in_flight: list[Tensor] = []  # buffers must outlive their ops

    def send_recv(self, block: Tensor) -> Tensor:
        # Point-to-point ops need contiguous buffers; empty_like would copy odd strides.
        block = block.contiguous()
        recv = torch.empty(block.shape, dtype=block.dtype, device=block.device)
        ring_tally.add(block)
        self._ops.append(dist.P2POp(dist.isend, block, self._next, self._group))
        self._ops.append(dist.P2POp(dist.irecv, recv, self._prev, self._group))
        self._in_flight += [block, recv]
        return recv

    def commit(self) -> None:
        assert not self._reqs, "wait() before the next commit()"
        self._reqs = dist.batch_isend_irecv(self._ops)
        self._ops = []

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs, self._in_flight = [], []


def ring_attention(
    q_BhTD: Tensor,
    k_BhTD: Tensor,
    v_BhTD: Tensor,
    mesh: ParallelMesh,
    block_ranges: tuple[tuple[tuple[int, int], ...], ...],
    scale: float,
    kernel: AttentionKernel,
) -> Tensor:
    """Attention of local queries over the K/V blocks of every ring rank -> (B, h, T, D).

    `block_ranges[r]` are the real-key ranges of the block that ring rank r holds; a block
    of pad only is skipped (it contributes nothing). The next block is received while the
    current one is computed on.
    """
    R = mesh.ring
    comm = RingComm(mesh)
    out = lse = None
    k, v = k_BhTD, v_BhTD
    for step in range(R):
        if step + 1 < R:
            next_k, next_v = comm.send_recv(k), comm.send_recv(v)
            comm.commit()
        # At step t this rank holds the block that started on ring rank (ring_rank - t).
        ranges = block_ranges[(mesh.ring_rank - step) % R]
        if ranges:
            block_out, block_lse = kernel(q_BhTD, select_ranges(k, ranges, 2), select_ranges(v, ranges, 2), scale)
            out, lse = merge_attention(out, lse, block_out, block_lse)
        if step + 1 < R:
            comm.wait()
            k, v = next_k, next_v
    assert out is not None, "the layout holds at least one real token"
    return out.to(q_BhTD.dtype)


DEFAULT_HEAD_CHUNKS = 4


@contextlib.contextmanager
def full_precision_attention():
    """Inside: every sp_attention of this process runs attention mode "bf16" (the run dtype's
    kernels) instead of its mesh's 8-bit or measured mode; nested uses are fine."""
    _FULL_PRECISION.append(True)
    try:
        yield
    finally:
        _FULL_PRECISION.pop()


@contextlib.contextmanager
def sparse_attention(source):
    """Inside: every sp_attention of this process given neither `sparse` nor `kernel` takes the
    mask source(layout) returns (None: that call runs dense); the innermost source wins."""
    _SPARSE_SOURCE.append(source)
    try:
        yield
    finally:
        _SPARSE_SOURCE.pop()


def sp_attention(
    q_BHSD: Tensor,
    k_BHSD: Tensor,
    v_BHSD: Tensor,
    mesh: ParallelMesh,
    layout: SeqLayout,
    scale: float | None = None,
    kernel: AttentionKernel | None = None,
    head_chunks: int | None = None,
    sparse: VideoMask | None = None,
) -> Tensor:
    """Full (non-causal) attention over the whole sp-sharded sequence; local shard in and out.

    q, k, v: this rank's local sequence (layout.local_len tokens) with all heads, (B, H, S, D).
    Returns (B, H, S, D) in q's dtype; rows of pad queries are defined but meaningless.
    head_chunks: how many chunks the Ulysses exchange is pipelined in (module docstring;
    default DEFAULT_HEAD_CHUNKS, at most h = H / ulysses; 1 = no overlap).
    kernel: the LSE kernel for every layout; None: the fastest that passed the float64 check
    on (device, dtype, D) (raydit.parallel.kernels), and with ring degree 1, where no lse is
    merged, torch's scaled_dot_product_attention.
    sparse: a sparse-attention mask in global token positions (raydit.parallel.sparse_ring):
    every layout then runs the block-sparse kernel, and the ring sends a K/V block only to
    the ranks that attend it; `kernel` must be None.
    """
    check_layout(mesh, layout)
    if q_BHSD.dim() != 4 or k_BHSD.shape != q_BHSD.shape or v_BHSD.shape != q_BHSD.shape:
        raise ValueError(
            f"q, k, v must share one (batch, heads, tokens, head_dim) shape; got "
            f"{tuple(q_BHSD.shape)}, {tuple(k_BHSD.shape)}, {tuple(v_BHSD.shape)}"
        )
    if not q_BHSD.dtype == k_BHSD.dtype == v_BHSD.dtype or not q_BHSD.device == k_BHSD.device == v_BHSD.device:
        # As torch's SDPA refuses; the Ulysses exchange packs q, k, v into one buffer and would
        # cast k and v to q's dtype without a word.
        raise ValueError(
            f"q, k, v must share one dtype and device; got {q_BHSD.dtype} on {q_BHSD.device}, {k_BHSD.dtype} on "
            f"{k_BHSD.device}, {v_BHSD.dtype} on {v_BHSD.device}: cast them to one before attention"
        )
    B, H, S, D = q_BHSD.shape
    if S != layout.local_len:
        raise ValueError(
            f"q has {S} tokens, but this rank's local sequence is {layout.local_len} tokens "
            f"(parts {layout.part_lengths} over sp={layout.sp}); shard the inputs with the same SeqLayout"
        )
    U = mesh.ulysses
    if H % U:
        raise ValueError(
            f"ulysses_degree {U} does not divide the {H} attention heads; "
            f"feasible: {', '.join(map(str, feasible_ulysses(H)))}"
        )
    if head_chunks is None:
        head_chunks = DEFAULT_HEAD_CHUNKS
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks {head_chunks!r} must be an integer >= 1 (1: no overlap)")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if sparse is None and kernel is None and _SPARSE_SOURCE:
        sparse = _SPARSE_SOURCE[-1](layout)
    if sparse is not None and kernel is not None:
        raise ValueError(f"kernel {kernel.name!r} and sparse attention were both given; the sparse mask runs "
                         "its own kernel: pass kernel=None")
    if sparse is not None and sparse.total_tokens != layout.total_len:
        raise ValueError(f"the sparse mask covers {sparse.total_tokens} tokens but the layout holds "
                         f"{layout.total_len} ({layout.part_lengths}); build the mask for this sequence")
    if torch.compiler.is_compiling():
        if sparse is not None:
            raise ValueError("sparse attention does not run under torch.compile yet; run it eager")
        # Dynamo cannot trace the async collectives below: one opaque op instead, so the
        # transformer block around it stays one graph (raydit.parallel.opaque).
        if kernel is not None and KERNELS.get(kernel.name) is not kernel.fn:
            raise ValueError(
                f"attention kernel {kernel.name!r} is not one of raydit's ({', '.join(KERNELS)}); "
                "a compiled model can name only those: pass kernel=None or select_kernel(...)"
            )
        return sp_attention_op(q_BHSD, k_BHSD, v_BHSD, mesh_key(mesh), list(layout.part_lengths), float(scale),
                               "" if kernel is None else kernel.name, head_chunks)
    # Ring 1 needs no lse: unless a kernel is forced, torch's SDPA runs there (it may pick a
    # backend that cannot return the lse, cuDNN on Hopper, faster than every LSE kernel).
    # The attention mode (mesh.attention) picks the LSE kernel; where that is a full-precision
    # kernel (bf16, or what auto measured fastest), ring 1 may run torch's SDPA instead.
    plain = None
    if sparse is not None:
        pass
    elif kernel is None:
        kernel = default_kernel(q_BHSD.device, q_BHSD.dtype, D, "bf16" if _FULL_PRECISION else mesh.attention)
        if mesh.ring == 1 and kernel.name not in LOWBIT_KERNELS:
            plain = plain_kernel(q_BHSD.device, q_BHSD.dtype, D)

    block_ranges = ring_block_ranges(layout, U, mesh.ring)

    def attend(q_BcTD: Tensor, k_BcTD: Tensor, v_BcTD: Tensor) -> Tensor:
        if sparse is not None:
            if mesh.ring == 1:  # pad tokens sit at position -1, which the mask never allows
                pos = block_positions(layout, U, 0)
                return sparse_kernel(q_BcTD, k_BcTD, v_BcTD, pos, pos, sparse, scale)[0].to(q_BcTD.dtype)
            return sparse_ring_attention(q_BcTD, k_BcTD, v_BcTD, mesh, layout, sparse, scale, merge_attention)
        if mesh.ring == 1:
            ranges = block_ranges[0]
            k_real, v_real = select_ranges(k_BcTD, ranges, 2), select_ranges(v_BcTD, ranges, 2)
            if plain is not None and q_BcTD.size(2) and k_real.size(2):
                return plain(q_BcTD, k_real, v_real, scale)
            return kernel(q_BcTD, k_real, v_real, scale)[0]
        return ring_attention(q_BcTD, k_BcTD, v_BcTD, mesh, block_ranges, scale, kernel)

    if U == 1:
        return attend(q_BHSD, k_BHSD, v_BHSD)

    group = mesh.ulysses_group
    chunks = head_chunks_of(H // U, head_chunks)
    qkv = (q_BHSD, k_BHSD, v_BHSD)

    def post_in(heads: tuple[int, int]) -> PendingAllToAll:
        # q, k, v of one head chunk in one all-to-all: (U, 3, B, c, S, D).
        return PendingAllToAll(seq_to_head_send(qkv, U, heads), group)

    out_BUhSD = q_BHSD.new_empty(B, U, H // U, S, D)
    pending_out: list[tuple[tuple[int, int], PendingAllToAll]] = []
    pending_in = post_in(chunks[0])
    for i, heads in enumerate(chunks):
        # (U, 3, B, c, S, D) -> q, k, v (B, c, T, D) of heads j*h + heads[0].. for every Ulysses rank j.
        recv = pending_in.wait()
        if i + 1 < len(chunks):
            pending_in = post_in(chunks[i + 1])  # in flight while chunk i is attended
        q_BcTD, k_BcTD, v_BcTD = seq_to_head_recv(recv)
        out_BcTD = attend(q_BcTD, k_BcTD, v_BcTD)
        # (B, c, T, D) -> (U, B, c, S, D): in flight while chunk i+1 is attended.
        pending_out.append((heads, PendingAllToAll(head_to_seq_send(out_BcTD, U), group)))
    for (start, stop), pending in pending_out:
        # Received (U, B, c, S, D): slice j = heads j*h + start..stop of my tokens.
        out_BUhSD[:, :, start:stop] = pending.wait().permute(1, 0, 2, 3, 4)
    return out_BUhSD.view(B, H, S, D)


# -- under torch.compile ---------------------------------------------------------------------
# sp_attention as one opaque op (raydit.parallel.opaque says why): while a block is compiled
# Dynamo sees the fake, a tensor of q's shape; the compiled block calls sp_attention, eager.
@torch.library.custom_op("raydit::sp_attention", mutates_args=())
def sp_attention_op(
    q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, mesh_id: int, part_lengths: list[int],
    scale: float, kernel: str, head_chunks: int,
) -> Tensor:
    """sp_attention, eager: `mesh_id` is mesh_key(mesh), `kernel` "" the default kernel."""
    mesh = mesh_of_key(mesh_id)
    chosen = AttentionKernel(kernel, KERNELS[kernel]) if kernel else None
    out = sp_attention(q_BHSD, k_BHSD, v_BHSD, mesh, SeqLayout(tuple(part_lengths), mesh.sp), scale, chosen, head_chunks)
    return fresh(out, (q_BHSD, k_BHSD, v_BHSD))


@sp_attention_op.register_fake
def _(q_BHSD, k_BHSD, v_BHSD, mesh_id, part_lengths, scale, kernel, head_chunks):
    return q_BHSD.new_empty(q_BHSD.shape)  # (B, H, S, D) in, (B, H, S, D) out, contiguous
