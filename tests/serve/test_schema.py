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
                 "lora": "style", "cache": "teacache", "cache_threshold": 0.3, "guidance_options": {"stg_scale": 0.5},
                 "scheduler_options": '{"shift": 5}', "sigmas": "1,0.75,0.5", "timesteps": [900, 500]}


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


def test_a_step_list_sets_the_steps_and_the_server_default_never_overrides_it():
    """A form's sigmas (text: numbers separated by commas) set the step count (the server's
    default 4 does not apply); a count that disagrees, both lists, a bad list: refused, named."""
    given = _resolve({**BASE, "sigmas": "1,0.75,0.5", "scheduler": "FlowMatchEulerDiscreteScheduler",
                      "scheduler_options": '{"shift": 5, "use_dynamic_shifting": false}'})
    assert (given["num_inference_steps"], given["sigmas"]) == (3, [1.0, 0.75, 0.5])
    assert given["scheduler_options"] == [["shift", 5], ["use_dynamic_shifting", False]]
    assert _resolve({**BASE, "timesteps": [900, 500], "num_inference_steps": 2})["num_inference_steps"] == 2
    assert _resolve(BASE)["num_inference_steps"] == LIMITS.default_steps
    for body, param, needle in [
        ({"sigmas": "1,0.5", "num_inference_steps": 3}, "num_inference_steps", "disagrees with the 2 sigmas"),
        ({"sigmas": "1,0.5", "timesteps": "900,500"}, "timesteps", "not both"),
        ({"sigmas": "1,x"}, "sigmas", "numbers separated by commas"),
        ({"sigmas": []}, "sigmas", "empty list"),
        ({"scheduler_options": "{shift"}, "scheduler_options", "not valid JSON"),
    ]:
        with pytest.raises(RequestError, match=needle) as info:
            _resolve({**BASE, **body})
        assert info.value.param == param, body


def test_a_scheduler_the_model_does_not_take_is_refused_with_the_ones_it_does():
    """Against the served pipeline's own scheduler config (Limits.model_dir): a 400 naming the
    field, before the video is queued."""
    from dataclasses import replace

    from raydit.models.loading import resolve_model_dir

    limits = replace(LIMITS, model="tiny-wan", model_dir=str(resolve_model_dir("tiny-wan")))
    for body, param, needle in [
        ({"scheduler": "NoSuchScheduler"}, "scheduler", "use one of: .*FlowMatchLCMScheduler"),
        ({"scheduler": "FlowMatchEulerDiscreteScheduler", "scheduler_options": {"shfit": 5}}, "scheduler_options",
         "takes no option shfit"),
    ]:
        with pytest.raises(RequestError, match=needle) as info:
            resolve(parse_body({**BASE, **body}), limits, TINY)
        assert info.value.param == param
    ok = resolve(parse_body({**BASE, "scheduler": "FlowMatchLCMScheduler", "sigmas": [1, 0.757, 0.522]}), limits, TINY)
    assert ok["scheduler"] == "FlowMatchLCMScheduler" and ok["num_inference_steps"] == 3
