"""Killing a rank's Ray actor from a test, shared by the runtime and Engine tests."""

from __future__ import annotations

import time


def kill_and_wait(actor, timeout: float = 60) -> None:
    """Kill `actor` and return once it no longer answers (ray.kill returns before the actor is
    dead, and a request could finish on it first)."""
    import ray

    ray.kill(actor, no_restart=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.GetTimeoutError:
            continue  # a slow answer (a loaded machine) does not say it is gone: ask again
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.2)
    raise AssertionError("the killed actor still answers")


def kill_at_step(actor, at: int):
    """A callback_on_step_end that kills `actor` (and waits until it is gone) when step `at` ends."""

    def callback(engine, step, timestep, kwargs):
        if step == at:
            kill_and_wait(actor)
        return kwargs

    return callback
