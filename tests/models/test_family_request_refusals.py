"""Requests the families took and then ran otherwise than asked (found by auditing them against
diffusers' pipelines): each is now one ValueError line from `check_request`, naming the value
and the fix, before anything runs. The tiny built-in pipelines; no step runs (seconds).
"""

from __future__ import annotations

import functools

import pytest

from raydit.models.requests import GenerationRequest, checker_image, image_to_png
from raydit.models.loading import load_pipeline
from raydit.models.registry import family_for_class


@functools.lru_cache(maxsize=None)
def _pipe(name):
    return load_pipeline(name)


def _check(name, **kw):
    pipe = _pipe(name)
    base = dict(prompt="a red fox", num_frames=9, height=32, width=32, num_inference_steps=2, guidance_scale=5.0)
    base.update(kw)
    family_for_class(type(pipe).__name__).check_request(pipe, GenerationRequest(**base))


def _refused(name, match, **kw):
    with pytest.raises(ValueError, match=match) as info:
        _check(name, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


# -- Wan 2.2 A14B: guidance_scale_2 without classifier-free guidance ---------------------------------
def test_wan_guidance_scale_2_without_guidance_is_refused():
    """WanPipeline runs the negative branch only when guidance_scale > 1 (for both experts), so
    guidance_scale_2 5 with guidance_scale 1 ran the second expert unguided: refused."""
    message = _refused("tiny-wan-a14b", r"guidance_scale_2 5 has no effect with guidance_scale 1",
                       num_frames=5, guidance_scale=1.0, guidance_scale_2=5.0)
    assert "raise guidance_scale or drop guidance_scale_2" in message
    # What does take effect is accepted: guided first expert, either scale on the second.
    _check("tiny-wan-a14b", num_frames=5, guidance_scale=5.0, guidance_scale_2=1.0)
    _check("tiny-wan-a14b", num_frames=5, guidance_scale=1.0, guidance_scale_2=1.0)
    _check("tiny-wan-a14b", num_frames=5, guidance_scale=1.0)


# -- LTX-2: an audio knob of 0 is the video's value in LTX2Pipeline ------------------------------------
@pytest.mark.parametrize("options, fallback", [
    ({"audio_stg_scale": 0}, r"audio_stg_scale=0 would run as stg_scale \(1\)"),
    ({"audio_guidance_rescale": 0}, r"audio_guidance_rescale=0 would run as guidance_rescale \(0.7\)"),
    ({"audio_guidance_scale": 0}, r"audio_guidance_scale=0 would run as guidance_scale \(5\)"),
    ({"audio_modality_scale": 0, "modality_scale": 2}, r"audio_modality_scale=0 would run as modality_scale \(2\)"),
])
def test_ltx2_audio_zero_that_falls_back_is_refused(options, fallback):
    _refused("tiny-ltx2", fallback, guidance_options=options)


def test_ltx2_audio_zero_with_the_video_zero_too_is_taken():
    """Both 0: the pipeline's fallback gives 0, what was asked (the README's way to turn STG off)."""
    _check("tiny-ltx2", guidance_options={"stg_scale": 0, "audio_stg_scale": 0})
    _check("tiny-ltx2", guidance_options={"guidance_rescale": 0, "audio_guidance_rescale": 0})
    _check("tiny-ltx2", guidance_options={"audio_stg_scale": 0.5, "audio_modality_scale": 1})


# -- SkyReels-V2 diffusion forcing: fps the transformer has no embedding for -------------------------
def test_skyreels_df_fps_without_an_embedding_is_refused():
    """The pipeline maps fps 16 to embedding 0 and every other value to 1 (24's): fps=30 ran as 24."""
    message = _refused("tiny-skyreels-df", r"guidance option fps=30 is not one SkyReels-V2 is conditioned on",
                       guidance_options={"fps": 30})
    assert "give fps=16 or fps=24" in message
    _check("tiny-skyreels-df", guidance_options={"fps": 16})
    _check("tiny-skyreels-df", guidance_options={"fps": 24})


# -- CogVideoX image-to-video with learned positional embeddings (CogVideoX-5b-I2V) ----------------
def test_cogvideox_learned_positions_at_another_size_are_refused_up_front():
    """diffusers' patch embedding raises at the first transformer call, naming neither the size
    asked for nor the one it takes; check_request names both."""
    message = _refused("tiny-i2v", r"height 32 and width 32: .* learned positional embeddings for 64 x 64 only",
                       image=image_to_png(checker_image(32, 32)))
    assert "ask for height 64 and width 64" in message
    _check("tiny-i2v", height=64, width=64, image=image_to_png(checker_image(64, 64)))
    _check("tiny", height=32, width=48)  # sinusoidal positions: any size
