"""Recovery paths found wanting in an audit: each test was seen failing before its fix.
Controller tests run against the dummy worker group of tests/support/controller.py (no Ray)."""

from __future__ import annotations

import pytest

from raydit.runtime.controller import Controller, Job
from raydit.runtime.errors import OutOfMemory, RequestFailed, WorkerFailure

from support.controller import DummyGroup, Req, replan_for, run_ticks

RELEASE_WAIT_S = 120.0  # a wait for released devices that ends only when they are seen free


class FormFails(DummyGroup):
    """A dummy group whose next `form` calls raise the queued exceptions (a member lost
    while the group is re-formed, devices that cannot be reserved)."""

    def __init__(self, *args, form_fails=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.form_fails = list(form_fails)

    def form(self, plan, timeout_s):
        if self.form_fails:
            exc = self.form_fails.pop(0)
            if isinstance(exc, WorkerFailure) and exc.lost:
                self.members = [m for m in self.members if m not in exc.lost]
            raise exc
        super().form(plan, timeout_s)


def test_a_rank_lost_while_regrouping_after_out_of_memory_is_recovered_not_raised():
    # Step 1 runs out of memory on 2 ranks; the regroup onto 4 (more sequence parallelism)
    # loses a member while forming. That is a lost rank like any other: recovered, the
    # request finishes; the internal WorkerFailure never reaches the caller.
    group = FormFails(2, free=2, fail_at={("step", 1): OutOfMemory("CUDA out of memory")},
                      form_fails=[WorkerFailure("injected loss while forming", lost=[0])])
    ctrl = Controller(group, replan_for, plan=replan_for(2))
    job = Job(Req(3))
    run_ticks(ctrl, job)
    assert job.done and job.frames == ("frames", (0, 1, 2))
    kinds = [e["event"] for e in ctrl.events]
    assert kinds.count("failure") == 2 and kinds[-1] == "regrouped", ctrl.events


def test_devices_not_reservable_for_an_out_of_memory_regroup_report_out_of_memory():
    # The larger plan's devices cannot be reserved after all: the user is told the request
    # ran out of memory (with what was tried), not a bare placement ValueError that the
    # CLI reads as a request error.
    group = DummyGroup(2, free=2, fail_at={("step", 0): OutOfMemory("CUDA out of memory")}, reserve_fails=1)
    ctrl = Controller(group, replan_for, plan=replan_for(2))
    with pytest.raises(OutOfMemory, match="out of memory.*could not hold"):
        run_ticks(ctrl, Job(Req(2)))


def _slow_probe(delay_s: float):
    """free_slots' probe of a suspect node, answering `delay_s` late: a loaded host whose
    raylet takes that long to start the probe's worker (CI's two cores under two test
    workers took longer than PING_S). Nested, so Ray ships it by value to the worker."""

    def probe():
        import time

        import ray

        time.sleep(delay_s)
        return ray.get_runtime_context().get_node_id()

    return probe


@pytest.mark.long  # real Ray with a killed or stopped rank: the second stage
def test_a_rank_process_killed_on_a_live_node_does_not_leave_the_engine_without_capacity(ray_local, monkeypatch):
    """A rank's process dies (SIGKILL: the OOM killer, a segfault) on a node that stays alive.
    Its node was suspected dead (rightly: Ray reports a dead node alive for a while), but the
    suspicion never ended, so the node's free devices never counted again: with its only rank
    gone, the replica could not be repaired and every request failed with NoCapacity although
    the node was alive with free slots. Then (CI, stop 51) the probe that ends the suspicion
    answered later than PING_S on a loaded host, and the request failed the same way: here
    the probe answers 2 s past PING_S."""
    import os
    import signal
    import time

    import ray

    import raydit.runtime.probing as probing
    from raydit.runtime.engine import Engine

    monkeypatch.setattr(probing, "node_id", _slow_probe(probing.PING_S + 2.0))
    engine = Engine(model="tiny", workers=1, device="cpu", grow="never", show_plan=False)
    try:
        engine.generate("a fox", num_inference_steps=2, seed=0, progress=False)
        member = engine.replicas[0].pool.members[0]
        os.kill(member.info["pid"], signal.SIGKILL)  # between requests
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                ray.get(member.actor.ping.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break
            time.sleep(0.2)
        result = engine.generate("a fox", num_inference_steps=2, seed=0, progress=False)
        assert result.latents is not None
        kinds = [e["event"] for e in engine.events]
        # Resumed on a fresh actor on the freed slot, in the request itself (not handed back).
        assert "regrouped" in kinds and "handed_back" not in kinds, engine.events
        from ray.util import placement_group_table

        assert placement_group_table(member.pg)["state"] == "REMOVED"  # the dead rank's reservation
        assert len(engine.replicas[0].pool.members) == 1
    finally:
        engine.shutdown()


@pytest.mark.long  # real Ray with a killed or stopped rank: the second stage
def test_a_stopped_rank_is_dropped_without_waiting_for_a_release_already_seen(ray_local, monkeypatch):
    """A rank stopped (SIGSTOP) mid-request is found silent by its deadline and dropped
    (its reservation removed) before the other calls settle; the wait for released devices
    then took the count of free devices after that removal as its baseline and waited the
    whole 10 s for one more device that never came, on every hang. And the rank found
    silent by the ping at the deadline was pinged again, waiting out PING_S a second time."""
    import os
    import signal
    import time

    import raydit.runtime.probing as probing
    from raydit.runtime.engine import Engine

    pings = []
    silent = probing.silent

    def counted(members, timeout_s):
        out = silent(members, timeout_s)
        pings.append(len(out))
        return out

    monkeypatch.setattr(probing, "silent", counted)

    engine = Engine(model="tiny", workers=2, device="cpu", grow="never", show_plan=False, step_timeout_s=3.0)
    stopped = []
    try:
        pool = engine.replicas[0].pool
        waits = []
        original = pool._drop_and_release

        def timed(lost, *args, **kwargs):
            t0 = time.monotonic()
            try:
                # The wait ends as soon as the release is seen; with the old baseline it never was
                # and the wait ran to its end. That end is put far off, so that only the bug
                # reaches it (a release slow to show on a loaded machine does not).
                return original(lost, *args, **{**kwargs, "wait_s": RELEASE_WAIT_S})
            finally:
                waits.append((len(lost), time.monotonic() - t0))

        pool._drop_and_release = timed
        step = pool.step
        calls = [0]

        def stop_then_step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                pid = pool.active[-1].info["pid"]
                stopped.append(pid)
                os.kill(pid, signal.SIGSTOP)
            return step(*args, **kwargs)

        pool.step = stop_then_step
        result = engine.generate("a fox", num_inference_steps=3, seed=0, progress=False)
        failures = [e for e in result.events if e["event"] == "failure"]
        assert failures and failures[0]["kind"] == "deadline", result.events
        dropped = [s for n, s in waits if n]
        assert dropped and max(dropped) < RELEASE_WAIT_S, waits  # the release was seen, not waited out
        assert sum(1 for n in pings if n) == 1, pings  # the silent rank waited for once
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        engine.shutdown()


class DecodeAlwaysLoses(DummyGroup):
    """Every decode loses a rank (on fresh workers each time)."""

    def decode(self, timeout_s=None):
        gone, self.members = self.members[:1], self.members[1:]
        raise WorkerFailure("injected loss in the decode", lost=gone)


def test_a_decode_failing_twice_is_stopped_naming_the_decode_not_a_step_past_the_last():
    group = DecodeAlwaysLoses(4, free=0)
    ctrl = Controller(group, replan_for, plan=replan_for(4))
    with pytest.raises(RequestFailed) as info:
        run_ticks(ctrl, Job(Req(2)))
    # A 2-step request has steps 0 and 1: "failed at step 2" named a step that does not exist.
    assert "the decode" in str(info.value) and "step 2" not in str(info.value), str(info.value)


@pytest.mark.long  # real Ray, probes that answer late: the second stage
def test_a_suspect_node_whose_probe_answers_late_counts_again_once_it_answers(ray_local, monkeypatch):
    """The probe of a suspect node that answers after PING_S, while the pool has ranks left,
    does not hold free_slots up past PING_S, and its answer is read by a later look: the
    node's devices count again (before, an unanswered probe was cancelled and the node left
    out until the next failure). With no rank left and no other free device, the look waits
    for the answer instead (the request depends on it)."""
    import time

    import raydit.runtime.probing as probing
    from raydit.runtime.cluster import free_slots
    from raydit.runtime.pool import WorkerPool

    delay = probing.PING_S + 8.0  # well past PING_S: a loaded host's slow look is not mistaken for a wait
    monkeypatch.setattr(probing, "node_id", _slow_probe(delay))
    node = next(iter(free_slots("CPU")))

    pool = WorkerPool(model_dir="unused", device="cpu", dtype="float32", placement_timeout_s=10.0)
    pool.members = ["a rank elsewhere"]  # not alone: the look does not wait for the late answer
    pool.suspect_nodes = {node}
    t0 = time.monotonic()
    assert node not in pool.free_slots()
    assert time.monotonic() - t0 < delay  # it gave up at PING_S, not at the answer
    assert node not in pool.free_slots()  # a second look neither waits nor asks again
    deadline = time.monotonic() + 120
    while node not in pool.free_slots():  # the late answer is read by a later look
        assert time.monotonic() < deadline, "the late probe's answer was never read"
        time.sleep(0.5)
    assert pool.suspect_nodes == set()

    alone = WorkerPool(model_dir="unused", device="cpu", dtype="float32", placement_timeout_s=10.0)
    alone.suspect_nodes = {node}  # no rank left, and the suspect node is all there is
    assert node in alone.free_slots()  # waited past PING_S for the answer
    assert alone.suspect_nodes == set()
    alone.close()
    pool.members = []
    pool.close()
