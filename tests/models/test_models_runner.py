"""Step-wise runner on one process: validation, checkpoint/resume, decode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from raydit.models import GenerationRequest, Runner
from raydit.models.conformance import run_steps
from raydit.models.families.cogvideox.cases import cogvideox_pipeline
from raydit.models.families.cogvideox.tiny import TINY_FRAMES, TINY_HEIGHT, TINY_WIDTH, load_tiny_pipeline, tiny_pipeline_dir

REQUEST = dict(prompt="a cat", num_frames=TINY_FRAMES, height=TINY_HEIGHT, width=TINY_WIDTH, num_inference_steps=3)


@pytest.fixture(scope="module")
def dpm_runner():
    """DPM draws noise every step, so resuming must restore the generator too."""
    return Runner(cogvideox_pipeline(str(tiny_pipeline_dir()), scheduler="dpm"))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_frames", 0, "num_frames 0 must be a positive integer"),
        ("height", 60, "height 60 and width 64 must be multiples of 8"),
        ("num_inference_steps", 2.5, "num_inference_steps 2.5 must be a positive integer"),
        ("guidance_scale", float("nan"), "guidance_scale nan must be a finite number"),
        ("seed", -1, "seed -1 must be an integer"),
        ("prompt", None, "prompt None must be a string"),
    ],
)
def test_request_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        GenerationRequest(**{**REQUEST, field: value})


def test_request_geometry_must_fit_the_patch():
    runner = Runner(load_tiny_pipeline())
    with pytest.raises(ValueError, match="must be multiples of 16"):
        runner.prepare(GenerationRequest(**{**REQUEST, "height": 72}))


def test_a_second_guidance_scale_needs_two_experts(dpm_runner):
    """Family.check_request, for every one-expert family (CogVideoX took it and dropped it)."""
    with pytest.raises(ValueError, match=r"guidance_scale_2 is for two-expert pipelines \(Wan 2.2 A14B\); "
                                         r"CogVideoXPipeline has one transformer: drop it \(got 3.0\)"):
        dpm_runner.prepare(GenerationRequest(**REQUEST, guidance_scale_2=3.0))


def test_runner_needs_a_supported_pipeline():
    with pytest.raises(ValueError, match="raydit cannot run a str; load one of .*CogVideoXPipeline"):
        Runner("not a pipeline")


def test_resume_from_checkpoint_is_exact(dpm_runner):
    request = GenerationRequest(**REQUEST, seed=4)
    full = run_steps(dpm_runner, request, 3)
    checkpoint = dpm_runner.checkpoint(run_steps(dpm_runner, request, 1))
    for key, value in checkpoint.items():
        assert value is None or isinstance(value, (int, float, str, dict, torch.Tensor)), key
        if isinstance(value, torch.Tensor):
            assert value.device.type == "cpu"
    assert checkpoint["step_index"] == 1 and checkpoint["carry"]["old_pred_original_sample"] is not None
    resumed = run_steps(dpm_runner, request, 3, checkpoint=checkpoint)
    assert resumed.step_index == full.step_index == 3 and resumed.num_steps == 3
    torch.testing.assert_close(resumed.latents, full.latents, rtol=0, atol=0)


def test_step_leaves_the_old_state_valid(dpm_runner):
    state = dpm_runner.prepare(GenerationRequest(**REQUEST, seed=1))
    first, again = dpm_runner.step(state), dpm_runner.step(state)
    assert state.step_index == 0
    torch.testing.assert_close(first.latents, again.latents, rtol=0, atol=0)


def test_resume_refuses_another_request(dpm_runner):
    checkpoint = dpm_runner.checkpoint(dpm_runner.prepare(GenerationRequest(**REQUEST, seed=1)))
    with pytest.raises(ValueError, match="checkpoint belongs to request"):
        dpm_runner.prepare(GenerationRequest(**REQUEST, seed=2), checkpoint=checkpoint)


def test_step_after_the_last_is_refused(dpm_runner):
    state = run_steps(dpm_runner, GenerationRequest(**{**REQUEST, "num_inference_steps": 1}), 1)
    assert state.done
    with pytest.raises(ValueError, match="all 1 steps are done"):
        dpm_runner.step(state)


def test_prompts_change_the_result():
    runner = Runner(load_tiny_pipeline())
    a = run_steps(runner, GenerationRequest(**REQUEST), 1)
    b = run_steps(runner, GenerationRequest(**{**REQUEST, "prompt": "a dog"}), 1)
    assert not torch.allclose(a.latents, b.latents)


def test_decode_gives_uint8_frames():
    runner = Runner(load_tiny_pipeline())
    state = run_steps(runner, GenerationRequest(**REQUEST), 2)
    frames = runner.decode(state)
    assert frames.shape == (TINY_FRAMES, TINY_HEIGHT, TINY_WIDTH, 3) and frames.dtype == np.uint8
    assert frames.std() > 0


def test_decode_cuts_the_temporal_patch_padding():
    """CogVideoX1.5: 9 frames -> 3 latent frames, padded to 4 for patch_size_t 2, cut at decode."""
    pipe = cogvideox_pipeline(str(tiny_pipeline_dir()), patch_size_t=2, use_rotary_positional_embeddings=True)
    runner = Runner(pipe)
    state = run_steps(runner, GenerationRequest(**REQUEST), 1)
    assert state.latents.shape[1] == 4 and state.context["additional_frames"] == 1
    assert runner.decode(state).shape == (TINY_FRAMES, TINY_HEIGHT, TINY_WIDTH, 3)


@pytest.mark.parametrize("degree", [3, 4])
def test_a_cfg_degree_that_does_not_divide_the_branches_is_refused(degree):
    """CogVideoX runs at most 2 guidance branches a step: cfg 3 and 4 are refused in one line
    (LTX-2 declares 4 and takes cfg 4: the conformance suite runs it)."""
    from raydit.parallel.mesh import build_mesh

    mesh = dataclasses.replace(build_mesh(1), cfg=degree)
    with pytest.raises(ValueError, match=f"cfg_degree {degree} does not divide the 2 guidance branches a "
                                         "CogVideoXPipeline step runs at most; use 1, 2$"):
        Runner(load_tiny_pipeline(), mesh)
