"""Mochi 1 (issue 34): what the shared conformance suite does not cover.

The shared suite (tests/models/test_conformance.py) runs Mochi's forward cases (masks that
differ per sample, a sample with no valid text, 6 and 5 heads) and its runner case (fresh and
resumed) on every plan of 1..6 and 8 ranks, and one process against MochiPipeline in float32,
bf16 and fp16. Here: the pipeline's sigma schedule, the refusals (one line each), the path
without guidance against diffusers, and step-level batching on one process.
"""

from __future__ import annotations

import pytest
import torch

from raydit.models import conformance as harness
from raydit.models.families.mochi import cases, family, tiny
from raydit.models.requests import GenerationRequest, checker_image
from raydit.models.runner import Runner

REQUEST = dict(prompt="a red fox runs", num_frames=7, height=32, width=48, num_inference_steps=2, seed=3)


@pytest.fixture(scope="module")
def base_dir() -> str:
    return str(tiny.tiny_pipeline_dir())


@pytest.mark.parametrize("steps", [2, 3, 7, 64])
def test_sigmas_are_the_pipelines(steps):
    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    assert family.linear_quadratic_sigmas(steps) == linear_quadratic_schedule(steps, 0.025)


def test_valid_text_counts_take_prefix_masks_and_refuse_others():
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    assert family.valid_text_counts(mask, 4, 2) == [2, 3]
    assert family.valid_text_counts(mask[:1], 4, 3) == [2, 2, 2]  # one mask for the whole batch
    assert family.valid_text_counts(torch.zeros(1, 4, dtype=torch.bool), 4, 1) == [0]
    with pytest.raises(ValueError, match="must mark a prefix of the text tokens") as info:
        family.valid_text_counts(torch.tensor([[True, False, True, False]]), 4, 1)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="covers 3 tokens; the text has 4"):
        family.valid_text_counts(torch.ones(1, 3, dtype=torch.bool), 4, 1)


@pytest.mark.parametrize("change, message", [
    (dict(num_frames=8), "num_frames 8 must be 6k + 1; nearest: 7 or 13"),
    (dict(height=40), "height 40 must be a multiple of 16 (VAE scale 8 x patch 2); nearest: 32 or 48"),
    (dict(width=8), "width 8 must be a multiple of 16 (VAE scale 8 x patch 2); nearest: 16"),
    (dict(num_inference_steps=1), "num_inference_steps 1 is too few for Mochi's linear-quadratic sigma schedule"),
    (dict(guidance_scale_2=3.0), "guidance_scale_2 is for two-expert pipelines"),
    (dict(true_cfg_scale=4.0, negative_prompt="blur"), "true_cfg_scale 4 is for pipelines whose guidance is embedded"),
    (dict(guidance_options={"stg_scale": 1.0}), "guidance option(s) stg_scale are not taken by MochiPipeline"),
])
def test_bad_requests_are_refused_in_one_line(base_dir, change, message):
    runner = Runner(cases.mochi_pipeline(base_dir))
    with pytest.raises(ValueError) as info:
        runner.prepare(GenerationRequest(**{**REQUEST, **change}))
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_an_image_is_refused(base_dir):
    from raydit.models.requests import image_to_png

    runner = Runner(cases.mochi_pipeline(base_dir))
    image = image_to_png(checker_image(32, 48))
    with pytest.raises(ValueError, match="MochiPipeline is a text-to-video pipeline and takes no image"):
        runner.prepare(GenerationRequest(**REQUEST, image=image))


def test_without_guidance_matches_the_pipeline(base_dir):
    """guidance_scale 1: one branch and no negative prompt encoded (the pipeline's other path)."""
    pipe = cases.mochi_pipeline(base_dir)
    request = GenerationRequest(**REQUEST, guidance_scale=1.0)
    expected = family.FAMILY.reference_latents(pipe, request)
    state = harness.run_steps(Runner(pipe), request, request.num_inference_steps)
    assert len(state.branches) == 1 and state.branches[0]["encoder_hidden_states"].shape[0] == 1
    torch.testing.assert_close(state.latents, expected, rtol=1e-5, atol=1e-5)


def test_requests_share_a_step_and_equal_their_runs_alone(base_dir):
    """Step-level batching: a 2-step and a 3-step request (other seeds, guidance scales and
    prompts, so other valid text lengths in one call), the second joining after one step."""
    pipe = cases.mochi_pipeline(base_dir)
    runner = Runner(pipe)
    requests = [GenerationRequest(**REQUEST, guidance_scale=4.5),
                GenerationRequest(**{**REQUEST, "prompt": "snow falls on a quiet town", "seed": 8,
                                     "num_inference_steps": 3}, guidance_scale=3.0, negative_prompt="blur")]
    assert family.FAMILY.batch_key(pipe, requests[0]) == family.FAMILY.batch_key(pipe, requests[1])
    batched = harness.run_batched(runner, requests, joins=[0, 1])
    for request, state in zip(requests, batched):
        alone = harness.run_steps(runner, request, request.num_inference_steps).latents
        torch.testing.assert_close(state.latents, alone, rtol=1e-5, atol=1e-5 * float(alone.abs().max()))
