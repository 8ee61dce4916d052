"""`raydit serve --model tiny-kandinsky5` called with OpenAI's client: a Kandinsky 5 video comes
back as an mp4 of the served geometry, and the request's guidance reaches the workers (guidance
off: one branch, another video). One worker: the 2-rank path is tests/runtime/test_cli_models.py's."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

import openai  # noqa: E402  (a declared test dependency: missing, the serve stage fails)
import requests  # noqa: E402,F401  (a declared test dependency: missing, the serve stage fails)
import psutil  # noqa: E402,F401  (a declared test dependency: missing, the serve stage fails)

from serving import Server, running  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running(Server(tmp_path_factory.mktemp("serve-kandinsky5"), model="tiny-kandinsky5",
                              args=("--frames", "5", "--height", "32", "--width", "48"), workers=1))


def test_videos_come_back_and_take_the_guidance_scale(server, tmp_path):
    from raydit.runtime.video import read_mp4

    client = server.client()
    body = {"num_inference_steps": 2, "seed": 3, "negative_prompt": "blur"}
    videos = {scale: client.videos.create(prompt="a paper boat", extra_body={**body, "guidance_scale": scale})
              for scale in (5.0, 1.0)}
    frames = {}
    for scale, video in videos.items():
        done = client.videos.poll(video.id, poll_interval_ms=100)
        assert done.status == "completed", (scale, done.error, server.tail())
        path = tmp_path / f"{video.id}.mp4"
        path.write_bytes(client.videos.download_content(video.id).read())
        frames[scale] = read_mp4(str(path))
    assert frames[5.0].shape == frames[1.0].shape == (5, 32, 48, 3)
    assert frames[5.0].std() > 1 and not np.array_equal(frames[5.0], frames[1.0])
