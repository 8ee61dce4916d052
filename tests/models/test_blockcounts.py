"""Each family's elementwise launches (and the bytes of those whose count comes from it) are what
bench/bench_blockcounts.py counts on the family's own tiny forward case (the figures the planner
prices a step's elementwise work and launches with: raydit.planner.devicemodel)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_blockcounts  # noqa: E402

from raydit.models.registry import families  # noqa: E402

# Counted at real width on diffusers' blocks before this tool (bench_opsweep --count-blocks),
# kept: the tool's tiny-width count differs by up to 8% (Wan 385 against 419).
BYTES_COUNTED_ELSEWHERE = {"cogvideox", "wan", "hunyuanvideo"}


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(bench_blockcounts.CASES))
def test_family_counts_are_the_tools(name):
    family = families()[name]
    got = bench_blockcounts.count_family(name)
    assert family.elementwise_launches == got["elementwise_launches"], (name, got)
    if name not in BYTES_COUNTED_ELSEWHERE:
        assert family.elementwise_bytes == pytest.approx(got["elementwise_bytes"], rel=1e-3), (name, got)
