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


# Attribute set on a parallelized transformer; its presence makes parallelize refuse.
HANDLE_ATTR = "_raydit_parallel_handle"


@dataclass(frozen=True)
class SplitInput:
    """A forward argument of the first block that carries one part of the sequence.

    Several inputs may carry one part (they must agree on its length). `ndim`: split the
    argument only when it has this many dims; otherwise it is per sample, not per token, and
    every rank gets it whole (Wan's temb is [B, 6, C], or [B, L, 6, C] with a per-token
    timestep). `every_block`: the model hands the same full tensor to every block instead of
    threading it through the blocks' outputs, so it is split before each block.
    """

    arg: str  # keyword name in the block's forward signature
    part: int  # index into SeqLayout.part_lengths
    dim: int = 1  # the sequence dim of the tensor
    ndim: int | None = None  # split only tensors of this many dims (None: always)
    every_block: bool = False
    # split only tensors at least this long along `dim` (LTX's temb: [B, 1, 6C] per sample, or
    # [B, L, 6C] with the image-to-video per-token timestep)
    min_len: int | None = None
    # split only in forwards where ForwardContext.flags[when] is true (None: always); in the
    # others the part is whole on every rank and has length 0 in the layout (LTX-2's audio
    # stream, split or whole by its length: raydit/models/families/ltx2/adapter.py)
    when: str | None = None

    def applies_to(self, x, flags=None) -> bool:
        if self.when is not None and not (flags or {}).get(self.when):
            return False
        if self.ndim is not None and getattr(x, "ndim", None) != self.ndim:
            return False
        return self.min_len is None or (hasattr(x, "shape") and x.shape[self.dim] >= self.min_len)


@dataclass(frozen=True)
class GatherOutput:
    """An element of the last block's output tuple that carries one part of the sequence.

    A block that returns a single tensor (Wan's) has one GatherOutput, index 0: the tensor.
    """

    index: int  # position in the output tuple
    part: int
    dim: int = 1
    when: str | None = None  # gathered only where its split inputs were split (SplitInput.when)


@dataclass(frozen=True)
class SequenceParallelPlan:
    """Where a model is split and gathered; validated where built.

    The layout's part lengths are read, at every forward, from the split inputs (the text
    length, the number of video tokens), since they depend on the request.
    """

    # attribute name of the nn.ModuleList of transformer blocks, or several names whose lists
    # run one after the other (HunyuanVideo: dual-stream, then single-stream blocks): the
    # split is before the first block of the first list, the gather after the last block of
    # the last list, and every block of every list gets the processor.
    blocks: str | tuple[str, ...]
    split_inputs: tuple[SplitInput, ...]
    gather_outputs: tuple[GatherOutput, ...]
    attention: str  # attribute name of the attention module inside each block

    def __post_init__(self):
        parts = sorted({s.part for s in self.split_inputs})
        if parts != list(range(len(parts))):
            raise ValueError(f"split_inputs parts {parts} must be 0..n-1")
        for part in parts:
            if all(s.ndim is not None for s in self.split_inputs if s.part == part):
                raise ValueError(f"part {part} needs a split input without `ndim`: one that always fixes its length")
        if sorted({g.part for g in self.gather_outputs}) != parts:
            raise ValueError("gather_outputs must gather exactly the parts that split_inputs split")

    @property
    def num_parts(self) -> int:
        return len({s.part for s in self.split_inputs})

    def block_list(self, transformer) -> list:
        """Every block the plan covers, in the order the model runs them."""
        names = (self.blocks,) if isinstance(self.blocks, str) else tuple(self.blocks)
        return [block for name in names for block in getattr(transformer, name)]


@dataclass
class ForwardContext:
    """Per-forward state shared by the split hook, the processors and the gather hook.

    Why mutable: the layout depends on the input lengths, known only when the first block
    runs; the processors, deeper in the call, read it from here. One context per handle.
    """

    mesh: Any
    layout: Any = None  # raydit.parallel.sharding.SeqLayout of the current forward
    # arg -> (full tensor, local shard) of `every_block` split inputs, for this forward only
    split_cache: dict = field(default_factory=dict)
    # what the plan asks of this model beyond the degrees (`parallelize(..., options=)`; e.g.
    # audio_split_tokens), read by the adapter's hooks and processors
    options: dict = field(default_factory=dict)
    # per-forward switches an adapter's hook sets before the first block (SplitInput.when)
    flags: dict = field(default_factory=dict)

    def self_attention(self, processor: str, hidden_states, encoder_hidden_states=None, attention_mask=None,
                       why: str = ""):
        """This forward's (mesh, layout) for a self-attention processor's call on this rank's
        chunk: text is refused (cross-attention keeps its own processor) and so is a mask (the
        split sequence takes none), each in one line naming the processor and `why`."""
        if encoder_hidden_states is not None:
            raise ValueError(f"{processor} serves self-attention (attn1) only; cross-attention keeps its own")
        if attention_mask is not None:
            raise ValueError(f"{processor}: attention_mask is not supported under sequence parallelism{why}")
        if self.layout is None:
            raise RuntimeError("the split hook did not run before attention")
        assert hidden_states.shape[1] == self.layout.local_len, (hidden_states.shape, self.layout.local_len)
        return self.mesh, self.layout


def attend(q_BLHD, k_BLHD, v_BLHD, mesh, layout):
    """sp_attention over token-major heads: q, k, v [B, L, H, D] -> [B, L, H x D] in q's dtype,
    what a processor hands its output projection."""
    from raydit.parallel.attention import sp_attention

    out_BHLD = sp_attention(q_BLHD.transpose(1, 2), k_BLHD.transpose(1, 2), v_BLHD.transpose(1, 2), mesh, layout)
    return out_BHLD.transpose(1, 2).flatten(2, 3).type_as(q_BLHD)


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
            set_processor(module, processor)
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
    """Pre-hook on the first block: pad and shard every split input per the layout; and on
    every later block, the `every_block` inputs (each full tensor is sharded once per forward)."""
    from raydit.parallel.sharding import SeqLayout

    ctx = handle.context
    blocks = plan.block_list(handle.transformer)
    per_block = tuple(s for s in plan.split_inputs if s.every_block)

    def locate(module, specs, args, kwargs):
        where = [_bind_arg(module, s.arg, args, kwargs) for s in specs]
        return [(s, kwargs[s.arg] if kind == "kwargs" else args[pos], (kind, pos)) for s, (kind, pos) in zip(specs, where)]

    def shard_into(found, args, kwargs):
        for spec, x, (kind, pos) in found:
            if not spec.applies_to(x, ctx.flags):
                continue  # per sample (or not split in this forward): every rank keeps it whole
            cached = ctx.split_cache.get(spec.arg)
            if cached is not None and cached[0] is x:
                local = cached[1]
            else:
                # [B, L_part, ...] -> [B, chunk_part, ...] (padded at the part's end, then chunked).
                # Contiguous, as the blocks' own outputs are: a compiled block specializes on
                # strides, and a strided first input would cost the first block its own graph.
                local = ctx.layout.shard(x, spec.part, ctx.mesh.sp_index, dim=spec.dim).contiguous()
                if spec.every_block:
                    ctx.split_cache[spec.arg] = (x, local)
            if kind == "kwargs":
                kwargs[spec.arg] = local
            else:
                args[pos] = local

    def split_hook(module, args, kwargs):
        args = list(args)
        found = locate(module, plan.split_inputs, args, kwargs)
        lengths: dict[int, int] = {}
        for spec, x, _ in found:
            if spec.applies_to(x, ctx.flags):
                n = x.shape[spec.dim]
                if lengths.setdefault(spec.part, n) != n:
                    raise ValueError(
                        f"`{spec.arg}` has {n} tokens of part {spec.part} along dim {spec.dim}, "
                        f"but another input of that part has {lengths[spec.part]}"
                    )
        # A part split only in some forwards (SplitInput.when) and whole in this one: length 0.
        ctx.layout = SeqLayout(part_lengths=tuple(lengths.get(p, 0) for p in range(plan.num_parts)),
                               sp=_sp_degree(ctx.mesh))
        ctx.split_cache.clear()
        shard_into(found, args, kwargs)
        return tuple(args), kwargs

    def later_split_hook(module, args, kwargs):
        args = list(args)
        shard_into(locate(module, per_block, args, kwargs), args, kwargs)
        return tuple(args), kwargs

    handle._hooks.append(blocks[0].register_forward_pre_hook(split_hook, with_kwargs=True))
    if per_block:
        for block in list(blocks)[1:]:
            handle._hooks.append(block.register_forward_pre_hook(later_split_hook, with_kwargs=True))


def apply_gather(handle: ParallelHandle, plan: SequenceParallelPlan) -> None:
    """Forward hook on the last block: gather every part back to its full, unpadded length."""
    from raydit.parallel.mesh import gather_sequence

    ctx = handle.context
    last = plan.block_list(handle.transformer)[-1]

    def gather_hook(module, args, output):
        ctx.split_cache.clear()  # drop the references to this forward's full tensors
        if not isinstance(output, (tuple, list)):
            # The block returns one tensor: the plan's single GatherOutput (index 0) is it.
            if [g.index for g in plan.gather_outputs] != [0]:
                raise ValueError(
                    f"{type(module).__name__} returns one tensor; the plan must have one GatherOutput with index 0"
                )
            spec = plan.gather_outputs[0]
            return gather_sequence(output, ctx.mesh, ctx.layout, spec.part, dim=spec.dim)
        out = list(output)
        for spec in plan.gather_outputs:
            if spec.when is not None and not ctx.flags.get(spec.when):
                continue  # whole on every rank in this forward
            # [B, chunk_part, C] -> [B, L_part, C]
            out[spec.index] = gather_sequence(out[spec.index], ctx.mesh, ctx.layout, spec.part, dim=spec.dim)
        return type(output)(out) if isinstance(output, tuple) else out

    handle._hooks.append(last.register_forward_hook(gather_hook))


def apply_attention(handle: ParallelHandle, plan: SequenceParallelPlan, make_processor: Callable) -> None:
    """Swap the processor of each block's attention for the sequence-parallel one."""
    for block in plan.block_list(handle.transformer):
        attn = getattr(block, plan.attention)
        handle._processors.append((attn, attn.processor))
        set_processor(attn, make_processor(handle.context))


def set_processor(attn, processor) -> None:
    """`attn.set_processor(processor)`; an attention module without that method (Mochi's
    MochiAttention, a plain nn.Module) holds its processor as the attribute `processor`."""
    if hasattr(attn, "set_processor"):
        attn.set_processor(processor)
    else:
        attn.processor = processor


class ModelAdapter:
    """Base of every model adapter: a plan, a processor factory, and model-specific checks."""

    name: str = ""
    # diffusers class names (matched along the transformer's MRO), so that defining an
    # adapter imports no diffusers.
    transformer_classes: tuple[str, ...] = ()
    plan: SequenceParallelPlan
    # Step caching (raydit.models.cache) reads the residual stream from these. block_outputs:
    # the forward argument each element of a block's output updates, in output order; None:
    # a block returns its first k forward arguments, updated, k = len(plan.gather_outputs)
    # (CogVideoX: hidden_states, encoder_hidden_states; Wan: hidden_states). block_temb: the
    # forward argument holding the timestep embedding (teacache's quantity).
    block_outputs: tuple[str, ...] | None = None
    block_temb: str = "temb"
    # The attention processor class, built with the forward context (make_processor's default).
    processor: type | None = None
    # The config entries that count the blocks, where a model may have none (refused by name:
    # "num_layers"); "": not checked.
    block_count: str = ""

    def validate(self, transformer: nn.Module, mesh) -> None:
        """Raise ValueError when this transformer cannot run on this mesh: blocks to split (where
        `block_count` says so), the Ulysses degree must divide the heads, and fused QKV
        projections must be unfused. A family adds its own checks after calling this."""
        from raydit.parallel.attention import feasible_ulysses

        if self.block_count and not self.plan.block_list(transformer):
            raise ValueError(f"the transformer has no blocks to parallelize ({self.block_count} = 0)")

        heads = transformer.config.num_attention_heads
        if heads % mesh.ulysses != 0:
            raise ValueError(
                f"ulysses_degree {mesh.ulysses} does not divide the {heads} attention heads; "
                f"feasible: {', '.join(map(str, feasible_ulysses(heads)))}"
            )
        for block in self.plan.block_list(transformer):
            if getattr(getattr(block, self.plan.attention), "fused_projections", False):
                raise ValueError("the transformer has fused QKV projections; call transformer.unfuse_qkv_projections() first")

    def make_processor(self, context: ForwardContext):
        if self.processor is None:
            raise NotImplementedError(f"{type(self).__name__} names no attention processor")
        return self.processor(context)

    # Keys of `parallelize(options=)` this adapter takes (a plan's further choices for it).
    options: tuple[str, ...] = ()

    def parallelize(self, transformer: nn.Module, mesh, options: dict | None = None) -> ParallelHandle:
        """Install the plan on `transformer`. options: the plan's further choices for this model
        (`options` names those taken; any other key is refused)."""
        options = {k: v for k, v in (options or {}).items() if v is not None}
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(f"{type(self).__name__} takes no parallel option {', '.join(unknown)} "
                             f"(it takes: {', '.join(self.options) or 'none'}); drop it")
        existing = getattr(transformer, HANDLE_ATTR, None)
        if existing is not None:
            raise ValueError(
                f"{type(transformer).__name__} is already parallelized by raydit ({existing.adapter_name}); "
                "call handle.remove() or raydit.models.unparallelize(transformer) first"
            )
        self.validate(transformer, mesh)
        handle = ParallelHandle(transformer=transformer, adapter_name=self.name,
                                context=ForwardContext(mesh=mesh, options=options))
        try:
            apply_attention(handle, self.plan, self.make_processor)
            apply_split(handle, self.plan)
            apply_gather(handle, self.plan)
        except Exception:
            handle.remove()
            raise
        setattr(transformer, HANDLE_ATTR, handle)
        return handle
