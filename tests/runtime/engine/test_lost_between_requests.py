"""A rank that dies between two requests is found before the next one runs on it: the replica
regroups on what is left without a failed call (before, the next request's first call failed on
the dead rank, was settled and classified, and counted toward that request's repeat rule)."""

from __future__ import annotations

import os
import signal
import time

import pytest


def _wait_dead(actor, seconds: float = 30.0) -> None:
    """Until Ray answers for the killed actor (a ping raises), so the next request finds it dead."""
    import ray

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.2)
    raise AssertionError("the killed rank still answers")


@pytest.mark.long  # real Ray, two ranks, a killed process: the second stage
def test_a_rank_dead_between_requests_is_dropped_before_any_call_fails(ray_local):
    from raydit.runtime.engine import Engine

    engine = Engine(model="tiny", workers=2, device="cpu", grow="never", show_plan=False)
    try:
        first = engine.generate("a fox", num_inference_steps=2, seed=0, progress=False)
        pool = engine.replicas[0].pool
        dead = pool.active[1]
        os.kill(dead.info["pid"], signal.SIGKILL)  # between requests
        _wait_dead(dead.actor)
        second = engine.generate("a fox", num_inference_steps=2, seed=0, progress=False)
        kinds = [e["event"] for e in second.events]
        assert "failure" not in kinds, second.events  # no call failed on the dead rank
        assert kinds.index("rank_lost") < kinds.index("regrouped"), second.events
        assert dead not in pool.members and second.plan.world_size == 1
        assert first.latents.shape == second.latents.shape
    finally:
        engine.shutdown()
