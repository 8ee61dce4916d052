"""`raydit serve --model tiny-ltx2` called with OpenAI's client: LTX-2's videos come back with
their sound (an mp4 with an audio stream as long as the pipeline makes it), its guidance
options travel in the body (`guidance_options`, kept in the video's record) and change the
video, and a name the model does not take is a 400 naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

import openai  # noqa: E402  (a declared test dependency: missing, the serve stage fails)
import requests  # noqa: E402,F401  (a declared test dependency: missing, the serve stage fails)
import psutil  # noqa: E402,F401  (a declared test dependency: missing, the serve stage fails)

from serving import Server, running  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from raydit.models.families.ltx2.tiny import TINY_DEFAULTS

    d = TINY_DEFAULTS
    yield from running(Server(tmp_path_factory.mktemp("serve-ltx2"), model="tiny-ltx2",
                              args=("--frames", str(d["num_frames"]), "--height", str(d["height"]),
                                    "--width", str(d["width"]))))


def test_videos_keep_their_sound_and_take_guidance_options(server, tmp_path):
    from raydit.runtime.video import read_mp4, read_mp4_audio

    client = server.client()
    body = {"num_inference_steps": 2, "seed": 3}
    off = {"stg_scale": 0, "audio_stg_scale": 0, "modality_scale": 1, "audio_modality_scale": 1}
    videos = {
        "default": client.videos.create(prompt="a dog barks", extra_body=body),
        # a form carries the object as JSON text (the openai client sends multipart)
        "cfg only": client.videos.create(prompt="a dog barks", extra_body={**body, "guidance_options": json.dumps(off)}),
    }
    frames, sounds = {}, {}
    for name, video in videos.items():
        done = client.videos.poll(video.id, poll_interval_ms=100)
        assert done.status == "completed", (name, done.error, server.tail())
        path = tmp_path / f"{video.id}.mp4"
        path.write_bytes(client.videos.download_content(video.id).read())
        frames[name] = read_mp4(str(path))
        # Without --fps the server plays LTX-2's video at the rate its sound was made for (24), so
        # the two are as long as each other (it wrote 8 fps once: a video three times its sound).
        import imageio_ffmpeg

        meta = next(imageio_ffmpeg.read_frames(str(path)))
        assert meta["fps"] == 24 and float(done.seconds) == pytest.approx(frames[name].shape[0] / 24, rel=1e-5)
        audio = read_mp4_audio(str(path))
        assert audio is not None, f"{name}: the mp4 has no audio stream"
        waveform, rate = audio
        # the pipeline's sound: 69 mel frames x 160 samples at 16 kHz (tests/runtime/test_cli_ltx2.py)
        assert rate == 16000 and waveform.shape[0] == 2 and abs(waveform.shape[1] / rate - 0.69) <= 1e-3
        assert np.abs(waveform).max() > 0
        sounds[name] = waveform
        record = server.http("GET", f"/v1/videos/{video.id}").json()["raydit"]
        assert record["guidance_options"] == ({} if name == "default" else off)
    assert frames["default"].shape == frames["cfg only"].shape == (17, 32, 416, 3)
    # Without the STG and modality passes it is another video (same seed, other guidance).
    assert not np.array_equal(frames["default"], frames["cfg only"]) or not np.array_equal(
        sounds["default"], sounds["cfg only"])

    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="x", extra_body={**body, "guidance_options": json.dumps({"stg": 0})})
    error = info.value.body if isinstance(info.value.body, dict) else {}
    assert error.get("param") == "guidance_options", info.value.body
    assert "stg not taken by tiny-ltx2 (it takes: stg_scale" in error.get("message", ""), info.value.body
