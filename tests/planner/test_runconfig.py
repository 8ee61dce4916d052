"""raydit.planner.runconfig: the run's modes checked once, frozen, the plan's share derived."""

from __future__ import annotations

import dataclasses

import pytest

from raydit.planner.devicemodel import Mode
from raydit.planner.runconfig import GroupModes, RunConfig


@pytest.mark.parametrize("kwargs, message", [
    ({"quantize": "int8"}, "quantize 'int8' is not a mode; use one of: none, fp8, fp8-sim"),
    ({"attention": "fp16"}, "attention 'fp16' is not a mode; use one of: bf16, auto, int8, fp8"),
    ({"compile": 1}, "compile 1 must be True or False"),
    ({"shard_weights": "yes"}, "shard_weights 'yes' must be True, False or None"),
    ({"fp8_granularity": "block"}, "fp8_granularity 'block' is not one of: row, tensor"),
    ({"full_precision_steps": -1}, "full_precision_steps -1 must be a whole number >= 0"),
    ({"full_precision_steps": 2}, "full_precision_steps 2 needs a quantized mode to leave"),
    ({"quantize": "fp8-sim", "full_precision_steps": 1, "shard_weights": True},
     "full_precision_steps 1 keeps every FP8 linear's unquantized weight"),
])
def test_bad_modes_are_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        RunConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_normalized_once_and_frozen():
    run = RunConfig(quantize="none", attention=None, full_precision_steps=None)
    assert (run.quantize, run.attention, run.full_precision_steps) == (None, "bf16", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.compile = True
    # kept unquantized weights are whole on every rank: the planner's choice becomes "never"
    assert RunConfig(quantize="fp8-sim", full_precision_steps=1).shard_weights is False


def test_mode_is_the_planners():
    run = RunConfig(quantize="fp8", attention="int8", compile=True, full_precision_steps=2)
    assert run.mode(steps=30) == Mode(quantize="fp8", attention="int8", compile=True, keep_bf16=True,
                                      full_precision_steps=2, steps=30)
    assert RunConfig(quantize="fp8-sim", attention="auto").mode() == Mode()  # priced as bf16


@dataclasses.dataclass
class _Plan:
    shard_weights: bool = False
    offload_idle_gb: float = 0.0
    audio_split_tokens: int | None = None


def test_group_modes_come_from_the_run_and_the_plan():
    plan = _Plan(shard_weights=True, offload_idle_gb=3.0, audio_split_tokens=64)
    assert RunConfig().for_group(plan, 2) == GroupModes(shard_weights=True, offload_idle=True,
                                                         parallel_options={"audio_split_tokens": 64})
    # one rank has nothing to share weights with, nor a sequence to split
    assert RunConfig(shard_weights=True).for_group(plan, 1) == GroupModes(offload_idle=True)
    assert not RunConfig(shard_weights=False).for_group(plan, 4).shard_weights
    assert RunConfig(shard_weights=True).for_group(_Plan(), 4).shard_weights
