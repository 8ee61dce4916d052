"""On a CUDA GPU, in bfloat16 and float16: one process equals diffusers' own pipeline bit for
bit, for every runner case of every family (the CPU test of test_conformance, on the device
where bf16 runs for real: its kernels, cuBLAS, the SDPA backends). Skipped without CUDA."""

import pytest
import torch

from raydit.models import conformance as harness

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = harness.family_cases(build=False)["runner"]


@pytest.fixture(scope="module")
def runner_cases():
    return harness.family_cases(build=True)["runner"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case_name", [c.name for c in CASES])
def test_runner_matches_diffusers_bit_for_bit_on_cuda(runner_cases, case_name, dtype):
    from raydit.models.registry import family_for_pipeline
    from raydit.models.runner import Runner

    dtype = getattr(torch, dtype)
    case = next(c for c in runner_cases if c.name == case_name)
    pipe = case.make(dtype=dtype).to("cuda")  # loaded in dtype as from_pretrained does (Kandinsky 5: its float32 parts)
    pipe.set_progress_bar_config(disable=True)
    request = case.make_request()
    family = family_for_pipeline(pipe)
    expected = family.reference_latents(pipe, request)
    assert expected.device.type == "cuda" and torch.isfinite(expected.float()).all()
    runner = Runner(pipe, device="cuda", dtype=dtype)
    latents = family.output_latents(pipe, harness.run_steps(runner, request, None))
    assert latents.dtype == expected.dtype, (latents.dtype, expected.dtype)
    assert torch.equal(latents, expected), (latents.float() - expected.float()).abs().max().item()
    checkpoint = runner.checkpoint(harness.run_steps(runner, request, 1))
    resumed = harness.run_steps(runner, request, None, checkpoint=checkpoint)
    assert torch.equal(family.output_latents(pipe, resumed), expected)
