"""quantize "fp8" on the CPU, for tests: torchao's FP8 tensors and torch._scaled_mm's CPU kernel
compute the real mode's products there. Two gates refuse the CPU because FP8 is slow there,
not wrong: torchao's `_check_hardware_support` and the Runner's `check_quantize_device`.
`lift_fp8_gates` lifts both in this process (with pytest's `monkeypatch.setattr`, for one
test); `lifted` is a raydit.parallel.testing.run_distributed worker that lifts them in a rank's
own process and then runs the worker named "module:function"."""

from __future__ import annotations

import importlib
import importlib.util

TORCHAO = importlib.util.find_spec("torchao") is not None


def lift_fp8_gates(patch=setattr) -> None:
    import torchao.quantization.quant_api as quant_api

    import raydit.models.runner as runner

    patch(quant_api, "_check_hardware_support", lambda granularities: None)
    patch(runner, "check_quantize_device", lambda *args, **kwargs: None)


def lifted(rank: int, world_size: int, target: str, *args, **kwargs):
    lift_fp8_gates()
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(rank, world_size, *args, **kwargs)
