"""The memory and time of sharded transformer weights (raydit.models.sharded), pure Python.

With sharding, each of a replica's N ranks keeps 1/N of every transformer block's weights and
gathers a block whole just before it runs, one block ahead (the running block and the next
are whole at once):

    weights per rank = outside the blocks + blocks / N + 2 x one block
    blocks           = BLOCK_SHARE x transformer parameters x resident experts x bytes/param
                       (quantize fp8: the blocks' FP8 weights at one byte, `block_gb`)

BLOCK_SHARE: the blocks hold nearly all of a video DiT's parameters; the rest (patch, text and
time embeddings, the output projection) stays whole on every rank. Wan 2.1 14B: 40 blocks of
~351 M parameters (self- and cross-attention 8 h^2, FFN 2 h f at h 5120, f 13824) = 14.05 B of
14.3 B (0.983); 0.98 is used for every family.

Time: every forward all-gathers every block: a rank receives (N - 1) / N of a block's bytes
over the replica's link (a ring all-gather: N - 1 hops of latency; PCIe lanes shared by the
N devices as `Link.shared_by` says). The gather of block i+1 runs beside block i's compute, so
what a step waits is per block max(0, gather - compute); on a link that takes the core
("shm", CPU slots) nothing overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

from raydit.planner.cost import Link
from raydit.planner.model import ModelSpec

BLOCK_SHARE = 0.98
GB = 1e9


def block_gb(spec: ModelSpec, experts: int) -> float:
    """GB of the transformer blocks of `experts` resident experts, whole. Under quantize fp8
    (spec.fp8_weights) the blocks hold every FP8 weight (spec.fp8_params, the blocks' linears)
    at one byte; their float32 row scales (4 bytes per output row, under 0.1% of a DiT
    linear's bytes) are not counted."""
    per_expert = BLOCK_SHARE * spec.params * spec.bytes_per_param
    if spec.fp8_weights:
        per_expert -= (spec.bytes_per_param - 1) * spec.fp8_params
    return per_expert * experts / GB


def sharded_gb(spec: ModelSpec, unsharded_gb: float, ranks: int, experts: int) -> float:
    """A rank's peak GB with the blocks sharded over `ranks`, from its unsharded peak
    (`experts`: the experts resident on the device)."""
    blocks = block_gb(spec, experts)
    one_block = blocks / experts / spec.layers
    return unsharded_gb - blocks + blocks / ranks + 2 * one_block


@dataclass(frozen=True)
class GatherCost:
    """Per step: the block gathers' transfer time and what of it the compute does not hide."""

    ranks: int
    block_mb: float
    per_block_s: float
    total_s: float
    exposed_s: float
    link: str

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def gather_cost(spec: ModelSpec, ranks: int, link: Link, compute_s: float, forwards: int = 1) -> GatherCost:
    """The gathers of `forwards` transformer calls per step on a replica of `ranks` ranks;
    compute_s: the step's compute (spread evenly over the blocks it runs)."""
    one_block = block_gb(spec, 1) / spec.layers * GB  # bytes
    shared = link.shared_by(ranks)
    per_block = shared.seconds(one_block * (ranks - 1) / ranks, hops=ranks - 1)
    blocks = spec.layers * forwards
    hidden = compute_s / blocks if shared.overlaps else 0.0
    return GatherCost(ranks, one_block / 1e6, per_block, per_block * blocks,
                      blocks * max(0.0, per_block - hidden), f"{link.kind} {shared.gb_s:g} GB/s")
