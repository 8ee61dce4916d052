"""The Engine's planning after start: a replica re-planned on what is left or what joined,
a user's regroup, and whether a request larger than the plan still fits it."""

from __future__ import annotations

from typing import Any


def plan_brief(plan) -> dict:
    return {
        "ulysses": plan.ulysses, "ring": plan.ring, "cfg": plan.cfg,
        "world_size": plan.world_size, "predicted_step_seconds": plan.predicted_step_seconds,
    }


class PlanningPart:
    """The Engine's planning (a part of raydit.runtime.engine.Engine)."""

    def describe_plan(self) -> str:
        from raydit.planner.report import format_plan_table

        return format_plan_table(self.plan_result, limit=5)

    def _replan(self, replica: Any, capacity: int, min_sp: int | None = None):
        """Best plan for `capacity` devices: the replica's surviving members plus the
        cluster's free devices. With `workers` fixed by the user (or grow="always") the
        plan uses as many ranks as it may, up to `workers`; otherwise the planner's best.
        Degrees the user forced hold; when no plan with them fits what is left, the best
        plan without them runs and an event says what and why. `min_sp`: only plans with
        at least that much sequence parallelism (after running out of memory)."""
        counts = replica.pool.member_counts()
        for node, free in replica.pool.free_slots().items():
            counts[node] = counts.get(node, 0) + free
        frames, height, width = self._geometry
        limit = capacity if self._workers is None else min(capacity, self._workers)

        def best(**forced):
            result = self.cluster.plan(
                self.spec, frames=frames, height=height, width=width, device=self.device,
                counts=counts, mode=self.plan_mode, **forced,
            )
            fits = [p for p in result.candidates if p.world_size <= limit
                    and (min_sp is None or p.ulysses * p.ring >= min_sp)]
            if not fits:
                raise ValueError(f"no feasible plan fits {limit} device(s)"
                                 + (f" with sequence parallelism >= {min_sp}" if min_sp else ""))
            if self._workers is not None or self._grow == "always":
                return max(fits, key=lambda p: (p.world_size, -p.predicted_step_seconds))
            return fits[0]

        forced = {k: v for k, v in self._forced.items() if v is not None}
        if not forced:
            return best()
        try:
            return best(**forced)
        except ValueError as exc:
            plan = best()
            said = ", ".join(f"{k} {v}" for k, v in forced.items())
            self._event("forced_degrees_dropped", replica=replica.index, forced=forced, plan=plan_brief(plan),
                        reason=f"{said} cannot run on the {limit} device(s) left ({exc}); running ulysses "
                               f"{plan.ulysses} x ring {plan.ring} x cfg {plan.cfg} instead")
            return plan

    def _regroup_cost(self) -> float:
        t = self._timings
        return t.get("actors_seconds", 0.0) + t.get("load_seconds", 0.0) + t.get("group_seconds", 0.0)

    def regroup(self, ulysses: int | None = None, ring: int | None = None, cfg: int | None = None):
        """Re-plan a single-replica engine's warm workers with other degrees (fewer ranks is
        fine), keeping the actors and their loaded weights; an infeasible layout is refused
        with the planner's reason. Not while requests are running."""
        if not self.replicas:
            raise RuntimeError("engine is shut down; create a new Engine")
        if len(self.replicas) > 1:
            raise ValueError("regroup works on a single-replica engine; this one has "
                             f"{len(self.replicas)} replicas")
        replica = self.replicas[0]
        with self._dispatcher.cond:
            if replica.busy:
                raise RuntimeError("regroup while a request runs; wait for it to finish")
            replica.busy = True
        try:
            counts = replica.pool.member_counts()
            frames, height, width = self._geometry
            result = self.cluster.plan(
                self.spec, frames=frames, height=height, width=width, device=self.device,
                ulysses=ulysses, ring=ring, cfg=cfg, counts=counts, mode=self.plan_mode,
            )
            plan = result.best
            replica.pool.reset_group()
            seconds = replica.pool.form(plan, self._collective_timeout_s)
            self.plan_result, replica.plan = result, plan
            replica.controller.on_plan(plan)
            self._event("regrouped", reason="requested", plan=plan_brief(plan), seconds=seconds)
            return plan
        finally:
            with self._dispatcher.cond:
                replica.busy = False
                self._dispatcher.cond.notify_all()

    def _planned_geometry(self) -> tuple[int, int, int]:
        frames, height, width = self._geometry
        return (frames or self.spec.default_frames, height or self.spec.default_height,
                width or self.spec.default_width)

    def _check_fits(self, replica: Any, request) -> None:
        """A request larger than the plan was made for: the planner checks that the
        replica's layout still holds it in memory (a clear error, not an OOM on the ranks)."""
        from raydit.planner import PlanError

        plan = replica.plan
        try:
            self.cluster.plan(
                self.spec, frames=request.num_frames, height=request.height, width=request.width,
                device=self.device, counts=replica.pool.member_counts(),
                ulysses=plan.ulysses, ring=plan.ring, cfg=plan.cfg, mode=self.plan_mode,
            )
        except PlanError as exc:
            raise ValueError(
                f"{request.num_frames} frames at {request.height}x{request.width} do not fit the running plan "
                f"(ulysses {plan.ulysses} x ring {plan.ring} x cfg {plan.cfg}): {exc}; create the Engine with "
                f"frames/height/width of this size so it plans for them"
            ) from None
