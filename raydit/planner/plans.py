"""A plan as data: one feasible layout (`Plan`, with the placement of its ranks), a layout
that cannot run (`Rejection`), and every layout judged (`PlanResult`). Built by the search
(raydit.planner.search), consumed by every other layer.

Placement: nodes are taken fastest first; a node of c devices offers c // ulysses
"Ulysses slots" of neighbouring devices; slot j of the concatenated list is ring rank
j % ring of cfg rank (j // ring) % cfg of replica j // (cfg * ring), so
rank = (replica * cfg + cfg_rank) * sp + ring_rank * ulysses + ulysses_rank (docs/design.md).
Devices that cannot hold a rank, and those left over when groups do not divide the slots,
are left out and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from raydit.planner.cluster import ClusterSpec
from raydit.planner.cost import StepCost
from raydit.planner.decode import DecodeCost
from raydit.planner.devicemodel import Mode
from raydit.planner.model import ModelSpec, VideoGeometry
from raydit.planner.sharding import GatherCost


class PlanError(ValueError):
    """No feasible layout (or a forced one is infeasible); the message says why in one line."""


@dataclass(frozen=True)
class Rank:
    """Where one rank runs and what it is in the mesh."""

    rank: int
    replica: int
    cfg_rank: int
    sp_index: int
    ulysses_rank: int
    ring_rank: int
    node: str
    gpu_index: int
    gpu_type: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Run:
    """`slots` consecutive Ulysses groups on one node, starting at device `first_gpu`."""

    node: str
    gpu_type: str
    first_gpu: int
    slots: int



@dataclass(frozen=True)
class Rejection:
    """A layout that cannot run, and why. kind: heads, node, count, tokens, memory, guidance, shard.
    need_gb: the memory a rank would need (memory rejections; lets an error quote the least)."""

    ulysses: int
    ring: int
    cfg: int
    replicas: int
    reason: str
    kind: str = "other"
    need_gb: float = 0.0

    def to_dict(self) -> dict:
        return {"ulysses": self.ulysses, "ring": self.ring, "cfg": self.cfg,
                "replicas": self.replicas, "reason": self.reason, "kind": self.kind}


@dataclass(frozen=True)
class Plan:
    """One feasible layout.

    ulysses, ring, cfg: degrees of each replica; sp = ulysses x ring; replicas: independent
        copies serving separate requests; world_size: devices used (cfg x sp x replicas).
    pad_tokens = text_pad_tokens + video_pad_tokens: tokens added so each part divides by sp;
        pad_fraction: pad / real tokens (extra work); split: "frames", "rows" or "tokens".
    predicted_step_seconds: one denoising step on the fastest replica (a request's latency
        per step); slowest_step_seconds: on the slowest; replica_step_seconds: each replica;
        throughput_steps_per_second: sum over replicas of 1 / step; cost: the fastest
        replica's breakdown. memory_gb_per_gpu: the model's peak per device.
    kind: "uniform" (one shape) or "per-type" (`parts`: one uniform plan per device type run
        side by side; the top-level degrees are those of the fastest part).
    notes: what a user should know (devices left out, groups across nodes or types).
    runs: the Ulysses slots used, node by node, in rank order (placement derives from them).
    """

    ulysses: int
    ring: int
    cfg: int
    replicas: int
    world_size: int
    pad_tokens: int
    text_pad_tokens: int
    video_pad_tokens: int
    split: str
    predicted_step_seconds: float
    slowest_step_seconds: float
    throughput_steps_per_second: float
    memory_gb_per_gpu: float
    cost: StepCost
    gpus_offered: int
    pad_fraction: float = 0.0
    kind: str = "uniform"
    notes: tuple[str, ...] = ()
    runs: tuple[Run, ...] = ()
    parts: tuple["Plan", ...] = ()
    replica_step_seconds: tuple[float, ...] = ()
    # GB per rank of idle weights kept in host memory because everything resident would not
    # fit (the inactive expert, the text encoder after encoding); 0: all stay on the device.
    offload_idle_gb: float = 0.0
    # The VAE decode of one video on the replica's ranks (raydit.planner.decode): seconds, ranks
    # it is split over, peak GB per rank (memory_gb_per_gpu counts it: cost.memory_gb).
    decode: DecodeCost | None = None
    # A model with an audio stream (LTX-2): requests with at least this many audio tokens have
    # them split over the sp ranks, shorter ones keep them whole on every rank (the cost model's
    # crossover for this layout and video, raydit.planner.cost.audio_split_tokens); None: never.
    audio_split_tokens: int | None = None
    # Transformer block weights sharded over the replica's ranks (raydit.planner.sharding):
    # chosen where it lets more devices hold a rank (or forced); `gather` is its cost per step,
    # whose exposed part the step times include.
    shard_weights: bool = False
    gather: GatherCost | None = None

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def gpus_left_out(self) -> int:
        return self.gpus_offered - self.world_size

    @property
    def degrees(self) -> dict:
        return {"ulysses": self.ulysses, "ring": self.ring, "cfg": self.cfg, "replicas": self.replicas}

    @property
    def split_cost(self) -> str:
        """What the split costs: pad tokens and the extra compute they bring."""
        what = {"frames": "whole latent frames per rank",
                "rows": "whole latent rows per rank",
                "tokens": "chunks cut inside a latent row"}[self.split]
        return (f"{what}; {self.video_pad_tokens} video + {self.text_pad_tokens} text pad tokens "
                f"(+{100 * self.pad_fraction:.2f}% tokens)")

    @property
    def explanation(self) -> str:
        head = (f"cfg {self.cfg} x ulysses {self.ulysses} x ring {self.ring} x {self.replicas} "
                f"replica{'s' if self.replicas != 1 else ''} on {self.world_size} of "
                f"{self.gpus_offered} devices; split by {self.split_cost}")
        return "; ".join((head,) + self.notes)

    @cached_property
    def placement(self) -> tuple[Rank, ...]:
        """Every rank's node and device index, in global rank order."""
        if self.parts:
            out: list[Rank] = []
            replica0 = 0
            for part in self.parts:
                for r in part.placement:
                    out.append(Rank(len(out), r.replica + replica0, r.cfg_rank, r.sp_index,
                                    r.ulysses_rank, r.ring_rank, r.node, r.gpu_index, r.gpu_type))
                replica0 += part.replicas
            return tuple(out)
        U, R, C, sp = self.ulysses, self.ring, self.cfg, self.sp
        out = []
        j = 0
        limit = self.replicas * C * R
        for run in self.runs:
            for k in range(run.slots):
                if j >= limit:
                    break
                replica, cfg_rank, ring_rank = j // (C * R), (j // R) % C, j % R
                for u in range(U):
                    sp_index = ring_rank * U + u
                    out.append(Rank((replica * C + cfg_rank) * sp + sp_index, replica, cfg_rank,
                                    sp_index, u, ring_rank, run.node, run.first_gpu + k * U + u,
                                    run.gpu_type))
                j += 1
        out.sort(key=lambda r: r.rank)
        return tuple(out)

    def to_dict(self, placement: bool = True) -> dict:
        d = {
            "kind": self.kind,
            "ulysses": self.ulysses, "ring": self.ring, "cfg": self.cfg, "replicas": self.replicas,
            "sp": self.sp, "world_size": self.world_size, "gpus_left_out": self.gpus_left_out,
            "pad_tokens": self.pad_tokens, "text_pad_tokens": self.text_pad_tokens,
            "video_pad_tokens": self.video_pad_tokens, "pad_fraction": round(self.pad_fraction, 6),
            "split": self.split,
            "split_cost": self.split_cost,
            "predicted_step_seconds": round(self.predicted_step_seconds, 6),
            "slowest_step_seconds": round(self.slowest_step_seconds, 6),
            "throughput_steps_per_second": round(self.throughput_steps_per_second, 4),
            "memory_gb_per_gpu": round(self.memory_gb_per_gpu, 2),
            "cost_seconds": self.cost.to_dict(),
            "notes": list(self.notes),
            "decode": self.decode.to_dict() if self.decode is not None else None,
            "shard_weights": self.shard_weights,
            "weight_gather": self.gather.to_dict() if self.gather is not None else None,
            "explanation": self.explanation,
        }
        if self.parts:
            d["parts"] = [p.to_dict(placement=False) for p in self.parts]
        if placement:
            d["placement"] = [r.to_dict() for r in self.placement]
        return d


@dataclass(frozen=True)
class PlanResult:
    """Every layout judged: `candidates` ranked best first, `rejected` with reasons."""

    model: ModelSpec
    geometry: VideoGeometry
    cluster: ClusterSpec
    guidance: bool
    candidates: tuple[Plan, ...]
    rejected: tuple[Rejection, ...] = field(default=())
    branches: int = 2  # transformer passes per step (1: guidance off or embedded; LTX-2: 4)
    mode: Mode = field(default_factory=Mode)  # how the step runs (bf16, fp8, 8-bit attention, compiled)
    rates_sources: tuple[str, ...] = ()  # per device type: where its rates come from (DeviceType.rates_source)

    @property
    def best(self) -> Plan:
        return self.candidates[0]

    def to_dict(self, top: int | None = None) -> dict:
        """JSON-ready; `top` limits the candidates listed (placement is per rank)."""
        m = self.model
        g = self.geometry
        shown = self.candidates if top is None else self.candidates[:top]
        return {
            "model": {
                "name": m.name, "family": m.family, "heads": m.heads, "head_dim": m.head_dim,
                "layers": m.layers, "hidden": m.hidden, "ffn_hidden": m.ffn_hidden,
                "patch_size": m.patch_size, "patch_size_t": m.patch_size_t,
                "positional": m.positional, "text_in_sequence": m.text_in_sequence,
                "params": m.params, "weights_gb": round(m.weight_bytes / 1e9, 2),
                **({"fp8_weight_params": m.fp8_params * m.experts} if m.fp8_weights else {}),
                "text_tokens": m.text_tokens, "video_tokens": g.video_tokens,
                "sequence_tokens": g.sequence_tokens,
                "frames": g.frames, "height": g.height, "width": g.width,
                "latent_frames": g.latent_frames, "latent_height": g.latent_height,
                "latent_width": g.latent_width, "token_frames": g.token_frames,
                "token_rows": g.token_rows, "token_cols": g.token_cols,
                **({"audio_heads": m.audio_heads, "audio_head_dim": m.audio_head_dim, "audio_hidden": m.audio_hidden,
                    "audio_ffn_hidden": m.audio_ffn_hidden, "audio_tokens": g.audio_tokens} if g.audio_tokens else {}),
            },
            "cluster": self.cluster.to_dict(),
            "guidance": self.guidance,
            "branches": self.branches,
            "mode": {"quantize": self.mode.quantize, "attention": self.mode.attention, "compile": self.mode.compile,
                     "keep_bf16": self.mode.keep_bf16, "full_precision_steps": self.mode.full_precision_steps,
                     "steps": self.mode.steps, "label": self.mode.label},
            "rates_sources": list(self.rates_sources),
            "best": self.best.to_dict(),
            "candidates": [p.to_dict() for p in shown],
            "candidates_total": len(self.candidates),
            "rejected": [r.to_dict() for r in self.rejected],
        }

