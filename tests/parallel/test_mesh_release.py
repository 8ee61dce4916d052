"""Meshes built one after another release their gloo groups: threads stay bounded.

Each gloo group runs its own threads; the conformance harness builds a mesh per plan (about a
hundred per spawned rank), and without release_mesh the ranks ended with ~900 threads each,
hundreds runnable, and starved the machine.
"""

from __future__ import annotations

import os

from raydit.parallel.testing import run_distributed


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _build_many(rank: int, world: int, release: bool) -> tuple[int, int]:
    from raydit.models.conformance import MeshPlan, prefix_mesh
    from raydit.parallel.mesh import build_mesh

    plans = [MeshPlan(2, 1), MeshPlan(1, 2), MeshPlan(1, 1, 2)]
    prefix_mesh(plans[0])
    before = _threads()
    for _ in range(10):
        for plan in plans:
            if release:
                prefix_mesh(plan)
            else:
                build_mesh(plan.ulysses, plan.ring, plan.cfg, ranks=[0, 1])
    return before, _threads()


def test_prefix_meshes_release_their_groups():
    for before, after in run_distributed(_build_many, 2, True, timeout=300):
        assert after - before <= 4, (before, after)


def test_without_release_threads_pile_up():
    """The check above can fail: building without releasing grows by threads per group."""
    for before, after in run_distributed(_build_many, 2, False, timeout=300):
        assert after - before >= 30, (before, after)



def _rejoin_after_a_failed_join(rank: int, world: int) -> tuple[str, float]:
    """Rank 1 fails to join a group whose peer never comes (a peer that died mid-join). Then
    both ranks join a fresh group together, as a regroup does: first without resetting
    torch's group counter (which the failed join left raised), then with it."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from raydit.parallel.mesh import leave_default_group

    def store(port=0, master=True, seconds=20):
        return dist.TCPStore("127.0.0.1", port, is_master=master, wait_for_workers=False,
                             timeout=timedelta(seconds=seconds))

    stores = [store(seconds=60) if rank == 0 else None for _ in range(2)]  # the next groups', on rank 0
    ports = [s.port if s is not None else None for s in stores]
    dist.broadcast_object_list(ports, src=0)
    leave_default_group()
    if rank == 1:
        try:
            dist.init_process_group("gloo", store=store(seconds=2), rank=0, world_size=2,
                                    timeout=timedelta(seconds=2))
        except Exception:  # noqa: BLE001 - the expected rendezvous timeout
            pass
        else:
            raise AssertionError("a join without its peer formed a group")

    def join(attempt, seconds):
        mine = stores[attempt] if rank == 0 else store(ports[attempt], master=False, seconds=60)
        dist.init_process_group("gloo", store=mine, rank=rank, world_size=2, timeout=timedelta(seconds=seconds))

    try:
        join(0, 5)  # fails whatever the timing: 5 s keeps the test short
        first = "joined"
    except Exception as exc:  # noqa: BLE001 - named groups "0" and "1": each waits for the other
        first = type(exc).__name__ + ": " + str(exc)[:80]
    leave_default_group()  # what RankWorker.join_group does first
    # Must succeed: a generous timeout, since rank 1 reaches it about 2 s after rank 0 (its
    # failed join first) and a loaded machine adds seconds more (5 s here once timed out).
    join(1, 60)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return first, total.item()


def test_a_rank_whose_join_failed_joins_the_next_group_after_the_reset():
    """Without the reset the join after a failed one times out on both ranks (this shows the
    check can fail); after leave_default_group the same two ranks form a group."""
    results = run_distributed(_rejoin_after_a_failed_join, 2, timeout=120)
    for first, total in results:
        assert "timeout" in first.lower(), first
        assert total == 3.0


def _wait_on_a_silent_peer(rank: int, world: int, seconds, done: str) -> str:
    import time
    from datetime import timedelta
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from raydit.parallel.mesh import build_mesh

    mesh = build_mesh(ulysses=2, timeout=None if seconds is None else timedelta(seconds=seconds))
    if rank == 1:
        # Alive, connected, never joining the collective (a wedged peer) until rank 0's call
        # has ended: what ended it was not this peer leaving. Limit: whole minutes.
        deadline = time.monotonic() + 90
        while not Path(done).exists():
            if time.monotonic() > deadline:
                return "rank 0 still waiting after 90 s"
            time.sleep(0.05)
        return "silent"
    try:
        dist.all_reduce(torch.ones(1), group=mesh.ulysses_group)
    except Exception as exc:  # noqa: BLE001 - gloo's timeout
        return f"raised: {type(exc).__name__}"
    finally:
        Path(done).touch()
    return "completed"


def test_axis_groups_take_the_timeout_they_are_given(tmp_path):
    """build_mesh passes its timeout to every axis group: a collective whose peer never comes
    raises after it (torch's own default for a new gloo group is 30 minutes), while the peer
    is still there."""
    waited, silent = run_distributed(_wait_on_a_silent_peer, 2, 2, str(tmp_path / "done"), timeout=120)
    assert silent == "silent" and waited.startswith("raised"), (waited, silent)
