"""The Engine's replicas: starting one (its ranks, weights, groups), its controller, repair
after a hand-back, the LoRA table synced to every rank, a user's regroup; and the autoscaler
that adds and removes replicas with the queue."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from raydit.runtime.controller import Controller, ElasticPolicy
from raydit.runtime.engine.planning import plan_brief
from raydit.runtime.pool import WorkerPool


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


@dataclass(frozen=True)
class PoolSettings:
    """What every replica's pool and controller is made with (the Engine's config, resolved)."""

    model_dir: str
    device: str
    dtype: str
    run: Any  # raydit.planner.runconfig.RunConfig
    placement_timeout_s: float
    collective_timeout_s: float
    step_timeout_s: float | None
    elastic: bool
    grow: str
    workers: int | None


class Replicas:
    """The replicas (`items`, the list the dispatcher serves from), and one lock under which a
    recovery, repair or growth takes from the cluster's free devices. `timings`: the first
    replica's start (actors, load, group) and the warm-up."""

    def __init__(self, settings: PoolSettings, planning, loras, events: list, event: Callable[..., None]):
        self.settings = settings
        self.planning = planning
        self.loras = loras
        self.events = events
        self._event = event
        self.items: list[Replica] = []
        self.timings: dict[str, float] = {}
        self.capacity_lock = threading.RLock()

    def start(self, index: int, plan, placement) -> Replica:
        """Start the ranks of one replica of `plan` (at `placement`, or packed onto free
        devices), load the model and form its groups; it is in `items` as soon as it holds
        actors (a failure below leaves it there for `close`)."""
        s = self.settings
        pool = WorkerPool.start(
            plan.world_size, placement=placement, model_dir=s.model_dir, device=s.device, dtype=s.dtype,
            placement_timeout_s=s.placement_timeout_s, run=s.run, loras=self.loras.table,
        )
        replica = Replica(index=index, pool=pool, plan=plan)
        self.items.append(replica)
        seconds = pool.form(plan, s.collective_timeout_s)
        self.timings.setdefault("group_seconds", seconds)
        return replica

    def start_detached(self, index: int, plan) -> Replica:
        """A replica started apart from `items` (the autoscaler's, added once warm);
        its actors are closed when its start fails."""
        s = self.settings
        pool = WorkerPool.start(
            plan.world_size, placement=None, model_dir=s.model_dir, device=s.device, dtype=s.dtype,
            placement_timeout_s=s.placement_timeout_s, run=s.run, loras=self.loras.table,
        )
        try:
            pool.form(plan, s.collective_timeout_s)
        except BaseException:
            pool.close()
            raise
        return Replica(index=index, pool=pool, plan=plan)

    def attach_controller(self, r: Replica) -> None:
        s = self.settings
        r.controller = Controller(
            r.pool,
            replan=lambda capacity, min_sp=None, r=r: self.planning.replan(r, capacity, min_sp),
            policy=ElasticPolicy(
                max_recoveries=8 if s.elastic else 0,
                grow_margin=1.0,
                always_grow=s.grow == "always",
                max_world=s.workers,
            ),
            events=self.events,
            on_plan=lambda p, r=r: setattr(r, "plan", p),
            regroup_cost_s=self.regroup_cost,
            step_timeout_s=s.step_timeout_s,
            collective_timeout_s=s.collective_timeout_s,
            plan=r.plan,
            capacity_lock=self.capacity_lock,
        )

    def regroup_cost(self) -> float:
        t = self.timings
        return t.get("actors_seconds", 0.0) + t.get("load_seconds", 0.0) + t.get("group_seconds", 0.0)

    def repair(self, replica: Replica) -> bool:
        """Make a replica that handed its request back whole again: its survivors plus
        free devices, re-planned (the dispatcher calls this while a request waits)."""
        whole = replica.controller.repair()
        if whole:
            self._event("repaired", replica=replica.index, plan=plan_brief(replica.plan))
        return whole

    def capacity_left(self) -> str:
        ranks = ", ".join(f"replica {r.index}: {len(r.pool.members)} rank(s)" for r in self.items)
        free = self.items[0].pool.free_slot_count() if self.items else 0
        key = "GPUs" if self.settings.device == "cuda" else "CPU slots"
        return f"{ranks}; {free} free {key} in the cluster"

    def free_slot_count(self) -> int:
        return self.items[0].pool.free_slot_count() if self.items else 0

    def _claim_all(self, cond) -> list:
        """Every replica marked busy as it becomes idle (the dispatcher starts nothing on it
        meanwhile); `release` hands them back."""
        claimed: list = []
        with cond:
            while len(claimed) < len(self.items):
                for r in self.items:
                    if r not in claimed and not r.busy:
                        r.busy = True
                        claimed.append(r)
                if len(claimed) < len(self.items):
                    cond.wait(timeout=1.0)
        return claimed

    @staticmethod
    def _release(cond, claimed: list) -> None:
        with cond:
            for r in claimed:
                r.busy = False
            cond.notify_all()

    def sync_loras(self, cond, table: dict, previous: dict) -> None:
        """Make every member of every replica hold `table`, between requests (`cond`: the
        dispatcher's). On a failure every rank goes back to `previous` and the error is raised."""
        import ray

        if not self.items:
            raise RuntimeError("engine is shut down; create a new Engine")
        claimed = self._claim_all(cond)
        try:
            actors = [m.actor for r in self.items for m in r.pool.members]
            try:
                ray.get([a.sync_loras.remote(table) for a in actors], timeout=300)
            except Exception as exc:
                from raydit.runtime.failures import classify

                try:
                    ray.get([a.sync_loras.remote(previous) for a in actors], timeout=300)
                except Exception:  # a rank that cannot even go back is replaced at the next form
                    for r in self.items:
                        r.pool.reset_group()
                raise ValueError(classify(exc).message) from None
            self.planning.with_adapter_bytes(self.loras.adapter_bytes(table))
            for r in self.items:
                r.pool.loras = dict(table)
            self._event("loras", loaded=sorted(table))
        finally:
            self._release(cond, claimed)

    def regroup(self, cond, ulysses: int | None, ring: int | None, cfg: int | None):
        """Re-plan a single-replica engine's warm workers with other degrees (fewer ranks is
        fine), keeping the actors and their loaded weights; an infeasible layout is refused
        with the planner's reason. Not while requests are running."""
        if not self.items:
            raise RuntimeError("engine is shut down; create a new Engine")
        if len(self.items) > 1:
            raise ValueError("regroup works on a single-replica engine; this one has "
                             f"{len(self.items)} replicas")
        replica = self.items[0]
        with cond:
            if replica.busy:
                raise RuntimeError("regroup while a request runs; wait for it to finish")
            replica.busy = True
        try:
            result = self.planning.plan_regroup(replica.pool.member_counts(), ulysses, ring, cfg)
            plan = result.best
            replica.pool.reset_group()
            seconds = replica.pool.form(plan, self.settings.collective_timeout_s)
            self.planning.adopt(result)
            replica.plan = plan
            replica.controller.on_plan(plan)
            self._event("regrouped", reason="requested", plan=plan_brief(plan), seconds=seconds)
            return plan
        finally:
            self._release(cond, [replica])

    def close(self) -> None:
        for r in self.items:
            r.pool.close()
        self.items.clear()


class Autoscaler:
    """Replicas that follow the queue, between `least` and `most`: one more (the planner's best
    layout, on free devices) while a request has waited `up_wait_s`; one idle for
    `down_idle_s` with nothing waiting is taken out. One change at a time; each an event.
    `warm_up(replicas)`: the Engine's warm-up of a new replica (None: none)."""

    def __init__(self, replicas: Replicas, queue, least: int, most: int, up_wait_s: float, down_idle_s: float,
                 next_index: int, warm_up: Callable[[list], None] | None, event: Callable[..., None]):
        self.replicas = replicas
        self.queue = queue
        self.least, self.most = least, most
        self.up_wait_s, self.down_idle_s = float(up_wait_s), float(down_idle_s)
        self._next_index = next_index
        self._warm_up = warm_up
        self._event = event
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.most > self.least:
            self._thread = threading.Thread(target=self._loop, name="raydit-autoscale", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=600)

    def _loop(self) -> None:
        tick = max(0.05, min(1.0, self.up_wait_s / 4, self.down_idle_s / 4))
        while not self._stop.wait(tick):
            try:
                self.once()
            except Exception as exc:  # the queue keeps running on the replicas it has
                self._event("autoscale_failed", error=f"{type(exc).__name__}: {exc}")
                self._stop.wait(max(5.0, self.up_wait_s))

    def once(self) -> None:
        replicas, queue = self.replicas, self.queue
        waited = queue.oldest_wait()
        if waited >= self.up_wait_s and waited > 0 and len(replicas.items) < self.most:
            plan = replicas.planning.plan_result.best
            with replicas.capacity_lock:
                if replicas.free_slot_count() < plan.world_size:
                    return  # no room: the queue waits for the replicas it has
                index, self._next_index = self._next_index, self._next_index + 1
                t0 = time.perf_counter()
                replica = replicas.start_detached(index, plan)
            try:
                replicas.attach_controller(replica)
                if self._warm_up is not None:
                    self._warm_up([replica])
            except BaseException:  # its actors and devices go back; the next try starts afresh
                replica.pool.close()
                raise
            if self._stop.is_set():
                replica.pool.close()
                return
            queue.add_replica(replica)
            self._event("replica_added", replica=index, plan=plan_brief(plan), waited=round(waited, 3),
                        seconds=round(time.perf_counter() - t0, 3), replicas=len(replicas.items))
            return
        replica = queue.take_idle_replica(self.down_idle_s, keep=self.least)
        if replica is not None:
            # Said when it leaves the rotation, the moment `replicas` stops listing it; its
            # actors and devices go back after (closing a pool takes seconds on a busy machine).
            self._event("replica_removed", replica=replica.index, idle=round(time.monotonic() - replica.idle_since, 3),
                        replicas=len(replicas.items))
            replica.pool.close()
