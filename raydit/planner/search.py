"""Enumerate every layout (cfg x ulysses x ring x replicas), judge each, rank the feasible ones.

`plan(...)` is the planner's entry: it checks the request and the forced degrees, walks the
layouts (raydit.planner.judge judges each, raydit.planner.ranking orders the feasible) and
returns a PlanResult (raydit.planner.plans), or raises PlanError with one reason per kind of
rejection.

Guidance: with guidance on, a step runs `branches` transformer passes: the model's
`cfg_branches` (2 for classifier-free guidance; 1 where guidance is embedded, HunyuanVideo; 4
for LTX-2's cfg pair, STG and modality passes), 2 when cfg 2 is forced on a one-branch model
(asking for true CFG), or what `branches=` says. The cfg axis is a branch degree: C groups
share the branches evenly (C divides branches, each group carries branches / C samples);
one branch never plans a cfg axis.

Mixed device types: besides the layouts packed fastest-first across types
(raydit.planner.judge), a "per-type" plan runs the best layout of each type's nodes side by
side (replicas of different shapes). Every plan's `notes` say which it is.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

from raydit.planner.cluster import ClusterSpec
from raydit.planner.hardware import DEVICE_TYPES
from raydit.planner.devicemodel import Mode
from raydit.planner.judge import LayoutJudge, audio_note
from raydit.planner.layouts import cfg_degrees, cfg_degrees_text
from raydit.planner.registry import model_spec
from raydit.planner.plans import Plan, PlanError, PlanResult, Rejection
from raydit.planner.ranking import rank_plans


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
        return ClusterSpec.uniform(gpus, "H100" if gpu_type is None else gpu_type, per_node)
    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, dict):
        return ClusterSpec.from_dict(cluster)
    if isinstance(cluster, (str, Path)):
        return ClusterSpec.from_yaml(cluster)
    raise ValueError(f"cluster must be a ClusterSpec, a dict or a YAML path, got {type(cluster).__name__}")



def _enumerate(spec, geo, cluster, branches, ulysses, ring, cfg, replicas, world_size=None,
               one_branch_why="guidance is off (--no-cfg)", mode=None, shard_weights=None):
    L = LayoutJudge(spec, geo, cluster, branches, one_branch_why, mode, shard_weights)
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
    return rank_plans(feasible), rejected


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
        notes.append(audio_note(geo, lead.sp, lead.cost, lead.audio_split_tokens))
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
    if not isinstance(guidance, bool):
        raise ValueError(f"guidance {guidance!r} must be True or False")
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
                            f"evenly; use {cfg_degrees_text(branches)}")
    mode = Mode() if mode is None else mode
    if not isinstance(mode, Mode):
        raise ValueError(f"mode must be a raydit.planner.devicemodel.Mode, got {type(mode).__name__}")
    # CPU slots ("shm") run the 8-bit attention modes' torch kernels (their numbers, no speed);
    # a GPU without FP8 runs no FP8 kernel (raydit.parallel.kernels.lowbit.candidates).
    for what, asked, cpu_lacks in (("quantize fp8", mode.quantize == "fp8", True),
                                   ("attention fp8", mode.attention == "fp8", False)):
        lacking = sorted({n.device.name for n in cl.nodes if n.device.fp8 is False
                          and (cpu_lacks or n.device.link_kind != "shm")}) if asked else []
        if lacking:
            have = sorted(name for name, d in DEVICE_TYPES.items() if d.fp8)
            raise PlanError(f"{what} needs FP8 tensor cores (compute capability 8.9 or newer: {', '.join(have)}), "
                            f"which {', '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} not; drop {what} "
                            "or plan devices that have them" + (" (attention int8 runs there)"
                                                                if what == "attention fp8" else ""))
    if mode.quantize == "fp8":
        # The blocks' quantized linears are kept in one byte per weight (ModelSpec.fp8_params),
        # whole or sharded (raydit.planner.sharding prices the FP8 blocks' bytes too).
        spec = dataclasses.replace(spec, fp8_weights=True)
    if mode.keep_bf16:
        # Full-precision steps: every quantized linear also keeps its weight as loaded, on every
        # rank (ModelSpec.keeps_bf16), and those are never sharded.
        if shard_weights:
            raise PlanError("full-precision steps keep every quantized linear's bf16 weight on its rank, which "
                            "sharded weights do not hold; drop full_precision_steps or shard_weights")
        shard_weights = False
        spec = dataclasses.replace(spec, keeps_bf16=True)
    feasible, rejected = _enumerate(spec, geo, cl, branches, ulysses, ring, cfg, replicas, world_size, why, mode,
                                    shard_weights)
    forced = any(v is not None for v in (ulysses, ring, cfg, replicas, world_size))
    if len(cl.types) > 1 and not forced:
        combo = _per_type(spec, geo, cl, branches, why, mode, shard_weights)
        if combo is not None:
            feasible.append(combo)
            feasible = rank_plans(feasible)
    if not feasible:
        what = ("forced layout" if forced else "layout")
        detail = (_summary(rejected, ulysses is not None)
                  or f"no layout of exactly {world_size} devices matches the forced degrees")
        raise PlanError(f"no feasible {what} for {spec.name} at {geo.frames}x{geo.height}x{geo.width} "
                        f"on {cl.total} device{'s' if cl.total != 1 else ''}: {detail}")
    sources = tuple(sorted({f"{t}: {d.rates_source(spec, mode)}" for t, d in
                            ((n.device.name, n.device) for n in cl.nodes)}))
    return PlanResult(spec, geo, cl, guidance, tuple(feasible), tuple(rejected), branches, mode, sources)
