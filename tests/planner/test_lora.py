"""The planner counts LoRA adapters: a spec's `adapter_bytes` (measured by the runtime from the
LoRA files, raydit.models.lora.adapter_bytes) adds exactly that much to every plan's per-rank
memory, and can make a layout that fitted no longer fit. Pure: no torch, no Ray."""

from __future__ import annotations

import dataclasses

import pytest

from raydit.planner import PlanError, model_spec, plan
from raydit.planner.cost import GB


def _layouts(result):
    return {(p.cfg, p.ulysses, p.ring, p.replicas): p.memory_gb_per_gpu for p in result.candidates}


@pytest.mark.parametrize("model, gpus", [("cogvideox-2b", 8), ("wan2.2-t2v-a14b", 4)])
def test_adapter_bytes_add_exactly_their_size_to_every_layout(model, gpus):
    spec = model_spec(model)
    adapters = 3 * 153_092_096  # e.g. three rank-64 LoRAs of Wan's attention, bf16
    with_lora = dataclasses.replace(spec, adapter_bytes=float(adapters))
    base = _layouts(plan(spec, gpus=gpus, gpu_type="H100"))
    more = _layouts(plan(with_lora, gpus=gpus, gpu_type="H100"))
    assert base.keys() == more.keys() and base
    for layout, gb in base.items():
        assert more[layout] - gb == pytest.approx(adapters / GB, rel=1e-9, abs=1e-12), layout
    assert with_lora.weight_bytes - spec.weight_bytes == adapters


def test_adapters_that_do_not_fit_reject_the_layout():
    spec = model_spec("cogvideox-2b")
    fits = plan(spec, gpus=1, gpu_type="H100").best.memory_gb_per_gpu
    too_big = dataclasses.replace(spec, adapter_bytes=(100.0 - fits) * GB)
    with pytest.raises(PlanError):
        plan(too_big, gpus=1, gpu_type="H100")


@pytest.mark.parametrize("value", [-1.0, "1e9", True, float("nan")])
def test_bad_adapter_bytes_are_refused(value):
    with pytest.raises(ValueError, match="adapter_bytes must be a number >= 0"):
        dataclasses.replace(model_spec("cogvideox-2b"), adapter_bytes=value)
