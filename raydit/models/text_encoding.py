"""Text encoding once per request: the encoders live on one rank, the embeddings are broadcast.

A replica's rank 0 (sp_index 0 of cfg_rank 0) is its *encoding rank*: it alone holds the
family's encoders (`Family.encoders`: text encoders, Wan 2.1 I2V's image encoder) and runs
`Family.encode`; every other rank drops them when its runner is built and receives the
guidance branches' model inputs by broadcast. T5-XXL (CogVideoX, LTX) is ~9.5 GB in bf16 and
umT5-XXL (Wan) ~11 GB: that much device memory is freed on every rank but one.

The broadcast reuses the mesh's own groups, in two hops (no new process group):

    hop 1  cfg group of sp_index 0:  rank (cfg 0, sp 0) -> rank (cfg 1, sp 0)
    hop 2  each cfg rank's sp group: rank (cfg c, sp 0) -> ranks (cfg c, sp 1 .. sp-1)

Each hop sends the structure first (keys, shapes, dtypes, non-tensor values: one
broadcast_object_list), then every tensor with `dist.broadcast`: the receivers hold bit-for-bit
the encoding rank's tensors, so results are those of one process.

After a re-plan (recovery, growth) the new rank 0 may be a rank that dropped its encoders. It
reloads them from the pipeline's own directory (`restore_encoders`). Keeping a host-memory
copy on every rank instead would hold one encoder per rank in the node's RAM (8 x 11 GB for
umT5 on an 8-GPU node) for an event that happens only when rank 0 changes; the reload reads
one component folder from local disk while the group is being re-formed, off the request path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

_DROPPED = "_raydit_dropped_encoders"  # pipe attribute: {component name: (class, dtype)}
_TENSOR = "__tensor__"


@dataclass(frozen=True)
class EncodeFailed:
    """Sent in place of the embeddings when the encoding rank's encode raised."""

    message: str


def is_encoding_rank(mesh) -> bool:
    """Whether this rank encodes prompts for its replica (always, without a mesh)."""
    return mesh is None or (mesh.sp_index == 0 and mesh.cfg_rank == 0)


def replica_size(mesh) -> int:
    return 1 if mesh is None else mesh.sp * mesh.cfg


def _encoder_names(pipe, family) -> list[str]:
    held = family.encoders(pipe)
    return [name for name, module in pipe.components.items() if any(module is m for m in held)]


def drop_encoders(pipe, family) -> list[str]:
    """Release the encoders of a rank that does not encode (their weights are freed once the
    pipeline's reference is gone: nothing else holds them). Returns the components dropped."""
    dropped = dict(getattr(pipe, _DROPPED, {}))
    names = _encoder_names(pipe, family)
    for name in names:
        module = getattr(pipe, name)
        dtype = next((p.dtype for p in module.parameters()), torch.float32)
        dropped[name] = (type(module), dtype)
        setattr(pipe, name, None)  # diffusers' own way to leave out an optional component
    setattr(pipe, _DROPPED, dropped)
    return names


def restore_encoders(pipe, source: str | Path | None = None) -> list[str]:
    """Reload the encoders this pipeline dropped, from `source` (default: the directory the
    pipeline was loaded from), on the CPU in their former dtype. Returns the names restored."""
    dropped = dict(getattr(pipe, _DROPPED, {}))
    if not dropped:
        return []
    where = str(source or getattr(pipe, "name_or_path", "") or "")
    missing = [name for name in sorted(dropped) if not where or not (Path(where) / name).is_dir()]
    if missing:
        raise ValueError(
            f"this rank became its replica's encoding rank but dropped its {', '.join(sorted(dropped))}, and "
            f"{where or 'the pipeline (built in memory)'!r} has no {', '.join(missing)} folder to reload them from; "
            "load the pipeline with from_pretrained from its directory (raydit.models.loading.load_pipeline)"
        )
    source = Path(where)
    from raydit.models.tiny import quiet_hub

    for name, (cls, dtype) in dropped.items():
        with quiet_hub():
            module = cls.from_pretrained(str(source), subfolder=name, dtype=dtype)
        setattr(pipe, name, module.eval())
    setattr(pipe, _DROPPED, {})
    return sorted(dropped)


# -- the broadcast -----------------------------------------------------------------------------
def _describe(value, tensors: list):
    """Structure of (positive, negative) with tensors replaced by (marker, shape, dtype)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.contiguous())
        return (_TENSOR, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _describe(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_describe(v, tensors) for v in value)
    return value


def _rebuild(meta, device, received: list):
    if isinstance(meta, tuple) and len(meta) == 3 and meta[0] == _TENSOR:
        out = torch.empty(meta[1], dtype=meta[2], device=device)
        received.append(out)
        return out
    if isinstance(meta, dict):
        return {k: _rebuild(v, device, received) for k, v in meta.items()}
    if isinstance(meta, (list, tuple)):
        return type(meta)(_rebuild(v, device, received) for v in meta)
    return meta


def _broadcast(value, group, device: torch.device):
    """`value` (nested dicts / tuples of tensors and plain values) from group rank 0 to the
    others of `group`; returns it on every rank (the sender's own objects on the sender)."""
    sender = dist.get_rank(group) == 0
    tensors: list = []
    meta = [_describe(value, tensors) if sender else None]
    # NCCL sends objects through device tensors: the rank's own device; gloo the CPU.
    dist.broadcast_object_list(meta, group=group, group_src=0,
                               device=device if device.type != "cpu" else None)
    if sender:
        for t in tensors:
            dist.broadcast(t, group=group, group_src=0)
        return value
    received: list = []
    out = _rebuild(meta[0], device, received)
    for t in received:
        dist.broadcast(t, group=group, group_src=0)
    return out


def broadcast_branches(branches, mesh, device) -> tuple:
    """(positive, negative) as encoded on the encoding rank -> the same on every rank of its
    replica (module docstring: two hops over the cfg and sp groups). Collective over the mesh."""
    device = torch.device(device)
    if mesh is None:
        return branches
    if mesh.cfg_group is not None and mesh.sp_index == 0:
        branches = _broadcast(branches, mesh.cfg_group, device)
    if mesh.sp_group is not None:
        branches = _broadcast(branches, mesh.sp_group, device)
    return branches
