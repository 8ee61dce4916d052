"""A Runner's model preparation, done once per group: the run's checks on this device, the
encoders dropped or restored, the transformer blocks quantized or sharded, the pipeline on the
device in the run's dtype, idle weights in host memory, attention made parallel, the blocks
compiled. `prepare_pipeline` returns what it did (`Prepared`); `release` undoes it, so the next
group's Runner starts from the loaded pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from raydit.models.quantize import quantize_transformers
from raydit.models.quantize_options import check_quantize_device
from raydit.models.text_encoding import drop_encoders, is_encoding_rank, restore_encoders
from raydit.planner.runconfig import GroupModes, RunConfig


@dataclass
class Prepared:
    """What preparation left on the pipeline, each undone by `release`: the parallel hooks
    (`handles`), the sharded blocks, the compiled blocks; `quantized`: per transformer its
    quantized linears (empty without quantize); `attention_mesh`: the mesh attention runs on."""

    pipe: Any
    encodes: bool
    offload_idle: bool
    attention_mesh: Any
    quantized: list = field(default_factory=list)
    sharded: list = field(default_factory=list)
    handles: list = field(default_factory=list)
    compiled: list = field(default_factory=list)


def check_device(run: RunConfig, device: torch.device, dtype: torch.dtype) -> None:
    """FP8 GEMMs where this device runs them, in bfloat16 (torchao's FP8 layers)."""
    if run.quantize != "fp8":
        return
    on_gpu = device.type == "cuda"
    check_quantize_device(run.quantize, device.type, torch.cuda.get_device_capability(device) if on_gpu else None,
                          torch.cuda.get_device_name(device) if on_gpu else None)
    if dtype != torch.bfloat16:
        raise ValueError(f"quantize 'fp8' runs in bfloat16 (torchao's FP8 layers), not {dtype}; "
                         "use dtype bfloat16, or quantize fp8-sim to check FP8 numerics in another dtype")


def prepare_pipeline(pipe, family, mesh, device: torch.device, dtype: torch.dtype, run: RunConfig,
                     group: GroupModes) -> Prepared:
    """Make `pipe` ready to run `run`'s steps on `mesh` (None: one rank) on `device`."""
    check_device(run, device, dtype)
    # Text encoding once per replica (raydit.models.text_encoding): only the encoding rank holds
    # the encoders; the others drop them before the pipeline goes to the device, and a rank that
    # dropped them reloads them when a re-plan makes it rank 0.
    encodes = is_encoding_rank(mesh)
    if not encodes:
        drop_encoders(pipe, family)
    else:
        restore_encoders(pipe)  # nothing to do unless an earlier mesh made it drop them
    done = Prepared(pipe=pipe, encodes=encodes, offload_idle=group.offload_idle and device.type != "cpu",
                    attention_mesh=mesh)
    if group.shard_weights:
        _check_shardable(pipe, mesh)
    if (group.shard_weights or run.quantize is not None) and any(t.dtype != dtype for t in family.transformers(pipe)):
        pipe.to(dtype=dtype)  # the cast the pipeline gets anyway, done before the rounding and the sharding
    # FP8 linear layers (raydit.models.quantize), quantized before sharding, offloading,
    # parallelizing and compiling, from the weights in the run's dtype (the scales are its
    # weights'), on `device`, one linear at a time: the device never holds a transformer
    # unquantized (a model that fits only in FP8 loads), and every rank rounds the same numbers on
    # the same kind of device. Sharded, each quantized linear goes back to the host, where the
    # shards are laid out (they hold the rounded bytes; fp8-sim: plain tensors in the run's dtype).
    # In place and kept by the pipeline: the next Runner on it (a regroup, a recovery) finds its
    # weights quantized; a fresh worker quantizes its own the same.
    done.quantized = quantize_transformers(family.transformers(pipe), run.quantize, run.fp8_granularity,
                                           keep=family.quantize_keep, device=device,
                                           stay=not group.shard_weights, full_precision_steps=run.full_precision_steps)
    if group.shard_weights:
        done.sharded = _shard(pipe, family, mesh)
    done.pipe = pipe = pipe.to(device)
    # Cast only when needed: diffusers warns on any .to(dtype) after loading.
    if any(t.dtype != dtype for t in family.transformers(pipe)):
        done.pipe = pipe = pipe.to(dtype=dtype)
    # The plan keeps idle weights in host memory (Plan.offload_idle_gb): the encoders live on the
    # CPU except while a request is prepared, and only the expert a step runs is on the device.
    if done.offload_idle:
        for module in family.encoders(pipe):
            module.to("cpu")
        for transformer in family.transformers(pipe)[1:]:
            transformer.to("cpu")
    # The mesh attention runs on: the plan's, or for an 8-bit mode a one-rank sequence mesh where
    # the plan splits no sequence (held by the Runner: custom ops find meshes by weak key).
    if run.attention != "bf16":
        from raydit.parallel.mesh import with_attention

        done.attention_mesh = with_attention(mesh, run.attention)
    try:
        if done.attention_mesh is not None and (done.attention_mesh.sp > 1 or run.attention != "bf16"):
            from raydit.models.registry import parallelize

            for transformer in family.transformers(pipe):
                done.handles.append(parallelize(transformer, done.attention_mesh, group.parallel_options))
        # Regional torch.compile of every transformer's blocks (raydit.models.compile); the first
        # request of each shape compiles them in the Runner's prepare (its warm-up).
        if run.compile:
            from raydit.models.compile import compile_blocks

            for transformer in family.transformers(pipe):
                done.compiled.append(compile_blocks(transformer))
    except BaseException:
        release(done)
        raise
    return done


def release(done: Prepared) -> None:
    """Undo the compiled blocks, the parallel hooks and the shards (sharded weights rebuilt
    whole: from the checkpoint files, or gathered over the replica for a model built in memory)."""
    for compiled in done.compiled:
        compiled.remove()
    done.compiled = []
    for handle in done.handles:
        handle.remove()
    done.handles = []
    for sharded in done.sharded:
        sharded.remove()
    done.sharded = []


def _check_shardable(pipe, mesh) -> None:
    """Sharded weights need a mesh of 2+ ranks and no LoRA fused into the weights (before any
    quantizing: a refusal leaves the pipeline as it was)."""
    from raydit.models.lora import fused
    from raydit.models.sharded import check_shardable

    check_shardable(mesh)
    if fused(pipe):
        raise ValueError(f"shard_weights cannot keep LoRA {', '.join(fused(pipe))} fused into the weights: a "
                         "regroup rebuilds the shards from the checkpoint files, without it; drop fuse_lora "
                         "(the adapter then runs unfused) or shard_weights")


def _shard(pipe, family, mesh) -> list:
    """Every transformer's blocks sharded over the replica, where the pipeline is now (host
    memory on a worker), in the dtype (and the quantization) it has."""
    from raydit.models.sharded import shard_transformer

    sharded: list = []
    try:
        for transformer in family.transformers(pipe):
            sharded.append(shard_transformer(transformer, mesh))
    except BaseException:
        for s in sharded:
            s.remove()
        raise
    return sharded
