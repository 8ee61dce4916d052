"""What torch.compile must not trace, as torch custom ops: the sequence-parallel collectives.

Dynamo cannot trace the attention's communication (all_to_all_single and batch_isend_irecv
posted with async_op=True, then `work.wait()`): each collective would end the graph of the
transformer block around it. A `torch.library.custom_op` is opaque instead: while compiling,
Dynamo and Inductor see only its fake implementation (a tensor of the right shape), so a
block becomes ONE graph; when the compiled block runs, the graph calls the real
implementation, which is the eager code with its collectives, unchanged.

A custom op takes tensors, numbers, strings and lists of them, not Python objects, so:
- the mesh travels as `mesh_key(mesh)` (every ParallelMesh is registered where it is made);
- the layout as its part lengths (the mesh gives sp): `raydit::sp_attention`, defined beside
  the function it wraps (raydit.parallel.attention);
- a model-specific piece of eager code (`opaque_call`) as the key of a registered callable,
  registered eagerly, under a stable name, by whoever owns it (a family's attention processor,
  when it is made).
Outside torch.compile the callers run their eager code directly: these ops cost nothing there.

Legend: B batch, H heads, S local tokens, D head dim.
"""

from __future__ import annotations

import weakref
from typing import Callable, Hashable

import torch
from torch import Tensor


def fresh(out: Tensor, inputs) -> Tensor:
    """What a custom op may return: contiguous (the strides its fake promises) and aliasing
    no input (a 1-rank layout could hand an input back as is)."""
    if any(out.data_ptr() == t.data_ptr() for t in inputs if t.numel()):
        return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


# -- model-specific eager code behind one op ------------------------------------------------
# key -> (the callables registered under it, newest last; bound methods held weakly, so a
# processor dropped with its model frees its entry), the outputs' `like` indices.
_CALLS: dict[int, tuple[list, tuple[int, ...]]] = {}
_NAMES: dict[Hashable, int] = {}  # name -> key: stable, as mesh keys are (raydit.parallel.mesh)


def _deref(ref):
    return ref() if isinstance(ref, weakref.WeakMethod) else ref


def register_call(fn: Callable, like: tuple[int, ...], name: Hashable) -> int:
    """Make `fn(tensors, ints) -> list of tensors` callable from a compiled graph; its i-th
    output has the shape, dtype and device of `tensors[like[i]]` (what the fake returns;
    contiguous). Returns the key to give `opaque_call`.

    The same `name` gets the same key, and the newest live callable registered under it is
    called: callables that share a name must be interchangeable (the same computation on the
    same mesh, e.g. one family's joint attention on one mesh key). A compiled graph holds the
    key as a constant, so with one key per name every block of a class shares one graph, and
    the graphs compiled before a regroup serve the regrouped model; a key per callable would
    compile a graph per block (Dynamo gives up after 8).
    """
    key = _NAMES.setdefault(name, len(_NAMES) + 1)
    live = [ref for ref in _CALLS.get(key, ([], ()))[0] if _deref(ref) is not None]
    live.append(weakref.WeakMethod(fn) if hasattr(fn, "__self__") else fn)
    _CALLS[key] = (live, tuple(like))
    return key


def _lookup(key: int):
    refs, like = _CALLS.get(key, ([], ()))
    for ref in reversed(refs):
        fn = _deref(ref)
        if fn is not None:
            return fn, like
    raise RuntimeError(f"no live callable is registered under key {key}; its owner was dropped")


@torch.library.custom_op("raydit::opaque_call", mutates_args=())
def _opaque_call_op(key: int, tensors: list[Tensor], ints: list[int]) -> list[Tensor]:
    fn, _ = _lookup(key)
    return [fresh(out, tensors) for out in fn(list(tensors), list(ints))]


@_opaque_call_op.register_fake
def _(key, tensors, ints):
    _, like = _lookup(key)
    return [tensors[i].new_empty(tensors[i].shape) for i in like]


def opaque_call(key: int, tensors: list[Tensor], ints: list[int]) -> list[Tensor]:
    """Call the callable registered under `key`: directly when eager, through the custom op
    (one opaque node in the graph) while torch.compile traces."""
    if torch.compiler.is_compiling():
        return _opaque_call_op(key, tensors, ints)
    return _lookup(key)[0](tensors, ints)
