"""Warm rank actors on their placement groups, and the torch.distributed process group formed
over them (`WorkerPool`); every call of one request is collective over the group's ranks,
and a failure is settled, classified and raised by its root cause (raydit.runtime.failures).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raydit.runtime.cluster import RayCluster, free_slots
from raydit.runtime.errors import WorkerFailure, reported
from raydit.runtime import probing
from raydit.runtime.failures import DEADLINE, Failure, classify, root_cause
from raydit.runtime.worker import RankWorker
from raydit.planner.runconfig import RunConfig

logger = logging.getLogger(__name__)


@dataclass
class Member:
    """One warm actor with the single-bundle placement group that reserves its device."""

    actor: Any
    pg: Any
    info: dict

    @property
    def node_id(self) -> str:
        return self.info["node_id"]


class WorkerPool:
    """Warm actors, and the process group formed over some of them.

    Each rank gets its own one-bundle placement group, pinned to the node the plan chose:
    a lost node then releases only its own ranks' reservations, and the survivors keep
    theirs (removing a shared placement group would kill every actor in it). The pool
    outlives its process groups: `form(plan)` tears the current group down and forms a new
    one (fresh store, fresh port) over warm actors, reusing their loaded pipelines.
    """

    def __init__(self, *, model_dir: str, device: str, dtype: str, placement_timeout_s: float,
                 run: RunConfig | None = None, loras: dict | None = None):
        self.model_dir = model_dir
        self.device = device
        self.dtype = dtype
        self.placement_timeout_s = placement_timeout_s
        self.members: list[Member] = []
        self.active: list[Member] = []
        self.plan = None
        self.kernel = None
        self.last_step_seconds: float | None = None
        self.timings: dict[str, float] = {}
        self.suspects = probing.Suspects()  # nodes suspected dead since the last failure
        # The engine's LoRA adapters (name -> raydit.models.lora.LoraSpec): every rank a
        # group is formed over holds exactly these (a rank that joins later gets them too).
        self.loras: dict = dict(loras or {})
        # The run's modes (raydit.planner.runconfig.RunConfig), the same for every group the
        # pool forms; each form's plan travels beside them.
        self.run = run if run is not None else RunConfig()
        self.quantized: list[int] = []  # per rank of the group: the linear layers its Runner quantized
        # How long the survivors of a failure get to finish their in-flight call. Ray
        # reports the death of an actor on a lost node only once it declares the node dead
        # (about 14 s with default health checks), so this must cover that.
        self.settle_s = 60.0
        # A call past its deadline whose ranks all answer a ping gets this many more.
        self.max_extensions = 5

    @classmethod
    def start(cls, size: int, *, placement=None, **kwargs) -> "WorkerPool":
        pool = cls(**kwargs)
        pool.timings = pool.add(size, [_node_of(p) for p in list(placement or [])[:size]])
        return pool

    @property
    def compile(self) -> bool:
        """Whether every rank compiles its blocks (the controller's deadline for a prepare)."""
        return self.run.compile

    @property
    def actors(self) -> list:
        return [m.actor for m in self.members]

    @property
    def infos(self) -> list[dict]:
        return [m.info for m in self.members]

    def add(self, count: int, nodes=None) -> dict[str, float]:
        """Reserve `count` more devices (on `nodes`, node ids, where given), start an actor
        on each and load the pipeline."""
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        nodes = list(nodes or [])
        pgs = reserve_devices(count, nodes, self.device, self.placement_timeout_s)
        timings["placement_seconds"] = time.perf_counter() - t0
        actors = []
        try:
            remote_cls = ray.remote(RankWorker)
            for pg in pgs:
                opts: dict[str, Any] = {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=0
                    ),
                    "runtime_env": {"env_vars": _worker_env(self.device)},
                    "num_cpus": 1,
                    # A second thread answers pings while a step runs in the first.
                    "max_concurrency": 2,
                }
                if self.device == "cuda":
                    opts["num_gpus"] = 1
                actors.append(
                    remote_cls.options(**opts).remote(self.model_dir, self.device, self.dtype, threads=1)
                )
            t1 = time.perf_counter()
            infos = ray.get([a.info.remote() for a in actors], timeout=self.placement_timeout_s + 120)
            timings["actors_seconds"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            ray.get([a.load.remote() for a in actors])
            timings["load_seconds"] = time.perf_counter() - t2
        except BaseException as exc:
            for a in actors:
                ray.kill(a, no_restart=True)
            for pg in pgs:
                remove_placement_group(pg)
            if isinstance(exc, ray.exceptions.RayError):
                failure = classify(exc)
                if not failure.recoverable:
                    raise reported(failure, "loading the pipeline") from None
                # The node went away while the actors started: the devices are not there.
                raise ValueError(f"could not start {count} worker(s): {failure.one_line()[:200]}") from None
            raise
        self.members.extend(Member(a, pg, info) for a, pg, info in zip(actors, pgs, infos))
        return timings

    def form(self, plan, timeout_s: float) -> float:
        """(Re)form the process group for `plan`; returns the seconds it took."""
        t0 = time.perf_counter()
        world = plan.ulysses * plan.ring * plan.cfg
        if world > len(self.members):
            raise ValueError(f"plan needs {world} ranks but the pool has {len(self.members)} workers")
        if self.active:
            self.reset_group(timeout_s)
        chosen = _assign(self.members, getattr(plan, "placement", None), world)
        backend = "nccl" if self.device == "cuda" else "gloo"
        # Every rank of the group holds the engine's LoRA adapters (free where it has them).
        self._call_all([m.actor.sync_loras.remote(self.loras) for m in chosen], timeout_s + 120.0, chosen, "form")
        addr = None
        if world > 1:
            addr = self._call_all([chosen[0].actor.open_store.remote(timeout_s)], timeout_s + 10.0, chosen[:1], "form")[0]
        refs = [
            m.actor.join_group.remote(rank, world, addr, plan, self.run, backend, timeout_s)
            for rank, m in enumerate(chosen)
        ]
        # The workers' own rendezvous timeout is `timeout_s`: they fail (a recoverable
        # collective failure) before the driver's deadline, which is for the stuck.
        outs = self._call_all(refs, timeout_s + 10.0, chosen, "form")
        self.active = chosen
        self.plan = plan
        self.kernel = outs[0]["kernel"]
        self.quantized = [out.get("quantized", 0) for out in outs]  # per rank: its quantized linear layers
        return time.perf_counter() - t0

    def free_slots(self) -> dict[str, int]:
        """Free devices per node, leaving out nodes suspected dead since the last failure."""
        key = "GPU" if self.device == "cuda" else "CPU"
        slots = free_slots(key)
        return self.suspects.leave_out(slots, has_members=bool(self.members))

    @property
    def suspect_nodes(self) -> set[str]:
        """Nodes suspected dead since the last failure (left out of free_slots until cleared)."""
        return self.suspects.nodes

    @suspect_nodes.setter
    def suspect_nodes(self, nodes) -> None:
        self.suspects.nodes = set(nodes)

    def member_counts(self) -> dict[str, int]:
        """Warm members per node id."""
        counts: dict[str, int] = {}
        for m in self.members:
            counts[m.node_id] = counts.get(m.node_id, 0) + 1
        return counts

    def free_slot_count(self) -> int:
        return sum(self.free_slots().values())

    def grow_to(self, plan) -> None:
        """Start actors for the ranks of `plan` that no warm member can take, on the nodes
        the plan placed them."""
        world = plan.ulysses * plan.ring * plan.cfg
        need = world - len(self.members)
        if need <= 0:
            return
        spare = self.member_counts()
        new_nodes = []
        for p in list(getattr(plan, "placement", None) or [])[:world]:
            node = _node_of(p)
            if spare.get(node, 0) > 0:
                spare[node] -= 1
            else:
                new_nodes.append(node)
        self.add(need, new_nodes[:need] if len(new_nodes) >= need else None)

    # -- one request: every call is collective over the active ranks -------------------------

    def _call_all(self, refs: list, timeout_s: float | None, members=None, where: str = "call") -> list:
        """Wait for one call per member. The first failure (ray.wait: never after a hang)
        settles every call in flight, classifies each rank's outcome and raises by the root
        cause (raydit.runtime.failures): a recoverable one as WorkerFailure, an application
        error or out of memory as the user-facing error, after leaving the group it broke
        (the controller re-forms it before the next request)."""
        members = self.active if members is None else members
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        extensions = 0
        while pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            silent = None  # members found not answering a ping at this deadline
            if not ready and extensions < self.max_extensions:
                # Every rank still answers from its second thread: slow (a loaded machine, a
                # first call on fresh actors), not stopped; a rank waiting on a dead peer is
                # freed by the collective's own timeout, which raises. Wait again, said in
                # the log, up to max_extensions more deadlines before calling it stuck.
                extensions += 1
                silent = probing.silent([m for m, r in zip(members, refs) if r in pending], timeout_s=probing.PING_S)
                if not silent:
                    logger.warning("raydit: %s is past its %.1f s deadline; every rank answers, waiting "
                                   "%.1f s more (%d of %d) before dropping the stuck ones",
                                   where, timeout_s, timeout_s, extensions, self.max_extensions)
                    deadline = time.monotonic() + timeout_s
                    continue
            if not ready:
                late = Failure(DEADLINE, "DeadlineExceeded",
                               f"{where} made no progress for {timeout_s:.1f} s (its deadline)")
                # Those found silent just now are not pinged again (another PING_S for each hang).
                lost, outcomes = self._settle(members, refs, settle_s=5.0, probe=True, silent=silent)
                self._raise(root_cause([late, *outcomes]), lost, where)
            try:
                ray.get(ready[0])
            except Exception:  # a dead actor or node, a broken collective, or worker code
                lost, outcomes = self._settle(members, refs, settle_s=self.settle_s)
                self._raise(root_cause(outcomes), lost, where)
        return ray.get(refs)

    def lost_to_dead_nodes(self, failure: WorkerFailure) -> bool:
        """True when every lost rank of `failure` was on a node Ray declares dead."""
        lost_nodes = {m.node_id for m in failure.lost}
        if not lost_nodes:
            return False
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return not (lost_nodes & alive)

    def _raise(self, failure: Failure, lost: list, where: str) -> None:
        if failure.recoverable or lost:
            # A lost rank is recovered even when another raised: the peers' errors are
            # usually the consequence, and a repeat is stopped by the controller.
            raise WorkerFailure(f"{failure.kind}: {failure.one_line()[:300]}", lost=lost, failure=failure)
        self.reset_group()
        raise reported(failure, where)

    def _settle(self, members: list, refs: list, settle_s: float, probe: bool = False,
                silent: list | None = None) -> tuple[list, list]:
        """Every call in flight settled after a failure (raydit.runtime.probing.settle); the
        lost dropped and their devices' release waited for. Returns (lost, failures)."""
        lost, outcomes, suspect, before = probing.settle(members, refs, settle_s, device=self.device, drop=self._drop,
                                                         probe=probe, silent_members=silent)
        self.suspects.replace(suspect)
        self._drop_and_release(lost, before=before)
        return lost, outcomes

    def _drop_and_release(self, lost: list, wait_s: float = 10.0, before: dict | None = None) -> None:
        """Drop lost members; on nodes that are still healthy, wait (bounded) until Ray
        reports their released devices free again, so the next plan can use them. `before`:
        the free devices counted before some of `lost` were dropped already (silent ranks,
        dropped as they were found): their release is waited for from that count, not from
        one that may hold it already (which waited all of `wait_s` for a device that never came)."""
        key = "GPU" if self.device == "cuda" else "CPU"
        expect: dict[str, int] = {}
        before = free_slots(key) if before is None else before
        for m in lost:
            if m.node_id not in self.suspect_nodes:
                expect[m.node_id] = expect.get(m.node_id, 0) + 1
            self._drop(m)
        deadline = time.monotonic() + wait_s
        while expect and time.monotonic() < deadline:
            now = free_slots(key)
            if all(now.get(n, 0) >= before.get(n, 0) + k for n, k in expect.items()):
                return
            time.sleep(0.1)

    def prepare(self, request, checkpoint: dict | None = None, timeout_s: float | None = None,
                slot: int = 0) -> dict:
        refs = [m.actor.prepare.remote(request, checkpoint, slot) for m in self.active]
        return self._call_all(refs, timeout_s, where="prepare")[0]

    def step(self, timeout_s: float | None = None, slots: list | None = None):
        """The finished step's checkpoint, in its wire form (raydit.runtime.wire: tensors as
        NumPy buffers, read back with from_wire where the driver needs tensors); with `slots`
        (a batch) {slot: checkpoint}. `last_step_seconds`: the step as rank 0 measured it,
        without Ray's round trip."""
        refs = [m.actor.step.remote(rank == 0, slots) for rank, m in enumerate(self.active)]
        answer = self._call_all(refs, timeout_s, where="step")[0]
        self.last_step_seconds = answer["seconds"]
        return answer["checkpoints"] if slots is not None else answer["checkpoints"][0]

    def forget(self, slot: int) -> None:
        """Every rank drops the request in `slot` (it left its batch unfinished); best effort."""
        for m in self.active:
            m.actor.forget.remote(slot)

    def decode(self, timeout_s: float | None = None, slot: int = 0):
        # Every rank decodes its band of latent rows (raydit.models.vae_parallel); rank 0's
        # frames are the answer. decode_ranks: how many ranks the last decode ran on;
        # decoded_audio: the sound rank 0 decoded with them (None for a silent family);
        # decoded_latents: rank 0's (video, audio or None) latents in the pipeline's layout.
        refs = [m.actor.decode.remote(all_ranks=True, slot=slot) for m in self.active]
        answers = self._call_all(refs, timeout_s, self.active, where="decode")
        frames, self.decode_ranks, self.decoded_audio, self.decoded_latents = next(a for a in answers if a is not None)
        return frames

    # -- failures ----------------------------------------------------------------------------

    def _drop(self, m: Member) -> None:
        try:
            ray.kill(m.actor, no_restart=True)
        except Exception:
            pass
        try:
            remove_placement_group(m.pg)
        except Exception:
            pass
        if m in self.members:
            self.members.remove(m)
        if m in self.active:
            self.active.remove(m)

    def drop_dead(self) -> list:
        """Drop the members whose process died since their last call (between requests) and
        release their devices, before anything is asked of them; returns them."""
        gone = probing.dead(self.members, timeout_s=probing.PING_S)
        if gone:
            self._drop_and_release(gone)
        return gone

    def reset_group(self, timeout_s: float = 30.0) -> None:
        """After a failure: survivors destroy their broken process group."""
        if not self.active:
            return
        refs = [m.actor.leave_group.remote() for m in self.active]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        # A survivor that cannot even leave its group is stuck, one whose process has died
        # since (Ray answers for it: actor died) is gone: drop both, so the next `form`
        # does not choose them and fail.
        gone = [m for m, r in zip(self.active, refs) if r in pending or probing.died(r)]
        for m in gone:
            self._drop(m)
        self.active = []

    def close(self) -> None:
        self.suspects.forget_probes()
        for m in list(self.members):
            self._drop(m)
        self.members, self.active = [], []


def _assign(members: list[Member], placement, world: int) -> list[Member]:
    """Order members as the plan's ranks: rank r takes a member on the node the plan put
    it on; where the plan's node names are not Ray node ids, keep the pool's order."""
    ranks = list(placement or [])[:world]
    by_node: dict[str, list[Member]] = {}
    for m in members:
        by_node.setdefault(m.node_id, []).append(m)
    if len(ranks) == world and all(len(by_node.get(_node_of(p), [])) > 0 for p in ranks):
        chosen = []
        for p in ranks:
            pool = by_node[_node_of(p)]
            if not pool:
                break
            chosen.append(pool.pop(0))
        if len(chosen) == world:
            return chosen
    return members[:world]


def _worker_env(device: str) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if device == "cuda":
        # NCCL survivors of a dead peer must error out, not hang (RAY-NOTES.md).
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    for key in ("RAYDIT_CACHE", "HF_HUB_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def reserve_devices(count: int, nodes: list, device: str, timeout_s: float) -> list:
    """One single-bundle placement group per rank, pinned to its planned node if known."""
    unit = {"GPU": 1.0, "CPU": 1.0} if device == "cuda" else {"CPU": 1.0}
    alive = {n["NodeID"] for n in RayCluster.alive_nodes()}
    pgs = []
    for i in range(count):
        node = nodes[i] if i < len(nodes) else None
        selector = [{"ray.io/node-id": node}] if node in alive else None
        pgs.append(placement_group([dict(unit)], strategy="PACK", bundle_label_selector=selector))
    try:
        ray.get([pg.ready() for pg in pgs], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for pg in pgs:
            remove_placement_group(pg)
        raise ValueError(
            f"the Ray cluster could not hold {count} x {unit} within {timeout_s:.0f} s "
            f"(available: {_short(ray.available_resources())}); free resources or ask for fewer workers"
        ) from None
    return pgs


def _short(res: dict) -> dict:
    return {k: v for k, v in res.items() if k in ("CPU", "GPU") or k.startswith("accelerator_type")}


def _node_of(p) -> str:
    if isinstance(p, dict):
        return p.get("node")
    return getattr(p, "node", None)
