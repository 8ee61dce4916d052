"""quantize="fp8" on a GPU (torchao's FP8 layers) against fp8-sim, the same numbers emulated.

Rule: both round weights (per row, fixed) and activations (per token, dynamic) to e4m3 with the
same scales; they differ in how the FP8 GEMM accumulates and where bf16 rounds, so fp8 is held
to a quarter of fp8-sim's own error against the unquantized bf16 forward, measured in the same
test; and fp8 must differ from bf16 (the layers really were replaced). Skipped without CUDA
compute capability 8.9+ or without torchao.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from raydit.models import conformance as harness
from raydit.models.precision import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU with FP8 (compute capability 8.9+)"),
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (pip install 'raydit[fp8]')"),
]


def forward_cases():
    from raydit.models.registry import families

    return [(f, f.conformance_cases(harness._Unbuilt())["forward"][0]) for f in families().values()]


@pytest.mark.parametrize("family, case", forward_cases(), ids=lambda v: getattr(v, "name", ""))
def test_fp8_equals_fp8_sim_on_the_gpu(family, case):
    from raydit.models.quantize import quantize_transformer

    outs = {}
    for mode in (None, "fp8-sim", "fp8"):
        torch.manual_seed(0)
        transformer, kwargs = harness.at_dtype(*case.make(), torch.bfloat16, case.cast)
        transformer = transformer.to("cuda")
        kwargs = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in kwargs.items()}
        done = quantize_transformer(transformer, mode, keep=family.quantize_keep) if mode else None
        if done is not None and not done.names:
            pytest.skip(f"{case.name}: no block linear at multiples of 16 features")
        outs[mode] = harness.forward_once(transformer, kwargs).float()
    sim_error = relative_error(outs["fp8-sim"], outs[None])
    assert sim_error > 1e-3
    assert relative_error(outs["fp8"], outs["fp8-sim"]) < 0.25 * sim_error + 1e-3
    assert relative_error(outs["fp8"], outs[None]) > 0.25 * sim_error
