"""The Engine's replicas: starting one (its ranks, weights, groups), its controller, the
warm-up request, autoscaling with the queue, and repair after a hand-back."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from raydit.runtime.pool import WorkerPool
from raydit.runtime.controller import Controller, ElasticPolicy
from raydit.runtime.engine.planning import plan_brief
from raydit.runtime.queue import Item


@dataclass
class Replica:
    """One independent copy of the model: its pool of ranks, its controller, its plan."""

    index: int
    pool: Any
    controller: Any = None
    plan: Any = None
    busy: bool = False
    in_rotation: bool = True  # False after it handed a request back, until repaired
    batch_size: int = 0  # requests in its running batch (step-level batching; 1: one alone)
    idle_since: float = field(default_factory=time.monotonic)  # when it last finished a request


class ReplicasPart:
    """The Engine's replicas (a part of raydit.runtime.engine.Engine)."""

    def _start_replica(self, index: int, plan, placement, add) -> "Replica":
        """Start the ranks of one replica of `plan` (at `placement`, or packed onto free
        devices), load the model and form its groups; `add(replica)` puts it in the engine's
        list as soon as it holds actors, so a failure below still closes them."""
        pool = WorkerPool.start(
            plan.world_size, placement=placement, model_dir=self.model_dir, device=self.device, dtype=self.dtype,
            placement_timeout_s=self._placement_timeout_s, run=self.run_config, loras=self._loras,
        )
        replica = Replica(index=index, pool=pool, plan=plan)
        add(replica)
        seconds = pool.form(plan, self._collective_timeout_s)
        self._timings.setdefault("group_seconds", seconds)
        return replica

    def _attach_controller(self, r: "Replica") -> None:
        r.controller = Controller(
            r.pool,
            replan=lambda capacity, min_sp=None, r=r: self._replan(r, capacity, min_sp),
            policy=ElasticPolicy(
                max_recoveries=8 if self.elastic else 0,
                grow_margin=1.0,
                always_grow=self._grow == "always",
                max_world=self._workers,
            ),
            events=self.events,
            on_plan=lambda p, r=r: setattr(r, "plan", p),
            regroup_cost_s=self._regroup_cost,
            step_timeout_s=self._step_timeout_s,
            collective_timeout_s=self._collective_timeout_s,
            plan=r.plan,
            capacity_lock=self._capacity_lock,
        )

    def _autoscale_loop(self) -> None:
        """Add a replica while a request has waited `scale_up_wait_s` and free devices hold
        one (up to `max_replicas`); take one out after `scale_down_idle_s` idle with nothing
        waiting (down to `replicas`). One change at a time; every change is an event."""
        tick = max(0.05, min(1.0, self.scale_up_wait_s / 4, self.scale_down_idle_s / 4))
        while not self._stop_scaling.wait(tick):
            try:
                self._autoscale_once()
            except Exception as exc:  # the queue keeps running on the replicas it has
                self._event("autoscale_failed", error=f"{type(exc).__name__}: {exc}")
                self._stop_scaling.wait(max(5.0, self.scale_up_wait_s))

    def _autoscale_once(self) -> None:
        dispatcher = self._dispatcher
        waited = dispatcher.oldest_wait()
        if waited >= self.scale_up_wait_s and waited > 0 and len(self.replicas) < self.max_replicas:
            plan = self.plan_result.best
            with self._capacity_lock:
                if self.replicas[0].pool.free_slot_count() < plan.world_size:
                    return  # no room: the queue waits for the replicas it has
                index, self._next_index = self._next_index, self._next_index + 1
                t0 = time.perf_counter()
                started: list = []
                try:
                    replica = self._start_replica(index, plan, None, started.append)
                except BaseException:
                    for r in started:
                        r.pool.close()
                    raise
            try:
                self._attach_controller(replica)
                if self._warmup:
                    self._warm_up([replica])
            except BaseException:  # its actors and devices go back; the next try starts afresh
                replica.pool.close()
                raise
            if self._stop_scaling.is_set():
                replica.pool.close()
                return
            dispatcher.add_replica(replica)
            self._event("replica_added", replica=index, plan=plan_brief(plan), waited=round(waited, 3),
                        seconds=round(time.perf_counter() - t0, 3), replicas=len(self.replicas))
            return
        replica = dispatcher.take_idle_replica(self.scale_down_idle_s, keep=self.min_replicas)
        if replica is not None:
            # Said when it leaves the rotation, the moment `replicas` stops listing it; its
            # actors and devices go back after (closing a pool takes seconds on a busy machine).
            self._event("replica_removed", replica=replica.index, idle=round(time.monotonic() - replica.idle_since, 3),
                        replicas=len(self.replicas))
            replica.pool.close()

    def _warm_up(self, replicas=None) -> None:
        """One request at the planned size on every replica, before any user's: the kernel
        choice, the allocator's growth, a compiled Engine's compilation and the decode are
        paid here (`timings["warmup_seconds"]`), not by the first video. Two steps, guidance
        on: the step a request runs, and a scheduler past its first step."""
        from raydit.models.requests import checker_image
        from raydit.models.family import GenerationRequest, image_to_png

        frames, height, width = self._planned_geometry()
        request = GenerationRequest(
            prompt="warm-up", num_frames=frames, height=height, width=width, num_inference_steps=2,
            guidance_scale=6.0, seed=0, image=image_to_png(checker_image(height, width)) if self.takes_image else None,
            cache=self.cache, cache_threshold=self.cache_threshold, lora=self._fused_default(None))
        t0 = time.perf_counter()
        for replica in list(self.replicas if replicas is None else replicas):
            t_replica = time.perf_counter()
            item = Item(request=request, future=Future(), callback=None, progress=False, checkpoint_dir=None)
            result = self._execute(replica, item, batch=False)  # alone: no user's request joins it
            self._event("warmed_up", replica=replica.index, frames=frames, height=height, width=width,
                        seconds=time.perf_counter() - t_replica,
                        compile_seconds=result.timings["compile_seconds"])
        self._timings.setdefault("warmup_seconds", time.perf_counter() - t0)

    def _repair(self, replica: Replica) -> bool:
        """Make a replica that handed its request back whole again: its survivors plus
        free devices, re-planned (the dispatcher calls this while a request waits)."""
        whole = replica.controller.repair()
        if whole:
            self._event("repaired", replica=replica.index, plan=plan_brief(replica.plan))
        return whole

    def _capacity_left(self) -> str:
        ranks = ", ".join(f"replica {r.index}: {len(r.pool.members)} rank(s)" for r in self.replicas)
        free = self.replicas[0].pool.free_slot_count() if self.replicas else 0
        key = "GPUs" if self.device == "cuda" else "CPU slots"
        return f"{ranks}; {free} free {key} in the cluster"
