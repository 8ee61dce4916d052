"""Sharded weights under quantize "fp8-sim" and "fp8" (issue 42): quantized first, from the cast
weights, then the quantized bytes sharded. On two gloo ranks, every plan (Ulysses 2, ring 2,
cfg 2):
- fp8-sim: the tiny CogVideoX loaded from its files (12 block linears quantized; its
  norm*.linear modulation kept in the run's dtype) in float32 and bfloat16, and the tiny Wan
  (its 20 block linears all skipped: 24-wide, not multiples of 16, so sharded in the run's
  dtype as they are) in bfloat16;
- fp8 (torchao's Float8Tensor weights, sharded as their FP8 bytes and float32 row scales):
  the tiny CogVideoX in bfloat16, on the CPU through torchao's tensors and torch._scaled_mm's
  CPU kernel, with torchao's and the Runner's hardware gates lifted in the ranks' processes
  (both refuse the CPU for speed, not for the numbers).

Rule: bit for bit (torch.equal; FP8 weights compared as their bytes and scales). The sharded
run computes with the very bytes the unsharded quantized run holds (the same rounding of the
same cast weights, all-gathered raw), with the same kernels, batch and threads. The recovery
case (what the survivors of a lost rank do): close() rebuilds the weights from the checkpoint
files, unquantized, and must quantize them again exactly as at load (every parameter equal to
the unsharded quantized run's, the quantized marker kept), while gathered back over the group
(a model built in memory) they are the quantized bytes as they were; the pipeline sharded
again resumes from step 1's checkpoint to the fault-free latents.
"""

from __future__ import annotations

import pytest
import torch
from fp8_cpu import MODES, TORCHAO, WHY

WORLD = 2
# (model, its quantized and skipped block linears)
MODELS = {"tiny": (12, 0), "tiny-wan": (0, 20)}


def _model(name: str, height: int, width: int, guidance: float, dtypes: tuple) -> tuple:
    from raydit.models.loading import resolve_model_dir

    return (str(resolve_model_dir(name)), dict(prompt="a red fox", num_frames=5, height=height, width=width,
                                               num_inference_steps=3, guidance_scale=guidance, seed=3), dtypes)


# fp8 (torchao) in stage two; fp8-sim, the same sharding rules, in stage one.
@pytest.fixture(scope="module", params=[pytest.param(m.values[0], marks=[*m.marks, pytest.mark.long])
                                        if not isinstance(m, str) else m for m in MODES])
def results(request):
    from fp8_cpu import lifted

    from shard_conformance import quantized_shard_worker
    from raydit.parallel.testing import run_distributed

    if request.param == "fp8":  # torchao's FP8 tensors on the CPU, the gates lifted in the ranks (fp8_cpu)
        return "fp8", run_distributed(lifted, WORLD, "shard_conformance:quantized_shard_worker",
                                      [_model("tiny", 32, 32, 6.0, ("bfloat16",))], quantize="fp8", timeout=600)
    models = [_model("tiny", 32, 32, 6.0, ("float32", "bfloat16")), _model("tiny-wan", 48, 80, 5.0, ("bfloat16",))]
    return "fp8-sim", run_distributed(quantized_shard_worker, WORLD, models, timeout=1200)


def _runs(out):
    return [k[:3] for k in out if k[-1] == "plain"]


def test_every_plan_sharded_under_fp8_equals_unsharded_bit_for_bit(results):
    mode, results = results
    for out in results:
        runs = _runs(out)
        if mode == "fp8-sim":  # tiny: 3 plans x 2 dtypes; tiny-wan: 3 plans x bf16
            assert len(runs) == 9 and {r[2] for r in runs} == {"float32", "bfloat16"}, runs
        else:  # tiny: 3 plans in bf16, its 12 quantized linears torchao's FP8 weights (bytes, scales)
            assert len(runs) == 3 and {r[2] for r in runs} == {"bfloat16"}, runs
            weights = out[runs[0] + ("weights",)]
            assert sum(n.endswith("#qdata") for n in weights) == 12 == sum(n.endswith("#scale") for n in weights)
        for run in runs:
            plain, sharded = out[run + ("plain",)], out[run + ("sharded",)]
            assert plain.dtype == sharded.dtype and torch.isfinite(plain.float()).all(), run
            assert torch.equal(plain, sharded), (run, (plain.float() - sharded.float()).abs().max().item())
            held, full = out[run + ("held",)]  # each rank keeps half of the blocks' bytes
            assert held * WORLD == full, run


def test_weights_rebuilt_from_the_files_are_quantized_again_as_at_load(results):
    from raydit.models.loading import resolve_model_dir

    _, results = results
    expected = {str(resolve_model_dir(name)): counts for name, counts in MODELS.items()}
    for out in results:
        for run in _runs(out):
            assert out[run + ("from files",)], run  # the rebuild reads the checkpoint files
            fresh, rebuilt = out[run + ("weights",)], out[run + ("rebuilt",)]
            assert fresh.keys() == rebuilt.keys() and len(fresh) > 0
            differ = [n for n in fresh if not torch.equal(fresh[n], rebuilt[n])]
            assert not differ, (run, differ[:3])
            assert out[run + ("marked",)] == expected[run[0]], run
            gathered = out[run + ("gathered",)]  # gathered back: the quantized bytes as they were
            assert [n for n in fresh if not torch.equal(fresh[n], gathered[n])] == [], run


def test_resumed_after_the_rebuild_equals_the_fault_free_run(results):
    _, results = results
    for out in results:
        for run in _runs(out):
            resumed, clean = out[run + ("resumed",)], out[run + ("plain",)]
            assert torch.equal(resumed, clean), (run, (resumed.float() - clean.float()).abs().max().item())


def test_batched_steps_sharded_under_fp8_sim_equal_unsharded():
    """Step-level batching under fp8-sim on cfg 2, the tiny CogVideoX: three requests sharing
    steps (one joins at the second), sharded against unsharded, bit for bit. One pipeline
    serves both runs: the sharded Runner finds it quantized by the first and shards it as it is."""
    from raydit.models.loading import resolve_model_dir
    from shard_conformance import batching_shard_worker
    from raydit.parallel.testing import run_distributed

    base = dict(prompt="a red fox runs", num_frames=5, height=32, width=32)
    requests = [dict(base, num_inference_steps=3, guidance_scale=5.0, seed=1),
                dict(base, num_inference_steps=4, guidance_scale=3.0, seed=2, negative_prompt="blur"),
                dict(base, num_inference_steps=3, guidance_scale=4.0, seed=3)]
    out = run_distributed(batching_shard_worker, WORLD, "raydit.models.loading:load_pipeline",
                          dict(model=str(resolve_model_dir("tiny"))), requests, [0, 0, 1], (1, 1, 2),
                          dict(quantize="fp8-sim"), timeout=600)
    for rank_out in out:
        for plain, sharded in zip(rank_out[False], rank_out[True], strict=True):
            assert torch.isfinite(plain).all() and torch.equal(plain, sharded)


@pytest.mark.slow
@pytest.mark.long  # the second stage (suite time)
@pytest.mark.skipif(not TORCHAO, reason=WHY)
def test_compiled_batched_steps_sharded_under_fp8_equal_unsharded():
    """quantize fp8 (torchao's FP8 tensors on the CPU, the gates lifted in the ranks), compiled
    blocks, step batching, Ulysses 2: two requests sharing steps (one joins at the second),
    sharded against unsharded, bit for bit. The sharded blocks get new Float8Tensor parameters
    at every gather; the compiled graphs take them as inputs like the unsharded run's."""
    from fp8_cpu import lifted

    from raydit.models.loading import resolve_model_dir
    from raydit.parallel.testing import run_distributed

    base = dict(prompt="a red fox runs", num_frames=5, height=32, width=32)
    requests = [dict(base, num_inference_steps=3, guidance_scale=5.0, seed=1),
                dict(base, num_inference_steps=3, guidance_scale=3.0, seed=2)]
    out = run_distributed(lifted, WORLD, "shard_conformance:batching_shard_worker",
                          "raydit.models.loading:load_pipeline", dict(model=str(resolve_model_dir("tiny"))),
                          requests, [0, 1], (2, 1, 1), dict(quantize="fp8", compile=True, dtype=torch.bfloat16),
                          timeout=900)
    for rank_out in out:
        for plain, sharded in zip(rank_out[False], rank_out[True], strict=True):
            assert plain.dtype == torch.bfloat16 and torch.isfinite(plain.float()).all()
            assert torch.equal(plain, sharded), (plain.float() - sharded.float()).abs().max().item()
