"""The elastic controller: run requests step by step, survive lost ranks, grow when it pays.

Decisions are plain data (`Decision`) made by a policy from plain facts; the controller
applies them to a worker group. The loop can be stepped one `tick` at a time, so tests
drive it with a dummy group and injected failures (the shape of Ray Train v2's controller).

A request's progress lives here, on the driver: after every finished step the group hands
back a checkpoint (latents, step index, scheduler state). When ranks are lost the
controller tears the group down, asks the planner for the best plan on what is left (plus
any free devices), re-forms the group on the survivors' warm actors, and resumes from the
last checkpoint, so the result equals an uninterrupted run.

The worker group the controller drives needs: `prepare(request, checkpoint)`, `step()`,
`decode()`, `reset_group()`, `members` (a list), `free_slot_count()`, `grow_to(plan)` and
`form(plan)`; failures surface as `WorkerFailure` (raydit.runtime.errors) with `.lost`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from raydit.runtime.errors import WorkerFailure


@dataclass(frozen=True)
class Decision:
    """What to do next. `plan` is the planner's Plan for regroup/grow."""

    action: str  # "resume" | "grow" | "stay" | "fail"
    reason: str
    plan: Any = None


@dataclass
class Job:
    """One request's life on the driver."""

    request: Any
    checkpoint: dict | None = None
    step_index: int = 0
    num_steps: int | None = None
    timesteps: list = field(default_factory=list)
    prepared: bool = False
    frames: Any = None
    done: bool = False
    recoveries: int = 0
    step_seconds: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)


class ElasticPolicy:
    """Pure decisions. `replan(n_devices)` returns the planner's best plan for a capacity of
    `n_devices` (survivors plus free) or raises ValueError when nothing is feasible."""

    def __init__(self, max_recoveries: int = 8, grow_margin: float = 1.0, always_grow: bool = False):
        self.max_recoveries = max_recoveries
        self.grow_margin = grow_margin
        # always_grow: take free devices whenever a larger feasible plan exists, whatever
        # the cost model predicts (for users who know better than the model, and tests).
        self.always_grow = always_grow

    def after_failure(self, job: Job, survivors: int, free: int, replan: Callable) -> Decision:
        if job.recoveries >= self.max_recoveries:
            return Decision("fail", f"gave up after {job.recoveries} recoveries")
        capacity = survivors + free
        if capacity < 1:
            return Decision("fail", "no workers are left alive and no free devices remain in the cluster")
        try:
            plan = replan(capacity)
        except ValueError as exc:
            return Decision("fail", f"no feasible plan on the {capacity} device(s) left: {exc}")
        return Decision("resume", f"{survivors} survivor(s) + {free} free device(s)", plan)

    def consider_growth(
        self, current, free: int, remaining_steps: int, regroup_cost_s: float, replan: Callable
    ) -> Decision:
        """Grow when (current - new step time) x remaining steps beats the regroup cost."""
        if free <= 0 or remaining_steps <= 0:
            return Decision("stay", "no free devices" if free <= 0 else "nothing left to run")
        world = current.ulysses * current.ring * current.cfg
        try:
            candidate = replan(world + free)
        except ValueError:
            return Decision("stay", "no feasible larger plan")
        gain = (current.predicted_step_seconds - candidate.predicted_step_seconds) * remaining_steps
        if candidate.world_size > world and self.always_grow:
            return Decision("grow", f"{free} free device(s); growth forced (grow='always')", candidate)
        if candidate.world_size > world and gain > self.grow_margin * regroup_cost_s:
            return Decision(
                "grow", f"predicted gain {gain:.2f} s > regroup cost {regroup_cost_s:.2f} s", candidate
            )
        return Decision("stay", f"predicted gain {gain:.2f} s does not beat regroup cost {regroup_cost_s:.2f} s")


class Controller:
    def __init__(
        self,
        group,
        replan: Callable[[int], Any],
        policy: ElasticPolicy | None = None,
        events: list | None = None,
        on_plan: Callable[[Any], None] | None = None,
        regroup_cost_s: Callable[[], float] | None = None,
        step_timeout_s: float | None = None,
        collective_timeout_s: float = 300.0,
    ):
        self.group = group
        self.replan = replan
        self.policy = policy or ElasticPolicy()
        self.events = events if events is not None else []
        self.on_plan = on_plan or (lambda plan: None)
        self.regroup_cost_s = regroup_cost_s or (lambda: 0.0)
        self.step_timeout_s = step_timeout_s
        self.collective_timeout_s = collective_timeout_s

    def _event(self, kind: str, **data) -> dict:
        ev = {"event": kind, "time": time.time(), **data}
        self.events.append(ev)
        return ev

    # -- one iteration -------------------------------------------------------------------

    def tick(self, job: Job) -> str:
        """Advance `job` by one unit of work: prepare, one step, or decode. Returns what it
        did ("prepared", "stepped", "decoded", "recovered"); raises RuntimeError with the
        reason when recovery is impossible."""
        try:
            if not job.prepared:
                t0 = time.perf_counter()
                info = self.group.prepare(job.request, job.checkpoint, timeout_s=self.step_timeout_s)
                job.timings.setdefault("prepare_seconds", time.perf_counter() - t0)
                job.num_steps = info["num_steps"]
                job.step_index = info["step_index"]
                job.timesteps = info["timesteps"]
                job.prepared = True
                return "prepared"
            if job.step_index < job.num_steps:
                t0 = time.perf_counter()
                job.checkpoint = self.group.step(timeout_s=self.step_timeout_s)
                job.step_seconds.append(time.perf_counter() - t0)
                job.step_index += 1
                return "stepped"
            t0 = time.perf_counter()
            job.frames = self.group.decode(timeout_s=self.step_timeout_s)
            job.timings["decode_seconds"] = time.perf_counter() - t0
            job.done = True
            return "decoded"
        except WorkerFailure as failure:
            self.recover(job, failure)
            return "recovered"

    def recover(self, job: Job, failure: WorkerFailure) -> None:
        t_fail = time.perf_counter()
        lost = len(failure.lost)
        self._event("failure", step=job.step_index, lost=lost, cause=str(failure))
        while True:
            self.group.reset_group()
            survivors = len(self.group.members)
            free = self.group.free_slot_count()
            decision = self.policy.after_failure(job, survivors, free, self.replan)
            if decision.action == "fail":
                self._event("gave_up", reason=decision.reason)
                raise RuntimeError(f"request failed at step {job.step_index}: {decision.reason}") from failure
            plan = decision.plan
            job.recoveries += 1
            try:
                self.group.grow_to(plan)
                self.group.form(plan, self.collective_timeout_s)
                break
            except WorkerFailure as again:  # a member died while regrouping: re-plan again
                lost += len(again.lost)
                self._event("failure", step=job.step_index, lost=len(again.lost), cause=str(again))
        self.on_plan(plan)
        job.prepared = False  # the next tick re-prepares from job.checkpoint
        seconds = time.perf_counter() - t_fail
        job.timings.setdefault("recovery_seconds", []).append(seconds)
        self._event(
            "regrouped",
            reason=f"lost {lost} rank(s); {decision.reason}",
            plan={"ulysses": plan.ulysses, "ring": plan.ring, "cfg": plan.cfg, "world_size": plan.world_size},
            resume_step=job.step_index,
            seconds=seconds,
        )

    def maybe_grow(self, current_plan, remaining_steps: int, job: Job | None = None):
        """Between steps or requests: regroup onto free devices when it pays. A member lost
        while regrouping is handled like any failure (recovered for `job`)."""
        try:
            return self._grow(current_plan, remaining_steps)
        except WorkerFailure as failure:
            self.recover(job if job is not None else Job(request=None), failure)
            return None

    def _grow(self, current_plan, remaining_steps: int):
        free = self.group.free_slot_count()
        decision = self.policy.consider_growth(
            current_plan, free, remaining_steps, self.regroup_cost_s(), self.replan
        )
        if decision.action != "grow":
            return None
        t0 = time.perf_counter()
        self.group.reset_group()
        self.group.grow_to(decision.plan)
        self.group.form(decision.plan, self.collective_timeout_s)
        self.on_plan(decision.plan)
        p = decision.plan
        self._event(
            "grew",
            reason=decision.reason,
            plan={"ulysses": p.ulysses, "ring": p.ring, "cfg": p.cfg, "world_size": p.world_size},
            seconds=time.perf_counter() - t0,
        )
        return decision.plan

    # -- a whole request -----------------------------------------------------------------

    def run(self, job: Job, on_step: Callable[[Job], None] | None = None) -> Job:
        """Tick until the job is done. `on_step(job)` runs after every finished step; it may
        replace `job.checkpoint` and set `job.prepared = False` to push edited latents."""
        while not job.done:
            if self.tick(job) == "stepped" and on_step is not None:
                on_step(job)
        return job
