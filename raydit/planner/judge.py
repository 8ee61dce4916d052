"""Judge one layout (cfg x ulysses x ring x replicas) on one cluster: feasible, and then
placed and priced as a Plan, or a Rejection that says why.

A layout is feasible when
  - ulysses divides the attention heads and fits inside one node (its all-to-alls are the
    most bandwidth-hungry collective: they stay on NVLink/PCIe),
  - the largest rank (rank 0: the transformers, the VAE and the text encoder) holds its share
    of activations, or of the decode after them (`cost.memory_gb`),
  - the groups fit the devices offered (Ulysses groups packed node by node),
  - sp = ulysses x ring does not exceed the video tokens (every rank holds real video).
Uneven token counts are never a reason to refuse: text and video are padded to sp.

Ulysses slots are taken fastest node first (raydit.planner.plans: placement). A layout so
packed may put a group across device types (paced by its slowest member), replicas of one
shape on different types, or leave the slow devices out; its `notes` say which.
Where nothing holds every weight resident, idle weights go to host memory; where it lets
more replicas fit (or is forced), the transformer blocks' weights are sharded over the
replica (raydit.planner.sharding).
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from dataclasses import dataclass

from raydit.planner import cost as costmod
from raydit.planner.cluster import ClusterSpec, NodeSpec
from raydit.planner.cost import Link, StepCost
from raydit.planner.decode import decode_cost
from raydit.planner.devicemodel import device_elementwise_gb_s
from raydit.planner.hardware import DeviceType
from raydit.planner.layouts import cfg_degrees_text
from raydit.planner.model import ModelSpec, VideoGeometry
from raydit.planner.plans import Plan, PlanResult, Rejection, Run
from raydit.planner.ranking import TIE_TOLERANCE
from raydit.planner.sharding import gather_cost, sharded_gb

# Memory held back on each device: a rank may use the device's memory less this.
GPU_RESERVE_GB = 1.5
CPU_RESERVE_GB = 0.5

# Effective device <-> host copy rate for weights kept in host memory (PCIe 4/5 x16 as
# measured by pinned copies, not the link between GPUs).
HOST_LINK_GB_S = 25.0


def reserve_gb(dev: DeviceType) -> float:
    """The memory a rank may not use on `dev` (GPU_RESERVE_GB, CPU_RESERVE_GB on a CPU slot)."""
    return CPU_RESERVE_GB if dev.link_kind == "shm" else GPU_RESERVE_GB


def _divisors_text(spec: ModelSpec) -> str:
    return ", ".join(str(d) for d in spec.heads_divisors())


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


class LayoutJudge:
    """Judges layouts for one (model, request, cluster); holds the per-call caches."""

    def __init__(self, spec: ModelSpec, geo: VideoGeometry, cluster: ClusterSpec, branches: int,
                 one_branch_why: str = "guidance is off (--no-cfg)", mode=None,
                 shard_weights: bool | None = None):
        # branches: transformer passes per step (module docstring); one_branch_why: why there is one.
        # shard_weights: True forces sharded block weights, False never, None where they make it fit.
        self.spec, self.geo, self.cluster, self.branches = spec, geo, cluster, branches
        self.shard_weights = shard_weights
        self.one_branch_why = one_branch_why
        # Sparse attention: the kernel does this share of dense attention's work (the ring's
        # K/V still travel whole: priced as dense, an upper bound).
        self.attention_work = getattr(mode, "attention_work", 1.0)
        # Fastest first; stable on the order given.
        order = sorted(enumerate(cluster.nodes),
                       key=lambda iv: (-iv[1].device.flops_per_second, -iv[1].device.memory_gb, iv[0]))
        self.nodes = []
        for _, n in order:
            linear, lse, plain = n.device.rates_for(spec, mode)
            self.nodes.append(_NodeInfo(n, n.device.memory_gb - reserve_gb(n.device), linear,
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
            attn = self._attention_rate(U, R, rates)
            hit = costmod.step_cost(self.spec, self.geo, U, R, C, b, rates[0], intra, ring_link, edge_link, small,
                                    wave_slots=0 if cpu else costmod.WAVE_SLOTS, attn_flops_per_s=attn,
                                    act_bytes=rates[2])
            self._cost_cache[key] = hit
            self._cost_args[id(hit)] = key
        return hit

    def _attention_rate(self, U: int, R: int, rates: tuple[float, float, int, float]) -> float:
        """A ring merges partial results by their lse; ring 1 runs the kernel without one. A
        model whose pipeline masks its attention (ModelSpec.masked_attention) pays the masked
        rate (the plain one) on one device only: sharded, raydit's processor attends to the valid
        text without a mask (HunyuanVideo's valid_text_counts), at the unmasked kernel's rate."""
        if R > 1 or (U > 1 and self.spec.masked_attention):
            return rates[1] / self.attention_work
        return rates[3] / self.attention_work

    def _audio_threshold(self, cost: StepCost) -> int | None:
        """The audio length from which the layout `cost` was computed for splits the audio
        tokens (costmod.audio_split_tokens, with the same rates and links); None: never."""
        U, R, C, b, rates, intra, ring_link, edge_link = self._cost_args[id(cost)]
        cpu = intra.kind == "shm"
        return costmod.audio_split_tokens(
            self.spec, self.geo, U, R, C, b, rates[0], intra, ring_link, edge_link,
            small_rows=0.0 if cpu else costmod.SMALL_SHARD_ROWS, wave_slots=0 if cpu else costmod.WAVE_SLOTS,
            attn_flops_per_s=self._attention_rate(U, R, rates), act_bytes=rates[2])

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
                worst = max(worst, reserve_gb(self.nodes[i].node.device))
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
                          f"evenly; use {cfg_degrees_text(self.branches)}")
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
                    idle = " and ".join((["the inactive expert"] if spec.experts > 1 else [])
                                        + (["the text encoder"] if spec.text_encoder_params else []))
                    fix = (f"the weights alone do not fit, {lean:.1f} GB even with {idle} in host memory: use "
                           "devices with more memory")
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
                # Off-node traffic also crosses a PCIe node's shared lanes (Link.through), which
                # the replica's ranks on its busiest node share: its first or last node's part,
                # or a whole node between them.
                network = self.network
                if intra.kind == "pcie":
                    inner = 0
                    if r_hi - r >= 2:
                        inner = slots_per_run if uniform_runs else max(runs[j][1] for j in range(r + 1, r_hi))
                    busiest = max(starts[r] + runs[r][1] - first, last + 1 - starts[r_hi], inner) * U
                    network = network.through(intra, busiest)
                c = self._cost(U, R, C, b, slow.rates, intra, network if group_crosses else intra, network)
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
            notes.append(audio_note(geo, sp, fastest_cost, audio_threshold))
        gather = None
        if shard:
            # The replica's link: inside a node where its C x sp ranks fit on one, else the network.
            info, node_ranks = runs[0][2], max(r[1] for r in runs) * U
            link = (info.intra if C * sp <= node_ranks
                    else self.network.through(min((r[2].intra for r in runs), key=lambda lk: lk.gb_s), node_ranks))
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
            expert_gb = spec.params * spec.transformer_bytes_per_param / 1e9 / (C * sp if shard else 1)
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
                               self.nodes[0].intra.latency_us,
                               elementwise_gb_s=device_elementwise_gb_s(self.nodes[0].node.device.name)),
            audio_split_tokens=audio_threshold,
            shard_weights=shard, gather=gather,
        )


def audio_note(geo: VideoGeometry, sp: int, cost: StepCost, threshold: int | None) -> str:
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


def batch_capacity(result: "PlanResult", plan: "Plan", limit: int = 64) -> int:
    """The most requests of the planned geometry one replica of `plan` can carry through a
    step side by side (step-level batching), by the memory model: their activations together,
    the weights once, within its smallest device's capacity less the reserve; at least 1."""
    spec, geo = result.model, result.geometry
    b = costmod.batch_per_group(result.branches, plan.cfg)
    types = {r.gpu_type for r in plan.runs} or {n.device.name for n in result.cluster.nodes}
    capacity = min(n.device.memory_gb - reserve_gb(n.device) for n in result.cluster.nodes if n.device.name in types)
    ranks = plan.cfg * plan.ulysses * plan.ring
    n = 1
    while n < limit and costmod.memory_gb(spec, geo, plan.ulysses, plan.ring, b * (n + 1), 0.0,
                                          decode_ranks=ranks) <= capacity:
        n += 1
    return n

