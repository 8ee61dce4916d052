"""The Ray connection: connect (or start a private local Ray), read the live cluster, plan on it.

`RayCluster` is the connection and what it sees; the warm actors and the process group
formed over them are raydit.runtime.pool's `WorkerPool`.
"""

from __future__ import annotations

import os
import threading

import ray

from raydit.runtime.raygc import RAYLET_GC_REQUESTS_OFF


# The Ray connection raydit opened in this process is shared by every RayCluster made while it
# is open (several Engines in one notebook): it is closed when the last of them closes, not
# when the first does, which killed the other engines' actors. A connection the user opened
# (ray.init before raydit) is never counted and never closed by raydit.
_SHARED = {"holders": 0}
_SHARED_LOCK = threading.Lock()


def _open(address: str | None, want_workers: int | None) -> None:
    """ray.init: the cluster at `address` or RAY_ADDRESS, else a private local one."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        # A dead or mistyped address answers in seconds, as one line, instead of
        # ray.init retrying for minutes.
        from raydit.runtime.topology import reachable_address

        ray.init(address=reachable_address(address), logging_level="WARNING", log_to_driver=True)
        return
    # No cluster named: start a private local one. Declare at least as many CPU slots
    # as workers were asked for; oversubscribing cores is the user's explicit choice.
    # Its raylet never asks this process to run Python's gc (raydit.runtime.raygc, issue 39).
    cpus = max(os.cpu_count() or 1, want_workers or 0)
    ray.init(
        address="local",
        num_cpus=cpus,
        include_dashboard=False,
        logging_level="WARNING",
        object_store_memory=256 * 1024 * 1024,
        _system_config=dict(RAYLET_GC_REQUESTS_OFF),
    )


class RayCluster:
    """A driver connection to a Ray cluster, started locally when none is given."""

    def __init__(self, owns_connection: bool):
        self.owns_connection = owns_connection
        self._probed = False

    @classmethod
    def connect(cls, address: str | None = None, want_workers: int | None = None) -> "RayCluster":
        with _SHARED_LOCK:
            if ray.is_initialized():
                if _SHARED["holders"] > 0:  # opened by raydit: one more holder
                    _SHARED["holders"] += 1
                    return cls(owns_connection=True)
                return cls(owns_connection=False)
            _open(address, want_workers)
            _SHARED["holders"] = 1  # a count left by a connection shut down behind us is reset
            return cls(owns_connection=True)

    def close(self) -> None:
        if not self.owns_connection:
            return
        self.owns_connection = False
        with _SHARED_LOCK:
            _SHARED["holders"] = max(_SHARED["holders"] - 1, 0)
            if _SHARED["holders"] == 0 and ray.is_initialized():
                ray.shutdown()

    # -- what the cluster holds ------------------------------------------------------------

    @staticmethod
    def alive_nodes() -> list[dict]:
        return [n for n in ray.nodes() if n.get("Alive")]

    def resolve_device(self, device: str) -> str:
        """`auto` -> cuda when the cluster has a GPU, else cpu (raydit.runtime.devices)."""
        from raydit.runtime.devices import resolve_device

        return resolve_device(device, ray.nodes())

    def cluster_spec(self, device: str, workers: int | None = None, counts: dict | None = None):
        """The live cluster as the planner's ClusterSpec (raydit.runtime.topology: GPU type
        per node from Ray's labels/resources, cached calibration, GPU memory probed on first
        read), or CPU slots on CPU. `counts` (node id -> devices) replaces what the nodes
        offer, e.g. survivors plus free devices after a failure."""
        from raydit.runtime.topology import live_cluster_spec

        key = "GPUs" if device == "cuda" else "CPU slots"
        try:
            first = counts is None and not self._probed
            # On GPUs, the first read measures device types the calibration cache lacks
            # (seconds, once per type); CPU runs use the cache or the table.
            spec = live_cluster_spec(
                device, counts, calibration="measure" if first and device == "cuda" else None,
                probe=first,
            )
        except ValueError as exc:
            if "at least one node" in str(exc):
                raise ValueError(f"the Ray cluster has no {key} to run on") from None
            raise
        self._probed = True
        if workers is not None and workers > spec.total:
            raise ValueError(
                f"workers {workers} is more than the {spec.total} {key} the Ray cluster has; "
                f"use --workers {spec.total} or fewer"
            )
        return spec

    def plan(self, spec, *, frames=None, height=None, width=None, device, workers=None,
             ulysses=None, ring=None, cfg=None, counts=None, shard_weights=None, mode=None, guidance=True):
        """The planner's result on the live cluster. `workers` given: the best plan that uses
        exactly that many ranks is put first (the user asked for that many). shard_weights: the
        planner's (True: every layout shards the block weights; None: where they fit more devices).
        mode: how the steps run (raydit.planner.devicemodel.Mode; None: bf16 eager). guidance
        False: the requests run one branch (no cfg degree)."""
        import dataclasses

        from raydit.planner import PlanError
        from raydit.planner import plan as make_plan

        cluster = self.cluster_spec(device, workers, counts)
        result = make_plan(
            spec, frames=frames, height=height, width=width, cluster=cluster,
            ulysses=ulysses, ring=ring, cfg=cfg, replicas=1, shard_weights=shard_weights, mode=mode,
            guidance=guidance,
        )
        if workers is None:
            return result
        exact = [p for p in result.candidates if p.world_size == workers]
        if not exact:
            sizes = sorted({p.world_size for p in result.candidates})
            raise PlanError(
                f"no feasible plan runs on exactly {workers} workers with these degrees; "
                f"feasible world sizes: {', '.join(map(str, sizes))}"
            )
        rest = [p for p in result.candidates if p.world_size != workers]
        return dataclasses.replace(result, candidates=tuple(exact + rest))


def free_slots(key: str) -> dict[str, int]:
    """Devices (`GPU`, or `CPU` slots) free right now, per alive node id."""
    from ray._private.state import available_resources_per_node

    alive = {n["NodeID"] for n in RayCluster.alive_nodes()}
    return {
        node: int(res.get(key, 0))
        for node, res in available_resources_per_node().items()
        if node in alive and int(res.get(key, 0)) > 0
    }

