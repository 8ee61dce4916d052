"""`raydit serve --model tiny-skyreels-df` called with OpenAI's client: a long SkyReels-V2
diffusion-forcing video (17 frames in three windows of 9, overlapping by 5) comes back as an
mp4 of 17 frames with its options kept in the video's record, and an option the model does not
take is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

import openai  # noqa: E402  (a declared test dependency: missing, the serve stage fails)
import requests  # noqa: E402,F401  (a declared test dependency: missing, the serve stage fails)
import psutil  # noqa: E402,F401  (a declared test dependency: missing, the serve stage fails)

from serving import Server, running  # noqa: E402

LONG = {"base_num_frames": 9, "overlap_history": 5, "addnoise_condition": 20}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running(Server(tmp_path_factory.mktemp("serve-skyreels"), model="tiny-skyreels-df", workers=1,
                              args=("--frames", "17", "--height", "32", "--width", "32")))


def test_a_long_video_in_windows_and_a_foreign_option(server, tmp_path):
    from raydit.runtime.video import read_mp4

    client = server.client()
    video = client.videos.create(prompt="a river", extra_body={"num_inference_steps": 2, "seed": 3, "num_frames": 17,
                                                               "guidance_options": json.dumps(LONG)})
    done = client.videos.poll(video.id, poll_interval_ms=100)
    assert done.status == "completed", (done.error, server.tail())
    path = tmp_path / f"{video.id}.mp4"
    path.write_bytes(client.videos.download_content(video.id).read())
    assert read_mp4(str(path)).shape == (17, 32, 32, 3)
    assert server.http("GET", f"/v1/videos/{video.id}").json()["raydit"]["guidance_options"] == LONG

    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="x", extra_body={"num_inference_steps": 2,
                                                     "guidance_options": json.dumps({"stg_scale": 0})})
    error = info.value.body if isinstance(info.value.body, dict) else {}
    assert error.get("param") == "guidance_options", info.value.body
    assert "stg_scale not taken by tiny-skyreels-df (it takes: ar_step" in error.get("message", ""), info.value.body
