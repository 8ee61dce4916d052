"""Model-independent machinery: a declarative sequence-parallel plan and the hooks that apply it.

An adapter describes a diffusers transformer in data (`SequenceParallelPlan`): the block list
whose first block receives the sharded sequence, which forward arguments of that block hold
which part of the layout, which outputs of the last block are gathered back, and a factory for
the attention processor that replaces the model's own. `apply_*` functions install hooks on
the unmodified model; `ParallelHandle.remove()` takes them all off again.

Legend: B batch, L sequence, C channels. "part" indexes `SeqLayout.part_lengths`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

# Attribute set on a parallelized transformer; its presence makes parallelize refuse.
HANDLE_ATTR = "_raydit_parallel_handle"


@dataclass(frozen=True)
class SplitInput:
    """A forward argument of the first block that carries one part of the sequence."""

    arg: str  # keyword name in the block's forward signature
    part: int  # index into SeqLayout.part_lengths
    dim: int = 1  # the sequence dim of the tensor


@dataclass(frozen=True)
class GatherOutput:
    """An element of the last block's output tuple that carries one part of the sequence."""

    index: int  # position in the output tuple
    part: int
    dim: int = 1


@dataclass(frozen=True)
class SequenceParallelPlan:
    """Where a model is split and gathered; validated where built.

    The layout's part lengths are read, at every forward, from the split inputs (the text
    length, the number of video tokens), since they depend on the request.
    """

    blocks: str  # attribute name of the nn.ModuleList of transformer blocks
    split_inputs: tuple[SplitInput, ...]
    gather_outputs: tuple[GatherOutput, ...]
    attention: str  # attribute name of the attention module inside each block

    def __post_init__(self):
        parts = sorted(s.part for s in self.split_inputs)
        if parts != list(range(len(parts))):
            raise ValueError(f"split_inputs parts {parts} must be 0..n-1, each once")
        if sorted(g.part for g in self.gather_outputs) != parts:
            raise ValueError("gather_outputs must gather exactly the parts that split_inputs split")

    @property
    def num_parts(self) -> int:
        return len(self.split_inputs)


@dataclass
class ForwardContext:
    """Per-forward state shared by the split hook, the processors and the gather hook.

    Why mutable: the layout depends on the input lengths, known only when the first block
    runs; the processors, deeper in the call, read it from here. One context per handle.
    """

    mesh: Any
    layout: Any = None  # raydit.parallel.sharding.SeqLayout of the current forward


@dataclass
class ParallelHandle:
    """What `parallelize` installed; `remove()` restores the model exactly."""

    transformer: nn.Module
    adapter_name: str
    context: ForwardContext
    _hooks: list = field(default_factory=list)
    _processors: list = field(default_factory=list)  # (attention module, original processor)
    removed: bool = False

    def remove(self) -> None:
        if self.removed:
            return
        for hook in self._hooks:
            hook.remove()
        for module, processor in self._processors:
            module.set_processor(processor)
        if getattr(self.transformer, HANDLE_ATTR, None) is self:
            delattr(self.transformer, HANDLE_ATTR)
        self.removed = True

    def __enter__(self) -> "ParallelHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _sp_degree(mesh) -> int:
    return mesh.sp


def _bind_arg(module: nn.Module, name: str, args: tuple, kwargs: dict) -> tuple[str, int | None]:
    """Where `name` sits in a call: ("kwargs", None) or ("args", position)."""
    if name in kwargs:
        return "kwargs", None
    params = list(inspect.signature(module.forward).parameters)
    pos = params.index(name)
    if pos < len(args):
        return "args", pos
    raise ValueError(f"{type(module).__name__}.forward was called without `{name}`; cannot shard it")


def apply_split(handle: ParallelHandle, plan: SequenceParallelPlan) -> None:
    """Pre-hook on the first block: pad and shard every split input per the layout."""
    from raydit.parallel.sharding import SeqLayout

    ctx = handle.context
    first = getattr(handle.transformer, plan.blocks)[0]

    def split_hook(module, args, kwargs):
        args = list(args)
        where = [_bind_arg(module, s.arg, args, kwargs) for s in plan.split_inputs]
        full = [kwargs[s.arg] if kind == "kwargs" else args[pos] for s, (kind, pos) in zip(plan.split_inputs, where)]
        lengths = [0] * plan.num_parts
        for spec, x in zip(plan.split_inputs, full):
            lengths[spec.part] = x.shape[spec.dim]
        ctx.layout = SeqLayout(part_lengths=tuple(lengths), sp=_sp_degree(ctx.mesh))
        for spec, x, (kind, pos) in zip(plan.split_inputs, full, where):
            # [B, L_part, C] -> [B, chunk_part, C] (padded at the part's end, then chunked)
            local = ctx.layout.shard(x, spec.part, ctx.mesh.sp_index, dim=spec.dim)
            if kind == "kwargs":
                kwargs[spec.arg] = local
            else:
                args[pos] = local
        return tuple(args), kwargs

    handle._hooks.append(first.register_forward_pre_hook(split_hook, with_kwargs=True))


def apply_gather(handle: ParallelHandle, plan: SequenceParallelPlan) -> None:
    """Forward hook on the last block: gather every part back to its full, unpadded length."""
    from raydit.parallel.mesh import gather_sequence

    ctx = handle.context
    last = getattr(handle.transformer, plan.blocks)[-1]

    def gather_hook(module, args, output):
        out = list(output)
        for spec in plan.gather_outputs:
            # [B, chunk_part, C] -> [B, L_part, C]
            out[spec.index] = gather_sequence(out[spec.index], ctx.mesh, ctx.layout, spec.part, dim=spec.dim)
        return type(output)(out) if isinstance(output, tuple) else out

    handle._hooks.append(last.register_forward_hook(gather_hook))


def apply_attention(handle: ParallelHandle, plan: SequenceParallelPlan, make_processor: Callable) -> None:
    """Swap the processor of each block's attention for the sequence-parallel one."""
    for block in getattr(handle.transformer, plan.blocks):
        attn = getattr(block, plan.attention)
        handle._processors.append((attn, attn.processor))
        attn.set_processor(make_processor(handle.context))


class ModelAdapter:
    """Base of every model adapter: a plan, a processor factory, and model-specific checks."""

    name: str = ""
    transformer_classes: tuple[type, ...] = ()
    plan: SequenceParallelPlan

    def validate(self, transformer: nn.Module, mesh) -> None:
        """Raise ValueError when this transformer cannot run on this mesh."""

    def make_processor(self, context: ForwardContext):
        raise NotImplementedError

    def parallelize(self, transformer: nn.Module, mesh) -> ParallelHandle:
        existing = getattr(transformer, HANDLE_ATTR, None)
        if existing is not None:
            raise ValueError(
                f"{type(transformer).__name__} is already parallelized by raydit ({existing.adapter_name}); "
                "call handle.remove() or raydit.models.unparallelize(transformer) first"
            )
        self.validate(transformer, mesh)
        handle = ParallelHandle(transformer=transformer, adapter_name=self.name, context=ForwardContext(mesh=mesh))
        try:
            apply_attention(handle, self.plan, self.make_processor)
            apply_split(handle, self.plan)
            apply_gather(handle, self.plan)
        except Exception:
            handle.remove()
            raise
        setattr(transformer, HANDLE_ATTR, handle)
        return handle
