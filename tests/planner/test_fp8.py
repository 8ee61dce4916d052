"""The planner under quantize fp8: the blocks' FP8 weights priced at one byte each
(ModelSpec.fp8_params, counted against diffusers in tests/models/test_fp8_params.py), what fits
only that way, the devices without FP8 refused in one line, and the Engine's mode handed on."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from raydit.planner import PlanError, model_spec, plan
from raydit.planner.devicemodel import Mode
from raydit.planner.report import format_plan_table

FP8 = Mode(quantize="fp8")


@pytest.mark.parametrize("name", ["wan2.1-t2v-14b", "wan2.2-t2v-a14b", "hunyuanvideo", "ltx-2"])
def test_fp8_weights_cost_one_byte_each(name):
    """Same model, same request, same layout: the fp8 plan's weights and per-device peak are
    the bf16 plan's less one byte per FP8 weight (Wan 2.2 A14B: both experts' weights)."""
    spec = model_spec(name)
    bf16 = plan(name, gpus=8, gpu_type="H200", cfg=1, ulysses=8, ring=1, replicas=1, shard_weights=False)
    fp8 = plan(name, gpus=8, gpu_type="H200", cfg=1, ulysses=8, ring=1, replicas=1, mode=FP8)
    saved = spec.fp8_params * spec.experts * (spec.bytes_per_param - 1)
    assert spec.fp8_params > 0.6 * spec.params
    assert fp8.model.weight_bytes == pytest.approx(bf16.model.weight_bytes - saved, rel=1e-12)
    assert (bf16.best.offload_idle_gb, fp8.best.offload_idle_gb) == (0.0, 0.0) or name == "wan2.2-t2v-a14b"
    idle_saved = (spec.experts - 1) * spec.fp8_params * (spec.bytes_per_param - 1) / 1e9
    offloaded = bf16.best.offload_idle_gb > 0
    assert bf16.best.memory_gb_per_gpu - fp8.best.memory_gb_per_gpu == pytest.approx(
        (saved / 1e9 - idle_saved) if offloaded else saved / 1e9, rel=1e-6)
    # said in the table and the JSON; nothing of it in bf16
    assert f"{spec.fp8_params * spec.experts / 1e9:.2f} B of them FP8, one byte each" in format_plan_table(fp8)
    assert fp8.to_dict()["model"]["fp8_weight_params"] == spec.fp8_params * spec.experts
    assert "FP8" not in format_plan_table(bf16) and "fp8_weight_params" not in bf16.to_dict()["model"]


def test_a_model_that_fits_one_l4_only_in_fp8():
    """LTX-Video 13B (26 GB of bf16 transformer weights) cannot run on one 24 GB L4 in bf16;
    with its 12.9 B block weights in FP8 it fits, and the plan says so."""
    with pytest.raises(PlanError, match="the largest device offered \\(L4\\) has 24 GB"):
        plan("ltx-video-13b", gpus=1, gpu_type="L4")
    result = plan("ltx-video-13b", gpus=1, gpu_type="L4", mode=FP8)
    assert result.best.memory_gb_per_gpu < 24
    assert result.mode == FP8 and "mode fp8 GEMMs" in format_plan_table(result)


def test_fp8_on_devices_without_fp8_is_one_line():
    with pytest.raises(PlanError) as err:
        plan("wan2.1-t2v-1.3b", gpus=2, gpu_type="A100-80GB", mode=FP8)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("quantize fp8 needs FP8 tensor cores (compute capability 8.9 or newer: ")
    assert "which A100-80GB has not" in message and "H100" in message and "L4" in message
    # a cluster mixing them: the types without are named
    cluster = {"nodes": [{"gpu_type": "H100", "count": 2}, {"gpu_type": "A10G", "count": 2}]}
    with pytest.raises(PlanError, match="which A10G has not"):
        plan("wan2.1-t2v-1.3b", cluster=cluster, mode=FP8)
    # a type the table does not know is not refused (the runtime checks the GPU itself)
    x1 = {"name": "X1", "memory_gb": 96, "tflops": 500, "efficiency": 0.3, "link_gb_s": 100, "link_kind": "nvlink"}
    custom = {"nodes": [{"gpu_type": "X1", "count": 2}], "gpu_types": [x1]}
    assert plan("wan2.1-t2v-1.3b", cluster=custom, mode=FP8).best.world_size >= 1
    # one the cluster file says has none is
    custom["gpu_types"] = [dict(x1, fp8=False)]
    with pytest.raises(PlanError, match="which X1 has not"):
        plan("wan2.1-t2v-1.3b", cluster=custom, mode=FP8)


def test_fp8_refusal_on_the_command_line_exits_2():
    out = subprocess.run([sys.executable, "-m", "raydit.cli", "plan", "--model", "wan2.1-t2v-1.3b", "--gpus", "1",
                          "--gpu-type", "T4", "--quantize", "fp8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "which T4 has not" in lines[0]


def test_a_model_without_an_fp8_count_is_priced_at_bf16_bytes():
    spec = dataclasses.replace(model_spec("wan2.1-t2v-1.3b"), name="mine", fp8_params=0.0)
    bf16, fp8 = plan(spec, gpus=1, gpu_type="H100"), plan(spec, gpus=1, gpu_type="H100", mode=FP8)
    assert fp8.model.weight_bytes == bf16.model.weight_bytes
    assert fp8.best.memory_gb_per_gpu == bf16.best.memory_gb_per_gpu
    assert "its FP8 weights are not counted: priced at 2 bytes each" in format_plan_table(fp8)
    with pytest.raises(ValueError, match="fp8_params must be a number in 0..params"):
        dataclasses.replace(spec, fp8_params=spec.params * 1.01)


def test_the_plan_json_of_fp8_on_the_command_line():
    out = subprocess.run([sys.executable, "-m", "raydit.cli", "plan", "--model", "wan2.1-t2v-14b", "--gpus", "1",
                          "--gpu-type", "H200", "--quantize", "fp8", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    spec = model_spec("wan2.1-t2v-14b")
    assert doc["model"]["fp8_weight_params"] == spec.fp8_params
    assert doc["model"]["weights_gb"] == round((spec.weight_bytes - spec.fp8_params) / 1e9, 2)


def test_the_engines_runs_are_planned_in_their_mode():
    """raydit.planner.devicemodel.run_mode: what an Engine's quantize / attention /
    compile price as (fp8-sim emulates in the run's dtype; attention auto is chosen on the
    device and priced as bf16)."""
    from raydit.planner.devicemodel import run_mode

    assert run_mode("fp8", "auto", True) == Mode("fp8", "bf16", True)
    assert run_mode("fp8-sim", "int8", False) == Mode("none", "int8", False)
    assert run_mode("none", "fp8", False) == Mode("none", "fp8", False)
    assert run_mode(None, None, None) == Mode()
    # Full-precision steps: the mean step of a request of raydit's default 50 steps; the kept
    # bf16 weights only where a quantized mode keeps them (fp8-sim's too: priced as bf16).
    assert run_mode("fp8", "int8", True, 2) == Mode("fp8", "int8", True, keep_bf16=True,
                                                        full_precision_steps=2, steps=50)
    assert run_mode("none", "int8", False, 1) == Mode("none", "int8", False, full_precision_steps=1)
    assert run_mode("fp8-sim", "auto", False, 1).full_precision_share == 0.0


def test_full_precision_steps_on_the_command_line():
    """`raydit plan --full-precision-steps N --steps S`: the mean step of an S-step request
    with its first and last N in bf16, as the planner's Mode prices it; a bad S exits 2."""
    base = [sys.executable, "-m", "raydit.cli", "plan", "--model", "wan2.1-t2v-1.3b", "--gpus", "1",
            "--gpu-type", "H100", "--quantize", "fp8", "--compile", "--json"]
    out = subprocess.run(base + ["--full-precision-steps", "3", "--steps", "30"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    mode = Mode("fp8", compile=True, keep_bf16=True, full_precision_steps=3, steps=30)
    assert doc["mode"]["full_precision_steps"] == 3 and doc["mode"]["steps"] == 30
    assert doc["best"]["predicted_step_seconds"] == pytest.approx(
        plan("wan2.1-t2v-1.3b", gpus=1, gpu_type="H100", mode=mode).best.predicted_step_seconds, rel=1e-3)
    out = subprocess.run(base + ["--full-precision-steps", "1", "--steps", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--steps 0 must be a positive integer" in lines[0], out.stderr
