"""The elastic controller: run requests step by step, survive lost ranks, grow when it pays.

Decisions are plain data (`Decision`) made by a policy from plain facts; the controller
applies them to a worker group. The loop can be stepped one `tick` at a time, so tests
drive it with a dummy group and injected failures (the shape of Ray Train v2's controller).

A request's progress lives here, on the driver: after every finished step the group hands
back a checkpoint (latents, step index, scheduler state). What happens on a failure
depends on its class (raydit.runtime.failures):

- application errors (worker code raised) reach the caller at once, never retried; the
  group, whose collectives they broke, is re-formed before the next request;
- lost ranks, broken collectives and missed deadlines are recovered: the controller tears
  the group down, asks the planner for the best plan on what is left (plus any free
  devices), re-forms the group on the survivors' warm actors and resumes from the last
  checkpoint, so the result equals an uninterrupted run. When nothing is left it hands
  the request back (`HandBack`) so the queue gives it to another replica. A request that
  fails the same step twice, on fresh workers each time, is stopped (a node's death does
  not count: it is not the request's doing);
- out of memory re-plans with more sequence parallelism where the devices allow.

Every call has a deadline derived from the plan (`Deadlines`): the predicted, then the
measured, time of that call times a factor, never under a floor of a few seconds.

The worker group the controller drives needs: `prepare(request, checkpoint, timeout_s)`,
`step(timeout_s)`, `decode(timeout_s)`, `reset_group()`, `members` and `active` (lists),
`free_slot_count()`, `grow_to(plan)` and `form(plan, timeout_s)`; recoverable failures
surface as `WorkerFailure` (raydit.runtime.errors) with `.lost`, `grow_to` raises
`ValueError` when the cluster cannot hold the new ranks.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from raydit.runtime.errors import HandBack, OutOfMemory, RequestFailed, WorkerFailure


@dataclass(frozen=True)
class Decision:
    """What to do next. `plan` is the planner's Plan for regroup/grow."""

    action: str  # "resume" | "grow" | "stay" | "fail" | "handback"
    reason: str
    plan: Any = None


@dataclass
class Job:
    """One request's life on the driver (it moves between replicas with its progress)."""

    request: Any
    checkpoint: dict | None = None
    step_index: int = 0
    num_steps: int | None = None
    timesteps: list = field(default_factory=list)
    prepared: bool = False
    frames: Any = None
    audio: Any = None  # raydit.models.family.Audio decoded with the frames, or None
    output_latents: Any = None  # (video, audio or None) arrays in the pipeline's latent layout
    done: bool = False
    recoveries: int = 0
    step_seconds: list = field(default_factory=list)
    # The same steps as rank 0 timed them (no Ray round trip), where the group reports it.
    rank_step_seconds: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    # Recoverable failures at the step in flight since the last finished step.
    failures_at_step: int = 0
    slot: int = 0  # where the workers hold it (a batch: one slot per request)


NO_CAPACITY = "no workers are left alive and no free devices remain in the cluster"


class ElasticPolicy:
    """Pure decisions. `replan(n_devices)` returns the planner's best plan for a capacity of
    `n_devices` (survivors plus free) or raises ValueError when nothing is feasible."""

    def __init__(self, max_recoveries: int = 8, grow_margin: float = 1.0, always_grow: bool = False,
                 max_world: int | None = None):
        self.max_recoveries = max_recoveries
        self.grow_margin = grow_margin
        # always_grow: take free devices whenever a larger feasible plan exists, whatever
        # the cost model predicts (for users who know better than the model, and tests).
        self.always_grow = always_grow
        # max_world: the most ranks a replica may have (the user's `workers`); a replica
        # that has them has nothing to grow to, so growth is not even considered.
        self.max_world = max_world

    def may_grow(self, current) -> bool:
        """False when `current` already has the most ranks allowed: then asking the cluster
        for free devices and replanning, between every two requests, is wasted work."""
        world = current.ulysses * current.ring * current.cfg
        return self.max_world is None or world < self.max_world

    def after_failure(self, job: Job, survivors: int, free: int, replan: Callable,
                      regroup_cost_s: float = 0.0) -> Decision:
        """Resume on the survivors plus free devices; but when starting actors on the free
        devices costs more than the larger plan would save on the steps left (the growth
        rule below), resume on the survivors alone at once (grow='always' takes them)."""
        if job.recoveries >= self.max_recoveries:
            return Decision("fail", f"gave up after {job.recoveries} recoveries")
        capacity = survivors + free
        if capacity < 1:
            return Decision("handback", NO_CAPACITY)
        try:
            plan = replan(capacity)
        except ValueError as exc:
            return Decision("handback", f"no feasible plan on the {capacity} device(s) left: {exc}")
        if free > 0 and survivors > 0 and not self.always_grow and plan.world_size > survivors:
            remaining = max(0, (job.num_steps or 0) - job.step_index)
            try:
                small = replan(survivors)
            except ValueError:
                small = None
            if small is not None:
                gain = (small.predicted_step_seconds - plan.predicted_step_seconds) * remaining
                if gain <= self.grow_margin * regroup_cost_s:
                    return Decision("resume", f"{survivors} survivor(s); starting {free} free device(s) would "
                                    f"cost {regroup_cost_s:.2f} s for a predicted gain of {gain:.2f} s", small)
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


# The least deadline of a prepare that compiles (Controller._prepare), before the extensions
# WorkerPool grants ranks that still answer their pings.
COMPILE_PREPARE_S = 600.0


class Deadlines:
    """How long one call may take before its ranks count as stuck.

    step: max(floor_s, factor x the slowest of the last measured steps), or x the plan's
    predicted step time before any was measured. prepare / decode: the same rule on their
    own measurements, with `first_s` until one was measured (a first decode's time is not
    predicted). `fixed_s` (the user's step_timeout_s) overrides all of them.
    """

    def __init__(self, floor_s: float = 10.0, first_s: float = 60.0, factor: float = 4.0, fixed_s: float | None = None):
        self.floor_s = floor_s
        self.first_s = first_s
        self.factor = factor
        self.fixed_s = fixed_s
        self._seen: dict[str, list[float]] = {}

    def observe(self, what: str, seconds: float) -> None:
        seen = self._seen.setdefault(what, [])
        seen.append(seconds)
        del seen[:-5]

    def forget(self, what: str = "step") -> None:
        """After a regroup the step time changes with the plan: predict again."""
        self._seen.pop(what, None)

    def for_call(self, what: str, plan=None) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        seen = self._seen.get(what)
        if seen:
            return max(self.floor_s, self.factor * max(seen))
        if what == "step":
            predicted = getattr(plan, "predicted_step_seconds", None) or 0.0
            return max(self.floor_s, self.factor * predicted)
        return max(self.first_s, self.factor * (getattr(plan, "predicted_step_seconds", None) or 0.0))


class Controller:
    def __init__(
        self,
        group,
        replan: Callable[..., Any],
        policy: ElasticPolicy | None = None,
        events: list | None = None,
        on_plan: Callable[[Any], None] | None = None,
        regroup_cost_s: Callable[[], float] | None = None,
        step_timeout_s: float | None = None,
        collective_timeout_s: float = 30.0,
        plan=None,
        capacity_lock=None,
        deadlines: Deadlines | None = None,
    ):
        self.group = group
        self.replan = replan
        self.policy = policy or ElasticPolicy()
        self.events = events if events is not None else []
        self._on_plan = on_plan or (lambda plan: None)
        self.regroup_cost_s = regroup_cost_s or (lambda: 0.0)
        self.deadlines = deadlines or Deadlines(fixed_s=step_timeout_s)
        # Deadline for forming a group: a rendezvous that does not complete in this time
        # is retried on a fresh store with the survivors.
        self.form_timeout_s = collective_timeout_s
        self.plan = plan
        # Replicas share the cluster's free devices: one recovery or growth at a time
        # decides what it takes from them.
        self.capacity_lock = capacity_lock if capacity_lock is not None else contextlib.nullcontext()

    def on_plan(self, plan) -> None:
        if self.plan is not None and plan is not self.plan:
            # Every call's time changes with the plan (and fresh actors' first calls are
            # slower): predict again rather than hold the new plan to the old times.
            for what in ("prepare", "step", "decode"):
                self.deadlines.forget(what)
        self.plan = plan
        self._on_plan(plan)

    def _event(self, name: str, **data) -> dict:
        ev = {"event": name, "time": time.time(), **data}
        self.events.append(ev)
        return ev

    # -- one iteration -------------------------------------------------------------------

    def tick(self, job: Job) -> str:
        """Advance `job` by one unit of work: prepare, one step, or decode. Returns what it
        did ("prepared", "stepped", "decoded", "recovered"). Raises the user-facing error of
        an application failure, `RequestFailed` when recovery gives up, `HandBack` when this
        replica cannot go on."""
        try:
            if not job.prepared and self._found_dead(lambda failure: self.recover(job, failure, **_FOUND)):
                return "recovered"
            if not self.group.active:
                self.ensure_group(job)
                return "recovered"
            if not job.prepared:
                self._prepare(job)
                return "prepared"
            if job.step_index < job.num_steps:
                self._step([job])
                return "stepped"
            self._decode(job)
            return "decoded"
        except WorkerFailure as failure:
            self.recover(job, failure)
            return "recovered"
        except OutOfMemory as oom:
            self.recover_oom(job, oom)
            return "recovered"

    def tick_batch(self, jobs: list[Job]) -> tuple[str, list[Job]]:
        """Advance a batch (step-level batching: unfinished jobs in distinct slots whose
        requests share a step) by one unit of work: prepare one job that is not prepared, else
        decode one whose steps are done (it leaves the batch), else one step of every job, as
        one batch. Returns
        (what it did, the jobs it did it for). A recovery re-prepares every job of the batch
        from its checkpoint (their states lived on the old group). Raises as `tick` does; an
        application error of a job's own prepare or decode names that job in
        `failed_job` on the exception."""
        lead = jobs[0]
        try:
            if not lead.prepared and self._found_dead(
                    lambda failure: self._recover_batch(jobs, lambda: self.recover(lead, failure, **_FOUND))):
                return self._lost_states(jobs)
            if not self.group.active:
                self.ensure_group(lead)
                return self._lost_states(jobs)
            for job in jobs:
                if not job.prepared:
                    self._own_call(self._prepare, job)
                    return "prepared", [job]
            for job in jobs:
                if job.step_index >= job.num_steps:  # its own steps are done: it leaves
                    self._own_call(self._decode, job)
                    return "decoded", [job]
            self._step(jobs)
            return "stepped", list(jobs)
        except WorkerFailure as failure:
            self._recover_batch(jobs, lambda: self.recover(lead, failure))
            return self._lost_states(jobs)
        except OutOfMemory as oom:
            self._recover_batch(jobs, lambda: self.recover_oom(lead, oom))
            return self._lost_states(jobs)

    def _found_dead(self, recover: Callable[[WorkerFailure], None]) -> bool:
        """Before a job is (re-)prepared: ranks whose process died since their last call
        (between requests) are dropped first, and `recover` regroups on what is left, so no
        call fails on them (which would count toward the request's repeat rule)."""
        drop_dead = getattr(self.group, "drop_dead", None)
        if drop_dead is None:
            return False
        with self.capacity_lock:
            gone = drop_dead()
        if not gone:
            return False
        self._event("rank_lost", lost=len(gone), reason="its process died since its last call")
        recover(WorkerFailure(f"{len(gone)} rank(s) died since their last call", lost=gone))
        return True

    @staticmethod
    def _recover_batch(jobs: list[Job], recover: Callable[[], None]) -> None:
        """Run `recover` for the batch (on its lead, whose counts the policy reads) and give
        every other job of the batch the same recovery: its count and its seconds."""
        lead = jobs[0]
        recoveries, seconds = lead.recoveries, len(lead.timings.get("recovery_seconds", []))
        recover()
        for job in jobs[1:]:
            job.recoveries += lead.recoveries - recoveries
            job.timings.setdefault("recovery_seconds", []).extend(lead.timings.get("recovery_seconds", [])[seconds:])

    @staticmethod
    def _own_call(call: Callable[[Job], None], job: Job) -> None:
        """`call(job)` for one job of a batch: an application error names the job
        (`failed_job`), so it alone leaves; lost ranks and out of memory are the batch's."""
        try:
            call(job)
        except (WorkerFailure, OutOfMemory):
            raise
        except Exception as exc:
            exc.failed_job = job
            raise

    @staticmethod
    def _lost_states(jobs: list[Job]) -> tuple[str, list[Job]]:
        for job in jobs:
            job.prepared = False  # re-prepared from its checkpoint on the new group
        return "recovered", list(jobs)

    def _prepare(self, job: Job) -> None:
        t0 = time.perf_counter()
        timeout = self.deadlines.for_call("prepare", self.plan)
        if getattr(self.group, "compile", False) and self.deadlines.fixed_s is None:
            # A compiled group compiles a new shape inside prepare: minutes on a GPU (374 s
            # measured for FP8 + int8 attention on an H100), more on a loaded CPU; not a hang.
            timeout = max(timeout, COMPILE_PREPARE_S)
        info = (self.group.prepare(job.request, job.checkpoint, timeout_s=timeout) if job.slot == 0
                else self.group.prepare(job.request, job.checkpoint, timeout_s=timeout, slot=job.slot))
        seconds = time.perf_counter() - t0
        self.deadlines.observe("prepare", seconds)
        # A compiled engine compiles for a new shape inside prepare: reported apart.
        warmup = float(info.get("warmup_seconds", 0.0))
        job.timings["compile_seconds"] = job.timings.get("compile_seconds", 0.0) + warmup
        job.timings.setdefault("prepare_seconds", seconds - warmup)
        job.num_steps = info["num_steps"]
        job.step_index = info["step_index"]
        job.timesteps = info["timesteps"]
        job.prepared = True

    def _step(self, jobs: list[Job]) -> None:
        """One step of `jobs` (one job: as ever; several: as one batch, their slots)."""
        t0 = time.perf_counter()
        # A batch's step costs at most its requests' steps one after another: the deadline
        # scales with it, and what is learned is the step of one request.
        timeout = self.deadlines.for_call("step", self.plan) * len(jobs)
        if len(jobs) == 1 and jobs[0].slot == 0:
            checkpoints = {0: self.group.step(timeout_s=timeout)}
        else:
            checkpoints = self.group.step(timeout_s=timeout, slots=[j.slot for j in jobs])
        seconds = time.perf_counter() - t0
        self.deadlines.observe("step", seconds / len(jobs))
        rank_seconds = getattr(self.group, "last_step_seconds", None)
        for job in jobs:
            job.checkpoint = checkpoints[job.slot]
            job.step_seconds.append(seconds)
            if rank_seconds is not None:
                job.rank_step_seconds.append(rank_seconds)
            job.step_index += 1
            job.failures_at_step = 0

    def _decode(self, job: Job) -> None:
        t0 = time.perf_counter()
        timeout = self.deadlines.for_call("decode", self.plan)
        job.frames = (self.group.decode(timeout_s=timeout) if job.slot == 0
                      else self.group.decode(timeout_s=timeout, slot=job.slot))
        seconds = time.perf_counter() - t0
        self.deadlines.observe("decode", seconds)
        job.timings["decode_seconds"] = seconds
        job.timings["decode_ranks"] = getattr(self.group, "decode_ranks", 1)
        job.audio = getattr(self.group, "decoded_audio", None)
        job.output_latents = getattr(self.group, "decoded_latents", None)
        job.done = True

    def ensure_group(self, job: Job) -> None:
        """Re-form a group that an application error (or a failed recovery) left unformed:
        on the same plan when the members allow, otherwise through a recovery."""
        plan = self.plan
        if plan is not None and plan.world_size <= len(self.group.members):
            try:
                self.group.form(plan, self.form_timeout_s)
                job.prepared = False
                return
            except WorkerFailure as failure:
                self.recover(job, failure, counts=False)
                return
        self.recover(job, WorkerFailure("the replica has fewer ranks than its plan", lost=[]), counts=False)

    def repair(self) -> bool:
        """Between requests, for a replica that handed its request back: re-form on its
        survivors plus free devices. True when it has a group again."""
        with self.capacity_lock:
            self.group.reset_group()
            getattr(self.group, "drop_dead", list)()  # a rank that died since: not re-formed over
            capacity = len(self.group.members) + self.group.free_slot_count()
            if capacity < 1:
                return False
            try:
                plan = self.replan(capacity)
                self.group.grow_to(plan)
                self.group.form(plan, self.form_timeout_s)
            except Exception as exc:  # nothing to resume here: try again later
                self._event("repair_failed", reason=f"{type(exc).__name__}: {exc}")
                return False
        self.on_plan(plan)
        return True

    def recover(self, job: Job, failure: WorkerFailure, counts: bool = True, failed: bool = True) -> None:
        """Regroup on what is left and resume `job` from its last checkpoint. `counts`:
        the failure happened in the job's own call (it counts toward the repeat rule).
        `failed` False: no call failed (ranks found dead before one, said by `rank_lost`)."""
        t_fail = time.perf_counter()
        lost = len(failure.lost)
        kind = failure.failure.kind if failure.failure is not None else "lost"
        if failed:
            self._event("failure", step=job.step_index, lost=lost, kind=kind, cause=str(failure))
        # A node's death is the cluster's doing, not the request's: it does not count
        # toward the repeat rule (two node losses at one step are not a poisoned request).
        node_died = getattr(self.group, "lost_to_dead_nodes", lambda f: False)(failure)
        if counts and not node_died:
            job.failures_at_step += 1
            if job.failures_at_step >= 2:
                reason = (f"the request failed at {_at(job)} twice, on fresh workers each "
                          f"time (last: {failure}); not retrying it")
                self._event("gave_up", reason=reason)
                # The survivors left the group with the failure: the next request re-forms it
                # (without this it was prepared on ranks holding no runner, and failed too).
                with self.capacity_lock:
                    self.group.reset_group()
                raise RequestFailed(reason) from failure
        use_free = True
        with self.capacity_lock:
            while True:
                self.group.reset_group()
                survivors = len(self.group.members)
                free = self.group.free_slot_count() if use_free else 0
                decision = self.policy.after_failure(job, survivors, free, self.replan, self.regroup_cost_s())
                if decision.action == "fail":
                    self._event("gave_up", reason=decision.reason)
                    raise RequestFailed(f"request failed at {_at(job)}: {decision.reason}") from failure
                if decision.action == "handback":
                    self._event("handed_back", step=job.step_index, reason=decision.reason)
                    raise HandBack(decision.reason)
                plan = decision.plan
                job.recoveries += 1
                try:
                    self.group.grow_to(plan)
                    self.group.form(plan, self.form_timeout_s)
                    break
                except WorkerFailure as again:  # a member died while regrouping: re-plan again
                    lost += len(again.lost)
                    self._event("failure", step=job.step_index, lost=len(again.lost),
                                kind=again.failure.kind if again.failure else "lost", cause=str(again))
                except ValueError as exc:  # the free devices could not be reserved after all
                    self._event("growth_failed", step=job.step_index, reason=str(exc))
                    use_free = False
        self.on_plan(plan)
        self.deadlines.forget("prepare")  # the re-prepare runs on a re-formed group
        job.prepared = False  # the next tick re-prepares from job.checkpoint
        seconds = time.perf_counter() - t_fail
        job.timings.setdefault("recovery_seconds", []).append(seconds)
        self._event(
            "regrouped",
            reason=f"lost {lost} rank(s); {decision.reason}",
            plan=_brief(plan),
            resume_step=job.step_index,
            seconds=seconds,
        )

    def recover_oom(self, job: Job, oom: OutOfMemory) -> None:
        """Out of memory: regroup with more sequence parallelism (less per device) where
        the devices allow; otherwise the user gets the figures."""
        current = self.plan
        sp = current.ulysses * current.ring if current is not None else 1
        self._event("failure", step=job.step_index, lost=0, kind="oom", cause=str(oom))
        figures = ""
        if current is not None:
            mem = getattr(current, "memory_gb_per_gpu", None)
            figures = (f" on ulysses {current.ulysses} x ring {current.ring} x cfg {current.cfg}"
                       + (f" (planned {mem:.1f} GB per device)" if mem else ""))
        lost_while_forming = None
        with self.capacity_lock:
            self.group.reset_group()
            getattr(self.group, "drop_dead", list)()  # a rank that died since: not re-formed over
            capacity = len(self.group.members) + self.group.free_slot_count()
            try:
                plan = self.replan(capacity, min_sp=sp + 1)
            except (ValueError, TypeError) as exc:
                self._event("gave_up", reason=f"out of memory; {exc}")
                raise OutOfMemory(
                    f"{oom}{figures}; no plan with more than {sp}-way sequence parallelism fits the "
                    f"{capacity} device(s) available: use fewer frames or a smaller size, or add devices"
                ) from None
            try:
                self.group.grow_to(plan)
                self.group.form(plan, self.form_timeout_s)
            except ValueError as exc:  # the larger plan's devices could not be reserved after all
                self._event("gave_up", reason=f"out of memory; {exc}")
                raise OutOfMemory(
                    f"{oom}{figures}; the {plan.world_size} device(s) of a plan with more sequence "
                    f"parallelism could not be reserved ({exc}): use fewer frames or a smaller size, "
                    "or free devices"
                ) from None
            except WorkerFailure as failure:  # a member died while regrouping: recovered as any loss
                lost_while_forming = failure
        if lost_while_forming is not None:
            self.recover(job, lost_while_forming, counts=False)
            return
        self.on_plan(plan)
        job.prepared = False
        self._event("regrouped", reason="out of memory: more sequence parallelism", plan=_brief(plan),
                    resume_step=job.step_index, seconds=0.0)

    def maybe_grow(self, current_plan, remaining_steps: int, job: Job | None = None):
        """Between steps or requests: regroup onto free devices when it pays. A member lost
        while regrouping is handled like any failure (recovered for `job`); devices that
        cannot be reserved after all leave the replica as it was."""
        if not self.policy.may_grow(current_plan):
            return None
        try:
            with self.capacity_lock:
                return self._grow(current_plan, remaining_steps)
        except WorkerFailure as failure:
            self.recover(job if job is not None else Job(request=None), failure, counts=False)
            return None

    def _grow(self, current_plan, remaining_steps: int):
        free = self.group.free_slot_count()
        decision = self.policy.consider_growth(
            current_plan, free, remaining_steps, self.regroup_cost_s(), self.replan
        )
        if decision.action != "grow":
            return None
        t0 = time.perf_counter()
        try:
            self.group.grow_to(decision.plan)
        except ValueError as exc:
            self._event("growth_failed", reason=str(exc))
            return None
        self.group.reset_group()
        self.group.form(decision.plan, self.form_timeout_s)
        self.on_plan(decision.plan)
        self._event("grew", reason=decision.reason, plan=_brief(decision.plan), seconds=time.perf_counter() - t0)
        return decision.plan

    # -- a whole request -----------------------------------------------------------------

    def run(self, job: Job, on_step: Callable[[Job], None] | None = None) -> Job:
        """Tick until the job is done. `on_step(job)` runs after every finished step; it may
        replace `job.checkpoint` and set `job.prepared = False` to push edited latents."""
        while not job.done:
            if self.tick(job) == "stepped" and on_step is not None:
                on_step(job)
        return job


_FOUND = {"counts": False, "failed": False}  # ranks found dead before any call failed on them


def _at(job: Job) -> str:
    """Where `job` failed, in words: its step, or the decode once every step is done (a
    2-step request that fails in its decode did not fail at "step 2")."""
    if job.num_steps is not None and job.step_index >= job.num_steps:
        return f"the decode (after step {job.num_steps - 1})" if job.num_steps else "the decode"
    return f"step {job.step_index}"


def _brief(plan) -> dict:
    return {"ulysses": plan.ulysses, "ring": plan.ring, "cfg": plan.cfg, "world_size": plan.world_size}
