"""The elastic controller, stepped one tick at a time against a dummy worker group with
injected failures (no Ray, no torch.distributed: the one place a dummy group is allowed)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from raydit.runtime.controller import Controller, Decision, ElasticPolicy, Job
from raydit.runtime.errors import WorkerFailure


@dataclass(frozen=True)
class FakePlan:
    ulysses: int
    ring: int
    cfg: int
    predicted_step_seconds: float

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg


@dataclass(frozen=True)
class Req:
    num_inference_steps: int
    seed: int = 0


class DummyGroup:
    """A worker group whose "latents" are the list of steps applied; failures are injected
    per call: fail_at[("step", step_index)] = number of members lost."""

    def __init__(self, members: int, free: int = 0, fail_at=None):
        self.members = list(range(members))
        self.free = free
        self.fail_at = dict(fail_at or {})
        self.formed = []
        self.state = None
        self.calls = []

    def prepare(self, request, checkpoint, timeout_s=None):
        self._maybe_fail("prepare", checkpoint["step_index"] if checkpoint else 0)
        self.calls.append(("prepare", checkpoint["step_index"] if checkpoint else 0))
        self.request = request
        self.state = list(checkpoint["applied"]) if checkpoint else []
        n = request.num_inference_steps
        return {"num_steps": n, "step_index": len(self.state), "timesteps": list(range(n, 0, -1))}

    def step(self, timeout_s=None):
        i = len(self.state)
        self._maybe_fail("step", i)
        self.calls.append(("step", i))
        self.state.append(i)
        return {"applied": list(self.state), "step_index": len(self.state), "latents": sum(self.state)}

    def decode(self, timeout_s=None):
        self._maybe_fail("decode", 0)
        return ("frames", tuple(self.state))

    def _maybe_fail(self, what, index):
        lost = self.fail_at.pop((what, index), 0)
        if lost:
            gone, self.members = self.members[:lost], self.members[lost:]
            raise WorkerFailure(f"injected loss of {lost}", lost=gone)

    def reset_group(self):
        self.calls.append(("reset",))

    def free_slot_count(self):
        return self.free

    def grow_to(self, plan):
        need = plan.world_size - len(self.members)
        if need > 0:
            assert need <= self.free
            self.free -= need
            self.members += [100 + k for k in range(need)]

    def form(self, plan, timeout_s):
        assert plan.world_size <= len(self.members)
        self.formed.append(plan)


def replan_for(capacity: int) -> FakePlan:
    """30 heads: 4 -> ulysses 2 x ring 2, 3 -> ulysses 3, 2 -> ulysses 2, 1 -> one rank."""
    table = {4: FakePlan(2, 2, 1, 1.0), 3: FakePlan(3, 1, 1, 1.3), 2: FakePlan(2, 1, 1, 2.0), 1: FakePlan(1, 1, 1, 4.0)}
    if capacity < 1:
        raise ValueError("no devices")
    return table[min(capacity, 4)]


def run_ticks(ctrl, job, limit=100):
    seen = []
    while not job.done and len(seen) < limit:
        seen.append(ctrl.tick(job))
    return seen


def test_uninterrupted_job_ticks_prepare_steps_decode():
    group = DummyGroup(4)
    ctrl = Controller(group, replan_for)
    job = Job(Req(3))
    assert run_ticks(ctrl, job) == ["prepared", "stepped", "stepped", "stepped", "decoded"]
    assert job.frames == ("frames", (0, 1, 2)) and job.checkpoint["step_index"] == 3
    assert ctrl.events == []


def test_lost_rank_mid_step_regroups_and_resumes_from_last_finished_step():
    group = DummyGroup(4, fail_at={("step", 2): 1})
    events = []
    plans = []
    ctrl = Controller(group, replan_for, events=events, on_plan=plans.append)
    job = Job(Req(4))
    ticks = run_ticks(ctrl, job)
    assert ticks == ["prepared", "stepped", "stepped", "recovered", "prepared", "stepped", "stepped", "decoded"]
    # Resumed at step 2 from the checkpoint of step 1: no step ran twice or was skipped.
    assert [c for c in group.calls if c[0] == "step"] == [("step", 0), ("step", 1), ("step", 2), ("step", 3)]
    assert ("prepare", 2) in group.calls
    assert job.frames == ("frames", (0, 1, 2, 3))
    # 4 -> 3 ranks: ulysses 2 x ring 2 becomes ulysses 3.
    assert plans == [FakePlan(3, 1, 1, 1.3)] and group.formed == plans
    kinds = [e["event"] for e in events]
    assert kinds == ["failure", "regrouped"]
    assert events[1]["resume_step"] == 2 and events[1]["plan"]["ulysses"] == 3
    assert job.recoveries == 1 and len(job.timings["recovery_seconds"]) == 1


def test_free_devices_replace_lost_ones():
    group = DummyGroup(4, free=2, fail_at={("step", 1): 2})
    ctrl = Controller(group, replan_for)
    job = Job(Req(3))
    run_ticks(ctrl, job)
    assert group.formed[-1].world_size == 4  # two survivors + two new members
    assert sorted(group.members)[-2:] == [100, 101]
    assert job.frames == ("frames", (0, 1, 2))


def test_failure_during_prepare_and_decode_are_recovered_too():
    group = DummyGroup(4, fail_at={("prepare", 0): 1, ("decode", 0): 1})
    ctrl = Controller(group, replan_for)
    job = Job(Req(2))
    run_ticks(ctrl, job)
    assert job.done and job.frames == ("frames", (0, 1)) and job.recoveries == 2


def test_everything_lost_gives_up_with_a_clear_error_not_a_hang():
    group = DummyGroup(2, fail_at={("step", 1): 2})
    ctrl = Controller(group, replan_for)
    job = Job(Req(3))
    with pytest.raises(RuntimeError, match="no workers are left alive"):
        run_ticks(ctrl, job)
    assert ctrl.events[-1]["event"] == "gave_up"


def test_policy_gives_up_after_too_many_recoveries():
    group = DummyGroup(4, free=10, fail_at={("step", 0): 1})
    ctrl = Controller(group, replan_for, policy=ElasticPolicy(max_recoveries=0))
    with pytest.raises(RuntimeError, match="gave up after 0 recoveries"):
        run_ticks(ctrl, Job(Req(2)))


def test_infeasible_replan_fails_with_the_planner_reason():
    def never(capacity):
        raise ValueError("ulysses 4 does not divide 30 heads")

    group = DummyGroup(4, fail_at={("step", 0): 1})
    ctrl = Controller(group, never)
    with pytest.raises(RuntimeError, match="no feasible plan on the 3 device.*30 heads"):
        run_ticks(ctrl, Job(Req(2)))


@pytest.mark.parametrize(
    "free, remaining, cost, always, expect",
    [
        (0, 10, 1.0, False, "stay"),  # nothing free
        (2, 0, 1.0, False, "stay"),  # nothing left to run
        (2, 10, 5.0, False, "grow"),  # (2.0 - 1.0) s x 10 steps = 10 s > 5 s
        (2, 10, 50.0, False, "stay"),  # 10 s gain does not pay 50 s of regrouping
        (2, 1, 50.0, True, "grow"),  # forced
    ],
)
def test_growth_decision_weighs_gain_against_regroup_cost(free, remaining, cost, always, expect):
    policy = ElasticPolicy(always_grow=always)
    current = FakePlan(2, 1, 1, 2.0)
    d = policy.consider_growth(current, free, remaining, cost, replan_for)
    assert isinstance(d, Decision) and d.action == expect
    if expect == "grow":
        assert d.plan == FakePlan(2, 2, 1, 1.0)


def test_maybe_grow_regroups_onto_free_devices_and_reports_it():
    group = DummyGroup(2, free=2)
    events = []
    ctrl = Controller(group, replan_for, events=events, regroup_cost_s=lambda: 1.0)
    plan = ctrl.maybe_grow(FakePlan(2, 1, 1, 2.0), remaining_steps=10)
    assert plan == FakePlan(2, 2, 1, 1.0) and len(group.members) == 4
    assert events[-1]["event"] == "grew" and events[-1]["plan"]["world_size"] == 4
    assert ctrl.maybe_grow(plan, remaining_steps=10) is None  # nothing free any more
