"""quantize="fp8" (torchao's FP8 layers) on a CUDA GPU and on the CPU.

On a GPU of compute capability 8.9+ as users run it. On the CPU through the same torchao
tensors and torch._scaled_mm's CPU kernel, with the two hardware gates lifted in the test
(tests/models/fp8_cpu.py: torchao's and the Runner's, which refuse the CPU because FP8 is
slow there, not wrong): the wiring and the numbers of the real mode
checked wherever the suite runs; the GPU cases skip without CUDA, FP8 or torchao.

The real mode against its emulation, fp8-sim, in bfloat16. One linear layer: the two agree to
within a quarter of FP8's own error against the unquantized layer (the sim multiplies the
dequantized operands rounded to bf16, the GEMM scales its float32 accumulator: on a CPU, with
torchao's hardware check bypassed, 0.3% apart for an FP8 error of 3.6%). A whole forward (Wan's
forward case): FP8 rounding is a step function, so last-bit differences between the two grow
through the layers to FP8's own size; the rule there is the same error against the
unquantized forward, within a factor 2 either way, the same layers quantized, and compiled
blocks (Inductor, fullgraph) held to the same rule. The Runner runs a tiny request under fp8.
Where FP8 is missing the Runner refuses.
"""

from __future__ import annotations

import pytest
import torch
from fp8_cpu import INSTALLED, TORCHAO, WHY, lift_fp8_gates

from raydit.models import conformance as harness
from raydit.models.precision import relative_error
from raydit.planner.runconfig import RunConfig

CUDA = torch.cuda.is_available()
FP8 = CUDA and torch.cuda.get_device_capability() >= (8, 9)

# "cuda": a GPU with FP8, as users run it; "cpu": torchao's tensors on the CPU, gates lifted.
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not (FP8 and INSTALLED), reason="needs a CUDA GPU of compute capability 8.9+ and torchao")]),
           pytest.param("cpu", marks=pytest.mark.skipif(not TORCHAO, reason=WHY))]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == "cpu":  # the gates lifted for this test only
        lift_fp8_gates(monkeypatch)
    return request.param


def wan_case():
    from raydit.models.registry import families

    return families()["wan"].conformance_cases(harness._Unbuilt())["forward"][0]


@torch.no_grad()
def test_one_fp8_linear_matches_fp8_sim(device):
    import copy

    from raydit.models.quantize import quantize_transformer

    torch.manual_seed(0)
    case = wan_case()
    transformer, _ = case.make()
    transformer = transformer.to(device, torch.bfloat16)
    block = transformer.blocks[0]
    layer = torch.nn.Linear(2048, 1024, dtype=torch.bfloat16, device=device)
    block.ffn.net[2] = layer  # a block linear of DiT-like width
    x = torch.randn(4, 512, 2048, dtype=torch.bfloat16, device=device)
    outs = {None: layer(x).float()}
    for mode in ("fp8", "fp8-sim"):
        model = copy.deepcopy(transformer)
        assert "blocks.0.ffn.net.2" in quantize_transformer(model, mode).names
        outs[mode] = model.blocks[0].ffn.net[2](x).float()
        # A zero-padded token's all-zero row gives the bias, not 0 / 0 (ACTIVATION_AMAX_FLOOR).
        zero = model.blocks[0].ffn.net[2](torch.zeros(1, 2048, dtype=torch.bfloat16, device=device)).float()
        assert torch.equal(zero[0], layer.bias.float()), mode
    e_fp8 = relative_error(outs["fp8"], outs[None])
    assert 5e-3 <= e_fp8 <= 0.1, e_fp8
    assert relative_error(outs["fp8"], outs["fp8-sim"]) <= 0.25 * e_fp8


@pytest.mark.long  # stage two: compiles the fp8 blocks (~120 s on the CPU)
def test_fp8_quantizes_the_layers_fp8_sim_does_and_costs_the_same_error(device):
    from raydit.models.compile import compile_blocks
    from raydit.models.quantize import quantize_transformer

    case = wan_case()
    out, names = {}, {}
    for mode in (None, "fp8", "fp8-sim"):
        transformer, kwargs = harness.at_dtype(*case.make(), torch.bfloat16)
        transformer = transformer.to(device)
        kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        if mode is not None:
            names[mode] = quantize_transformer(transformer, mode).names
        out[mode] = harness.forward_once(transformer, kwargs).float()
        if mode == "fp8":
            compiled = compile_blocks(transformer, fullgraph=True)
            try:
                out["fp8 compiled"] = harness.forward_once(transformer, kwargs).float()
            finally:
                compiled.remove()
    assert names["fp8"] == names["fp8-sim"] and len(names["fp8"]) == 20
    e_sim = relative_error(out["fp8-sim"], out[None])
    assert 1e-3 <= e_sim <= 0.2, e_sim
    for mode in ("fp8", "fp8 compiled"):
        e = relative_error(out[mode], out[None])
        assert 0.5 * e_sim <= e <= 2 * e_sim, (mode, e, e_sim)


def test_runner_runs_a_request_under_fp8(device):
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    request = GenerationRequest(prompt="a red fox", num_frames=5, height=32, width=32, num_inference_steps=3, seed=1)
    latents = {}
    for mode in (None, "fp8"):
        runner = Runner(load_pipeline("tiny", dtype=torch.bfloat16), device=device, dtype=torch.bfloat16,
                        run=RunConfig(quantize=mode))
        latents[mode] = harness.run_steps(runner, request, None).latents.float().cpu()
    assert torch.isfinite(latents["fp8"]).all()
    assert 1e-3 <= relative_error(latents["fp8"], latents[None]) <= 0.2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or FP8, reason="needs a CUDA GPU without FP8 (compute capability below 8.9)")
def test_runner_refuses_fp8_on_a_gpu_before_sm89():
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    with pytest.raises(ValueError, match="needs compute capability 8.9 or newer"):
        Runner(load_pipeline("tiny", dtype=torch.bfloat16), device="cuda", dtype=torch.bfloat16,
               run=RunConfig(quantize="fp8"))


@pytest.mark.gpu
@pytest.mark.skipif(not FP8 or INSTALLED, reason="needs an FP8 GPU without torchao installed")
def test_runner_names_the_install_when_torchao_is_missing():
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    with pytest.raises(ValueError, match="needs torchao, which is not installed: pip install torchao"):
        Runner(load_pipeline("tiny", dtype=torch.bfloat16), device="cuda", dtype=torch.bfloat16,
               run=RunConfig(quantize="fp8"))


@pytest.mark.gpu
@pytest.mark.skipif(not (FP8 and INSTALLED), reason="needs a CUDA GPU of compute capability 8.9+ and torchao")
def test_the_gpu_never_holds_the_transformer_unquantized():
    """The Runner quantizes one linear at a time on the GPU before the rest of the pipeline
    moves there: the GPU's peak while the Runner is built stays under the bf16 bytes of the
    block linears alone (before, the whole bf16 transformer went to the GPU first: a model
    that fits only in FP8 could not load); the sharded path's host-side variant (`stay=False`)
    brings each linear back to the host holding the very bytes the GPU rounded. A Wan
    transformer of 1.3B width (1536, FFN 8960), 12 blocks: 1.10 GB of bf16 block linears,
    0.55 GB in FP8, plus about 0.2 GB for the rest and one linear's quantization."""
    from raydit.models.families.wan.tiny import tiny_transformer
    from raydit.models.loading import load_pipeline
    from raydit.models.quantize import quantize_transformer, select_linears
    from raydit.models.runner import Runner

    def wide(layers):
        return tiny_transformer(3, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960,
                                num_layers=layers).to(torch.bfloat16)

    pipe = load_pipeline("tiny", dtype=torch.bfloat16)
    pipe.transformer = wide(12)
    linears = sum(m.weight.numel() * 2 for _, m in select_linears(pipe.transformer)[0])
    assert linears > 1.05e9
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    runner = Runner(pipe, device="cuda", dtype=torch.bfloat16, run=RunConfig(quantize="fp8"))
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < linears, (peak, linears)
    assert type(runner.transformer.blocks[0].ffn.net[2].weight).__name__ == "Float8Tensor"

    on_host, on_gpu = wide(2), wide(2)
    quantize_transformer(on_host, "fp8", device="cuda", stay=False)
    quantize_transformer(on_gpu.to("cuda"), "fp8")
    for (name, a), (_, b) in zip(select_linears(on_host)[0], select_linears(on_gpu)[0]):
        assert a.weight.device.type == "cpu", name
        assert torch.equal(a.weight.qdata.view(torch.uint8), b.weight.qdata.cpu().view(torch.uint8)), name
        assert torch.equal(a.weight.scale, b.weight.scale.cpu()), name
