"""The request queue (raydit.runtime.queue) without Ray, as test_queue.py drives it: cases an
audit of the dispatcher found."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from raydit.runtime.errors import NoCapacity
from raydit.runtime.queue import Dispatcher, Item


@dataclass(frozen=True)
class Plan:
    predicted_step_seconds: float


@dataclass
class R:
    index: int
    plan: Plan
    busy: bool = False
    in_rotation: bool = True


def test_no_capacity_is_answered_even_when_the_cluster_cannot_say_what_is_left():
    """The no-capacity answer names what is left (the Engine asks Ray for the free devices);
    when that question raised (Ray's state API unreachable), it escaped the dispatcher's loop:
    the request's future was never resolved and the loop's thread was gone, so every later
    request hung too."""
    def capacity():
        raise ConnectionError("GCS unreachable")

    d = Dispatcher([R(0, Plan(1.0), in_rotation=False)], execute=lambda r, i: "ran", repair=lambda r: False,
                   capacity=capacity)
    try:
        for name in ("a", "b"):
            with pytest.raises(NoCapacity, match="unknown: ConnectionError: GCS unreachable"):
                d.put(Item(request=name, future=Future())).result(timeout=30)
    finally:
        d.close(join_s=5)
