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
