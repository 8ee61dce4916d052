"""Inference-only weight sharding: each rank of a group keeps 1/N of every block's parameters.

Layout of one block: its managed parameters laid end to end as raw bytes in one flat buffer
(`BlockLayout`), each where its address has the same remainder modulo ALIGN bytes as the
parameter it replaces (CPU GEMMs take other code paths, and round differently, on other
alignments: safetensors' loader leaves weights at any 4-byte address, and the sharded run
must compute as the unsharded one does), the total padded to N equal ALIGN-aligned chunks. Rank r keeps chunk r (`shard`, uint8). Before the block
runs, the chunks are all-gathered into a full flat buffer (bytes: bit-exact, any dtype, one
collective per block, and gloo has no bfloat16 while uint8 is everywhere) and every
parameter's `.data` becomes a view of its bytes; after the block ran, `.data` is an empty
tensor again and the buffer is freed.

    flat_U8 = [p0 bytes | pad | p1 bytes | pad | ... | pad]   len = N * chunk
    shard_U8 (rank r) = flat_U8[r * chunk:(r + 1) * chunk]

Overlap: while block i runs, block i+1's gather is already posted (async_op=True: gloo's
own thread on CPU; on CUDA posted from a side stream, so NCCL's stream waits for the
shard's producer only and the compute stream waits for the gather only where block i+1
starts). So at most two blocks are full at once: the running one and the next.

Why not FSDP2 (`torch.distributed.fsdp.fully_shard`)? It runs on torch 2.13 CPU/gloo in
float32 and bfloat16 (checked), but it converts the parameters to DTensors in place and
swaps the modules' classes, with no way to undo it: raydit keeps one warm pipeline per rank
and re-parallelizes it on every regroup (Runner.close() restores the model exactly, the next
mesh may have another size and other members, some of them new), rebuilding the shards from
the checkpoint files. Our hooks stay plain module hooks outside the compiled block forwards
(raydit.models.compile) and leave the parameters plain tensors between forwards, so peft's
LoRA injection and diffusers' `.to()` see ordinary modules.

A tensor-subclass parameter (torch's traceable wrapper subclasses: torchao's Float8Tensor, an
FP8 weight with its float32 row scales) is laid out as its inner tensors
(`__tensor_flatten__`: qdata's bytes, then scale's), each a piece of the flat buffer, and
rebuilt around the gathered views (`__tensor_unflatten__`, with the flattening's own
metadata and the outer shape kept in the layout) as a new parameter at every gather.
Between forwards such a parameter is a plain empty tensor of its outer dtype, never the
subclass around empty data: torchao's Float8Tensor takes its shape from its FP8 data (every
`.to()` rebuilds it from there), so an emptied one would be shapeless to whatever reads it.

Legend: U8 raw bytes (torch.uint8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

ALIGN = 64  # bytes: every parameter view and every rank's chunk starts 64-byte aligned
SHARD_BUFFER = "_raydit_weight_shard"  # the block's non-persistent buffer: .to(device) moves it
SHARDED_ATTR = "_raydit_sharded_weights"  # set on a module whose blocks a live handle shards


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class Piece:
    """One tensor's bytes in the flat buffer: a plain parameter's, or one inner tensor (`inner`)
    of a tensor-subclass parameter's."""

    inner: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes
    nbytes: int
    misalign: int  # the original address modulo ALIGN (offset has the same remainder)
    # The original strides of a dense but non-contiguous tensor (a transposed weight: its
    # bytes kept in memory order and viewed back with these strides, so its GEMMs take the
    # same path); None: contiguous.
    stride: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Entry:
    """One managed parameter: where it lives and where its bytes sit in the flat buffer."""

    module: nn.Module
    attr: str  # the parameter's name in `module`
    name: str  # its name relative to the block (state-dict style)
    dtype: torch.dtype  # the parameter's (a subclass's outer dtype)
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    # A tensor-subclass parameter: (its class, its __tensor_flatten__ metadata, outer stride).
    subclass: tuple | None = None

    def value(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The parameter's value from its pieces' tensors."""
        if self.subclass is None:
            return tensors[0]
        cls, meta, stride = self.subclass
        return cls.__tensor_unflatten__({p.inner: t for p, t in zip(self.pieces, tensors, strict=True)},
                                        meta, torch.Size(self.shape), stride)

    def put(self, value: torch.Tensor) -> None:
        """`value` becomes the parameter: its data (a plain parameter keeps its object), or a
        new parameter (a subclass, or the plain empty stand-in of a released subclass)."""
        if self.subclass is None:
            getattr(self.module, self.attr).data = value
        else:
            self.module._parameters[self.attr] = nn.Parameter(value, requires_grad=False)


def _parts(tensor: torch.Tensor) -> tuple[list[tuple[str | None, torch.Tensor]], tuple | None]:
    """[(inner name or None, tensor)] whose bytes hold `tensor`, and its subclass metadata."""
    if not is_traceable_wrapper_subclass(tensor):
        return [(None, tensor)], None
    names, meta = tensor.__tensor_flatten__()
    parts = [(n, getattr(tensor, n)) for n in names]
    nested = [n for n, t in parts if is_traceable_wrapper_subclass(t)]
    if nested:
        raise ValueError(f"a {type(tensor).__name__} parameter holds tensor subclasses ({', '.join(nested)}); "
                         "weight sharding lays out plain tensors and one level of subclass only")
    return parts, (type(tensor), meta, tuple(tensor.stride()))


@dataclass(frozen=True)
class BlockLayout:
    entries: tuple[Entry, ...]
    chunk: int  # bytes per rank
    ranks: int

    @property
    def total(self) -> int:
        return self.chunk * self.ranks


def _dense_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """t's strides where t is non-contiguous but dense (its elements fill numel slots of memory
    from its first one, in another order: a transpose); None otherwise (contiguous, or with
    gaps or overlaps, which are laid out contiguous)."""
    if t.is_contiguous() or t.numel() == 0:
        return None
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return None
        expected *= size
    return tuple(t.stride())


def _memory_bytes(t: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """t's bytes as the piece keeps them: in memory order where it keeps t's strides."""
    if stride is None:
        return _bytes_of(t)
    return t.detach().as_strided((t.numel(),), (1,)).view(torch.uint8)


def _typed(raw_U8: torch.Tensor, piece: "Piece") -> torch.Tensor:
    """A piece's bytes viewed as its tensor (its strides where it keeps them)."""
    typed = raw_U8.view(piece.dtype)
    if piece.stride is None:
        return typed.view(piece.shape)
    return typed.as_strided(piece.shape, piece.stride)


def plan_layout(named: list[tuple[str, nn.Module, str, torch.Tensor]], ranks: int) -> BlockLayout:
    """(name, module, attr, tensor) of a block's managed parameters -> their layout over `ranks`."""
    entries, offset = [], 0
    for name, module, attr, tensor in named:
        parts, subclass = _parts(tensor)
        pieces = []
        for inner, t in parts:
            nbytes = t.numel() * t.element_size()
            misalign = t.data_ptr() % ALIGN if t.numel() else 0
            pieces.append(Piece(inner, t.dtype, tuple(t.shape), offset + misalign, nbytes, misalign, _dense_stride(t)))
            offset = _round_up(offset + misalign + nbytes, ALIGN)
        entries.append(Entry(module, attr, name, tensor.dtype, tuple(tensor.shape), tuple(pieces), subclass))
    chunk = _round_up(max(1, -(-offset // ranks)), ALIGN)
    return BlockLayout(tuple(entries), chunk, ranks)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _placed(piece: Piece, source: torch.Tensor, device) -> torch.Tensor:
    """A copy of `source` (the piece's values) in its own storage, at its original alignment."""
    raw = torch.empty(piece.nbytes + ALIGN, dtype=torch.uint8, device=device)
    start = (piece.misalign - raw.data_ptr()) % ALIGN
    if piece.stride is None:
        out = raw[start:start + piece.nbytes]
        out.copy_(_bytes_of(source.to(device=device, dtype=piece.dtype)))
        return out.view(piece.dtype).view(piece.shape)
    out = _typed(raw[start:start + piece.nbytes], piece)
    out.copy_(source.to(device=device, dtype=piece.dtype))  # element by element: exact, into its strides
    return out


def _views(e: Entry, flat: torch.Tensor) -> list[torch.Tensor]:
    return [_typed(flat[p.offset:p.offset + p.nbytes], p) for p in e.pieces]


def _empty(e: Entry, device) -> torch.Tensor:
    """What a released parameter holds: an empty tensor of its (outer) dtype."""
    return torch.empty(0, dtype=e.dtype, device=device)


@dataclass
class ShardedWeights:
    """What `shard_blocks` installed on a list of blocks; `remove()` gives back full weights.

    `resident_bytes`: parameter bytes this handle holds now (shards + gathered blocks);
    `peak_bytes`: the most it held at once since the last `reset_peak()`."""

    blocks: list
    group: object
    rank: int
    ranks: int
    layouts: list = field(default_factory=list)
    prefetch: bool = True
    _hooks: list = field(default_factory=list)
    _full: dict = field(default_factory=dict)  # block index -> gathered flat buffer (installed)
    _pending: dict = field(default_factory=dict)  # block index -> (flat buffer, work, stream)
    _stream: object = None
    resident_bytes: int = 0
    peak_bytes: int = 0
    removed: bool = False

    # -- gather / free --------------------------------------------------------------------
    def _shard(self, i: int) -> torch.Tensor:
        return getattr(self.blocks[i], SHARD_BUFFER)

    def _count(self, delta: int) -> None:
        self.resident_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.resident_bytes

    def _post(self, i: int) -> None:
        """Post block i's all-gather (async), unless it is gathered or posted already."""
        if i in self._full or i in self._pending:
            return
        shard = self._shard(i)
        layout = self.layouts[i]
        stream = None
        if shard.is_cuda:
            # Posted from a side stream: it waits for whatever produced the shard (a .to()),
            # not for the compute posted since; the compute stream waits for it in _install.
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=shard.device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(shard.device))
            with torch.cuda.stream(stream):
                flat = torch.empty(layout.total, dtype=torch.uint8, device=shard.device)
                work = dist.all_gather_into_tensor(flat, shard, group=self.group, async_op=True)
        else:
            flat = torch.empty(layout.total, dtype=torch.uint8, device=shard.device)
            work = dist.all_gather_into_tensor(flat, shard, group=self.group, async_op=True)
        self._count(layout.total)
        self._pending[i] = (flat, work, stream)

    def _install(self, i: int) -> None:
        """Block i's parameters become views of its gathered bytes (gathering it now if no
        prefetch was posted)."""
        if i in self._full:
            return
        self._post(i)
        flat, work, stream = self._pending.pop(i)
        work.wait()
        if stream is not None:
            current = torch.cuda.current_stream(flat.device)
            current.wait_stream(stream)
            flat.record_stream(current)  # allocated on the side stream, used and freed on this one
        for e in self.layouts[i].entries:
            e.put(e.value(_views(e, flat)))
        self._full[i] = flat

    def _release(self, i: int) -> None:
        flat = self._full.pop(i, None)
        if flat is None:
            return
        for e in self.layouts[i].entries:
            e.put(_empty(e, flat.device))
        self._count(-flat.numel())

    def _drain(self) -> None:
        """Finish and drop prefetches that no block used (a forward that skipped blocks)."""
        for i in list(self._pending):
            flat, work, _ = self._pending.pop(i)
            work.wait()
            self._count(-flat.numel())

    # -- hooks ----------------------------------------------------------------------------
    def _install_hooks(self, root: nn.Module | None) -> None:
        n = len(self.blocks)

        def before(i):
            def hook(module, args):
                self._install(i)
                if self.prefetch and i + 1 < n:
                    self._post(i + 1)  # overlaps this block's compute
            return hook

        def after(i):
            def hook(module, args, output):
                self._release(i)
            return hook

        for i, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(before(i)))
            self._hooks.append(block.register_forward_hook(after(i), always_call=True))
        if root is not None:
            def root_before(module, args):
                if self.prefetch:
                    self._post(0)

            def root_after(module, args, output):
                for i in list(self._full):
                    self._release(i)
                self._drain()

            self._hooks.append(root.register_forward_pre_hook(root_before))
            self._hooks.append(root.register_forward_hook(root_after, always_call=True))

    def idle_pass(self) -> None:
        """The gathers of one forward, in its order, without running the blocks: a rank whose
        group runs fewer forwards than another keeps the group's collectives matched."""
        for i in range(len(self.blocks)):
            self._install(i)
            if self.prefetch and i + 1 < len(self.blocks):
                self._post(i + 1)
            self._release(i)

    def gather_all(self) -> None:
        """Every block full (collective over the group): what `remove` does without a source."""
        for i in range(len(self.blocks)):
            self._install(i)

    # -- removal --------------------------------------------------------------------------
    def remove(self, source: Callable[[int], list[torch.Tensor]] | None = None) -> None:
        """Full weights back in every block and the hooks off. source(i): block i's managed
        tensors, full, in layout order (read from the checkpoint files: local, no peer needed;
        the way back after a peer is lost); a tensor-subclass parameter gets the source's plain
        tensor in its outer dtype (the files' unquantized weight: the caller quantizes it
        again, raydit.models.quantize.requantize_rebuilt). None: all-gathered over the group
        (collective), subclasses rebuilt as they were."""
        if self.removed:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._drain()
        for i, block in enumerate(self.blocks):
            layout = self.layouts[i]
            device = self._shard(i).device
            if source is None:
                self._install(i)
                flat = self._full.pop(i)
                for e in layout.entries:  # own storage, not views of one buffer
                    views = _views(e, flat)
                    e.put(e.value([_placed(p, v, device) for p, v in zip(e.pieces, views)]))
                del flat
            else:
                tensors = source(i)
                for e, t in zip(layout.entries, tensors, strict=True):
                    if tuple(t.shape) != e.shape:
                        raise ValueError(f"checkpoint tensor {e.name} has shape {tuple(t.shape)}, the model {e.shape}")
                    # a subclass's parameter becomes a plain one of its outer dtype (as loaded)
                    whole = e.pieces[0] if e.subclass is None else Piece(None, e.dtype, e.shape, 0,
                                                                         t.numel() * e.dtype.itemsize, 0)
                    e.put(_placed(whole, t, device))
            delattr(block, SHARD_BUFFER)
            self.resident_bytes = 0
        for block in self.blocks:
            if getattr(block, SHARDED_ATTR, None) is self:
                delattr(block, SHARDED_ATTR)
        self.removed = True


def _shared_parameters(blocks: list, root: nn.Module | None) -> set[int]:
    """ids of the parameters that more than one block holds, or that `root` uses outside the
    blocks too: they stay whole (a block's release would empty them under the other user, and
    the next block would lay out the emptied tensor)."""
    holders: dict[int, int] = {}
    refs: dict[int, int] = {}
    for block in blocks:
        for p in {id(p) for p in block.parameters()}:
            holders[p] = holders.get(p, 0) + 1
        for _, p in block.named_parameters(remove_duplicate=False):
            refs[id(p)] = refs.get(id(p), 0) + 1
    shared = {p for p, n in holders.items() if n > 1}
    if root is not None:
        outer: dict[int, int] = {}
        for _, p in root.named_parameters(remove_duplicate=False):
            outer[id(p)] = outer.get(id(p), 0) + 1
        shared |= {p for p, n in outer.items() if p in holders and n > refs[p]}
    return shared


def shard_blocks(blocks: list, group, *, root: nn.Module | None = None, prefetch: bool = True,
                 manage: Callable[[str], bool] = lambda name: True) -> ShardedWeights:
    """Keep 1/N of each block's parameters on this rank (N: the group's size) and gather them
    around each block's forward. Local: every rank must hold the same full weights when it
    calls this (they do: loaded from the same files). `manage(name)`: which parameters are
    sharded (others, e.g. LoRA adapters, stay whole on every rank). `root`: the module whose
    forward runs the blocks; its pre-hook posts the first block's gather early and its hook
    frees what a forward left (blocks skipped by step caching). A parameter two blocks share, or
    that `root` also uses outside them, stays whole on every rank."""
    ranks = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if ranks < 2:
        raise ValueError(f"weight sharding needs a group of 2 or more ranks, this one has {ranks}: "
                         "on one rank every weight is resident anyway; drop shard_weights")
    for block in blocks:
        if getattr(block, SHARDED_ATTR, None) is not None:
            raise ValueError(f"a {type(block).__name__} is already sharded; remove() the first handle")
    handle = ShardedWeights(blocks=list(blocks), group=group, rank=rank, ranks=ranks, prefetch=prefetch)
    whole = _shared_parameters(blocks, root)
    for block in blocks:
        named = []
        for full_name, p in block.named_parameters():
            if not manage(full_name) or id(p) in whole:
                continue
            owner, _, attr = full_name.rpartition(".")
            named.append((full_name, block.get_submodule(owner) if owner else block, attr, p))
        layout = plan_layout(named, ranks)
        flat = torch.zeros(layout.total, dtype=torch.uint8, device=named[0][3].device if named else "cpu")
        for e, (_, _, _, p) in zip(layout.entries, named):
            for piece, (_, t) in zip(e.pieces, _parts(p)[0]):
                flat[piece.offset:piece.offset + piece.nbytes] = _memory_bytes(t, piece.stride)
        shard = flat[rank * layout.chunk:(rank + 1) * layout.chunk].clone()
        del flat
        for e in layout.entries:
            e.put(_empty(e, shard.device))
        block.register_buffer(SHARD_BUFFER, shard, persistent=False)
        setattr(block, SHARDED_ATTR, handle)
        handle.layouts.append(layout)
        handle._count(shard.numel())
    handle._install_hooks(root)
    return handle


def resident_parameter_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages behind `module`'s parameters and buffers right now (what a
    rank holds of it; views of one buffer count once)."""
    seen, total = set(), 0
    tensors = [part for t in list(module.parameters()) + list(module.buffers()) for _, part in _parts(t)[0]]
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
