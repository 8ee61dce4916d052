"""The LTX-2 family: what the shared conformance suite does not cover.

The suite (tests/models/test_conformance.py) runs the family's cases on its plans and checks one
process against diffusers' LTX2Pipeline / LTX2ImageToVideoPipeline (video and audio latents).
Here: the guidance options a request carries (their normal form and one-line errors) and the
requests the pipelines cannot take.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from raydit.models.families import ltx2
from raydit.models.family import GenerationRequest
from raydit.models.runner import Runner


@pytest.fixture(scope="module")
def pipe():
    return ltx2.ltx2_pipeline(str(ltx2.tiny_pipeline_dir()))


REQUEST = GenerationRequest(**ltx2.TINY_REQUEST)


def test_guidance_options_normal_form_survives_a_checkpoint():
    a = GenerationRequest(prompt="x", num_frames=9, height=32, width=32,
                          guidance_options={"stg_scale": 0.5, "stg_blocks": [3, 1]})
    b = GenerationRequest(prompt="x", num_frames=9, height=32, width=32,
                          guidance_options=[("stg_blocks", (3, 1)), ("stg_scale", 0.5)])
    assert a == b and a.guidance_options == (("stg_blocks", (3, 1)), ("stg_scale", 0.5))
    assert GenerationRequest(**json.loads(json.dumps(a.to_dict()))) == a  # a checkpoint's JSON form
    assert a.option("stg_scale") == 0.5 and a.option("modality_scale", 3.0) == 3.0


@pytest.mark.parametrize("options, message", [
    ({"stg scale": 1.0}, "must be an identifier"),
    ({"stg_scale": float("nan")}, "must be a finite number"),
    ({"stg_blocks": [1.5]}, "a list must hold integers"),
    ({"stg_scale": "high"}, "must be a number, a bool or a list of integers"),
    ("stg_scale=1", "must be a dict"),
])
def test_malformed_guidance_options_get_one_line(options, message):
    with pytest.raises(ValueError, match=message) as err:
        GenerationRequest(prompt="x", num_frames=9, height=32, width=32, guidance_options=options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("options, message", [
    ({"stg_blocks": (2,)}, r"stg_blocks=\(2,\) must list block indices in 0..1"),
    ({"guidance_rescale": 1.5}, "must be in \\[0, 1\\]"),
    ({"audio_stg_scale": -1.0}, "must be a number >= 0"),
    ({"use_cross_timestep": 1}, "must be true or false"),
    ({"image_crf": 18}, "image_crf is for image-to-video requests"),
    ({"cfg_trunc": 0.5}, "cfg_trunc are not taken by LTX2Pipeline"),
])
def test_bad_ltx2_options_get_one_line(pipe, options, message):
    request = dataclasses.replace(REQUEST, guidance_options=options)
    with pytest.raises(ValueError, match=message) as err:
        Runner(pipe).prepare(request)
    assert "\n" not in str(err.value)


def test_other_families_refuse_guidance_options():
    from raydit.models.families import ltx

    pipe = ltx.ltx_pipeline(str(ltx.tiny_pipeline_dir()))
    request = GenerationRequest(prompt="x", num_frames=9, height=32, width=32, guidance_options={"stg_scale": 1.0})
    with pytest.raises(ValueError, match="stg_scale are not taken by LTXPipeline .it takes: none."):
        Runner(pipe).prepare(request)


@pytest.mark.parametrize("change, message", [
    (dict(num_frames=12), "num_frames 12 must be 8k \\+ 1; nearest: 9 or 17"),
    (dict(width=400), "width 400 must be a multiple of 32; nearest: 384 or 416"),
    (dict(guidance_scale_2=2.0), "guidance_scale_2 is for two-expert pipelines"),
    (dict(cache="fbcache"), "step caching .fbcache. is not supported for LTX-2"),
])
def test_bad_requests_get_one_line(pipe, change, message):
    with pytest.raises(ValueError, match=message):
        Runner(pipe).prepare(dataclasses.replace(REQUEST, **change))


def test_the_image_crf_needs_pyav_or_zero():
    """LTX2ImageToVideoPipeline re-compresses the image (CRF 33) with PyAV; without PyAV the
    request says so in one line and names the way out (image_crf=0)."""
    pytest.importorskip("PIL")
    try:
        import av  # noqa: F401
        pytest.skip("PyAV is installed: the re-compression runs")
    except ImportError:
        pass
    from raydit.models.conformance import test_image
    from raydit.models.family import image_to_png

    pipe = ltx2.ltx2_pipeline(str(ltx2.tiny_i2v_pipeline_dir()))
    request = dataclasses.replace(REQUEST, image=image_to_png(test_image(32, 416)), guidance_options={})
    with pytest.raises(ValueError, match="CRF 33 .* needs PyAV .* image_crf=0"):
        Runner(pipe).prepare(request)


def test_guidance_options_from_the_command_line(capsys):
    from raydit.cli import main
    from raydit.commands import parse_guidance_options

    assert parse_guidance_options(["stg_scale=0", "stg_blocks=28,29", "use_cross_timestep=false",
                                   "modality_scale=2.5"]) == (
        ("modality_scale", 2.5), ("stg_blocks", (28, 29)), ("stg_scale", 0), ("use_cross_timestep", False))
    for bad, message in [("stg_scale", "must be NAME=VALUE"), ("stg_blocks=1,x", "integers separated by commas"),
                         ("stg_scale=lots", "is not a number")]:
        assert main(["generate", "--prompt", "a fox", "--device", "cpu", "--guidance-option", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("frames", [9, 17, 41])
def test_the_planner_counts_the_audio_tokens_init_makes(pipe, frames):
    """The planner's La for a request is the audio latent length `init` prepares for it."""
    import raydit

    spec = raydit.model_spec(str(ltx2.tiny_pipeline_dir()))
    request = dataclasses.replace(REQUEST, num_frames=frames, guidance_options={"stg_blocks": (1,)})
    state = Runner(pipe).prepare(request)
    assert state.context["audio_frames"] == spec.geometry(frames, 32, 416).audio_tokens
    assert state.context["audio_shape"][0] == state.context["audio_frames"]  # the packed latents [La, Ca]
