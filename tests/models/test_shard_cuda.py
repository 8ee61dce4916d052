"""Sharded weights on a CUDA GPU (issue 42): the side-stream gathers, skipped without CUDA.

Two ranks on one GPU (two processes on cuda:0, gloo's CUDA all-gather: NCCL takes one rank per
device), the tiny CogVideoX loaded from its files, bf16, cfg 2 (each rank one guidance branch:
the collectives are all-gathers and broadcasts, which gloo runs on CUDA tensors). Under
fp8-sim, and under fp8 (torchao's FP8 layers) where the GPU has FP8. Rule as on the CPU
(tests/models/test_shard_quantize.py): bit for bit (torch.equal), sharded against the same plan
unsharded, the same kernels on the same device; the gathers were posted from a side stream
(raydit.parallel.shard_weights), each rank holds half the blocks' bytes, the weights rebuilt
from the files equal the unsharded run's, and the resumed request equals the fault-free one.
"""

from __future__ import annotations

import pytest
import torch
from fp8_cpu import INSTALLED

CUDA = torch.cuda.is_available()
FP8 = CUDA and torch.cuda.get_device_capability() >= (8, 9)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("quantize", ["fp8-sim", pytest.param("fp8", marks=pytest.mark.skipif(
    not (FP8 and INSTALLED), reason="needs a GPU of compute capability 8.9+ and torchao"))])
def test_sharded_on_cuda_equals_unsharded_bit_for_bit(quantize):
    from raydit.models.loading import resolve_model_dir
    from shard_conformance import quantized_shard_worker
    from raydit.parallel.testing import run_distributed

    model = (str(resolve_model_dir("tiny")), dict(prompt="a red fox", num_frames=5, height=32, width=32,
                                                  num_inference_steps=3, guidance_scale=6.0, seed=3), ("bfloat16",))
    results = run_distributed(quantized_shard_worker, 2, [model], quantize=quantize, device="cuda",
                              plans=("u1r1c2",), timeout=300)
    for out in results:
        runs = [k[:3] for k in out if k[-1] == "plain"]
        assert len(runs) == 1, runs
        run = runs[0]
        plain = out[run + ("plain",)]
        assert torch.isfinite(plain.float()).all()
        assert torch.equal(plain, out[run + ("sharded",)])
        assert torch.equal(plain, out[run + ("resumed",)])
        assert out[run + ("side stream",)] and out[run + ("from files",)]
        held, full = out[run + ("held",)]
        assert held * 2 == full
        fresh, rebuilt = out[run + ("weights",)], out[run + ("rebuilt",)]
        assert fresh.keys() == rebuilt.keys()
        assert [n for n in fresh if not torch.equal(fresh[n], rebuilt[n])] == []
