"""Sharded transformer weights for any family: which blocks, over which group, rebuilt from where.

The blocks are the adapter plan's (`SequenceParallelPlan.block_list`: the repeated blocks that
hold nearly all of a video DiT's weights); the group is the whole replica (every rank of
ulysses x ring x cfg, `ParallelMesh.replica_group`); the mechanism is
raydit.parallel.shard_weights. What stays whole on every rank: the parameters outside the
blocks (patch and time embeddings, the output projection) and LoRA adapters (peft's
`lora_*` parameters: small, and loaded or dropped between requests on every rank alike).

Rebuilding: `remove()` gives every block its full weights back. A transformer loaded from
its checkpoint files (diffusers' `config._name_or_path`, the files' tensors equal to the
loaded ones) is rebuilt from those files, on this rank alone: after a rank is lost there is
no peer to gather its shard from, and the next mesh (another size, other members) shards
the rebuilt weights again. A transformer built in memory is gathered back over the group
(collective: every rank closes together).

Quantized weights (raydit.models.quantize): the Runner quantizes the cast weights first and
shards the quantized ones, every rank the same numbers. "fp8-sim"'s are plain tensors in the
run's dtype; "fp8"'s are torchao's Float8Tensor weights, sharded as their FP8 bytes and float32
row scales (raydit.parallel.shard_weights lays out a tensor subclass's inner tensors and
rebuilds it around the gathered bytes), so a rank holds 1/N of the FP8 bytes, and a block's
gather moves one byte per weight. Gathered back, they are the quantized weights again;
rebuilt from the files they come back unquantized and are quantized again as at load
(`requantize_rebuilt`), so the transformer's quantized marker stays true.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from raydit.parallel.shard_weights import ShardedWeights, shard_blocks


def _manage(name: str) -> bool:
    return "lora_" not in name  # peft's adapters (lora_A / lora_B / lora_magnitude...) stay whole


def _file_key(prefix: str, name: str) -> str:
    # peft wraps a targeted layer: its own weight becomes `<layer>.base_layer.weight`
    return f"{prefix}{name}".replace(".base_layer.", ".")


class CheckpointSource:
    """Reads one block's tensors from a diffusers model folder's safetensors files."""

    def __init__(self, folder: Path):
        index = folder / "diffusion_pytorch_model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {k: folder / f for k, f in weight_map.items()}
        else:
            from safetensors import safe_open

            self.where = {}
            for path in sorted(folder.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    self.where.update(dict.fromkeys(f.keys(), path))

    def read(self, keys: list[str]) -> list[torch.Tensor]:
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.where[key], []).append(key)
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for key in names:
                    out[key] = f.get_tensor(key)
        return [out[k] for k in keys]


def _checkpoint_source(transformer, handle: ShardedWeights, prefixes: list[str], first: list) -> object | None:
    """The transformer's checkpoint files as a source for `remove`, or None where it was not
    loaded from files or they do not hold its weights (checked: every key and shape, and the
    values of the first block's first tensor that is not a quantized weight, read before
    sharding: `first`, (its index among the block's managed tensors, its value))."""
    folder = Path(str(getattr(transformer.config, "_name_or_path", "") or ""))
    if not folder.is_dir() or not any(folder.glob("*.safetensors")):
        return None
    try:
        source = CheckpointSource(folder)
    except Exception:  # noqa: BLE001 - unreadable files: gather back instead
        return None
    keys = [[_file_key(prefixes[i], e.name) for e in layout.entries] for i, layout in enumerate(handle.layouts)]
    if any(k not in source.where for block in keys for k in block):
        return None
    if first:
        index, value = first[0]
        (probe,) = source.read(keys[0][index:index + 1])
        if probe.shape != value.shape or not torch.equal(probe.to(value.dtype), value):
            return None
    return lambda i: source.read(keys[i])


class ShardedTransformer:
    """One transformer's sharded blocks; `remove()` rebuilds their full weights."""

    def __init__(self, transformer, handle: ShardedWeights, source):
        self.transformer, self.handle, self.source = transformer, handle, source

    def remove(self) -> None:
        from raydit.models.quantize import requantize_rebuilt

        self.handle.remove(self.source)
        if self.source is not None:  # the files' unquantized weights: quantized again as at load
            requantize_rebuilt(m for block in self.handle.blocks for m in block.modules())

    @property
    def peak_bytes(self) -> int:
        return self.handle.peak_bytes


def replica_size(mesh) -> int:
    return 1 if mesh is None else mesh.ulysses * mesh.ring * mesh.cfg


def check_shardable(mesh) -> None:
    """ValueError where sharding cannot help: a replica of one rank."""
    if replica_size(mesh) < 2:
        raise ValueError("shard_weights needs a replica of 2 or more ranks to share the weights, this plan has 1 "
                         "rank per replica (every weight is resident on it anyway); drop shard_weights or use more ranks")


def shard_transformer(transformer, mesh, prefetch: bool = True) -> ShardedTransformer:
    """Shard the blocks of `transformer`'s adapter plan over `mesh`'s replica."""
    from raydit.models.quantize import QUANTIZED_ATTR
    from raydit.models.registry import get_adapter

    check_shardable(mesh)
    plan = get_adapter(transformer).plan
    names = (plan.blocks,) if isinstance(plan.blocks, str) else tuple(plan.blocks)
    blocks, prefixes = [], []
    for name in names:
        for j, block in enumerate(getattr(transformer, name)):
            blocks.append(block)
            prefixes.append(f"{name}.{j}.")
    # The probe of the files: a tensor the files hold as the model does (not a quantized weight).
    rounded = {id(m.weight) for m in blocks[0].modules() if getattr(m, QUANTIZED_ATTR, None) is not None}
    first = [(i, p.detach().clone()) for i, (n, p) in enumerate((n, p) for n, p in blocks[0].named_parameters()
                                                              if _manage(n)) if id(p) not in rounded][:1]
    handle = shard_blocks(blocks, mesh.replica_group, root=transformer, prefetch=prefetch, manage=_manage)
    try:
        source = _checkpoint_source(transformer, handle, prefixes, first)
    except BaseException:
        handle.remove(None)
        raise
    return ShardedTransformer(transformer, handle, source)
