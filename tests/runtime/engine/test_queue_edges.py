"""The request queue (raydit.runtime.queue) without Ray, as test_queue.py drives it: cases an
audit of the dispatcher found."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from raydit.runtime.errors import NoCapacity
from raydit.runtime.queue import Dispatcher, Item

from support.replicas import Plan, R



def _runner(execute):
    """The dispatcher hands each item to a runner part: this one runs `execute(replica, item)`."""
    return SimpleNamespace(run=lambda replica, item, queue: execute(replica, item))

def test_no_capacity_is_answered_even_when_the_cluster_cannot_say_what_is_left():
    """The no-capacity answer names what is left (the Engine asks Ray for the free devices);
    when that question raised (Ray's state API unreachable), it escaped the dispatcher's loop:
    the request's future was never resolved and the loop's thread was gone, so every later
    request hung too."""
    def capacity():
        raise ConnectionError("GCS unreachable")

    d = Dispatcher([R(0, Plan(1.0), in_rotation=False)], _runner(lambda r, i: "ran"), repair=lambda r: False,
                   capacity=capacity)
    try:
        for name in ("a", "b"):
            with pytest.raises(NoCapacity, match="unknown: ConnectionError: GCS unreachable"):
                d.put(Item(request=name, future=Future())).result(timeout=30)
    finally:
        d.close(join_s=5)


def test_a_handed_back_request_waiting_at_shutdown_is_told_it_did_not_finish():
    """A request handed back with its progress and waiting for a replica when the engine shut
    down was failed with "before the request ran": it had run (its steps up to the hand-back)."""
    import threading
    import time

    from raydit.runtime.controller import Job
    from raydit.runtime.errors import HandBack

    release = threading.Event()
    replicas = [R(0, Plan(1.0)), R(1, Plan(2.0))]

    def execute(replica, item):
        if item.request == "long":
            release.wait(30)
            return "long done"
        item.job = item.job or Job(request=item.request)
        item.job.step_index = 2
        raise HandBack("no workers are left alive")

    d = Dispatcher(replicas, _runner(execute), repair=lambda r: False, capacity=lambda: "none")
    long = d.put(Item(request="long", future=Future()))  # replica 0 (the faster)
    handed = d.put(Item(request="handed", future=Future()))  # replica 1, which hands it back
    deadline = time.time() + 30
    while replicas[1].in_rotation or replicas[1].busy:
        assert time.time() < deadline, "never handed back"
        time.sleep(0.01)
    closer = threading.Thread(target=d.close, kwargs={"join_s": 30})
    closer.start()
    with pytest.raises(RuntimeError, match="engine shut down before the request finished"):
        handed.result(timeout=30)
    release.set()
    closer.join(30)
    assert long.result(timeout=30) == "long done"


def test_take_matching_without_passing_stops_at_a_waiting_request_of_another_kind_but_not_a_cancelled_one():
    """take_matching(passing=False), what a batch whose first request has left asks for: the
    matching requests ahead of the first one of another kind that still waits; one cancelled
    while it waited does not hold them back."""
    d = Dispatcher([R(0, Plan(1.0), busy=True)], _runner(lambda r, i: "ran"), repair=lambda r: False,
                   capacity=lambda: "none")
    items = {name: Item(request=name, future=Future()) for name in ("k1", "x-cancelled", "k2", "x", "k3")}
    with d.cond:
        d._items.extend(items.values())
    items["x-cancelled"].future.cancel()
    try:
        taken = d.take_matching(lambda r: r.startswith("k"), 5, passing=False)
        assert [i.request for i in taken] == ["k1", "k2"]
        assert [i.request for i in d.take_matching(lambda r: r.startswith("k"), 5)] == ["k3"]
    finally:
        d.close(join_s=5)
