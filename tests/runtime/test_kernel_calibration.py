"""The attention kernel in the calibration cache and in `raydit doctor` (no Ray, no GPU)."""

import json

import pytest
import torch

from raydit.parallel import kernels

H100_NAME = "NVIDIA H100 80GB HBM3"
# What `raydit doctor --calibrate` stores for a GPU type (measure_dit's attention keys),
# figures from an H200-like machine; fa3 installed but dropped by the float64 check.
MEASURED = {
    "matmul_tflops": 700.0, "dit_linear_tflops": 500.0, "matmul_dtype": "bfloat16",
    "attention_kernel": "torch-cudnn",
    "attention_kernel_by_head_dim": {"64": "torch-cudnn", "128": "torch-cudnn"},
    "attention_tflops_by_head_dim": {"64": 427.0, "128": 593.0},
    "attention_rates_by_head_dim": {"64": {"torch-cudnn": 427.0, "torch-flash": 320.0, "torch-efficient": 136.0},
                                    "128": {"torch-cudnn": 593.0, "torch-flash": 351.0, "torch-efficient": 178.0}},
    "attention_plain_tflops_by_head_dim": {"64": 433.0, "128": 587.0},
    "attention_dropped_by_head_dim": {"128": {"fa3": "lse off by 0.693 (tolerance 0.002)"}},
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from raydit.runtime import calibration_cache

    monkeypatch.setenv("RAYDIT_CACHE", str(tmp_path))
    calibration_cache.save_calibration({"H100": {"name": "H100", "device": "cuda", "device_name": H100_NAME,
                                         "measured": MEASURED, "host": "gpu-1", "when": "2026-11-26"}})
    kernels.forget_choices()
    yield tmp_path / "calibration.json"
    kernels.forget_choices()


def test_cache_round_trip_of_the_chosen_kernel_and_every_rate(cache):
    from raydit.runtime import calibration_cache

    assert json.loads(cache.read_text())["version"] == calibration_cache.CACHE_VERSION == 1  # keys added, none changed
    m = calibration_cache.load_calibration()["H100"]["measured"]
    assert m["attention_kernel_by_head_dim"] == MEASURED["attention_kernel_by_head_dim"]
    assert m["attention_rates_by_head_dim"] == MEASURED["attention_rates_by_head_dim"]
    # A worker on a GPU of that name gets the per-kernel rates; another GPU gets none (it probes).
    entries = calibration_cache.load_calibration()
    assert calibration_cache.kernel_rates_for(entries, H100_NAME) == {
        int(d): r for d, r in MEASURED["attention_rates_by_head_dim"].items()}
    assert calibration_cache.kernel_rates_for(entries, "NVIDIA A100-SXM4-80GB") == {}
    # The planner: the chosen kernel's rate for rings, SDPA's for ring 1, the linear part apart.
    dev = calibration_cache.calibrated_device_type("H100")
    assert dev.tflops == 700.0 and dev.flops_per_second == pytest.approx(500e12)
    assert dev.attention_flops_per_second(64) == pytest.approx(427e12)
    assert dev.attention_flops_per_second(128) == pytest.approx(593e12)
    assert dev.attention_flops_per_second(128, lse=False) == pytest.approx(587e12)


def test_an_entry_from_before_the_kernel_split_still_reads(tmp_path):
    from raydit.runtime import calibration_cache

    path = tmp_path / "c.json"
    old = {"matmul_tflops": 700.0, "dit_linear_tflops": 500.0, "attention_kernel": "torch-cuda",
           "attention_tflops_by_head_dim": {"64": 300.0, "128": 350.0}}
    calibration_cache.save_calibration({"H100": {"name": "H100", "device": "cuda", "device_name": H100_NAME,
                                         "measured": old}}, path)
    dev = calibration_cache.calibrated_device_type("H100", path)
    assert dev.attention_flops_per_second(64, lse=False) == pytest.approx(300e12)  # no plain figure
    assert calibration_cache.kernel_rates_for(calibration_cache.load_calibration(path), H100_NAME) == {}
    [line] = calibration_cache.describe_calibration(path)
    assert "attention (torch-cuda) d64 300, d128 350" in line


def test_calibration_seeds_the_choice_with_its_rates():
    """What seed_kernel_choices does on a GPU, on the CPU: the cached rates decide, the
    kernels still pass the float64 check, the choice says where the rates came from."""
    kernels.forget_choices()
    try:
        choice = kernels.use_measured_rates("cpu", torch.float32, 64, {"torch-cpu": 0.1, "fa3": 900.0})
        assert (choice.name, choice.why) == ("torch-cpu", "calibration")
        assert dict(choice.rates) == {"torch-cpu": 0.1}  # rates of kernels that cannot run here are ignored
        assert kernels.default_kernel("cpu", torch.float32, 64).name == "torch-cpu"
    finally:
        kernels.forget_choices()


def test_doctor_names_the_kernel_of_each_head_dim_and_why(cache):
    from raydit.doctor import _kernel_line, collect, format_report

    text = format_report(collect())
    # The cached GPU type: per head dim the kernel, its rate and the others', SDPA's, what was dropped.
    assert ("attention d64 torch-cudnn 427 TFLOP/s (fastest of torch-cudnn 427, torch-flash 320, "
            "torch-efficient 136; ring 1: sdpa 433)") in text
    assert "attention d128 torch-cudnn 593 TFLOP/s" in text and "fa3 dropped: lse off by 0.693" in text
    # This machine's own kernels, per head dim (a CPU: one candidate).
    assert "cpu float32 d64: torch-cpu (only candidate)" in text
    assert "cpu float32 d128: torch-cpu (only candidate)" in text
    # A GPU machine's line names the CUDA choice per head dim (as describe_kernels gives it there).
    gpu = {"cuda": {"dtype": "bfloat16", "selected": "torch-cudnn", "by_head_dim": {
        "64": {"kernel": "torch-cudnn", "text": "torch-cudnn (calibration: torch-cudnn 427, torch-flash 320 TFLOP/s)"},
        "128": {"kernel": "torch-flash", "text": "torch-flash (probe: torch-flash 400, torch-cudnn 390 TFLOP/s; "
                                                "torch-cudnn dropped: RuntimeError: no graph)"}}},
        "cpu": {"dtype": "float32", "selected": "torch-cpu",
                "by_head_dim": {"64": {"kernel": "torch-cpu", "text": "torch-cpu (only candidate)"}}}}
    line = _kernel_line(gpu)
    assert line.index("cuda bfloat16 d64: torch-cudnn (calibration") < line.index("cuda bfloat16 d128: torch-flash (probe")
    assert line.index("cuda bfloat16 d128") < line.index("cpu float32 d64: torch-cpu")
