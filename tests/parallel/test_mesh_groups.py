"""Mesh rank order and group lists (pure, no processes); the live groups are tested in test_sp_distributed."""

import itertools

import pytest

from raydit.parallel.mesh import mesh_groups, mesh_rank_of


def test_design_doc_example():
    # ulysses 2 x ring 2 x cfg 2: Ulysses groups are neighbours, ring groups stride by 2.
    groups = mesh_groups(2, 2, 2)
    assert groups["ulysses"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ring"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["sp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["cfg"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("U, R, C, P", list(itertools.product([1, 2, 3], [1, 2, 3], [1, 2], [1, 2])))
def test_every_axis_partitions_the_ranks(U, R, C, P):
    world = U * R * C * P
    degree = {"ulysses": U, "ring": R, "sp": U * R, "cfg": C}
    coords = {
        mesh_rank_of(U, R, C, rep, c, r, u): (rep, c, r, u)
        for rep, c, r, u in itertools.product(range(P), range(C), range(R), range(U))
    }
    assert sorted(coords) == list(range(world))
    free = {"ulysses": {3}, "ring": {2}, "sp": {2, 3}, "cfg": {1}}
    for axis, groups in mesh_groups(U, R, C, P).items():
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:
            assert len(g) == degree[axis] and g == sorted(g)
            # Members agree on every coordinate but the axis' own.
            fixed = [j for j in range(4) if j not in free[axis]]
            assert len({tuple(coords[r][j] for j in fixed) for r in g}) == 1
