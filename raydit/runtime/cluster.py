"""Ray plumbing: connect, read the cluster, reserve a placement group, form groups.

`RayCluster` is the connection and what it sees; `WorkerPool` is the warm actors on
their placement group, and the torch.distributed process group formed over them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raydit.runtime.worker import RankWorker


class RayCluster:
    """A driver connection to a Ray cluster, started locally when none is given."""

    def __init__(self, owns_connection: bool, started_local: bool):
        self.owns_connection = owns_connection
        self.started_local = started_local

    @classmethod
    def connect(cls, address: str | None = None, want_workers: int | None = None) -> "RayCluster":
        if ray.is_initialized():
            return cls(owns_connection=False, started_local=False)
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, logging_level="WARNING", log_to_driver=True)
            return cls(owns_connection=True, started_local=False)
        # No cluster named: start a private local one. Declare at least as many CPU slots
        # as workers were asked for; oversubscribing cores is the user's explicit choice.
        cpus = max(os.cpu_count() or 1, want_workers or 0)
        ray.init(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            logging_level="WARNING",
            object_store_memory=256 * 1024 * 1024,
        )
        return cls(owns_connection=True, started_local=True)

    def close(self) -> None:
        if self.owns_connection and ray.is_initialized():
            ray.shutdown()
        self.owns_connection = False

    # -- what the cluster holds ------------------------------------------------------------

    @staticmethod
    def alive_nodes() -> list[dict]:
        return [n for n in ray.nodes() if n.get("Alive")]

    def resolve_device(self, device: str) -> str:
        gpus = sum(n["Resources"].get("GPU", 0) for n in self.alive_nodes())
        if device == "auto":
            return "cuda" if gpus >= 1 else "cpu"
        if device == "cuda" and gpus < 1:
            raise ValueError("device 'cuda' asked for, but the Ray cluster has no GPUs; use --device cpu")
        return device

    def cluster_spec(self, device: str, workers: int | None):
        """The live cluster as the planner's ClusterSpec: GPUs per node with their type,
        or CPU slots (one rank per slot) when running on CPU."""
        from raydit.planner import ClusterSpec, NodeSpec

        nodes = []
        for n in self.alive_nodes():
            res = n["Resources"]
            if device == "cuda":
                count = int(res.get("GPU", 0))
                gpu_type = _accelerator_type(n)
            else:
                count = int(res.get("CPU", 0))
                gpu_type = "cpu"
            if count > 0:
                nodes.append(NodeSpec(name=n["NodeID"], gpu_type=gpu_type, count=count))
        total = sum(n.count for n in nodes)
        if workers is not None:
            if workers > total:
                unit = "GPUs" if device == "cuda" else "CPU slots"
                raise ValueError(
                    f"workers {workers} is more than the {total} {unit} the Ray cluster has; "
                    f"use --workers {total} or fewer"
                )
            # Keep the first `workers` slots, filling nodes in order (PACK).
            kept, left = [], workers
            for n in nodes:
                if left <= 0:
                    break
                take = min(left, n.count)
                kept.append(NodeSpec(name=n.name, gpu_type=n.gpu_type, count=take))
                left -= take
            nodes = kept
        if not nodes:
            raise ValueError(f"the Ray cluster has no {'GPUs' if device == 'cuda' else 'CPUs'} to run on")
        return ClusterSpec(nodes=tuple(nodes))

    def plan(self, spec, *, frames, height, width, device, workers, ulysses, ring, cfg):
        from raydit.planner import plan as make_plan

        cluster = self.cluster_spec(device, workers)
        result = make_plan(
            spec,
            frames=frames,
            height=height,
            width=width,
            cluster=cluster,
            ulysses=ulysses,
            ring=ring,
            cfg=cfg,
            replicas=1,
        )
        return result

    def start_pool(self, plan, **kwargs) -> "WorkerPool":
        return WorkerPool.start(plan.world_size, placement=plan.placement, **kwargs)


def _accelerator_type(node: dict) -> str:
    labels = node.get("Labels") or {}
    if labels.get("ray.io/accelerator-type"):
        return labels["ray.io/accelerator-type"]
    for key in node["Resources"]:
        if key.startswith("accelerator_type:"):
            return key.split(":", 1)[1]
    return "H100"  # unknown type: plan with the table's default


class WorkerPool:
    """Warm actors on a placement group, and the process group formed over some of them.

    The pool outlives its process groups: `form(plan)` tears the current group down and
    forms a new one (fresh store, fresh port) over the first `plan` world-size actors,
    reusing their loaded pipelines. Regrouping after a failure or a growth uses the same call.
    """

    def __init__(self, actors, pg, infos, device, timings):
        self.actors = actors
        self.pg = pg
        self.infos = infos
        self.device = device
        self.timings = timings
        self.active: list = []
        self.plan = None
        self.kernel = None

    @classmethod
    def start(
        cls,
        size: int,
        *,
        placement,
        model_dir: str,
        device: str,
        dtype: str,
        placement_timeout_s: float,
    ) -> "WorkerPool":
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        pg = _reserve(size, placement, device, placement_timeout_s)
        timings["placement_seconds"] = time.perf_counter() - t0
        actors = []
        try:
            remote_cls = ray.remote(RankWorker)
            for index in range(size):
                opts: dict[str, Any] = {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index
                    ),
                    "runtime_env": {"env_vars": _worker_env(device)},
                    "num_cpus": 1,
                }
                if device == "cuda":
                    opts["num_gpus"] = 1
                actors.append(
                    remote_cls.options(**opts).remote(model_dir, device, dtype, threads=1)
                )
            t1 = time.perf_counter()
            infos = ray.get([a.info.remote() for a in actors], timeout=placement_timeout_s + 120)
            timings["actors_seconds"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            ray.get([a.load.remote() for a in actors])
            timings["load_seconds"] = time.perf_counter() - t2
        except BaseException:
            for a in actors:
                ray.kill(a, no_restart=True)
            remove_placement_group(pg)
            raise
        return cls(actors, pg, infos, device, timings)

    def form(self, plan, timeout_s: float) -> float:
        """(Re)form the process group for `plan`; returns the seconds it took."""
        t0 = time.perf_counter()
        world = plan.ulysses * plan.ring * plan.cfg
        if world > len(self.actors):
            raise ValueError(
                f"plan needs {world} ranks but the pool has {len(self.actors)} workers"
            )
        if self.active:
            ray.get([a.leave_group.remote() for a in self.active])
        self.active = self.actors[:world]
        self.plan = plan
        self.kernel = _form_group(self.active, plan, self.device, timeout_s)
        return time.perf_counter() - t0

    # -- one request: every call is collective over the active ranks -------------------------

    def prepare(self, request, checkpoint: dict | None = None) -> dict:
        outs = ray.get([a.prepare.remote(request, checkpoint) for a in self.active])
        return outs[0]

    def step(self) -> dict:
        refs = [a.step.remote(rank == 0) for rank, a in enumerate(self.active)]
        return ray.get(refs)[0]

    def decode(self):
        # The VAE runs replicated today; rank 0's frames are the answer.
        return ray.get(self.active[0].decode.remote())

    def close(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors, self.active = [], []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None


def _worker_env(device: str) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if device == "cuda":
        # NCCL survivors of a dead peer must error out, not hang (RAY-NOTES.md).
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    for key in ("RAYDIT_CACHE", "HF_HUB_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _reserve(world: int, placement, device: str, timeout_s: float):
    """One bundle per rank, pinned to the node the plan placed it on."""
    unit = {"GPU": 1.0, "CPU": 1.0} if device == "cuda" else {"CPU": 1.0}
    bundles = [dict(unit) for _ in range(world)]
    alive = {n["NodeID"] for n in RayCluster.alive_nodes()}
    selectors = None
    placement = list(placement or [])[:world]
    if placement and all(_node_of(p) in alive for p in placement):
        selectors = [{"ray.io/node-id": _node_of(p)} for p in placement]
    pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ValueError(
            f"the Ray cluster could not hold {world} x {unit} within {timeout_s:.0f} s "
            f"(available: {ray.available_resources()}); free resources or ask for fewer workers"
        ) from None
    return pg


def _node_of(p) -> str:
    if isinstance(p, dict):
        return p.get("node")
    return getattr(p, "node", None)


def _form_group(actors, plan, device: str, timeout_s: float) -> str:
    """Rank 0 opens a store on an OS-chosen port; all ranks join it in parallel."""
    world = len(actors)
    degrees = {"ulysses": plan.ulysses, "ring": plan.ring, "cfg": plan.cfg}
    backend = "nccl" if device == "cuda" else "gloo"
    addr = None
    if world > 1:
        addr = ray.get(actors[0].open_store.remote(timeout_s))
    outs = ray.get(
        [
            a.join_group.remote(rank, world, addr, degrees, backend, timeout_s)
            for rank, a in enumerate(actors)
        ]
    )
    return outs[0]["kernel"]
