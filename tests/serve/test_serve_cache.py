"""`POST /v1/videos` step-caching fields (`cache`, `cache_threshold`): parsed from forms and JSON,
passed on only when the body sets them (the server's --cache otherwise), refused naming the
field. Pure Python: the body model and `resolve`, no server."""

from __future__ import annotations

import pytest

from raydit.planner import model_spec
from raydit.serve.schema import Limits, RequestError, parse_body, resolve

TINY = model_spec("tiny")
LIMITS = Limits(model="tiny", max_frames=17, max_height=32, max_width=32, max_steps=50, default_steps=4,
                fps=8, vae_temporal=4, cache="fbcache")  # a server started with --cache fbcache


def _params(body: dict) -> dict:
    return resolve(parse_body({"prompt": "a fox", **body}), LIMITS, TINY)


def test_cache_fields_pass_only_when_given():
    assert "cache" not in _params({}) and "cache_threshold" not in _params({})  # the engine's default
    form = _params({"cache": "teacache", "cache_threshold": "0.3"})
    as_json = _params({"cache": "teacache", "cache_threshold": 0.3})
    assert {k: form[k] for k in ("cache", "cache_threshold")} == {"cache": "teacache", "cache_threshold": 0.3}
    assert {k: as_json[k] for k in ("cache", "cache_threshold")} == {"cache": "teacache", "cache_threshold": 0.3}
    for off in (None, "none", "off", ""):
        params = _params({"cache": off})
        assert params["cache"] is None and "cache_threshold" not in params
    # A threshold alone applies to the server's method.
    params = _params({"cache_threshold": 0.2})
    assert params["cache_threshold"] == 0.2 and "cache" not in params


@pytest.mark.parametrize("body, param, needle", [
    ({"cache": "fastcache"}, "cache", "cache 'fastcache' is not a step-cache method; use one of: fbcache, teacache"),
    ({"cache": "off", "cache_threshold": 0.1}, "cache_threshold", "needs a cache method"),
    ({"cache": "fbcache", "cache_threshold": "0"}, "cache_threshold", "greater than 0"),
    ({"cache_threshold": "nan"}, "cache_threshold", "finite number"),
    ({"cache_threshold": "abc"}, "cache_threshold", "valid number"),
])
def test_bad_cache_fields_are_named(body, param, needle):
    with pytest.raises(RequestError) as info:
        _params(body)
    assert info.value.param == param and info.value.status == 400
    assert needle in info.value.message and "\n" not in info.value.message


def test_the_service_passes_the_body_cache_to_the_engine():
    """Service._submit_args hands the stored params' cache fields to Engine.submit, and
    leaves them out (the engine's default) when the body did not set them."""
    from types import SimpleNamespace

    from raydit.serve.service import VideoService

    def args_for(params):
        run = SimpleNamespace(job=SimpleNamespace(params=params, has_image=False, id="x"))
        return VideoService._submit_args(SimpleNamespace(_on_step=lambda run, step: None), run)

    base = _params({"seed": 1})
    assert "cache" not in args_for(base) and "cache_threshold" not in args_for(base)
    given = args_for(_params({"seed": 1, "cache": "fbcache", "cache_threshold": 0.5}))
    assert (given["cache"], given["cache_threshold"]) == ("fbcache", 0.5)
