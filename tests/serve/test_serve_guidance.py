"""`POST /v1/videos` `guidance_options` (a model's further guidance knobs, LTX-2's STG and
modality scales ...): parsed from JSON objects and from a form's JSON text, checked against the
names the served model takes, kept in the video's record and handed to the engine. Pure
Python: the body model, `resolve` and the service's arguments, no server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raydit.models.families.ltx2.guidance import OPTION_DEFAULTS
from raydit.planner import model_spec
from raydit.serve.schema import Limits, RequestError, parse_body, resolve

SPEC = model_spec("ltx-2")
LIMITS = Limits(model="tiny-ltx2", max_frames=9, max_height=64, max_width=64, max_steps=50, default_steps=2,
                fps=24, vae_temporal=8, guidance_options=tuple(OPTION_DEFAULTS))
COGVIDEOX = Limits(model="tiny", max_frames=17, max_height=32, max_width=32, max_steps=50, default_steps=2,
                   fps=8, vae_temporal=4)


def _params(body: dict, limits: Limits = LIMITS, spec=SPEC) -> dict:
    return resolve(parse_body({"prompt": "a drum", **body}), limits, spec)


def test_options_from_json_and_forms_parse_alike_and_reach_the_engine():
    from raydit.serve.service import VideoService

    as_json = _params({"guidance_options": {"stg_scale": 0, "stg_blocks": [1], "use_cross_timestep": False}})
    as_form = _params({"guidance_options": '{"stg_scale": 0, "stg_blocks": [1], "use_cross_timestep": false}'})
    expected = {"stg_blocks": [1], "stg_scale": 0, "use_cross_timestep": False}
    assert as_json["guidance_options"] == as_form["guidance_options"] == expected
    assert _params({})["guidance_options"] == {} and _params({"guidance_options": ""})["guidance_options"] == {}

    def args_for(params):
        run = SimpleNamespace(job=SimpleNamespace(params=params, has_image=False, id="x"))
        return VideoService._submit_args(SimpleNamespace(_on_step=lambda run, step: None), run)

    assert args_for(as_json)["guidance_options"] == expected
    assert args_for(_params({}))["guidance_options"] is None  # the model's defaults


def test_the_record_keeps_the_options_across_a_restart(tmp_path):
    from raydit.serve.store import VideoJob, VideoStore, new_id

    store = VideoStore(str(tmp_path))
    params = _params({"guidance_options": {"modality_scale": 1, "stg_blocks": [0, 1]}})
    job = VideoJob(id=new_id(), model="tiny-ltx2", prompt="a drum", params=params, fps=24)
    assert job.to_object()["raydit"]["guidance_options"] == {"modality_scale": 1, "stg_blocks": [0, 1]}
    store.save(job)
    (again,), _ = store.load_all()
    assert again.params["guidance_options"] == {"modality_scale": 1, "stg_blocks": [0, 1]}
    assert VideoJob(id=new_id(), model="tiny", prompt="x", params={**params, "guidance_options": {}},
                    fps=8).to_object()["raydit"]["guidance_options"] == {}


@pytest.mark.parametrize("value, limits, needle", [
    ({"stg": 0}, LIMITS, "guidance_options: stg not taken by tiny-ltx2 (it takes: stg_scale, modality_scale"),
    ({"stg_scale": 0}, COGVIDEOX, "guidance_options: stg_scale not taken by tiny (it takes: none)"),
    ('{"stg_scale": 0', LIMITS, "is not valid JSON; give an object such as"),
    ({"stg_scale": "zero"}, LIMITS, "guidance option stg_scale='zero' must be a number, a bool or a list of integers"),
    ({"stg_blocks": [1.5]}, LIMITS, "a list must hold integers"),
    ('[1, 2]', LIMITS, "must be a dict {name: value}"),
])
def test_bad_options_are_400_naming_the_field(value, limits, needle):
    with pytest.raises(RequestError) as info:
        _params({"guidance_options": value}, limits, SPEC if limits is LIMITS else model_spec("tiny"))
    assert info.value.param == "guidance_options" and info.value.status == 400
    assert needle in info.value.message and "\n" not in info.value.message
