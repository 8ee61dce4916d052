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
    expected = harness.latent_streams(family.reference_latents(pipe, request))
    assert all(e.device.type == "cuda" and torch.isfinite(e.float()).all() for e in expected)
    runner = Runner(pipe, device="cuda", dtype=dtype)
    streams = harness.latent_streams(family.output_latents(pipe, harness.run_steps(runner, request, None)))
    checkpoint = runner.checkpoint(harness.run_steps(runner, request, 1))
    resumed = harness.run_steps(runner, request, None, checkpoint=checkpoint)
    again = harness.latent_streams(family.output_latents(pipe, resumed))
    assert len(streams) == len(again) == len(expected)
    for latents, resumed_latents, reference in zip(streams, again, expected):  # LTX-2: video, then audio
        assert latents.dtype == reference.dtype, (latents.dtype, reference.dtype)
        assert torch.equal(latents, reference), (latents.float() - reference.float()).abs().max().item()
        assert torch.equal(resumed_latents, reference)
