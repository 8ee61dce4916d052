"""SkyReels-V2: what the shared conformance suite does not cover.

The suite (tests/models/test_conformance.py) runs the family's cases on every plan (the
diffusion-forcing forward with a timestep per frame, the block-causal mask on 2 and 5 ranks,
T2V, asynchronous DF in causal blocks, a long DF video in windows, I2V) and checks one process
against diffusers' own pipelines (float32 1e-5, bf16/fp16 bit for bit). Here: that
causal_block_size reaches the transformer and is not left set, the per-frame scheduler state
a long video's checkpoint carries across a window change, the planner's spec of the tiny
directories, and the one-line errors for requests the pipelines cannot take.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raydit.models import conformance as harness
from raydit.models.requests import GenerationRequest, checker_image, image_to_png
from raydit.models.families.skyreels import cases, family, tiny
from raydit.models.runner import Runner


@pytest.fixture(scope="module")
def df_dir():
    return str(tiny.tiny_pipeline_dir("tiny-skyreels-df"))


@pytest.fixture(scope="module")
def df_pipe(df_dir):
    return cases.skyreels_pipeline(df_dir)


def test_causal_block_size_reaches_the_transformer_and_is_not_left_behind(df_pipe):
    """causal_block_size 2 (the suite's skyreels-df-causal case, checked there against diffusers
    and on 2 and 4 ranks) changes the video, and neither diffusers' call (which rewrites the
    transformer's num_frame_per_block) nor raydit's leaves it set for the next request."""
    request = GenerationRequest(prompt="a lighthouse", num_frames=13, height=48, width=80, num_inference_steps=2,
                                guidance_scale=5.0, seed=5, guidance_options=dict(causal_block_size=2))
    expected = family.FAMILY.reference_latents(df_pipe, request)
    assert df_pipe.transformer.config.num_frame_per_block == 1  # restored after diffusers' call
    torch.testing.assert_close(harness.run_steps(Runner(df_pipe), request, None).latents, expected,
                               rtol=1e-5, atol=1e-5)
    plain = harness.run_steps(Runner(df_pipe), dataclasses.replace(request, guidance_options=()), None)
    assert not torch.allclose(plain.latents, expected, rtol=1e-3, atol=1e-3)
    assert torch.equal(plain.latents, family.FAMILY.reference_latents(df_pipe, plain.request))


def test_long_video_checkpoint_across_a_window_change(df_pipe):
    """A checkpoint taken on the last step of a window holds the next window's latents and
    fresh per-frame schedulers; resuming from it equals the uninterrupted run bit for bit."""
    request = GenerationRequest(prompt="a river", num_frames=13, height=32, width=48, num_inference_steps=2,
                                guidance_scale=5.0, seed=8,
                                guidance_options=dict(base_num_frames=9, overlap_history=5, addnoise_condition=20))
    runner = Runner(df_pipe)
    state = runner.prepare(request)
    assert state.num_steps == 4 and tuple(state.latents.shape[2:]) == (4, 4, 6)  # 2 windows of 3 latent frames
    state = runner.step(runner.step(state))  # the first window done
    assert state.carry["window"].shape[2] == 3 and len(state.carry["frames"]) == 3
    checkpoint = runner.checkpoint(state)
    whole = harness.run_steps(runner, request, None).latents
    resumed = harness.run_steps(Runner(cases.skyreels_pipeline(tiny.tiny_pipeline_dir("tiny-skyreels-df"))),
                                request, None, checkpoint=checkpoint).latents
    assert torch.equal(resumed, whole)
    # The window's frames [0, 2) hold the first window's last two frames: its overlap.
    torch.testing.assert_close(checkpoint["carry"]["window"][:, :, :2], checkpoint["latents"][:, :, 1:3])


def test_diffusion_forcing_requests_run_alone(df_pipe):
    request = GenerationRequest(prompt="x", num_frames=9, height=48, width=80, num_inference_steps=2)
    assert family.FAMILY.batch_key(df_pipe, request) is None


def test_spec_of_the_tiny_directories():
    import raydit

    for name, frames in (("tiny-skyreels", 9), ("tiny-skyreels-i2v", 9), ("tiny-skyreels-df", 9)):
        spec = raydit.model_spec(str(tiny.tiny_pipeline_dir(name)))
        assert (spec.family, spec.heads, spec.head_dim, spec.layers) == ("skyreels", 6, 12, 2)
        assert (spec.default_frames, spec.default_height, spec.default_width) == (frames, 48, 80)
        assert spec.in_channels == (12 if name.endswith("i2v") else 4)


BAD = [
    (dict(num_frames=17), "num_frames 17 exceeds base_num_frames 9: give overlap_history", dict(base_num_frames=9)),
    (dict(), "overlap_history and addnoise_condition apply to long videos only", dict(overlap_history=5)),
    (dict(num_frames=13), "causal_block_size 3 must divide the 4 latent frames of every window",
     dict(causal_block_size=3)),
    (dict(), "guidance option ar_step=-1 must be an integer >= 0", dict(ar_step=-1)),
    (dict(), "guidance option base_num_frames=10 must be 4k + 1", dict(base_num_frames=10)),
    (dict(num_frames=17), "overlap_history 9 must leave new frames", dict(base_num_frames=9, overlap_history=9)),
    (dict(), "guidance option addnoise_condition=-2 must be a number >= 0", dict(addnoise_condition=-2)),
]


@pytest.mark.parametrize("fields, message, options", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_diffusion_forcing_requests_are_one_line(df_pipe, fields, message, options):
    request = GenerationRequest(**{**dict(prompt="x", num_frames=9, height=48, width=80, num_inference_steps=2),
                                   **fields}, guidance_options=options)
    with pytest.raises(ValueError) as info:
        Runner(df_pipe).prepare(request)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_other_requests_are_refused_in_one_line(df_pipe):
    t2v = cases.skyreels_pipeline(str(tiny.tiny_pipeline_dir("tiny-skyreels")))
    base = dict(prompt="x", num_frames=9, height=48, width=80, num_inference_steps=2)
    refusals = [
        (t2v, GenerationRequest(**base, guidance_options=dict(ar_step=2)), "are diffusion forcing's"),
        (df_pipe, GenerationRequest(**base, image=image_to_png(checker_image(48, 80))), "takes no image"),
        (t2v, GenerationRequest(**base, guidance_scale_2=3.0), "has one transformer"),
        (t2v, GenerationRequest(**{**base, "num_frames": 10}), "must be 4k + 1"),
        (df_pipe, GenerationRequest(**base, guidance_options=dict(stg_scale=1.0)), "are not taken by"),
    ]
    for pipe, request, message in refusals:
        with pytest.raises(ValueError) as info:
            Runner(pipe).prepare(request)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
