"""The HunyuanVideo family: what the shared conformance suite does not cover.

The suite (tests/models/test_conformance.py) runs the family's cases on every plan and
checks one process against diffusers' own pipelines. Here: HunyuanVideo's embedded
guidance (one branch per step; a pair only for true CFG with a negative prompt), the joint
mask the processor accepts, and the one-line errors for requests the pipelines cannot take.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raydit.models.requests import GenerationRequest, checker_image, image_to_png
from raydit.models.families.hunyuanvideo import cases, family, tiny
from raydit.models.requests import png_to_image
from raydit.models.runner import Runner


@pytest.fixture(scope="module")
def hunyuan_pipe():
    return cases.hunyuan_pipeline(str(tiny.tiny_pipeline_dir()))


@pytest.fixture(scope="module")
def hunyuan_i2v_pipe():
    return cases.hunyuan_pipeline(str(tiny.tiny_i2v_pipeline_dir()))


REQUEST = GenerationRequest(prompt="a red fox runs", negative_prompt="blur", num_frames=5, height=32, width=32,
                            num_inference_steps=2, guidance_scale=6.0, seed=3)


def test_embedded_guidance_runs_one_branch_and_true_cfg_two(hunyuan_pipe):
    runner = Runner(hunyuan_pipe)
    state = runner.prepare(REQUEST)  # guidance 6 is embedded: a negative prompt alone asks for nothing
    assert len(state.branches) == 1 and state.branches[0]["encoder_hidden_states"].shape[0] == 1
    assert float(state.context["guidance"]) == 6000.0
    true_cfg = runner.prepare(dataclasses.replace(REQUEST, true_cfg_scale=3.0))
    assert len(true_cfg.branches) == 2  # (negative, positive): two calls, as the pipeline makes them
    assert not torch.equal(true_cfg.branches[0]["encoder_hidden_states"], true_cfg.branches[1]["encoder_hidden_states"])


def test_the_prompt_survives_the_template_crop(hunyuan_pipe):
    """The tiny tokenizer's template is 95 tokens, as Llama-3's: the pipeline's crop leaves the
    prompt (distinct prompts, distinct embeddings; the mask counts the prompt's tokens)."""
    a, _, mask_a = hunyuan_pipe.encode_prompt("a cat", device="cpu")
    b, _, mask_b = hunyuan_pipe.encode_prompt("a dog", device="cpu")
    assert a.shape == (1, family.MAX_SEQUENCE_LENGTH, tiny.TINY_TEXT_DIM)
    assert not torch.equal(a, b)
    # "a", "c", "##a", "##t", <|eot_id|> (the tokenizer splits unknown words into characters)
    assert int(mask_a.sum()) == int(mask_b.sum()) == 5


def test_valid_text_counts_reads_prefix_masks_and_refuses_others():
    video, text = 4, 3
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool).view(2, 1, 1, 7)
    assert family.valid_text_counts(mask, video, text, 2) == [2, 1]
    assert family.valid_text_counts(None, video, text, 2) == [3, 3]
    holes = torch.tensor([[1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool).view(1, 1, 1, 7)
    with pytest.raises(ValueError, match="prefix of the text tokens"):
        family.valid_text_counts(holes, video, text, 1)


@pytest.mark.parametrize("change, message", [
    (dict(true_cfg_scale=3.0, negative_prompt=""), "true_cfg_scale 3.0 needs a negative prompt"),
    (dict(num_frames=8), "num_frames 8 must be 4k \\+ 1; nearest: 5 or 9"),
    (dict(height=40), "height 40 must be a multiple of 16 .* nearest: 32 or 48"),
    (dict(guidance_scale_2=2.0), "guidance_scale_2 is for two-expert pipelines"),
])
def test_hunyuan_bad_requests_get_one_line(hunyuan_pipe, change, message):
    with pytest.raises(ValueError, match=message) as err:
        Runner(hunyuan_pipe).prepare(dataclasses.replace(REQUEST, **change))
    assert "\n" not in str(err.value)


# -- image-to-video ------------------------------------------------------------------------------
I2V_REQUEST = dataclasses.replace(REQUEST, num_frames=9, height=48, width=80,
                                  image=image_to_png(checker_image(48, 80)))


def test_image_for_text_to_video_and_none_for_image_to_video_get_one_line(hunyuan_pipe, hunyuan_i2v_pipe):
    with pytest.raises(ValueError, match="HunyuanVideoPipeline is a text-to-video pipeline and takes no image") as err:
        Runner(hunyuan_pipe).prepare(I2V_REQUEST)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="HunyuanVideoImageToVideoPipeline is an image-to-video pipeline; give an "
                                         "image") as err:
        Runner(hunyuan_i2v_pipe).prepare(dataclasses.replace(I2V_REQUEST, image=None))
    assert "\n" not in str(err.value)


def test_i2v_text_holds_the_image_and_the_cropped_prompt(hunyuan_i2v_pipe):
    """The tiny Llava tokenizer's template is 103 tokens with <image> 6th, as Llama-3's: the
    pipeline's crop leaves 576 / 4 image features, then the prompt; the image reaches the text."""
    image = png_to_image(I2V_REQUEST.image)
    black = png_to_image(image_to_png(checker_image(48, 80) * 0))
    a, _, mask_a = hunyuan_i2v_pipe.encode_prompt(image=image, prompt="a cat", device="cpu", image_embed_interleave=4)
    b, _, _ = hunyuan_i2v_pipe.encode_prompt(image=image, prompt="a dog", device="cpu", image_embed_interleave=4)
    c, _, _ = hunyuan_i2v_pipe.encode_prompt(image=black, prompt="a cat", device="cpu", image_embed_interleave=4)
    assert a.shape == (1, 144 + family.MAX_SEQUENCE_LENGTH - 4, tiny.TINY_TEXT_DIM)
    assert int(mask_a[0, :144].sum()) == 144 and int(mask_a.sum()) == 144 + 5  # "a", "c", "##a", "##t", <|eot_id|>
    assert torch.equal(a[:, :144], b[:, :144]) and not torch.equal(a[:, 144:149], b[:, 144:149])
    assert not torch.equal(a[:, :144], c[:, :144])


def test_token_replace_keeps_the_image_on_the_first_frame(hunyuan_i2v_pipe):
    runner = Runner(hunyuan_i2v_pipe)
    state = runner.step(runner.prepare(I2V_REQUEST))
    image_latents = state.context["image_latents"]
    assert image_latents.shape[2] == 1 and state.context["condition"] == "token_replace"
    assert torch.equal(state.latents[:, :, :1], image_latents)


@pytest.mark.parametrize("sp, first, expected", [
    (1, 15, [15]),
    (2, 15, [15, 0]),  # 45 tokens: chunks of 23
    (3, 15, [15, 0, 0]),  # chunks of 15: exactly rank 0's
    (4, 15, [12, 3, 0, 0]),  # chunks of 12
    (8, 15, [6, 6, 3, 0, 0, 0, 0, 0]),  # chunks of 6; the last rank holds 3 video tokens and padding
])
def test_first_frame_tokens_are_split_with_the_video(sp, first, expected):
    from raydit.parallel.sharding import SeqLayout

    layout = SeqLayout((45,), sp)
    assert [family.local_first_frame_tokens(layout, first, i) for i in range(sp)] == expected


def test_latent_concat_matches_diffusers_pipeline(hunyuan_i2v_pipe):
    """HunyuanVideo-I2V-33ch's conditioning (image latents on frame 0 and a frame mask as
    channels; the pipeline returns its latents less frame 0 and decodes 4 frames fewer): one
    process equals diffusers' own pipeline, its output_type="latent" layout included."""
    from diffusers import HunyuanVideoImageToVideoPipeline

    from raydit.models.conformance import run_steps

    channels = tiny.TINY_LATENT_CHANNELS
    transformer = tiny.tiny_transformer(41, in_channels=2 * channels + 1, out_channels=channels,
                                        image_condition_type="latent_concat")
    pipe = HunyuanVideoImageToVideoPipeline(**{**hunyuan_i2v_pipe.components, "transformer": transformer})
    pipe.set_progress_bar_config(disable=True)
    request = dataclasses.replace(I2V_REQUEST, true_cfg_scale=3.0)
    expected = family.FAMILY.reference_latents(pipe, request)
    runner = Runner(pipe)
    state = run_steps(runner, request, request.num_inference_steps)
    assert [b["encoder_hidden_states"].shape[1] for b in state.branches] == [288 + 252, 288 + 252]
    assert state.latents.shape[2] == expected.shape[2] + 1  # the runner keeps frame 0, as the pipeline's loop
    torch.testing.assert_close(family.FAMILY.output_latents(pipe, state), expected, rtol=1e-5, atol=1e-5)
    assert runner.decode(state).shape == (request.num_frames - 4, request.height, request.width, 3)
