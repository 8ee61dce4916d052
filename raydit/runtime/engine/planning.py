"""The Engine's planning: the model's spec and the plans made for it, a replica re-planned
on what is left or what joined, a user's regroup's plan, and whether a request larger than
the plan still fits it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


def plan_brief(plan) -> dict:
    return {
        "ulysses": plan.ulysses, "ring": plan.ring, "cfg": plan.cfg,
        "world_size": plan.world_size, "predicted_step_seconds": plan.predicted_step_seconds,
    }


class Planning:
    """Plans for one model on the Engine's cluster, in the run's mode. `spec`: the model (its
    adapters' bytes follow the LoRA table); `plan_result`: the last full planning (the start,
    a regroup); `geometry`: the (frames, height, width) the Engine was made for (None: the
    model's defaults); `guidance` False: every plan for one guidance branch (Engine(guidance=))."""

    def __init__(self, cluster, spec, device: str, geometry: tuple, mode, forced: dict, workers: int | None,
                 grow: str, event: Callable[..., None], guidance: bool = True):
        self.cluster = cluster
        self.spec = spec
        self.device = device
        self.geometry = geometry
        self.mode = mode
        self.forced = forced
        self.workers = workers
        self.grow = grow
        self._event = event
        self.guidance = guidance  # False: the requests run one branch, plans have no cfg degree
        self.plan_result = None

    def with_adapter_bytes(self, nbytes: float) -> None:
        """The planner counts the adapters' bytes on every rank (0 for a fused one)."""
        self.spec = dataclasses.replace(self.spec, adapter_bytes=float(nbytes))

    def plan_start(self, **kwargs):
        """The Engine's first plan (its layout, forced degrees, sharding), kept as plan_result."""
        frames, height, width = self.geometry
        self.plan_result = self.cluster.plan(self.spec, frames=frames, height=height, width=width,
                                             device=self.device, mode=self.mode, guidance=self.guidance, **kwargs)
        return self.plan_result

    def describe(self) -> str:
        from raydit.planner.report import format_plan_table

        return format_plan_table(self.plan_result, limit=5)

    def replan(self, replica: Any, capacity: int, min_sp: int | None = None):
        """Best plan for `capacity` devices: the replica's surviving members plus the
        cluster's free devices. With `workers` fixed by the user (or grow="always") the
        plan uses as many ranks as it may, up to `workers`; otherwise the planner's best.
        Degrees the user forced hold; when no plan with them fits what is left, the best
        plan without them runs and an event says what and why. `min_sp`: only plans with
        at least that much sequence parallelism (after running out of memory)."""
        counts = replica.pool.member_counts()
        for node, free in replica.pool.free_slots().items():
            counts[node] = counts.get(node, 0) + free
        frames, height, width = self.geometry
        limit = capacity if self.workers is None else min(capacity, self.workers)

        def best(**forced):
            result = self.cluster.plan(
                self.spec, frames=frames, height=height, width=width, device=self.device,
                counts=counts, mode=self.mode, guidance=self.guidance, **forced,
            )
            fits = [p for p in result.candidates if p.world_size <= limit
                    and (min_sp is None or p.ulysses * p.ring >= min_sp)]
            if not fits:
                raise ValueError(f"no feasible plan fits {limit} device(s)"
                                 + (f" with sequence parallelism >= {min_sp}" if min_sp else ""))
            if self.workers is not None or self.grow == "always":
                return max(fits, key=lambda p: (p.world_size, -p.predicted_step_seconds))
            return fits[0]

        forced = {k: v for k, v in self.forced.items() if v is not None}
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

    def plan_regroup(self, counts: dict, ulysses: int | None, ring: int | None, cfg: int | None):
        """A user's regroup: the planning with these degrees on the replica's members (an
        infeasible layout is refused with the planner's reason); `adopt` it once formed."""
        frames, height, width = self.geometry
        return self.cluster.plan(
            self.spec, frames=frames, height=height, width=width, device=self.device,
            ulysses=ulysses, ring=ring, cfg=cfg, counts=counts, mode=self.mode, guidance=self.guidance,
        )

    def adopt(self, result) -> None:
        """The planning a replica now runs (its best plan), for batch limits and autoscaling."""
        self.plan_result = result

    def planned_geometry(self) -> tuple[int, int, int]:
        frames, height, width = self.geometry
        return (frames or self.spec.default_frames, height or self.spec.default_height,
                width or self.spec.default_width)

    def batch_limit(self, max_batch: int, plan) -> int:
        """The most requests a replica running `plan` carries per step: max_batch, within the
        plan's memory."""
        from raydit.planner.judge import batch_capacity

        return min(max_batch, batch_capacity(self.plan_result, plan))

    def check_fits(self, replica: Any, request) -> None:
        """A request larger than the plan was made for: the planner checks that the
        replica's layout still holds it in memory (a clear error, not an OOM on the ranks)."""
        from raydit.planner import PlanError

        plan = replica.plan
        try:
            self.cluster.plan(
                self.spec, frames=request.num_frames, height=request.height, width=request.width,
                device=self.device, counts=replica.pool.member_counts(),
                ulysses=plan.ulysses, ring=plan.ring, cfg=plan.cfg, mode=self.mode, guidance=self.guidance,
            )
        except PlanError as exc:
            raise ValueError(
                f"{request.num_frames} frames at {request.height}x{request.width} do not fit the running plan "
                f"(ulysses {plan.ulysses} x ring {plan.ring} x cfg {plan.cfg}): {exc}; create the Engine with "
                f"frames/height/width of this size so it plans for them"
            ) from None
