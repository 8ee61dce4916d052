"""WorkerPool.reset_group against a real local Ray: a rank whose process died after its
group broke is dropped with the survivors' reset, not chosen again by the next `form`."""

from __future__ import annotations

import pytest


@pytest.mark.long  # real Ray with a killed rank: the second stage
def test_a_rank_dead_by_the_reset_is_dropped_and_the_next_request_runs(ray_local):
    """Between a failure and the recovery's reset a second rank dies (a node's ranks do not
    all die in the same instant). Its `leave_group` call comes back at once with Ray's "actor
    died"; only a leaver that did not answer in time was dropped, so the dead one stayed a
    member, the recovery counted it a survivor and the next `form` chose it and failed: one
    more failure and regroup. Now it is dropped with its reservation, and the engine's next
    request runs on what is left."""
    import os
    import signal
    import time

    import ray
    from ray.util import placement_group_table

    from raydit.runtime.engine import Engine

    engine = Engine(model="tiny", workers=2, device="cpu", grow="never", show_plan=False)
    try:
        reference = engine.generate("a fox", num_inference_steps=2, seed=0, progress=False)
        pool = engine.replicas[0].pool
        assert len(pool.active) == 2
        dead, alive = pool.active[1], pool.active[0]
        os.kill(dead.info["pid"], signal.SIGKILL)
        deadline = time.time() + 60
        while time.time() < deadline:  # until Ray itself reports the actor dead
            try:
                ray.get(dead.actor.ping.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                pass
            time.sleep(0.2)
        pool.reset_group()
        assert pool.members == [alive] and pool.active == []
        assert placement_group_table(dead.pg)["state"] == "REMOVED"
        result = engine.generate("a fox", num_inference_steps=2, seed=0, progress=False)
        assert result.plan.world_size == 1
        # One rank runs the same request as two did, within the runtime tests' float32 bound.
        import torch

        torch.testing.assert_close(torch.from_numpy(result.latents), torch.from_numpy(reference.latents),
                                   rtol=1e-4, atol=1e-4)
    finally:
        engine.shutdown()
