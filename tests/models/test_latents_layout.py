"""Every family's latents are its pipeline's (issue 41 item 8).

What `raydit generate --save-latents` writes and `GenerationResult.latents` holds is what the
family's diffusers pipeline returns with output_type="latent": the same shape, the same
numbers. Here diffusers' pipeline is called directly, not through the family's
`reference_latents`: `pipe(prompt=..., num_inference_steps=2, generator=CPU generator(seed),
output_type="latent")` with its own defaults for everything else, except the sizes (the tiny
pipeline's defaults, the smallest it takes, where the pipeline's own are a real model's) and,
for an image-to-video pipeline, an image. raydit gets the same request with the pipeline's
defaults (its guidance_scale / true_cfg_scale, or its guider's scale).

- Every registered family (the registry, not a list: a new family is covered by its first
  tiny pipeline): raydit's one-process result, `Runner.output_latents`, which the worker
  returns with the frames and the Engine hands on as GenerationResult.latents.
- Through the Engine (one Ray worker): GenerationResult.latents, and where the pipeline makes
  sound, GenerationResult.audio_latents against the pipeline's `audio`, for the image-to-video
  Kandinsky 5 (its pipeline renormalizes the first latent frames before it returns them) and
  LTX-2.

Rules, float32: on one process, the same kernels on the same inputs in the same order, bit for
bit (assert_close with rtol=0, atol=0). Through the Engine the steps run in a Ray worker, another
process: not bit for bit there (tiny-kandinsky5-i2v: 346 of 480 values differ, by 8.1e-6 at
most), so held to the runtime tests' rtol=1e-4, atol=1e-4, far below a wrong layout (the same
latents without the pipeline's first-frame renormalization differ by 0.88). Measured by script
(2026-11-27) on both tiny pipelines of CogVideoX, HunyuanVideo, HunyuanVideo 1.5, Kandinsky 5
and LTX-Video: all bit for bit on one process (Kandinsky 5 I2V's only through output_latents:
its runner state is not the pipeline's output). LTX-2's are a (video, audio) pair, each held
to the pipeline's `frames` and `audio`.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from raydit.models.registry import families

PROMPT = "a red fox runs through snow"
STEPS = 2
SEED = 3
BIT_FOR_BIT = dict(rtol=0, atol=0)
WORKER = dict(rtol=1e-4, atol=1e-4)  # a Ray worker against this process: the runtime tests' tolerance


def _first_tinies() -> list:
    """(family, its first tiny pipeline) for every registered family."""
    return [pytest.param(name, next(iter(family.tiny())), id=name)
            for name, family in sorted(families().items()) if family.tiny()]


def _calls(tiny: str):
    """The pipeline called directly with diffusers' defaults (its output) and the raydit request
    with the same defaults, for the tiny pipeline `tiny`: (pipeline output, request kwargs)."""
    from raydit import model_spec
    from raydit.models.loading import load_pipeline, resolve_model_dir
    from raydit.models.registry import family_for_class
    from raydit.models.requests import checker_image, image_to_png, png_to_image

    spec = model_spec(str(resolve_model_dir(tiny)))
    sizes = dict(num_frames=spec.default_frames, height=spec.default_height, width=spec.default_width)
    pipe = load_pipeline(tiny)
    pipe.set_progress_bar_config(disable=True)
    params = inspect.signature(type(pipe).__call__).parameters
    kwargs = {k: v for k, v in sizes.items() if k in params}
    request = dict(prompt=PROMPT, num_inference_steps=STEPS, seed=SEED, **sizes)
    if type(pipe).__name__ in family_for_class(type(pipe).__name__).image_pipelines:
        request["image"] = image_to_png(checker_image(sizes["height"], sizes["width"]))
        kwargs["image"] = png_to_image(request["image"])
    # A transformer whose config fixes the text length (CogVideoX's max_text_seq_length; the
    # pipeline's default, 226, is the released checkpoints') takes only that length.
    config = pipe.transformer.config
    if "max_text_seq_length" in config and "max_sequence_length" in params:
        kwargs["max_sequence_length"] = config["max_text_seq_length"]
    for name in ("guidance_scale", "true_cfg_scale"):
        if name in params and params[name].default is not inspect.Parameter.empty:
            request[name] = params[name].default
    if "guidance_scale" not in params and getattr(pipe, "guider", None) is not None:
        request["guidance_scale"] = pipe.guider.guidance_scale  # a pipeline guided by its guider
    torch.manual_seed(SEED)  # the global generator, for a pipeline that draws from it
    with torch.no_grad():
        out = pipe(prompt=PROMPT, num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(SEED),
                   output_type="latent", **kwargs)
    return out, request


def _expect_same(mine: torch.Tensor, expected: torch.Tensor, what: str, tolerance: dict) -> None:
    assert tuple(mine.shape) == tuple(expected.shape), f"{what}: {tuple(mine.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(mine, expected.to(mine.dtype), **tolerance)


@pytest.mark.parametrize("family, tiny", _first_tinies())
def test_runner_output_latents_are_the_pipelines(family, tiny):
    """Runner.output_latents (what the worker hands the Engine) against diffusers' pipeline
    called directly, on the family's first tiny pipeline, in float32 on one process."""
    from raydit.models.conformance import run_steps
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    out, request = _calls(tiny)
    runner = Runner(load_pipeline(tiny))  # a pipeline of its own: diffusers' call may leave state behind
    try:
        state = run_steps(runner, GenerationRequest(**request), None)
        mine = runner.output_latents(state)
        video, audio = mine if isinstance(mine, tuple) else (mine, None)
        _expect_same(video, out.frames, f"{tiny} latents", BIT_FOR_BIT)
        assert (audio is None) == (getattr(out, "audio", None) is None), f"{tiny}: audio latents {audio is not None}"
        if audio is not None:
            _expect_same(audio, out.audio, f"{tiny} audio latents", BIT_FOR_BIT)
    finally:
        runner.close()


@pytest.mark.long  # the second stage; stage one: the Runner cases above and test_cli_ltx2's saved latents
@pytest.mark.parametrize("tiny", ["tiny-kandinsky5-i2v", "tiny-ltx2"])
def test_generation_result_latents_are_the_pipelines(ray_local, tiny):
    """GenerationResult.latents (and audio_latents where the pipeline makes sound) from an Engine
    with one worker, against diffusers' pipeline called directly; float32, to WORKER. The Engine
    is given no guidance scale: its default must be the pipeline's."""
    import numpy as np

    from raydit.models.requests import png_to_image
    from raydit.runtime.engine import Engine

    out, request = _calls(tiny)
    image = request.pop("image", None)
    # Left out, the guidance is the Engine's default: the model's pipeline's own, as here (Family.call_defaults).
    request.pop("guidance_scale")
    with Engine(model=tiny, device="cpu", workers=1, grow="never", show_plan=False) as engine:
        result = engine.generate(**request, image=None if image is None else png_to_image(image), progress=False)
    assert result.latents.dtype == np.float32
    _expect_same(torch.from_numpy(result.latents), out.frames, f"{tiny} latents", WORKER)
    if getattr(out, "audio", None) is not None:
        _expect_same(torch.from_numpy(np.asarray(result.audio_latents)), out.audio, f"{tiny} audio latents", WORKER)
    else:
        assert result.audio_latents is None, f"{tiny}: audio latents from a silent pipeline"
