"""Tensors between Ray processes as NumPy buffers: what a step's checkpoint travels as.

Ray pickles a torch tensor through torch's own reducer, which writes every storage with
torch.save into bytes: returning a Wan checkpoint (latents and UniPC's history, 4 x 8.4 MB)
from an actor took 130-160 ms on a 2-core host, against 7 ms for the same bytes as NumPy
arrays, which Ray moves out of band through its object store without a copy into the
pickle (bench/bench_engine_step.py measures the step this sits in). That difference was
paid on every denoising step, since rank 0 hands the driver its checkpoint each step.

`to_wire` replaces every tensor in a nest of dicts, lists and tuples by a `WireTensor` (its
bytes as a NumPy array, its torch dtype by name; dtypes NumPy lacks, bfloat16 and the
float8s, travel as integers of the same width); `from_wire` turns them back into tensors.
Anything else passes through, so a checkpoint that never travelled is its own wire form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Same-width integer views for the dtypes NumPy has no type for.
_BITS_AS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class WireTensor:
    """A CPU tensor's bytes (`array`, in the tensor's shape) and its torch dtype's name."""

    array: np.ndarray
    dtype: str

    def tensor(self) -> torch.Tensor:
        """A writable tensor of its own (the array Ray hands a receiver maps its object store
        read-only, and a local array may share a live tensor's memory)."""
        t = torch.from_numpy(self.array.copy())
        dtype = getattr(torch, self.dtype)
        return t if t.dtype == dtype else t.view(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


def _wire_tensor(t: torch.Tensor) -> WireTensor:
    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    try:
        array = t.numpy()
    except TypeError:  # bfloat16, float8: no NumPy dtype; travel as same-width integers
        array = t.view(_BITS_AS[t.element_size()]).numpy()
    return WireTensor(array=array, dtype=name)


def _map(value: Any, leaf: type, fn) -> Any:
    """`fn` on every `leaf` in a nest of dicts, lists and tuples; anything else as it is."""
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map(v, leaf, fn) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # a namedtuple: its fields by position
        return type(value)(*(_map(v, leaf, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, leaf, fn) for v in value)
    return value


def to_wire(value: Any) -> Any:
    """Every tensor in `value` (dicts, lists, tuples, nested) -> WireTensor, on the CPU."""
    return _map(value, torch.Tensor, _wire_tensor)


def from_wire(value: Any) -> Any:
    """The inverse of `to_wire`: every WireTensor -> a writable CPU tensor of its own."""
    return _map(value, WireTensor, WireTensor.tensor)
