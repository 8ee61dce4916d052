"""Bad inputs found by an audit of raydit serve, each answered with a 4xx in OpenAI's error
shape naming the value and the fix: a body giving `seconds` and `num_frames` that disagree
(num_frames silently won), and a Range header on GET /v1/videos/{id}/content that Starlette's
file response refused in plain text (400 without JSON, a bare 416)."""

from __future__ import annotations

import os

import pytest

from raydit.planner import model_spec
from raydit.serve.schema import Limits, RequestError, parse_body, resolve

TINY = model_spec("tiny")  # frames = 1 + 4k
LIMITS = Limits(model="tiny", max_frames=33, max_height=64, max_width=64, max_steps=50, default_steps=2, fps=8,
                vae_temporal=4)


def test_seconds_and_num_frames_that_disagree_are_refused_naming_both():
    with pytest.raises(RequestError) as err:
        resolve(parse_body({"prompt": "x", "seconds": 4, "num_frames": 9}), LIMITS, TINY)
    assert err.value.param == "seconds" and err.value.status == 400
    assert "seconds 4 and num_frames 9 disagree" in err.value.message and "33 frames" in err.value.message
    # Both naming one length, or either alone, are taken as before.
    assert resolve(parse_body({"prompt": "x", "seconds": 2, "num_frames": 17}), LIMITS, TINY)["num_frames"] == 17
    assert resolve(parse_body({"prompt": "x", "seconds": "2"}), LIMITS, TINY)["num_frames"] == 17
    assert resolve(parse_body({"prompt": "x", "num_frames": 9}), LIMITS, TINY)["num_frames"] == 9


def _content(tmp_path, range_header: str | None):
    """GET /v1/videos/{id}/content's answer through the app (its exception handlers and the
    route), with a stand-in service holding one completed video of 1000 bytes."""
    import asyncio
    from types import SimpleNamespace

    from raydit.serve import app as appmod

    path = tmp_path / "video_0123456789abcdef01234567.mp4"
    path.write_bytes(os.urandom(1000))
    job = SimpleNamespace(status="completed")
    front = SimpleNamespace(
        _auth=lambda request: None, _job=lambda video_id: job,
        service=SimpleNamespace(store=SimpleNamespace(video_path=lambda video_id: path)))
    headers = [(b"range", range_header.encode())] if range_header is not None else []
    scope = {"type": "http", "method": "GET", "path": "/", "headers": headers, "query_string": b""}
    from starlette.requests import Request

    request = Request(scope)
    sent: list[dict] = []

    async def receive():
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def answer():
        try:
            response = await appmod.VideoAPI.func_or_class.content(front, request, path.stem)
        except appmod.RequestError as exc:
            response = await appmod._request_error(request, exc)
        await response(scope, receive, send)

    asyncio.run(answer())
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict((k.decode(), v.decode()) for k, v in start["headers"]), body


@pytest.mark.parametrize("header, status", [("bytes=abc", 400), ("items=0-9", 400), ("bytes=9-3", 400),
                                            ("bytes=5000-", 416)])
def test_a_bad_range_is_an_openai_error_naming_it(tmp_path, header, status):
    import json

    got, headers, body = _content(tmp_path, header)
    assert got == status, (got, body)
    assert headers["content-type"] == "application/json", (headers, body)
    error = json.loads(body)["error"]
    assert error["param"] == "range" and header in error["message"] and "bytes=START-END" in error["message"], error
    if status == 416:
        assert error["code"] == "range_not_satisfiable" and headers["content-range"] == "bytes */1000"


def test_a_good_range_and_no_range_still_serve_the_video(tmp_path):
    got, headers, body = _content(tmp_path, "bytes=10-19")
    assert got == 206 and len(body) == 10 and headers["content-range"] == "bytes 10-19/1000"
    got, headers, body = _content(tmp_path, None)
    assert got == 200 and len(body) == 1000
