"""The LTX-Video family: what the shared conformance suite does not cover.

The suite (tests/models/test_conformance.py) runs the family's cases on every plan and
checks one process against diffusers' own pipelines. Here: the one-line errors for requests
the pipeline cannot take, and the latents kept packed as tokens, as LTXPipeline returns them.
"""

from __future__ import annotations

import dataclasses

import pytest

from raydit.models.families.ltx import cases, tiny
from raydit.models.requests import GenerationRequest
from raydit.models.runner import Runner


@pytest.fixture(scope="module")
def ltx_pipe():
    return cases.ltx_pipeline(str(tiny.tiny_pipeline_dir()))


REQUEST = GenerationRequest(prompt="a red fox runs", negative_prompt="blur", num_frames=5, height=32, width=32,
                            num_inference_steps=2, guidance_scale=6.0, seed=3)


@pytest.mark.parametrize("change, message", [
    (dict(num_frames=5), "num_frames 5 must be 8k \\+ 1; nearest: 1 or 9"),
    (dict(width=48), "width 48 must be a multiple of 32 .* nearest: 32 or 64"),
    (dict(true_cfg_scale=2.0), "true_cfg_scale 2.0 is for pipelines with embedded guidance"),
])
def test_ltx_bad_requests_get_one_line(ltx_pipe, change, message):
    request = dataclasses.replace(REQUEST, **{**dict(num_frames=9, height=32, width=64), **change})
    with pytest.raises(ValueError, match=message) as err:
        Runner(ltx_pipe).prepare(request)
    assert "\n" not in str(err.value)


def test_ltx_latents_stay_packed_as_tokens(ltx_pipe):
    """What output_type="latent" returns: [1, frames x height x width, channels]."""
    state = Runner(ltx_pipe).prepare(dataclasses.replace(REQUEST, num_frames=17, height=32, width=64))
    assert tuple(state.latents.shape) == (1, 3 * 1 * 2, tiny.TINY_LATENT_CHANNELS)
    assert len(state.branches) == 1 and state.branches[0]["encoder_hidden_states"].shape[0] == 2  # [neg, pos]
