"""Mesh layouts: the (ulysses, ring, cfg) degrees a model can run on some devices (pure Python).

One enumerator for every place that walks layouts: the planner's search judges the layouts of
its cfg degrees, `raydit verify` runs every layout of up to its workers against one worker,
and the conformance suite every plan of a world size against one process.
"""

from __future__ import annotations


def cfg_degrees(branches: int) -> list[int]:
    """The cfg degrees that share `branches` guidance branches evenly (its divisors): each of
    the cfg groups evaluates an equal share of a step's branches."""
    return [d for d in range(1, max(branches, 1) + 1) if branches % d == 0]


def cfg_degrees_text(branches: int) -> str:
    """The cfg degrees that share `branches` evenly, as words."""
    return " or ".join(f"cfg {d}" for d in cfg_degrees(branches))


def mesh_layouts(heads: int, world_size: int, cfgs=(1,), exact: bool = True) -> list[tuple[int, int, int]]:
    """Every (ulysses, ring, cfg) with cfg one of `cfgs`, ulysses dividing the `heads` and
    ulysses x ring x cfg equal to `world_size` (`exact`) or at most it; in the order of `cfgs`,
    then of ulysses, then of ring."""
    out = []
    for cfg in cfgs:
        for ulysses in range(1, world_size // cfg + 1):
            if heads % ulysses:
                continue
            rings = world_size // (cfg * ulysses)
            if not exact:
                out += [(ulysses, ring, cfg) for ring in range(1, rings + 1)]
            elif ulysses * rings * cfg == world_size:
                out.append((ulysses, rings, cfg))
    return out
