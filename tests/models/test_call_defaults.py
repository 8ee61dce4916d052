"""A request that leaves out steps or guidance runs what the model's diffusers pipeline runs when
its caller leaves them out (`Family.call_defaults`): Wan 5.0, LTX 3, Mochi 4.5 and 64 steps, LTX-2
30 steps, HunyuanVideo 1.5 its guider's scale. raydit once asked 50 steps at guidance 6.0 of
every model. The Engine, `raydit generate` and `raydit serve` fill a request's gaps from it
(the end-to-end check: tests/runtime/test_cli_models.py, whose runs give no --guidance-scale)."""

from __future__ import annotations

import json

import pytest


# pipeline class -> (steps, guidance) as diffusers' __call__ defaults them (diffusers 0.37+).
EXPECTED = {
    "CogVideoXPipeline": (50, 6.0),
    "CogVideoXImageToVideoPipeline": (50, 6.0),
    "WanPipeline": (50, 5.0),
    "WanImageToVideoPipeline": (50, 5.0),
    "HunyuanVideoPipeline": (50, 6.0),
    "HunyuanVideoImageToVideoPipeline": (50, 1.0),
    "LTXPipeline": (50, 3.0),
    "LTX2Pipeline": (30, 3.0),
    "MochiPipeline": (64, 4.5),
    "Kandinsky5T2VPipeline": (50, 5.0),
    "SkyReelsV2Pipeline": (50, 6.0),
    "SkyReelsV2ImageToVideoPipeline": (50, 5.0),
    "SkyReelsV2DiffusionForcingPipeline": (50, 6.0),
}


def family_of(path):
    from raydit.runtime.engine.validation import family_of

    return family_of(path)


def _pipeline_dir(tmp_path, name, guider=None):
    """A directory that names the pipeline class (all call_defaults reads), with a guider config."""
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": name}))
    if guider is not None:
        (tmp_path / "guider").mkdir()
        (tmp_path / "guider" / "guider_config.json").write_text(json.dumps(guider))
    return str(tmp_path)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_models_defaults_are_its_pipelines_own(tmp_path, name):
    path = _pipeline_dir(tmp_path, name)
    steps, guidance = EXPECTED[name]
    assert family_of(path).call_defaults(path) == {"num_inference_steps": steps, "guidance_scale": guidance}


def test_hunyuanvideo15_takes_its_guiders_scale(tmp_path):
    """HunyuanVideo15Pipeline's call has no guidance_scale: the saved guider's scale is the default,
    ClassifierFreeGuidance's own where the config gives none."""
    from inspect import signature

    from diffusers import ClassifierFreeGuidance

    (tmp_path / "a").mkdir()
    given = _pipeline_dir(tmp_path / "a", "HunyuanVideo15Pipeline", guider={"_class_name": "ClassifierFreeGuidance", "guidance_scale": 7.5})
    assert family_of(given).call_defaults(given) == {"num_inference_steps": 50, "guidance_scale": 7.5}
    (tmp_path / "b").mkdir()
    bare = _pipeline_dir(tmp_path / "b", "HunyuanVideo15Pipeline", guider={"_class_name": "ClassifierFreeGuidance"})
    own = signature(ClassifierFreeGuidance.__init__).parameters["guidance_scale"].default
    assert family_of(bare).call_defaults(bare)["guidance_scale"] == float(own)


def test_the_command_line_and_the_server_leave_the_gaps_to_the_model(tmp_path):
    """Neither `raydit generate` nor `raydit serve` fixes a step count or a guidance of its own."""
    from raydit.cli import build_parser
    from raydit.commands import resolve_generate_options
    from raydit.runtime import options as _options
    from raydit.serve.config import resolve_serve_options

    opts = resolve_generate_options(build_parser().parse_args(
        ["generate", "--prompt", "a kite", "--out", str(tmp_path / "a.mp4")]))
    assert opts.get("steps") is None and opts.get("guidance_scale") is None
    kwargs = _options.request_kwargs(opts, "generate")
    assert "num_inference_steps" not in kwargs and "guidance_scale" not in kwargs  # submit's defaults: None
    signature = _options.submit_signature()  # Engine.submit's: None, the model's own
    assert signature.parameters["num_inference_steps"].default is None
    assert signature.parameters["guidance_scale"].default is None
    assert resolve_serve_options({}).get("default_steps") is None
