"""full_precision_steps (Runner, Engine, generate, serve): the first N and the last N steps of a
request run without the quantized modes, the others under them.

Rule: bit for bit (torch.equal), bfloat16, one process, the tiny Wan pipeline. A full-precision
step is the unquantized model's step (the FP8 linears on the weights they had before the
rounding, kept for it; fp8-sim's input rounding skipped) and a middle step the quantized
model's, so a run equals the same request stepped by hand: the unquantized Runner at the ends,
a quantized Runner (quantized without keeping anything) in the middle. For the 8-bit attention
modes the full-precision steps run sp_attention's bf16 kernels on the one-rank mesh, which are
not diffusers' own attention call: there the reference is the same Runner with the steps
forced, and the rule that the ends are no longer 8-bit is checked against the 8-bit run.
Under fp8 (torchao's tensors on the CPU, gates lifted: tests/models/fp8_cpu.py) and fp8-sim.
"""

from __future__ import annotations

import pytest
import torch
from fp8_cpu import INSTALLED, MODES, TORCHAO, WHY, lift_fp8_gates

from raydit.models import conformance as harness
from raydit.models.precision import relative_error
from raydit.planner.runconfig import RunConfig

from support.quantize import assert_batched_as_alone

GEN = dict(prompt="a red fox running through fresh snow", num_frames=5, height=32, width=32, guidance_scale=6.0)


@pytest.fixture
def quantize(request, monkeypatch):
    if request.param == "fp8":
        lift_fp8_gates(monkeypatch)
    return request.param


FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
# (quantize, device): fp8-sim and fp8 (torchao's tensors, gates lifted) on the CPU; fp8 on an FP8 GPU.
CASES = [pytest.param(("fp8-sim", "cpu"), id="fp8-sim-cpu"),
         pytest.param(("fp8", "cpu"), id="fp8-cpu", marks=pytest.mark.skipif(not TORCHAO, reason=WHY)),
         pytest.param(("fp8", "cuda"), id="fp8-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
             not (FP8_GPU and INSTALLED), reason="needs a CUDA GPU of compute capability 8.9+ and torchao")])]


@pytest.mark.parametrize("case", CASES)
def test_the_first_and_last_steps_are_the_unquantized_models_bit_for_bit(case, monkeypatch):
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    quantize, device = case
    if quantize == "fp8" and device == "cpu":
        lift_fp8_gates(monkeypatch)
    bf16 = torch.bfloat16
    request = GenerationRequest(num_inference_steps=5, seed=4, **GEN)
    plain = Runner(load_pipeline("tiny", dtype=bf16), device=device, dtype=bf16)
    quantized = Runner(load_pipeline("tiny", dtype=bf16), device=device, dtype=bf16, run=RunConfig(quantize=quantize))
    out = {}
    for n in (2, 3):
        runner = Runner(load_pipeline("tiny", dtype=bf16), device=device, dtype=bf16,
                        run=RunConfig(quantize=quantize, full_precision_steps=n))
        out[n] = harness.run_steps(runner, request, None).latents
    assert torch.equal(out[2], harness.run_switching(plain, quantized, request, {0, 1, 3, 4}))
    assert not torch.equal(out[2], harness.run_switching(plain, quantized, request, {0, 1}))  # the last steps count too
    assert torch.equal(out[3], harness.run_steps(plain, request, None).latents)  # 2 x 3 >= 5: every step
    quantized_run = harness.run_steps(quantized, request, None).latents
    assert relative_error(out[2], quantized_run) > 1e-3  # the ends really ran unquantized
    assert relative_error(out[2], out[3]) > 1e-3  # and the middle quantized


@pytest.mark.slow
@pytest.mark.long  # the second stage (suite time)
@pytest.mark.parametrize("quantize", MODES, indirect=True)
def test_batched_requests_at_different_steps_each_run_their_own_precision(quantize):
    """Two requests sharing steps, the second joining at the first's step 1: at a tick one is at
    a full-precision step and the other not, so the batch splits in two calls; each request
    equals itself alone under the same setting (where the unquantized batch equals its requests
    alone bit for bit, the same ops per row)."""
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    bf16 = torch.bfloat16
    requests = [GenerationRequest(num_inference_steps=4, seed=s, **GEN) for s in (1, 2)]
    out = {}
    for q, n in ((None, 0), (quantize, 1)):
        runner = Runner(load_pipeline("tiny", dtype=bf16), dtype=bf16,
                        run=RunConfig(quantize=q, full_precision_steps=n))
        out[q, "batched"] = [s.latents for s in harness.run_batched(runner, requests, [0, 1])]
        out[q, "alone"] = [harness.run_steps(runner, r, None).latents for r in requests]
    assert_batched_as_alone(out, quantize)


def test_8bit_attention_runs_bf16_kernels_at_the_ends():
    """attention int8 with full_precision_steps 2, 5 steps: the run equals the int8 Runner's
    middle step with steps 0, 1, 3 and 4 run inside full_precision_attention by hand; and
    those ends are not int8's: the run differs from the int8 run, and from the run with only
    the first two steps in bf16 (the last step's own change is below bf16's rounding of the
    latents here: DDIM's last step scales the model output by sqrt(1 - alpha), near 0)."""
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner
    from raydit.parallel.attention import full_precision_attention

    bf16 = torch.bfloat16
    request = GenerationRequest(num_inference_steps=5, seed=5, **GEN)
    ends = Runner(load_pipeline("tiny", dtype=bf16), dtype=bf16,
                  run=RunConfig(attention="int8", full_precision_steps=2))
    latents = harness.run_steps(ends, request, None).latents
    int8 = Runner(load_pipeline("tiny", dtype=bf16), dtype=bf16, run=RunConfig(attention="int8"))

    def by_hand(full):
        state = int8.prepare(request)
        while not state.done:
            if state.step_index in full:
                with full_precision_attention():
                    state = int8.step(state)
            else:
                state = int8.step(state)
        return state.latents

    assert torch.equal(latents, by_hand({0, 1, 3, 4}))
    assert not torch.equal(latents, by_hand(set()))
    assert not torch.equal(latents, by_hand({0, 1}))


def test_refusals_name_the_value_and_the_fix():
    from raydit.models.loading import load_pipeline
    from raydit.models.quantize_options import check_full_precision_steps
    from raydit.models.runner import Runner

    for bad in (-1, "2", True, 1.5):
        with pytest.raises(ValueError, match=r"full_precision_steps .* must be a whole number >= 0"):
            check_full_precision_steps(bad, "fp8-sim", None)
    with pytest.raises(ValueError, match="needs a quantized mode to leave .* drop it"):
        check_full_precision_steps(2, None, "bf16")
    with pytest.raises(ValueError, match="sharded weights do not hold; drop full_precision_steps or shard_weights"):
        check_full_precision_steps(1, "fp8-sim", None, shard_weights=True)
    assert check_full_precision_steps(1, None, "int8", shard_weights=True) == 1  # no weights kept: fine
    assert check_full_precision_steps(None, None, None) == 0
    # a pipeline quantized by an earlier Runner without keeping its weights
    tiny_pipe = load_pipeline("tiny")
    Runner(tiny_pipe, dtype=torch.float32, run=RunConfig(quantize="fp8-sim"))
    with pytest.raises(ValueError, match="quantized without keeping its unquantized weights; load it again"):
        Runner(tiny_pipe, dtype=torch.float32, run=RunConfig(quantize="fp8-sim", full_precision_steps=1))


def test_generate_serve_and_job_config_pass_it_to_the_engine(tmp_path):
    from raydit.cli import build_parser
    from raydit.commands import engine_kwargs, resolve_generate_options
    from raydit.serve import config as serve_config

    parser = build_parser()

    def generate(*argv):
        return engine_kwargs(resolve_generate_options(parser.parse_args(["generate", *argv]))).get("full_precision_steps", 0)

    def serve(given):
        return serve_config.engine_kwargs(serve_config.resolve_serve_options(given)).get("full_precision_steps", 0)

    job = tmp_path / "job.yaml"
    job.write_text("prompt: a cat\nquantize: fp8-sim\nfull_precision_steps: 2\n")
    assert generate("--prompt", "x", "--quantize", "fp8", "--full-precision-steps", "1") == 1
    assert generate("--config", str(job)) == 2
    assert generate("--prompt", "x") == 0
    assert serve(parser.parse_args(["serve", "--attention", "int8", "--full-precision-steps", "3"])) == 3
    assert serve({"quantize": "fp8-sim", "full_precision_steps": 1}) == 1
    assert serve({}) == 0
    with pytest.raises(ValueError, match="full_precision_steps 1 needs a quantized mode to leave"):
        serve({"full_precision_steps": 1})
    with pytest.raises(ValueError, match="full_precision_steps -1 must be a whole number >= 0"):
        serve({"quantize": "fp8-sim", "full_precision_steps": -1})
    with pytest.raises(ValueError, match="sharded weights do not hold"):
        serve({"quantize": "fp8-sim", "full_precision_steps": 1, "shard_weights": True, "workers": 2})


@pytest.mark.slow
@pytest.mark.long  # the second stage (suite time): three compiled Runners
def test_compiled_runs_warm_up_both_variants_and_equal_the_compiled_steps_by_hand():
    """compile=True under fp8-sim with full_precision_steps 1: the warm-up compiles the blocks
    both ways (the unquantized variant is a graph of its own), so no step compiles, and the run
    equals the same request stepped by a compiled unquantized Runner at the ends and a compiled
    fp8-sim Runner in the middle, bit for bit (the same Inductor code)."""
    from torch._dynamo.utils import counters

    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    bf16 = torch.bfloat16
    request = GenerationRequest(num_inference_steps=4, seed=6, **GEN)
    runners = []
    try:
        ends = Runner(load_pipeline("tiny", dtype=bf16), dtype=bf16,
                      run=RunConfig(quantize="fp8-sim", full_precision_steps=1, compile=True))
        runners.append(ends)
        state = ends.prepare(request)
        graphs = counters["stats"]["unique_graphs"]
        while not state.done:
            state = ends.step(state)
        assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a graph"
        plain = Runner(load_pipeline("tiny", dtype=bf16), dtype=bf16, run=RunConfig(compile=True))
        quantized = Runner(load_pipeline("tiny", dtype=bf16), dtype=bf16,
                           run=RunConfig(quantize="fp8-sim", compile=True))
        runners += [plain, quantized]
        assert torch.equal(state.latents, harness.run_switching(plain, quantized, request, {0, 3}))
    finally:
        for runner in runners:
            runner.close()
