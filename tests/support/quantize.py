"""What the quantize tests compare: requests batched against each alone, under a mode."""

from __future__ import annotations

import torch


def assert_batched_as_alone(out: dict, mode: str) -> None:
    """out[(m, "batched" / "alone")]: each request's latents batched and alone, unquantized (m
    None) and under `mode`. Where the unquantized batch equals its requests alone bit for bit
    (the same ops per row), so must the mode's (per-token scales: a neighbour changes none);
    at least one request must be such."""
    exact = 0
    for i, (batched, alone) in enumerate(zip(out[None, "batched"], out[None, "alone"])):
        if torch.equal(batched, alone):
            assert torch.equal(out[mode, "batched"][i], out[mode, "alone"][i]), f"request {i}"
            exact += 1
    assert exact > 0
