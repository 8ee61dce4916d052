"""Enumerate every layout (cfg x ulysses x ring x replicas), judge it, rank the feasible ones.

A layout is feasible when
  - ulysses divides the attention heads and fits inside one node (its all-to-alls are the
    most bandwidth-hungry collective: they stay on NVLink/PCIe),
  - the largest rank (rank 0: the transformers, the VAE and the text encoder) holds its share
    of activations, or of the decode after them (`cost.memory_gb`),
  - the groups fit the devices offered (Ulysses groups packed node by node),
  - sp = ulysses x ring does not exceed the video tokens (every rank holds real video).
Uneven token counts are never a reason to refuse: text and video are padded to sp.

Placement: nodes are taken fastest first; a node of c devices offers c // ulysses
"Ulysses slots" of neighbouring devices; slot j of the concatenated list is ring rank
j % ring of cfg rank (j // ring) % cfg of replica j // (cfg * ring), so
rank = (replica * cfg + cfg_rank) * sp + ring_rank * ulysses + ulysses_rank (docs/design.md).
Devices that cannot hold a rank, and those left over when groups do not divide the slots,
are left out and the plan says so.

Ranking: predicted step time of the fastest replica (what one request waits per step),
step times within 0.5% count as equal; then throughput (replicas add it), then fewer pad
tokens, then the split (frames, rows, tokens), then fewer devices, then published practice
(TensorRT-LLM, SGLang): cfg parallel first, then Ulysses up to the head limit, then ring.
The cost model decides; the practice only breaks its ties.

Guidance: with guidance on, a step runs `branches` transformer passes: the model's
`cfg_branches` (2 for classifier-free guidance; 1 where guidance is embedded, HunyuanVideo; 4
for LTX-2's cfg pair, STG and modality passes), 2 when cfg 2 is forced on a one-branch model
(asking for true CFG), or what `branches=` says. The cfg axis is a branch degree: C groups
share the branches evenly (C divides branches, each group carries branches / C samples);
one branch never plans a cfg axis.

Mixed device types: a layout packed fastest-first may put a group across types (paced by
its slowest member), replicas of one shape on different types, or leave the slow devices
out; in addition a "per-type" plan runs the best layout of each type's nodes side by side
(replicas of different shapes). Every plan's `notes` say which of these it is.
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from raydit.planner import cost as costmod
from raydit.planner.cluster import ClusterSpec, NodeSpec
from raydit.planner.cost import Link, StepCost
from raydit.planner.decode import DecodeCost, decode_cost
from raydit.planner.devicemodel import Mode
from raydit.planner.hardware import DeviceType
from raydit.planner.layouts import cfg_degrees
from raydit.planner.model import ModelSpec, VideoGeometry, model_spec
from raydit.planner.sharding import GatherCost, gather_cost, sharded_gb

TIE_TOLERANCE = 0.005
GPU_RESERVE_GB = 1.5
CPU_RESERVE_GB = 0.5


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


# Effective device <-> host copy rate for weights kept in host memory (PCIe 4/5 x16 as
# measured by pinned copies, not the link between GPUs).
HOST_LINK_GB_S = 25.0


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
                     "label": self.mode.label},
            "rates_sources": list(self.rates_sources),
            "best": self.best.to_dict(),
            "candidates": [p.to_dict() for p in shown],
            "candidates_total": len(self.candidates),
            "rejected": [r.to_dict() for r in self.rejected],
        }


# -- helpers -----------------------------------------------------------------------------


def _reserve(dev: DeviceType) -> float:
    return CPU_RESERVE_GB if dev.link_kind == "shm" else GPU_RESERVE_GB


def _divisors_text(spec: ModelSpec) -> str:
    return ", ".join(str(d) for d in spec.heads_divisors())


def _check_forced(name: str, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _resolve_cluster(gpus, gpu_type, per_node, cluster) -> ClusterSpec:
    if cluster is not None and gpus is not None:
        raise ValueError("give either gpus=N (with gpu_type) or cluster=, not both")
    if cluster is not None and (gpu_type is not None or per_node is not None):
        raise ValueError("gpu_type / per_node (--gpu-type / --per-node) go with gpus=N (--gpus); "
                         "a cluster names each node's type and count itself")
    if cluster is None:
        if gpus is None:
            raise ValueError("give gpus=N (with gpu_type) or cluster= (a ClusterSpec, dict or YAML path)")
        return ClusterSpec.uniform(gpus, gpu_type or "H100", per_node)
    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, dict):
        return ClusterSpec.from_dict(cluster)
    if isinstance(cluster, (str, Path)):
        return ClusterSpec.from_yaml(cluster)
    raise ValueError(f"cluster must be a ClusterSpec, a dict or a YAML path, got {type(cluster).__name__}")


@dataclass(frozen=True)
class _NodeInfo:
    node: NodeSpec
    capacity_gb: float  # memory a rank may use: the device's memory less the reserve
    flops: float  # the linear part's rate for this model (DeviceType.rates_for)
    intra: Link
    attn_flops: float  # the LSE attention kernel's rate at the model's head dim (ring > 1)
    act_bytes: int  # bytes per activation element sent
    plain_attn_flops: float  # the rate of the kernel that runs with ring 1 (no lse)

    @property
    def rates(self) -> tuple[float, float, int, float]:
        return self.flops, self.attn_flops, self.act_bytes, self.plain_attn_flops


class _Layouts:
    """Judges layouts for one (model, request, cluster); holds the per-call caches."""

    def __init__(self, spec: ModelSpec, geo: VideoGeometry, cluster: ClusterSpec, branches: int,
                 one_branch_why: str = "guidance is off (--no-cfg)", mode=None,
                 shard_weights: bool | None = None):
        # branches: transformer passes per step (module docstring); one_branch_why: why there is one.
        # shard_weights: True forces sharded block weights, False never, None where they make it fit.
        self.spec, self.geo, self.cluster, self.branches = spec, geo, cluster, branches
        self.shard_weights = shard_weights
        self.one_branch_why = one_branch_why
        # Fastest first; stable on the order given.
        order = sorted(enumerate(cluster.nodes),
                       key=lambda iv: (-iv[1].device.flops_per_second, -iv[1].device.memory_gb, iv[0]))
        self.nodes = []
        for _, n in order:
            linear, lse, plain = n.device.rates_for(spec, mode)
            self.nodes.append(_NodeInfo(n, n.device.memory_gb - _reserve(n.device), linear,
                                        Link(n.intra_gb_s, n.device.link_latency_us, n.intra_kind),
                                        lse, n.device.activation_bytes, plain))
        self.max_node = max(n.count for n in cluster.nodes)
        self.network = Link(cluster.network_gb_s, cluster.network_latency_us, "network")
        self.total = cluster.total
        # Nodes that cost the same (device rate and link) share a class id.
        classes: dict = {}
        self._class = [classes.setdefault((n.rates, n.intra), len(classes)) for n in self.nodes]
        self._capacities = sorted({n.capacity_gb for n in self.nodes})
        self._cost_cache: dict = {}
        self._cost_args: dict[int, tuple] = {}  # id of a cached StepCost -> its _cost arguments
        self._slots_cache: dict = {}

    def _cost(self, U, R, C, b, rates: tuple[float, float, int, float], intra: Link, ring_link: Link,
              edge_link: Link) -> StepCost:
        """rates: the pacing node's FLOP/s of the linear part and of the LSE attention kernel,
        its bytes per activation, and the FLOP/s of the ring-1 (no lse) attention kernel."""
        key = (U, R, C, b, rates, intra, ring_link, edge_link)
        hit = self._cost_cache.get(key)
        if hit is None:
            # CPU slots (shm) run one thread: no GPU-style tail of small tiles.
            cpu = intra.kind == "shm"
            small = 0.0 if cpu else costmod.SMALL_SHARD_ROWS
            # A ring merges partial results by their lse; ring 1 runs the kernel without one.
            attn = rates[1] if R > 1 else rates[3]
            hit = costmod.step_cost(self.spec, self.geo, U, R, C, b, rates[0], intra, ring_link, edge_link, small,
                                    wave_slots=0 if cpu else costmod.WAVE_SLOTS, attn_flops_per_s=attn,
                                    act_bytes=rates[2])
            self._cost_cache[key] = hit
            self._cost_args[id(hit)] = key
        return hit

    def _audio_threshold(self, cost: StepCost) -> int | None:
        """The audio length from which the layout `cost` was computed for splits the audio
        tokens (costmod.audio_split_tokens, with the same rates and links); None: never."""
        U, R, C, b, rates, intra, ring_link, edge_link = self._cost_args[id(cost)]
        cpu = intra.kind == "shm"
        return costmod.audio_split_tokens(
            self.spec, self.geo, U, R, C, b, rates[0], intra, ring_link, edge_link,
            small_rows=0.0 if cpu else costmod.SMALL_SHARD_ROWS, wave_slots=0 if cpu else costmod.WAVE_SLOTS,
            attn_flops_per_s=rates[1] if R > 1 else rates[3], act_bytes=rates[2])

    def _slots(self, U: int, need_gb: float):
        """Nodes that can hold a rank, their Ulysses slot counts and where each run starts."""
        key = (U, tuple(cap >= need_gb for cap in self._capacities))
        hit = self._slots_cache.get(key)
        if hit is None:
            usable = [i for i, n in enumerate(self.nodes) if n.capacity_gb >= need_gb]
            runs = [(i, self.nodes[i].node.count // U, self.nodes[i], self._class[i])
                    for i in usable if self.nodes[i].node.count >= U]
            starts, total, reserve, worst = [], 0, [], 0.0
            for i, s, _, _ in runs:
                starts.append(total)
                total += s
                worst = max(worst, _reserve(self.nodes[i].node.device))
                reserve.append(worst)  # the largest reserve among runs[0..j]
            excluded: dict[str, int] = {}
            for i, n in enumerate(self.nodes):
                if n.capacity_gb < need_gb:
                    excluded[n.node.device.name] = excluded.get(n.node.device.name, 0) + n.node.count
            one_link = len({self.nodes[i].intra for i, *_ in runs}) <= 1
            run_records = tuple(Run(self.nodes[i].node.name, self.nodes[i].node.device.name, 0, n)
                                for i, n, *_ in runs)
            uniform = bool(runs) and len({(n, c) for _, n, _, c in runs}) == 1
            hit = (runs, starts, total, excluded, reserve, one_link, run_records,
                   uniform, runs[0][1] if runs else 0)
            self._slots_cache[key] = hit
        return hit

    def judge(self, C: int, U: int, R: int, K: int | None) -> Plan | Rejection:
        """A feasible Plan for cfg C x ulysses U x ring R (K replicas, None: as many as fit)."""
        spec, geo, N = self.spec, self.geo, self.total
        sp = U * R
        k_shown = K or 1

        def reject(kind, reason):
            return Rejection(U, R, C, k_shown, reason, kind)

        if C > 1 and self.branches == 1:
            return reject("guidance", f"cfg {C} runs guidance branches on separate groups, but "
                          f"{self.one_branch_why}; use cfg 1")
        if self.branches % C:
            return reject("guidance", f"cfg {C} does not share the {self.branches} guidance branches of a step "
                          f"evenly; use {_degrees_text(self.branches)}")
        if spec.heads % U:
            return reject("heads", f"ulysses {U} does not divide the {spec.heads} attention heads; "
                          f"feasible: {_divisors_text(spec)}")
        if U > self.max_node:
            return reject("node", f"ulysses {U} exceeds the largest node ({self.max_node} devices); a "
                          "Ulysses group must stay inside one node: use ring for the rest")
        need = C * sp * k_shown
        if need > N:
            return reject("count", f"cfg {C} x ulysses {U} x ring {R} x replicas {k_shown} = {need} "
                          f"devices, but the cluster offers {N}")
        if sp > geo.video_tokens:
            return reject("tokens", f"sp {sp} (ulysses x ring) exceeds the {geo.video_tokens} video "
                          "tokens; every rank must hold video tokens: use fewer devices")
        if self.shard_weights and C * sp == 1:
            return reject("shard", "sharded weights need 2 or more ranks per replica (cfg x ulysses x ring), "
                          "this layout has 1")
        b = costmod.batch_per_group(self.branches, C)  # samples one group carries per step
        # The largest rank: rank 0 (text encoder), with the decode split over the replica.
        base_gb = costmod.memory_gb(spec, geo, U, R, b, 0.0, decode_ranks=C * sp)
        resident_gb, offload_gb = base_gb, 0.0
        idle_gb = spec.idle_weight_bytes / 1e9
        if idle_gb > 0:
            # Nothing holds every weight resident: keep what is idle during denoising (the
            # inactive expert, the text encoder once the prompt is encoded) in host memory.
            everything = self._slots(U, base_gb)[3]
            lean = self._slots(U, base_gb - idle_gb)[3]
            if everything and sum(everything.values()) == N and not (lean and sum(lean.values()) == N):
                base_gb, offload_gb = base_gb - idle_gb, idle_gb
        # Sharded block weights: where they let more replicas of this layout fit (the K asked
        # for, or any more), or forced; from the unsharded peak without offloading, then with it.
        shard, unsharded_gb = False, base_gb
        if self.shard_weights is not False and C * sp > 1:
            def left_out(gb):
                out = self._slots(U, gb)[3]
                return sum(out.values()) if out else 0

            def replicas_fit(gb):
                return self._slots(U, gb)[2] // (C * R)

            experts = spec.experts
            options = [(resident_gb, 0.0, experts)] + ([(resident_gb - idle_gb, idle_gb, 1)] if idle_gb > 0 else [])
            best = None
            for gb, off, resident_experts in options:
                candidate = (sharded_gb(spec, gb, C * sp, resident_experts if off else experts), off)
                if best is None or left_out(candidate[0]) < left_out(best[0]):
                    best = candidate
            plain, sharded = replicas_fit(base_gb), replicas_fit(best[0])
            if self.shard_weights or (sharded > plain and (K is None or plain < K)):
                base_gb, offload_gb, shard = best[0], best[1], True
        (runs, starts, slots, excluded, reserve, one_link, run_records,
         uniform_runs, slots_per_run) = self._slots(U, base_gb)
        if excluded and sum(excluded.values()) == N:  # no device can hold a rank
            big = max(self.nodes, key=lambda n: n.capacity_gb)
            dev = big.node.device
            weights = spec.weight_bytes / 1e9
            lean = weights - spec.idle_weight_bytes / 1e9
            if lean > big.capacity_gb:
                fix = "the weights alone do not fit: use devices with more memory"
                if lean < weights:
                    fix = (f"the weights alone do not fit, {lean:.1f} GB even with the idle ones (inactive "
                           "expert, text encoder) in host memory: use devices with more memory")
            else:
                fix = "raise ring or ulysses (activations shrink with sp) or use devices with more memory"
            if shard:
                fix = (f"{unsharded_gb + dev.memory_gb - big.capacity_gb:.1f} GB without sharding; "
                       "use more ranks per replica or devices with more memory")
                return Rejection(U, R, C, k_shown, (
                    f"needs {base_gb + dev.memory_gb - big.capacity_gb:.1f} GB per device with the block weights "
                    f"sharded over the replica's {C * sp} ranks (+ reserve), the largest device offered ({dev.name}) "
                    f"has {dev.memory_gb:g} GB; {fix}"), "memory", base_gb)
            if C * sp > 1 and self.shard_weights is not False:
                least = min(sharded_gb(spec, resident_gb, C * sp, spec.experts),
                            sharded_gb(spec, resident_gb - idle_gb, C * sp, 1 if idle_gb else spec.experts))
                fix += f" (with the block weights sharded over its {C * sp} ranks it would still need " \
                       f"{least + dev.memory_gb - big.capacity_gb:.1f} GB)"
            return Rejection(U, R, C, k_shown, (
                f"needs {base_gb + dev.memory_gb - big.capacity_gb:.1f} GB per device (weights "
                f"{weights:.1f} GB + activations {base_gb - weights:.1f} GB + reserve), the largest "
                f"device offered ({dev.name}) has {dev.memory_gb:g} GB; {fix}"), "memory", base_gb)
        P = C * R  # Ulysses slots per replica
        fit = slots // P
        if (K is not None and fit < K) or fit == 0:
            groups = k_shown * P
            why = (f"needs {groups} Ulysses group{'s' if groups != 1 else ''} of {U} devices on single "
                   f"nodes, the usable nodes hold {slots}")
            if excluded:
                why += " (" + ", ".join(f"{n} {t}" for t, n in excluded.items()) + \
                       f" cannot hold a rank: {base_gb:.1f} GB + reserve)"
            return reject("count", why)
        K = fit if K is None else K

        # Replicas take P consecutive slots; each cfg group R of them. Replicas inside one node
        # are counted in bulk, those straddling nodes one by one.
        steps: list[float] = []
        fastest_cost: StepCost | None = None
        notes: list[str] = []
        spans_types: list[tuple[int, list[str], str]] = []
        crosses = False
        in_node: dict[int, StepCost] = {}  # per node class: a replica inside one node
        if uniform_runs and slots_per_run % P == 0:
            # Equal nodes, replicas never straddle: every replica is the same.
            node = runs[0][2]
            c = self._cost(U, R, C, b, node.rates, node.intra, node.intra, node.intra)
            steps.extend([c.total] * K)
            fastest_cost = c
            K_done = K
        else:
            K_done = 0
        # On equal nodes the pattern of straddling replicas repeats every lcm(slots, P) slots:
        # walk one period and tile it.
        K_walk = min(K, math.lcm(slots_per_run, P) // P) if uniform_runs else K
        k, r = K_done, 0  # replica, index into runs
        while k < K_walk:
            first = k * P
            while starts[r] + runs[r][1] <= first:
                r += 1
            info = runs[r][2]
            inside = (starts[r] + runs[r][1] - first) // P
            if inside >= 1:
                m = min(inside, K_walk - k)
                c = in_node.get(runs[r][3])
                if c is None:
                    c = in_node[runs[r][3]] = self._cost(U, R, C, b, info.rates, info.intra, info.intra,
                                                         info.intra)
                steps.extend([c.total] * m)
                k += m
            else:
                last = first + P - 1
                r_hi = bisect_right(starts, last) - 1
                # Nodes are sorted fastest first, so the last member paces the replica.
                slow = runs[r_hi][2]
                if one_link:
                    intra = slow.intra
                else:
                    intra = min((runs[j][2].intra for j in range(r, r_hi + 1)),
                                key=lambda lk: (lk.gb_s, -lk.latency_us))
                # A cfg group (R consecutive slots) crosses when its ends lie on different runs.
                group_crosses = any(
                    bisect_right(starts, first + g * R) != bisect_right(starts, first + g * R + R - 1)
                    for g in range(C))
                crosses = crosses or group_crosses
                c = self._cost(U, R, C, b, slow.rates, intra,
                               self.network if group_crosses else intra, self.network)
                if info.node.device is not slow.node.device:
                    names = sorted({runs[j][2].node.device.name for j in range(r, r_hi + 1)})
                    spans_types.append((k, names, slow.node.device.name))
                steps.append(c.total)
                k += 1
            if fastest_cost is None or c.total < fastest_cost.total:
                fastest_cost = c
        if len(steps) < K:
            steps = (steps * (K // len(steps) + 1))[:K]
        assert fastest_cost is not None and len(steps) == K
        world = K * P * U
        text_p, video_p = costmod.padded_parts(geo, sp)

        if crosses:
            notes.append(f"a ring group crosses nodes over the network ({self.network.gb_s:g} GB/s)")
        for rep, names, slow_name in spans_types[:3]:
            notes.append(f"replica {rep} spans {' + '.join(names)}: paced by {slow_name}")
        if K > 1 and max(steps) > min(steps) * (1 + TIE_TOLERANCE):
            notes.append(f"replicas step in {min(steps):.3g} to {max(steps):.3g} s "
                         "(different devices or links)")
        if excluded:
            notes.append(", ".join(f"{n} {t}" for t, n in excluded.items()) +
                         f" left out: a rank needs {base_gb:.1f} GB + reserve")
        left = N - world - (sum(excluded.values()) if excluded else 0)
        if left:
            notes.append(f"{left} device{'s' if left != 1 else ''} left out: groups of "
                         f"{C * sp} (cfg {C} x sp {sp}) do not fill the rest"
                         + (" with Ulysses groups inside nodes" if U > 1 else ""))
        audio_threshold = self._audio_threshold(fastest_cost) if geo.audio_tokens else None
        if geo.audio_tokens:
            notes.append(_audio_note(geo, sp, fastest_cost, audio_threshold))
        gather = None
        if shard:
            # The replica's link: inside a node where its C x sp ranks fit on one, else the network.
            info = runs[0][2]
            link = info.intra if C * sp <= max(r[1] for r in runs) * U else self.network
            gather = gather_cost(spec, C * sp, link, fastest_cost.compute)
            steps = [s + gather.exposed_s for s in steps]
            fastest_cost = dataclasses.replace(fastest_cost, total=fastest_cost.total + gather.exposed_s)
            notes.append(
                f"block weights sharded over the replica's {C * sp} ranks: {base_gb:.1f} GB per rank instead of "
                f"{resident_gb - offload_gb:.1f} GB; each step gathers {spec.layers} blocks of "
                f"{gather.block_mb:.0f} MB over {gather.link} ({gather.total_s:.3g} s, {gather.exposed_s:.3g} s not "
                "hidden by compute)")
        if offload_gb:
            link = HOST_LINK_GB_S  # device <-> host memory: PCIe, whatever links the GPUs
            # A sharded expert moves its 1/N share only.
            expert_gb = spec.params * spec.bytes_per_param / 1e9 / (C * sp if shard else 1)
            switch_s = expert_gb / link if spec.experts > 1 else 0.0
            encoder_gb = spec.text_encoder_params * spec.bytes_per_param / 1e9
            idle = (["the inactive expert"] if spec.experts > 1 else []) + \
                (["the text encoder after encoding"] if spec.text_encoder_params else [])
            notes.append(
                f"keeps {offload_gb:.1f} GB of idle weights in host memory ({' and '.join(idle)}): "
                f"{base_gb:.1f} GB per rank instead of {resident_gb:.1f} GB"
                + (f"; each expert switch moves {expert_gb:.1f} GB, about "
                   f"{switch_s:.1f} s per request over {link:g} GB/s" if switch_s else "")
                + (f"; the text encoder's trip to the device and back, about {2 * encoder_gb / link:.1f} s per "
                   "request" if encoder_gb else ""))
        mem = base_gb + reserve[bisect_right(starts, K * P - 1) - 1]
        return Plan(
            offload_idle_gb=offload_gb,
            ulysses=U, ring=R, cfg=C, replicas=K, world_size=world,
            pad_tokens=text_p + video_p - geo.sequence_tokens,
            text_pad_tokens=text_p - geo.text_tokens, video_pad_tokens=video_p - geo.video_tokens,
            split=costmod.split_kind(geo, sp),
            predicted_step_seconds=fastest_cost.total, slowest_step_seconds=max(steps),
            throughput_steps_per_second=sum(1.0 / t for t in steps),
            memory_gb_per_gpu=mem, cost=fastest_cost, gpus_offered=N,
            pad_fraction=(text_p + video_p - geo.sequence_tokens) / geo.sequence_tokens,
            kind="uniform", notes=tuple(notes),
            runs=run_records,
            replica_step_seconds=tuple(steps),
            decode=decode_cost(spec, geo, C * sp, self.nodes[0].node.device.flops_per_second, self.nodes[0].intra.gb_s,
                               self.nodes[0].intra.latency_us),
            audio_split_tokens=audio_threshold,
            shard_weights=shard, gather=gather,
        )


def _audio_note(geo: VideoGeometry, sp: int, cost: StepCost, threshold: int | None) -> str:
    """What a plan does with an audio stream (LTX-2): its tokens split over the sp ranks or
    whole on every rank, by the cost model, and from which length it would split them."""
    if cost.audio_split:
        note = (f"{geo.audio_tokens} audio tokens are split over the {sp} sp ranks (the cost model prefers it from "
                f"{threshold} tokens on this layout): each rank computes its share of the audio stream, "
                f"{cost.audio_compute - cost.audio_whole:.3g} s a step with its video tokens' side of the "
                f"audio<->video attention; their attention's exchanges and gathers add {cost.audio_exchange:.3g} s")
    else:
        note = (f"{geo.audio_tokens} audio tokens stay whole on every rank: each rank computes the whole audio "
                f"stream, {cost.audio_whole:.3g} s a step at any sp, and its video tokens' side of the "
                f"audio<->video attention, {cost.audio_compute - cost.audio_whole:.3g} s")
        if sp > 1:
            note += ("; splitting them would pay from " + (f"{threshold} audio tokens" if threshold else
                     f"no length up to {costmod.AUDIO_SPLIT_SEARCH_TOKENS}") + " on this layout")
    if sp > 1:
        note += (f"; video-to-audio attention all-gathers the video keys and values every block, "
                 f"{cost.audio_gather:.3g} s")
    return note


def _tie_key(p: Plan, best_throughput: float):
    """Among plans tied on step time: throughput (within TIE_TOLERANCE of the group's best
    counts as the best: one replica's throughput is 1 / its step time, so comparing it
    exactly would break every tie by time again), then less padding, aligned splits, fewer
    devices, then published practice (cfg first, then Ulysses, then ring)."""
    tp = p.throughput_steps_per_second
    behind = tp * (1 + TIE_TOLERANCE) < best_throughput
    return (behind, -tp if behind else 0.0, p.pad_tokens, costmod.SPLIT_ORDER[p.split],
            p.world_size, -p.cfg, -p.ulysses)


def _rank(plans) -> list[Plan]:
    """Plans best first. Step time decides, except between plans within TIE_TOLERANCE of the
    fastest plan not yet placed: those form one tie group, ordered by `_tie_key`. (Groups are
    anchored at their fastest member, so two plans 0.1% apart always tie; fixed buckets of
    log time would split them when a bucket boundary fell between them.)"""
    by_time = sorted(plans, key=lambda p: p.predicted_step_seconds)
    ranked: list[Plan] = []
    i = 0
    while i < len(by_time):
        limit = by_time[i].predicted_step_seconds * (1 + TIE_TOLERANCE)
        j = i + 1
        while j < len(by_time) and by_time[j].predicted_step_seconds <= limit:
            j += 1
        best_tp = max(p.throughput_steps_per_second for p in by_time[i:j])
        ranked += sorted(by_time[i:j], key=lambda p: _tie_key(p, best_tp))
        i = j
    return ranked


def batch_capacity(result: "PlanResult", plan: "Plan", limit: int = 64) -> int:
    """The most requests of the planned geometry one replica of `plan` can carry through a
    step side by side (step-level batching), by the memory model: their activations together,
    the weights once, within its smallest device's capacity less the reserve; at least 1."""
    spec, geo = result.model, result.geometry
    b = costmod.batch_per_group(result.branches, plan.cfg)
    types = {r.gpu_type for r in plan.runs} or {n.device.name for n in result.cluster.nodes}
    capacity = min(n.device.memory_gb - _reserve(n.device) for n in result.cluster.nodes if n.device.name in types)
    ranks = plan.cfg * plan.ulysses * plan.ring
    n = 1
    while n < limit and costmod.memory_gb(spec, geo, plan.ulysses, plan.ring, b * (n + 1), 0.0,
                                          decode_ranks=ranks) <= capacity:
        n += 1
    return n


def _degrees_text(branches: int) -> str:
    """The cfg degrees that share `branches` evenly, as words."""
    return " or ".join(f"cfg {d}" for d in cfg_degrees(branches))


def _enumerate(spec, geo, cluster, branches, ulysses, ring, cfg, replicas, world_size=None,
               one_branch_why="guidance is off (--no-cfg)", mode=None, shard_weights=None):
    L = _Layouts(spec, geo, cluster, branches, one_branch_why, mode, shard_weights)
    N = cluster.total
    feasible: list[Plan] = []
    rejected: list[Rejection] = []
    cfgs = [cfg] if cfg is not None else cfg_degrees(branches)
    for C in cfgs:
        if ulysses is not None:
            us = [ulysses]
        else:
            fit = (world_size or N) // (C * (ring or 1) * (replicas or 1))
            us = list(range(1, min(fit, spec.heads) + 1)) or [1]
        for U in us:
            if ulysses is None and U > L.max_node and spec.heads % U:
                continue  # beyond every node and not a divisor: the node rule alone says enough
            if ring is not None:
                rs = [ring]
            else:
                rs = list(range(1, max((world_size or N) // (C * U * (replicas or 1)), 1) + 1))
            for R in rs:
                K = replicas
                if world_size is not None:
                    # Only layouts of exactly world_size devices: K follows from the rest.
                    if world_size % (C * U * R) or (K is not None and K * C * U * R != world_size):
                        continue
                    K = world_size // (C * U * R)
                out = L.judge(C, U, R, K)
                if isinstance(out, Plan):
                    feasible.append(out)
                    continue
                rejected.append(out)
                # Reasons that hold for every larger ring degree are listed once.
                if ring is None and out.kind in ("heads", "node", "guidance", "tokens", "shard"):
                    break
    return _rank(feasible), rejected


def _per_type(spec, geo, cluster, branches, one_branch_why, mode=None, shard_weights=None) -> Plan | None:
    """One best layout per device type, run side by side as replicas of different shapes."""
    parts = []
    for t in cluster.types:
        sub = cluster.only(t)
        feasible, _ = _enumerate(spec, geo, sub, branches, None, None, None, None,
                                 one_branch_why=one_branch_why, mode=mode, shard_weights=shard_weights)
        if feasible:
            parts.append(feasible[0])
    if len(parts) < 2:
        return None
    parts.sort(key=lambda p: p.predicted_step_seconds)
    lead = parts[0]
    world = sum(p.world_size for p in parts)
    steps = tuple(t for p in parts for t in p.replica_step_seconds)
    notes = ["one layout per device type, side by side (replicas of different shapes): " + "; ".join(
        f"{p.runs[0].gpu_type}: cfg {p.cfg} x ulysses {p.ulysses} x ring {p.ring} x {p.replicas} at "
        f"{p.predicted_step_seconds:.3g} s/step" for p in parts)]
    if geo.audio_tokens:
        notes.append(_audio_note(geo, lead.sp, lead.cost, lead.audio_split_tokens))
    left = cluster.total - world
    if left:
        notes.append(f"{left} device{'s' if left != 1 else ''} left out")
    return Plan(
        ulysses=lead.ulysses, ring=lead.ring, cfg=lead.cfg, replicas=sum(p.replicas for p in parts),
        world_size=world, pad_tokens=lead.pad_tokens, text_pad_tokens=lead.text_pad_tokens,
        video_pad_tokens=lead.video_pad_tokens, split=lead.split,
        predicted_step_seconds=lead.predicted_step_seconds, slowest_step_seconds=max(steps),
        throughput_steps_per_second=sum(p.throughput_steps_per_second for p in parts),
        memory_gb_per_gpu=max(p.memory_gb_per_gpu for p in parts), cost=lead.cost,
        gpus_offered=cluster.total, pad_fraction=lead.pad_fraction, kind="per-type",
        notes=tuple(notes), parts=tuple(parts),
        replica_step_seconds=steps, audio_split_tokens=lead.audio_split_tokens,
    )


def _summary(rejected: list[Rejection], forced_ulysses: bool = False) -> str:
    """One reason per kind of rejection; for memory, the layout that needs the least. Where
    Ulysses was not forced, a degree that does not divide the heads or fit a node never stopped
    every layout (ulysses 1 was judged too): those reasons are left out unless nothing else was
    said."""
    ignorable = set() if forced_ulysses else {"heads", "node"}
    if any(r.kind not in ignorable for r in rejected):
        rejected = [r for r in rejected if r.kind not in ignorable]
    picked: dict[str, Rejection] = {}
    for r in rejected:
        have = picked.get(r.kind)
        if have is None or (r.kind == "memory" and r.need_gb < have.need_gb):
            picked[r.kind] = r
    parts = []
    for r in picked.values():
        where = ""
        if r.kind == "memory":
            where = f" (at best: cfg {r.cfg} x ulysses {r.ulysses} x ring {r.ring})"
        parts.append(r.reason + where)
    return "; ".join(parts)


def plan(model, frames: int | None = None, height: int | None = None, width: int | None = None, *,
         gpus: int | None = None, gpu_type: str | None = None, per_node: int | None = None,
         cluster=None, ulysses: int | None = None, ring: int | None = None, cfg: int | None = None,
         replicas: int | None = None, guidance: bool = True,
         world_size: int | None = None, branches: int | None = None, mode: Mode | None = None,
         shard_weights: bool | None = None) -> PlanResult:
    """Plan `model` (name, diffusers directory or ModelSpec) for a frames x height x width
    request on `gpus` devices of `gpu_type` or on `cluster` (ClusterSpec, dict, YAML path).

    Any of ulysses / ring / cfg / replicas given restricts the enumeration; world_size keeps
    only layouts that use exactly that many devices (cfg x ulysses x ring x replicas);
    PlanError when no layout remains feasible. guidance=False: one branch per step, cfg 1.
    branches: transformer passes per step with guidance on (default: the model's
    cfg_branches, or 2 when cfg=2 is forced on a one-branch model; module docstring).
    mode: how the step runs (devicemodel.Mode: fp8 GEMMs, 8-bit attention, compile; default
    bf16 eager); priced where the device type has an op table (`PlanResult.rates_sources`).
    shard_weights: True: every layout shards the transformer blocks' weights over its replica
    (raydit.planner.sharding); False: none does; None: those that fit more devices with it.
    """
    spec = model_spec(model)
    geo = spec.geometry(frames, height, width)
    cl = _resolve_cluster(gpus, gpu_type, per_node, cluster)
    if shard_weights not in (None, True, False):
        raise ValueError(f"shard_weights {shard_weights!r} must be True, False or None (where it fits more devices)")
    if shard_weights and (cl.total == 1 or world_size == 1 or (replicas is not None and cl.total // replicas < 2)):
        raise PlanError("sharded weights need 2 or more ranks per replica to share the blocks, this request leaves "
                        "1 (every weight is resident on one device anyway); drop shard_weights or offer more devices")
    for name, value in (("ulysses", ulysses), ("ring", ring), ("cfg", cfg), ("replicas", replicas),
                        ("world_size", world_size)):
        _check_forced(name, value)
    if world_size is not None and world_size > cl.total:
        raise PlanError(f"world_size {world_size} is more than the {cl.total} devices offered")
    most = max(2, spec.cfg_branches)  # a one-branch model still takes true CFG's two
    if branches is not None and (isinstance(branches, bool) or not isinstance(branches, int)
                                 or not 1 <= branches <= most):
        raise ValueError(f"branches {branches!r} must be an integer in 1..{most} (transformer passes per step)")
    if branches is not None and branches > 1 and not guidance:
        raise PlanError(f"branches {branches} runs {branches} guidance branches per step, but guidance is off "
                        "(--no-cfg); drop branches or turn guidance on")
    if not guidance:
        branches, why = 1, "guidance is off (--no-cfg)"
    else:
        if branches is None:
            branches = 2 if cfg == 2 and spec.cfg_branches == 1 else spec.cfg_branches
        why = (f"{spec.name} runs one branch per step (embedded guidance)" if spec.cfg_branches == 1
               else "branches=1 was asked")
    if cfg is not None and cfg > 1:
        if branches == 1:
            raise PlanError(f"cfg {cfg} runs guidance branches on separate groups, but {why}; "
                            "use cfg 1" + (", or branches=2 for true classifier-free guidance" if guidance else ""))
        if branches % cfg:
            raise PlanError(f"cfg {cfg} does not share the {branches} guidance branches of a {spec.name} step "
                            f"evenly; use {_degrees_text(branches)}")
    mode = Mode() if mode is None else mode
    if not isinstance(mode, Mode):
        raise ValueError(f"mode must be a raydit.planner.devicemodel.Mode, got {type(mode).__name__}")
    if mode.quantize == "fp8":
        # The runtime shards fp8-sim's weights (plain tensors) but not torchao's FP8 weights
        # (raydit.models.quantize_options.SHARD_FP8_REFUSAL): no fp8 layout may rely on sharding.
        if shard_weights:
            raise PlanError("sharded weights are not run with quantize fp8 (torchao's FP8 weights stay whole on every "
                            "rank); drop shard_weights or quantize fp8")
        shard_weights = False
    feasible, rejected = _enumerate(spec, geo, cl, branches, ulysses, ring, cfg, replicas, world_size, why, mode,
                                    shard_weights)
    forced = any(v is not None for v in (ulysses, ring, cfg, replicas, world_size))
    if len(cl.types) > 1 and not forced:
        combo = _per_type(spec, geo, cl, branches, why, mode, shard_weights)
        if combo is not None:
            feasible.append(combo)
            feasible = _rank(feasible)
    if not feasible:
        what = ("forced layout" if forced else "layout")
        detail = (_summary(rejected, ulysses is not None)
                  or f"no layout of exactly {world_size} devices matches the forced degrees")
        raise PlanError(f"no feasible {what} for {spec.name} at {geo.frames}x{geo.height}x{geo.width} "
                        f"on {cl.total} device{'s' if cl.total != 1 else ''}: {detail}")
    sources = tuple(sorted({f"{t}: {d.rates_source(spec, mode)}" for t, d in
                            ((n.device.name, n.device) for n in cl.nodes)}))
    return PlanResult(spec, geo, cl, guidance, tuple(feasible), tuple(rejected), branches, mode, sources)
