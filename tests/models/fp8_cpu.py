"""quantize "fp8" on the CPU, for tests: torchao's FP8 tensors and torch._scaled_mm's CPU kernel
compute the real mode's products there.

torchao: the venv's own (a GPU user's `pip install 'raydit[fp8]'`), else the copy that
scripts/setup.sh keeps apart in .venv/fp8-site, put on sys.path only by the tests that use it
(transformers and diffusers import torchao in every process where it is importable, and under a
CPU torch its CUDA extensions fail to load with warnings on stderr).

Two gates refuse the CPU because FP8 is slow there, not wrong: torchao's
`_check_hardware_support` and the Runner's `check_quantize_device`. `lift_fp8_gates` lifts
both in this process (with pytest's monkeypatch, for one test); `lifted` is a
raydit.parallel.testing.run_distributed worker that lifts them in a rank's own process and then
runs the worker named "module:function"."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parents[2] / ".venv" / "fp8-site"
INSTALLED = importlib.util.find_spec("torchao") is not None
TORCHAO = INSTALLED or (SITE / "torchao").is_dir()
WHY = "quantize fp8 needs torchao (pip install torchao, or bash scripts/setup.sh for .venv/fp8-site)"
# The two quantize modes as test parameters: fp8 skips, saying why, where torchao is missing.
MODES = ["fp8-sim", pytest.param("fp8", marks=pytest.mark.skipif(not TORCHAO, reason=WHY))]


def lift_fp8_gates(monkeypatch=None) -> None:
    """torchao importable and both gates open: for one test (`monkeypatch`: undone after it) or
    for the rest of this process (None: a rank's own process)."""
    if monkeypatch is None:
        if not INSTALLED and str(SITE) not in sys.path:
            sys.path.append(str(SITE))  # last: its wheel's other top-level folders shadow nothing
        patch = setattr
    else:
        if not INSTALLED:
            monkeypatch.setattr(sys, "path", [*sys.path, str(SITE)])
        patch = monkeypatch.setattr
    import torchao.quantization.quant_api as quant_api

    import raydit.models.prepare as prepare

    patch(quant_api, "_check_hardware_support", lambda granularities: None)
    patch(prepare, "check_quantize_device", lambda *args, **kwargs: None)


def lifted(rank: int, world_size: int, target: str, *args, **kwargs):
    lift_fp8_gates()
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(rank, world_size, *args, **kwargs)
