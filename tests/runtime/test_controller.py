"""The elastic controller, stepped one tick at a time against a dummy worker group with
injected failures (no Ray, no torch.distributed: the one place a dummy group is allowed)."""

from __future__ import annotations

import pytest

from raydit.runtime.controller import Controller, Deadlines, Decision, ElasticPolicy, Job
from raydit.runtime.errors import HandBack, OutOfMemory, RequestError, RequestFailed

from support.controller import DummyGroup, FakePlan, Req, replan_for, run_ticks


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


def test_everything_lost_hands_the_request_back_with_its_progress_not_a_hang():
    group = DummyGroup(2, fail_at={("step", 1): 2})
    ctrl = Controller(group, replan_for)
    job = Job(Req(3))
    with pytest.raises(HandBack, match="no workers are left alive"):
        run_ticks(ctrl, job)
    assert ctrl.events[-1]["event"] == "handed_back"
    # The queue gives the job to another replica, which resumes from step 1.
    other = DummyGroup(2)
    job.prepared = False
    run_ticks(Controller(other, replan_for), job)
    assert job.frames == ("frames", (0, 1, 2)) and ("prepare", 1) in other.calls


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
    with pytest.raises(HandBack, match="no feasible plan on the 3 device.*30 heads"):
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


def test_a_replica_at_its_worker_limit_never_asks_for_free_devices():
    """With `workers` fixed, a replica that has them skips growth before asking the cluster
    for free devices or the planner for a plan: between every two requests of a server that
    would be a GCS query and a planner run for nothing. Below the limit it still grows."""
    asked = []

    class Counting(DummyGroup):
        def free_slot_count(self):
            asked.append("free")
            return super().free_slot_count()

    def counted_replan(capacity, min_sp=None):
        asked.append("replan")
        return replan_for(capacity, min_sp)

    at_limit = Controller(Counting(2, free=2), counted_replan, policy=ElasticPolicy(max_world=2),
                          regroup_cost_s=lambda: 1.0)
    assert at_limit.maybe_grow(FakePlan(2, 1, 1, 2.0), remaining_steps=10) is None
    assert asked == []
    below = Controller(Counting(1, free=2), lambda c, m=None: counted_replan(min(c, 2), m),
                       policy=ElasticPolicy(max_world=2), regroup_cost_s=lambda: 1.0)
    assert below.maybe_grow(FakePlan(1, 1, 1, 4.0), remaining_steps=10) == FakePlan(2, 1, 1, 2.0)
    assert "free" in asked and "replan" in asked


# -- failure classes -----------------------------------------------------------------------


def test_application_error_reaches_the_caller_at_once_and_is_never_retried():
    err = RequestError("ValueError: num_inference_steps 20 > 10 (raised in the workers during prepare; not retried)")
    group = DummyGroup(4, free=4, fail_at={("prepare", 0): err})
    ctrl = Controller(group, replan_for, plan=FakePlan(2, 2, 1, 1.0))
    with pytest.raises(RequestError, match="20 > 10"):
        run_ticks(ctrl, Job(Req(3)))
    assert [e["event"] for e in ctrl.events] == []  # no failure, no recovery
    assert group.formed == [] and len(group.members) == 4
    # The next request re-forms the group the error broke, on the same plan and members.
    job = Job(Req(2))
    assert run_ticks(ctrl, job)[0] == "recovered" and job.done
    assert group.formed == [FakePlan(2, 2, 1, 1.0)] and job.recoveries == 0


def test_the_same_step_failing_twice_on_fresh_workers_is_stopped_with_that_said():
    group = DummyGroup(4, free=0)
    group.fail_at = {("step", 1): 1}
    ctrl = Controller(group, replan_for)
    job = Job(Req(3))
    real_form = group.form

    def form_then_fail_again(plan, timeout_s):
        real_form(plan, timeout_s)
        group.fail_at[("step", 1)] = 1  # the fresh group fails the same step again

    group.form = form_then_fail_again
    with pytest.raises(RequestFailed, match="failed at step 1 twice, on fresh workers"):
        run_ticks(ctrl, job)
    assert [e["event"] for e in ctrl.events] == ["failure", "regrouped", "failure", "gave_up"]
    # The survivors of the last failure left the group (the real pool's leave_group): it is
    # reset, and the next request re-forms it before it prepares, then runs to the end.
    assert group.calls[-1] == ("reset",) and group.active == []
    group.form = real_form
    following = Job(Req(2))
    assert run_ticks(ctrl, following)[0] == "recovered" and following.done


def test_node_deaths_at_the_same_step_do_not_count_toward_the_repeat_rule():
    """Two node losses at one step are the cluster's doing: the request goes on (the real
    pool answers lost_to_dead_nodes from Ray's node table)."""
    group = DummyGroup(4, free=0)
    group.fail_at = {("step", 1): 1}
    group.lost_to_dead_nodes = lambda failure: True
    ctrl = Controller(group, replan_for)
    job = Job(Req(3))
    real_form = group.form
    refails = [1]

    def form_then_fail_again(plan, timeout_s):
        real_form(plan, timeout_s)
        if refails:
            group.fail_at[("step", 1)] = refails.pop()

    group.form = form_then_fail_again
    run_ticks(ctrl, job)
    assert job.done and job.frames == ("frames", (0, 1, 2))
    assert [e["event"] for e in ctrl.events] == ["failure", "regrouped", "failure", "regrouped"]


def test_a_regroup_forgets_the_measured_call_times():
    """After a regroup the first prepare runs on a re-formed group (maybe fresh actors): it
    gets the first-call deadline again, not 4 x the last quick prepare."""
    group = DummyGroup(4, free=0, fail_at={("step", 1): 1})
    ctrl = Controller(group, replan_for, plan=replan_for(4), deadlines=Deadlines(floor_s=5.0, first_s=60.0))
    run_ticks(ctrl, Job(Req(3)))
    prepares = [t for what, t in group.timeouts if what == "prepare"]
    assert prepares == [60.0, 60.0], group.timeouts


def test_failures_at_different_steps_are_all_recovered():
    group = DummyGroup(4, free=0, fail_at={("step", 1): 1, ("step", 2): 1})
    ctrl = Controller(group, replan_for)
    job = Job(Req(4))
    run_ticks(ctrl, job)
    assert job.done and job.recoveries == 2 and job.frames == ("frames", (0, 1, 2, 3))


def test_free_devices_that_cannot_be_reserved_fall_back_to_the_survivors():
    group = DummyGroup(4, free=2, fail_at={("step", 1): 2}, reserve_fails=1)
    ctrl = Controller(group, replan_for)
    job = Job(Req(3))
    run_ticks(ctrl, job)
    kinds = [e["event"] for e in ctrl.events]
    assert kinds == ["failure", "growth_failed", "regrouped"]
    assert group.formed[-1] == FakePlan(2, 1, 1, 2.0) and len(group.members) == 2  # never left without ranks
    assert job.frames == ("frames", (0, 1, 2))


def test_out_of_memory_regroups_with_more_sequence_parallelism():
    group = DummyGroup(2, free=2, fail_at={("step", 1): OutOfMemory("CUDA out of memory. Tried to allocate 9 GiB")})
    ctrl = Controller(group, replan_for, plan=FakePlan(2, 1, 1, 2.0))
    job = Job(Req(3))
    run_ticks(ctrl, job)
    assert ctrl.plan == FakePlan(2, 2, 1, 1.0) and len(group.members) == 4
    assert job.frames == ("frames", (0, 1, 2))
    assert [e["event"] for e in ctrl.events] == ["failure", "regrouped"] and ctrl.events[0]["kind"] == "oom"


def test_out_of_memory_without_a_larger_plan_reports_the_figures():
    group = DummyGroup(4, free=0, fail_at={("step", 0): OutOfMemory("CUDA out of memory. Tried to allocate 9 GiB")})
    ctrl = Controller(group, replan_for, plan=FakePlan(2, 2, 1, 1.0))
    with pytest.raises(OutOfMemory, match="9 GiB.*ulysses 2 x ring 2 x cfg 1.*4-way.*4 device"):
        run_ticks(ctrl, Job(Req(2)))


def test_deadlines_follow_the_plan_then_the_measured_times_with_a_floor():
    d = Deadlines(floor_s=5.0, first_s=60.0, factor=4.0)
    assert d.for_call("step", FakePlan(1, 1, 1, 0.1)) == 5.0  # floor
    assert d.for_call("step", FakePlan(1, 1, 1, 3.0)) == 12.0  # predicted x 4
    assert d.for_call("decode", FakePlan(1, 1, 1, 3.0)) == 60.0  # nothing measured yet
    d.observe("step", 0.5)
    d.observe("step", 2.5)
    assert d.for_call("step", FakePlan(1, 1, 1, 3.0)) == 10.0  # slowest measured x 4
    d.forget("step")
    assert d.for_call("step", FakePlan(1, 1, 1, 3.0)) == 12.0
    assert Deadlines(fixed_s=7.0).for_call("decode") == 7.0
    # The controller passes them to every call.
    group = DummyGroup(1)
    ctrl = Controller(group, replan_for, plan=FakePlan(1, 1, 1, 3.0), deadlines=Deadlines(floor_s=5.0))
    run_ticks(ctrl, Job(Req(2)))
    assert group.timeouts[0] == ("prepare", 60.0) and group.timeouts[1] == ("step", 12.0)
    assert group.timeouts[2][1] == max(5.0, 4 * ctrl.deadlines._seen["step"][0])


def test_repair_reforms_a_replica_that_handed_back_once_devices_are_free():
    group = DummyGroup(2, fail_at={("step", 0): 2})
    ctrl = Controller(group, replan_for)
    with pytest.raises(HandBack):
        run_ticks(ctrl, Job(Req(2)))
    assert not ctrl.repair() and group.members == []
    group.free = 3
    assert ctrl.repair() and ctrl.plan == FakePlan(3, 1, 1, 1.3) and len(group.active) == 3


def test_recovery_skips_free_devices_that_cost_more_to_start_than_they_save():
    # 2 survivors + 2 free: ulysses 2 x ring 2 saves (2.0 - 1.0) s x 3 steps = 3 s.
    job_steps = 4
    cheap = DummyGroup(4, free=2, fail_at={("step", 1): 2})
    run_ticks(Controller(cheap, replan_for, regroup_cost_s=lambda: 1.0), Job(Req(job_steps)))
    assert cheap.formed[-1].world_size == 4  # 3 s gain > 1 s to start two actors
    dear = DummyGroup(4, free=2, fail_at={("step", 1): 2})
    ctrl = Controller(dear, replan_for, regroup_cost_s=lambda: 30.0)
    job = Job(Req(job_steps))
    run_ticks(ctrl, job)
    assert dear.formed[-1].world_size == 2 and dear.free == 2  # resumed at once on the survivors
    assert "would cost 30.00 s" in ctrl.events[-1]["reason"] and job.frames == ("frames", (0, 1, 2, 3))
    forced = DummyGroup(4, free=2, fail_at={("step", 1): 2})
    run_ticks(Controller(forced, replan_for, policy=ElasticPolicy(always_grow=True), regroup_cost_s=lambda: 30.0),
              Job(Req(job_steps)))
    assert forced.formed[-1].world_size == 4


def test_a_compiled_groups_prepare_gets_the_compile_deadline():
    """A compiled group compiles a new shape inside prepare: its deadline is at least
    COMPILE_PREPARE_S (under a 60 s first deadline and 5 extensions a compile of 374 s, measured
    on an H100, or a loaded CPU's, was dropped as stuck); a user's fixed timeout still rules."""
    from raydit.runtime.controller import COMPILE_PREPARE_S

    group = DummyGroup(1)
    group.compile = True
    ctrl = Controller(group, replan_for, plan=FakePlan(1, 1, 1, 3.0), deadlines=Deadlines(floor_s=5.0))
    run_ticks(ctrl, Job(Req(2)))
    assert group.timeouts[0] == ("prepare", COMPILE_PREPARE_S) and group.timeouts[1] == ("step", 12.0)
    fixed = DummyGroup(1)
    fixed.compile = True
    ctrl = Controller(fixed, replan_for, plan=FakePlan(1, 1, 1, 3.0), deadlines=Deadlines(fixed_s=7.0))
    run_ticks(ctrl, Job(Req(2)))
    assert fixed.timeouts[0] == ("prepare", 7.0)
