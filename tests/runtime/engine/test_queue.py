"""The request queue (raydit.runtime.queue) without Ray: replicas are plain objects and
`execute` is a function, so hand-backs, repairs and the no-capacity answer are driven
exactly. Durable progress files are real files written with torch.save."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from raydit.runtime.controller import Job
from raydit.runtime.errors import HandBack, NoCapacity
from raydit.runtime.queue import Dispatcher, Item, load_progress, save_progress

from support.replicas import Plan, R


def _item(name):
    return Item(request=name, future=Future())



def _runner(execute):
    """The dispatcher hands each item to a runner part: this one runs `execute(replica, item)`."""
    return SimpleNamespace(run=lambda replica, item, queue: execute(replica, item))

def test_a_handed_back_request_resumes_on_another_replica_with_its_progress():
    replicas = [R(0, Plan(1.0)), R(1, Plan(2.0))]
    ran = []

    def execute(replica, item):
        if item.job is None:
            item.job = Job(request=item.request)
        ran.append((replica.index, item.request, item.job.step_index))
        if replica.index == 0 and item.request == "a":
            item.job.step_index = 3  # progress made before the replica lost its ranks
            raise HandBack("no workers are left alive")
        return (item.request, replica.index)

    d = Dispatcher(replicas, _runner(execute), repair=lambda r: False, capacity=lambda: "none")
    a = d.put(_item("a"))
    assert a.result(timeout=10) == ("a", 1)
    assert ran == [(0, "a", 0), (1, "a", 3)]  # resumed at step 3, not from scratch
    assert not replicas[0].in_rotation
    # Replica 0 stays out of rotation (its repair fails); replica 1 serves the rest.
    assert d.put(_item("b")).result(timeout=10) == ("b", 1)
    d.close()


def test_a_repaired_replica_comes_back_into_rotation():
    replicas = [R(0, Plan(1.0), in_rotation=False)]
    repairs = []

    def repair(r):
        repairs.append(r.index)
        return len(repairs) >= 1

    d = Dispatcher(replicas, _runner(lambda r, item: item.request), repair=repair, capacity=lambda: "none")
    assert d.put(_item("x")).result(timeout=10) == "x"
    assert repairs == [0] and replicas[0].in_rotation
    d.close()


def test_no_replica_and_no_repair_fails_with_no_capacity_instead_of_waiting():
    replicas = [R(0, Plan(1.0)), R(1, Plan(1.0))]

    def execute(replica, item):
        raise HandBack("no workers are left alive")

    d = Dispatcher(replicas, _runner(execute), repair=lambda r: False, capacity=lambda: "replica 0: 0 rank(s); 0 free")
    fut = d.put(_item("x"))
    with pytest.raises(NoCapacity, match="no workers are left alive and no free devices.*replica 0: 0 rank"):
        fut.result(timeout=10)
    d.close()


def test_requests_run_in_submission_order_each_once_across_replicas():
    replicas = [R(0, Plan(1.0)), R(1, Plan(1.0))]
    seen, lock = [], threading.Lock()
    gate = threading.Event()

    def execute(replica, item):
        gate.wait(5)
        with lock:
            seen.append(item.request)
        return item.request

    d = Dispatcher(replicas, _runner(execute), repair=lambda r: False, capacity=lambda: "")
    futures = [d.put(_item(i)) for i in range(6)]
    gate.set()
    assert [f.result(timeout=10) for f in futures] == list(range(6))
    assert sorted(seen) == list(range(6))
    d.close()


def test_progress_is_written_atomically_and_read_back(tmp_path):
    import torch

    ckpt = {"latents": torch.arange(6.0).reshape(1, 6), "step_index": 2}
    path = save_progress(str(tmp_path / "job"), {"prompt": "a fox"}, ckpt)
    assert [p.name for p in path.parent.iterdir()] == ["progress.pt"]  # no temporary left
    request, back = load_progress(str(tmp_path / "job"))
    assert request == {"prompt": "a fox"} and back["step_index"] == 2
    torch.testing.assert_close(back["latents"], ckpt["latents"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="no saved progress"):
        load_progress(str(tmp_path / "nothing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "progress.pt").write_text("not torch")
    with pytest.raises(ValueError, match="not a raydit progress file"):
        load_progress(str(tmp_path / "bad"))


def test_the_request_waiting_at_the_head_of_the_queue_can_be_cancelled():
    """Only a replica taking a request makes it running: the head of the queue, waiting for a
    busy replica, was marked running at once, so a DELETE (future.cancel()) could not stop it
    and it ran to its first step."""
    replicas = [R(0, Plan(1.0))]
    gate, ran = threading.Event(), []

    def execute(replica, item):
        ran.append(item.request)
        if item.request == "busy":
            gate.wait(10)
        return item.request

    d = Dispatcher(replicas, _runner(execute), repair=lambda r: False, capacity=lambda: "")
    busy = d.put(_item("busy"))
    waiting = d.put(_item("waiting"))
    after = d.put(_item("after"))
    deadline = time.monotonic() + 60  # the replica has taken "busy": "waiting" is at the head
    while not ran and time.monotonic() < deadline:  # (threads slow to run on a loaded machine)
        threading.Event().wait(0.01)
    for _ in range(50):  # the dispatcher's turn at the head: it must leave it pending
        if waiting.running():
            break
        threading.Event().wait(0.01)
    assert ran == ["busy"] and waiting.cancel()
    gate.set()
    assert busy.result(timeout=10) == "busy" and after.result(timeout=10) == "after"
    assert waiting.cancelled() and ran == ["busy", "after"]
    d.close()


def test_a_request_is_answered_after_its_replica_is_free_again():
    """Whoever sees a request's result (a done callback, a caller submitting the next request
    at once) sees its replica idle: the answer comes after the replica is marked free, for a
    result and for an error alike."""
    replicas = [R(0, Plan(1.0))]

    def execute(replica, item):
        if item.request == "bad":
            raise ValueError("a request the worker refuses")
        return item.request

    d = Dispatcher(replicas, _runner(execute), repair=lambda r: False, capacity=lambda: "none")
    seen = []
    for name in ("a", "bad"):
        item = _item(name)
        item.future.add_done_callback(lambda f: seen.append(replicas[0].busy))
        future = d.put(item)
        if name == "bad":
            with pytest.raises(ValueError, match="refuses"):
                future.result(timeout=10)
        else:
            assert future.result(timeout=10) == "a"
    d.close()
    assert seen == [False, False]
