"""`raydit serve --model tiny-mochi` called with OpenAI's client (issue 34): two videos of Mochi 1
on 2 ranks, asked by frame count and by `seconds`, come back as mp4s of the asked frames (Mochi
takes 6k + 1), and a frame count its VAE cannot take is a 400 naming the field and the nearest valid counts."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

import openai  # noqa: E402  (a declared test dependency: missing, the serve stage fails)
import requests  # noqa: E402,F401  (a declared test dependency: missing, the serve stage fails)
import psutil  # noqa: E402,F401  (a declared test dependency: missing, the serve stage fails)

from serving import Server, running  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running(Server(tmp_path_factory.mktemp("serve-mochi"), model="tiny-mochi",
                              args=("--frames", "13", "--height", "32", "--width", "48")))


def test_mochi_videos_through_the_openai_client(server, tmp_path):
    from raydit.runtime.video import read_mp4

    client = server.client()
    asked = {"by frames": ({"num_frames": 7}, 7), "defaults": ({}, 13)}
    videos = {name: client.videos.create(prompt=f"a paper boat, {name}", extra_body={"num_inference_steps": 2,
                                                                                    "seed": 3, **fields})
              for name, (fields, _) in asked.items()}
    for name, video in videos.items():
        done = client.videos.poll(video.id, poll_interval_ms=100)
        assert done.status == "completed", (name, done.error, server.tail())
        path = tmp_path / f"{video.id}.mp4"
        path.write_bytes(client.videos.download_content(video.id).read())
        frames = read_mp4(str(path))
        assert frames.shape == (asked[name][1], 32, 48, 3), (name, frames.shape)
        assert frames.std() > 1  # a video, not a constant
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="x", extra_body={"num_inference_steps": 2, "num_frames": 9})
    error = info.value.body if isinstance(info.value.body, dict) else {}
    assert error.get("param") == "num_frames", info.value.body
    assert "(frames - 1) must be a multiple of 6; nearest valid: 7 or 13" in error.get("message", ""), info.value.body
