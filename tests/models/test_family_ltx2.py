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

from raydit.models.families.ltx2 import cases, tiny
from raydit.models.requests import GenerationRequest
from raydit.models.runner import Runner


@pytest.fixture(scope="module")
def pipe():
    return cases.ltx2_pipeline(str(tiny.tiny_pipeline_dir()))


REQUEST = GenerationRequest(**cases.TINY_REQUEST)


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
    from raydit.models.families.ltx import cases as ltx_cases
    from raydit.models.families.ltx import tiny as ltx_tiny

    pipe = ltx_cases.ltx_pipeline(str(ltx_tiny.tiny_pipeline_dir()))
    request = GenerationRequest(prompt="x", num_frames=9, height=32, width=32, guidance_options={"stg_scale": 1.0})
    with pytest.raises(ValueError, match="stg_scale are not taken by LTXPipeline .it takes: none."):
        Runner(pipe).prepare(request)


@pytest.mark.parametrize("change, message", [
    (dict(num_frames=12), "num_frames 12 must be 8k \\+ 1; nearest: 9 or 17"),
    (dict(width=400), "width 400 must be a multiple of 32; nearest: 384 or 416"),
    (dict(guidance_scale_2=2.0), "guidance_scale_2 is for two-expert pipelines"),
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
    from raydit.models.requests import checker_image, image_to_png

    pipe = cases.ltx2_pipeline(str(tiny.tiny_i2v_pipeline_dir()))
    request = dataclasses.replace(REQUEST, image=image_to_png(checker_image(32, 416)), guidance_options={})
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

    spec = raydit.model_spec(str(tiny.tiny_pipeline_dir()))
    request = dataclasses.replace(REQUEST, num_frames=frames, guidance_options={"stg_blocks": (1,)})
    state = Runner(pipe).prepare(request)
    assert state.context["audio_frames"] == spec.geometry(frames, 32, 416).audio_tokens
    assert state.context["audio_shape"][0] == state.context["audio_frames"]  # the packed latents [La, Ca]


def _audio_lengths_worker(rank, world_size, thresholds):
    """Per threshold: the audio tokens each block's audio self-attention saw on this rank, the
    audio tokens video queries attended to, and the forward's output (video, audio)."""
    from raydit.models.registry import parallelize
    from raydit.parallel.mesh import build_mesh

    mesh = build_mesh(2, world_size // 2)  # Ulysses 2 x ring 2
    out = {}
    for threshold in thresholds:
        transformer, kwargs = cases.ltx2_forward(3, 1, 13, 18, (4, 11))
        seen = {"self": [], "a2v keys": []}
        hooks = []
        for block in transformer.transformer_blocks:
            hooks.append(block.audio_attn1.register_forward_pre_hook(
                lambda m, a, k: seen["self"].append(k["hidden_states"].shape[1]), with_kwargs=True))
            hooks.append(block.audio_to_video_attn.register_forward_pre_hook(
                lambda m, a, k: seen["a2v keys"].append(k["encoder_hidden_states"].shape[1]), with_kwargs=True))
        with parallelize(transformer, mesh, {"audio_split_tokens": threshold}):
            video, audio = transformer(**kwargs, return_dict=False)[:2]
        out[threshold] = (seen, video, audio)
    reference = cases.ltx2_forward(3, 1, 13, 18, (4, 11))
    return out, reference[0](**reference[1], return_dict=False)[:2]


@pytest.mark.long  # stage two: ~60 s
def test_audio_tokens_split_from_the_plans_threshold():
    """18 audio tokens on 4 ranks (Ulysses 2 x ring 2): a threshold of 18 splits them (5 a rank, the last 3 real + 2
    pads) and a threshold of 19 keeps all 18 on every rank; both equal one process (1e-5)."""
    import torch

    from raydit.parallel.testing import run_distributed

    for out, (video_1, audio_1) in run_distributed(_audio_lengths_worker, 4, (18, 19), timeout=300):
        seen, video, audio = out[18]
        assert seen == {"self": [5, 5], "a2v keys": [5, 5]}, seen
        seen_whole = out[19][0]
        assert seen_whole == {"self": [18, 18], "a2v keys": [18, 18]}, seen_whole
        for threshold in (18, 19):
            torch.testing.assert_close(out[threshold][1], video_1, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[threshold][2], audio_1, rtol=1e-5, atol=1e-5)


def test_bad_audio_split_options_get_one_line():
    from raydit.models.registry import parallelize
    from raydit.parallel.mesh import build_mesh

    transformer, _ = cases.ltx2_forward(3, 1, 13, 18, (4,))
    mesh = build_mesh(1, 1)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="audio_split_tokens .* must be an integer >= 1"):
            parallelize(transformer, mesh, {"audio_split_tokens": bad})
    # a model without an audio stream takes no such option (None, a plan's "never", is no option)
    from raydit.models.families.wan.tiny import tiny_transformer as wan_tiny

    other = wan_tiny(0)
    with pytest.raises(ValueError, match="takes no parallel option audio_split_tokens"):
        parallelize(other, mesh, {"audio_split_tokens": 4})
    parallelize(other, mesh, {"audio_split_tokens": None}).remove()
