"""raydit.serve.schema's resolution of POST /v1/videos reads every field the options table
gives the form: each reaches the request (or the request fields made of it), none is dropped.
Pure Python: the body model and `resolve`, no server."""

from __future__ import annotations

from typing import get_args

import pytest

from raydit.planner import model_spec
from raydit.runtime.options import form_fields
from raydit.serve.schema import FORM_INPUTS, FORM_REQUEST, Limits, RequestError, parse_body, resolve

TINY = model_spec("tiny")
LIMITS = Limits(model="tiny", max_frames=17, max_height=32, max_width=32, max_steps=50, default_steps=4,
                fps=8, vae_temporal=4, cache="fbcache", guidance_options=("stg_scale",))
BASE = {"prompt": "a fox", "seed": 5}
# Values that only this server's state makes valid (its plan's geometry, its LoRAs, its model's
# guidance options); every other field gets one from its declared type and bounds.
SERVER_VALUES = {"model": "not-served", "size": "16x16", "seconds": 1, "num_frames": 9, "num_inference_steps": 7,
                 "lora": "style", "cache": "teacache", "cache_threshold": 0.3, "guidance_options": {"stg_scale": 0.5}}


def _sample(name: str, spec: dict):
    if name in SERVER_VALUES:
        return SERVER_VALUES[name]
    kinds = get_args(spec["annotation"]) or (spec["annotation"],)
    least = spec.get("ge", spec.get("gt", 0))
    if int in kinds:
        return least + 3
    if float in kinds:
        return least + 1.5
    return "another text"


def _resolve(body: dict) -> dict:
    return resolve(parse_body(body), LIMITS, TINY, loras=("style",))


def test_every_form_field_is_read():
    assert set(form_fields()) == set(FORM_REQUEST) | set(FORM_INPUTS)


@pytest.mark.parametrize("name", sorted(form_fields()))
def test_every_form_field_reaches_the_request(name):
    """Each field, set to a value other than the base body's, changes the request fields it
    names (GenerationRequest's for a request option, those made of it for size and seconds);
    `model` is read as a check: a model not served is refused."""
    value = _sample(name, form_fields()[name])
    base = _resolve(BASE)
    if name == "model":
        with pytest.raises(RequestError, match="not served here") as info:
            _resolve({**BASE, name: value})
        assert info.value.param == "model"
        return
    given = _resolve({**BASE, name: value})
    targets = FORM_INPUTS.get(name) or (FORM_REQUEST[name],)
    for target in targets:
        assert target in given and given[target] != base.get(target), (name, target, given.get(target))
