"""HunyuanVideo 1.5: what the shared conformance suite does not cover.

The suite (tests/models/test_conformance.py) runs the family's cases on every plan and checks
one process against diffusers' own pipelines. Here: the guider's scale comes from the request,
the text the tiny tokenizer and the glyph encoder produce, the text mask the processor accepts,
the default size the planner computes, and the one-line errors for requests the pipelines
cannot take.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raydit.models.requests import GenerationRequest, checker_image, image_to_png
from raydit.models.families.hunyuanvideo15 import cases, family, tiny
from raydit.models.runner import Runner


@pytest.fixture(scope="module")
def pipe():
    return cases.hunyuan15_pipeline(str(tiny.tiny_pipeline_dir()))


@pytest.fixture(scope="module")
def i2v_pipe():
    return cases.hunyuan15_pipeline(str(tiny.tiny_i2v_pipeline_dir()))


REQUEST = GenerationRequest(prompt="a red fox runs", negative_prompt="blur", num_frames=5, height=48, width=80,
                            num_inference_steps=1, guidance_scale=3.0, seed=3)


def test_guidance_scale_sets_the_guider(pipe):
    """The request's guidance_scale is the guider's: the runner at 3.0 equals diffusers'
    pipeline holding a ClassifierFreeGuidance(3.0), and differs from its saved 6.0 guider."""
    from diffusers.guiders import ClassifierFreeGuidance

    state = Runner(pipe).prepare(REQUEST)
    assert len(state.branches) == 2  # (negative, positive): two calls, as the guider's batches
    ours = Runner(pipe).step(state).latents
    saved = pipe.guider
    try:
        pipe.guider = ClassifierFreeGuidance(guidance_scale=3.0)
        theirs = pipe(prompt=REQUEST.prompt, negative_prompt="blur", num_frames=5, height=48, width=80,
                      num_inference_steps=1, generator=torch.Generator().manual_seed(3), output_type="latent").frames
    finally:
        pipe.guider = saved
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert saved.guidance_scale == 6.0 and pipe.guider is saved
    at_six = Runner(pipe).step(Runner(pipe).prepare(dataclasses.replace(REQUEST, guidance_scale=6.0))).latents
    assert not torch.allclose(ours, at_six)
    # guidance 1: one branch, no negative prompt encoded
    assert len(Runner(pipe).prepare(dataclasses.replace(REQUEST, guidance_scale=1.0)).branches) == 1


def test_the_prompt_survives_the_template_crop_and_glyphs_reach_byt5(pipe):
    """The tiny chat template is 108 tokens, as Qwen2.5-VL's: the pipeline's crop leaves the
    prompt; quoted text goes to the ByT5 encoder, a prompt without quotes gives it nothing."""
    a, mask_a, glyph_a, glyph_mask_a = pipe.encode_prompt("a cat", device="cpu")
    b, _, _, _ = pipe.encode_prompt("a dog", device="cpu")
    assert a.shape == (1, family.QWEN_TOKENS, tiny.TINY_TEXT_DIM)
    assert not torch.equal(a, b)
    # "a", "c", "##a", "##t", then <|im_end|> <|im_start|> "assistant"
    assert int(mask_a.sum()) == 7
    assert int(glyph_mask_a.sum()) == 0 and not glyph_a.any()
    _, _, glyph, glyph_mask = pipe.encode_prompt('a sign saying "stop"', device="cpu")
    assert glyph.shape == (1, family.BYT5_TOKENS, tiny.TINY_BYT5_DIM) and int(glyph_mask.sum()) > 0


def test_valid_text_counts_reads_prefix_masks_and_refuses_others():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    assert family.valid_text_counts(mask, 4, 2) == [2, 3]
    assert family.valid_text_counts(None, 4, 2) == [4, 4]
    with pytest.raises(ValueError, match="prefix of the text tokens"):
        family.valid_text_counts(torch.tensor([[1, 0, 1, 0]]), 4, 1)


@pytest.mark.parametrize("target", [64, 640, 960])
def test_default_size_is_the_pipelines(target):
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    expected = HunyuanVideo15ImageProcessor(vae_scale_factor=16).calculate_default_height_width(9, 16, target)
    assert family.default_size(target) == tuple(expected)


@pytest.mark.parametrize("change, message", [
    (dict(num_frames=8), "num_frames 8 must be 4k \\+ 1; nearest: 5 or 9"),
    (dict(height=40), "height 40 must be a multiple of 16 .* nearest: 32 or 48"),
    (dict(guidance_scale_2=2.0), "guidance_scale_2 is for two-expert pipelines"),
    (dict(true_cfg_scale=2.0), "true_cfg_scale 2 is for pipelines whose guidance is embedded"),
    (dict(image=image_to_png(checker_image(48, 80))), "text-to-video pipeline and takes no image"),
])
def test_bad_requests_get_one_line(pipe, change, message):
    with pytest.raises(ValueError, match=message) as err:
        Runner(pipe).prepare(dataclasses.replace(REQUEST, **change))
    assert "\n" not in str(err.value)


def test_a_guider_the_runner_cannot_reproduce_is_refused(pipe):
    saved = pipe.guider
    try:
        pipe.guider = saved.new(guidance_rescale=0.7)
        with pytest.raises(ValueError, match="guider sets {'guidance_rescale': 0.7}") as err:
            Runner(pipe).prepare(REQUEST)
        assert "\n" not in str(err.value)
    finally:
        pipe.guider = saved


def test_i2v_sizes_come_from_the_image(i2v_pipe):
    """The I2V pipeline takes its size from the image's aspect bucket: another size is refused
    in one line naming the one it makes; no image is refused too."""
    square = image_to_png(checker_image(64, 64))
    with pytest.raises(ValueError, match="a 64x64 image gives height .* and width .*; ask for those") as err:
        Runner(i2v_pipe).prepare(dataclasses.replace(REQUEST, image=square))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="image-to-video pipeline; give an image"):
        Runner(i2v_pipe).prepare(REQUEST)
