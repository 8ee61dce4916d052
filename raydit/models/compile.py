"""Regional torch.compile of a transformer's repeated blocks, around raydit's parallel hooks.

What is compiled: the `forward` of each block of the adapter's plan (the blocks that hold the
sequence-parallel attention processors, in every family; diffusers' `_repeated_blocks` names
the same classes where it is set, and is empty on CogVideoX). Blocks of one class share one
code object, so Dynamo compiles one graph per block class and shape and reuses it for every
block: the compile time of one block, not of the model.

Why `forward` and not the module (`nn.Module.compile`, which diffusers'
`compile_repeated_blocks` calls): the module's call runs its hooks, and raydit's hooks are
not graph material. The split hook computes the per-forward layout in Python and keeps
per-forward caches keyed by tensor identity; the gather hook all-gathers. They stay eager,
outside the graph, and so do step caching's wrappers (raydit.models.cache), which call the
compiled forward. Inside the forward the attention processor runs, and its collectives are
custom ops (raydit.parallel.opaque): the block is one graph, which `fullgraph=True` checks.

Shapes: `dynamic=False`. A deployment serves a few fixed resolutions and frame counts; each
is compiled once (one graph per block class and shape) and then reused by every request of
that shape without a recompile (Dynamo's guards hold: same shapes, same layout, same mesh).
Dynamic shapes would make the sequence length symbolic, but the layout (padding, chunks,
ranges of real keys) is Python arithmetic on it and would specialize anyway.

Legend: none (no tensors here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Attribute set on a transformer whose blocks are compiled; its presence makes compile refuse.
COMPILED_ATTR = "_raydit_compiled"


@dataclass
class CompiledBlocks:
    """What `compile_blocks` installed; `remove()` gives every block its own forward back."""

    transformer: object
    blocks: list = field(default_factory=list)
    removed: bool = False

    def remove(self) -> None:
        if self.removed:
            return
        for block in self.blocks:
            # The compiled forward is an instance attribute over the class's own.
            block.__dict__.pop("forward", None)
        if getattr(self.transformer, COMPILED_ATTR, None) is self:
            delattr(self.transformer, COMPILED_ATTR)
        self.removed = True


def compile_blocks(transformer, fullgraph: bool = False, mode: str | None = None,
                   backend: str = "inductor") -> CompiledBlocks:
    """Compile the forward of every block of `transformer`'s plan (regional compilation).

    Call it after `parallelize` or before: the processors are read when a block first runs.
    fullgraph=True makes a graph break inside a block an error instead of a silent split.
    Nothing is compiled here; the first forward of each shape does it (the warm-up).
    `mode` and `backend` go to torch.compile ("aot_eager" traces the same graphs without
    generating code: the tests' cheap check of the tracing).
    """
    import torch

    from raydit.models.registry import get_adapter

    if getattr(transformer, COMPILED_ATTR, None) is not None:
        raise ValueError(f"{type(transformer).__name__}'s blocks are already compiled; call remove() on the first handle")
    blocks = get_adapter(transformer).plan.block_list(transformer)
    for block in blocks:
        if "forward" in block.__dict__:
            # Another wrapper (step caching) sits on the block: compiling under it would
            # compile the wrapper's Python state too.
            raise ValueError(
                f"a {type(block).__name__} of {type(transformer).__name__} already has its forward wrapped "
                "(step caching is installed); compile the blocks before the first cached request"
            )
    handle = CompiledBlocks(transformer)
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=fullgraph, dynamic=False, mode=mode,
                                      backend=backend)
        handle.blocks.append(block)
    setattr(transformer, COMPILED_ATTR, handle)
    return handle
