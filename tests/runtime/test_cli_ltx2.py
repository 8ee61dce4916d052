"""LTX-2 from the command line: `raydit generate --model tiny-ltx2` writes an mp4 with a video
stream and an audio stream (the sound the model made, muxed as AAC by the generic writer).

Read back: the frame count is the request's, and the sound lasts as long as the pipeline makes
it (num_frames / 24 s, less the audio VAE's causal trim: here 69 mel frames x 160 samples at
16 kHz = 0.69 s) within 1 ms, in 2 channels at the vocoder's 16 kHz. The mp4 plays at 24 fps,
the rate the sound was made for, when --fps is not given.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest


@pytest.fixture(scope="module")
def address(ray_local):
    return ray_local.get_runtime_context().gcs_address


def _generate(address, tmp_path, workers: int):
    out = tmp_path / f"ltx2-{workers}.mp4"
    res = subprocess.run(
        [sys.executable, "-m", "raydit.cli", "generate", "--model", "tiny-ltx2", "--prompt", "a dog barks",
         "--steps", "2", "--seed", "3", "--device", "cpu", "--address", address, "--json", "--workers",
         str(workers), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("workers", [2])  # 1 rank passed too; the suite keeps the parallel run
def test_generate_tiny_ltx2_writes_video_and_audio(address, tmp_path, workers):
    from raydit.models.families.ltx2 import tiny
    from raydit.runtime.video import read_mp4, read_mp4_audio

    out, summary = _generate(address, tmp_path, workers)
    assert summary["plan"]["world_size"] == workers
    frames = read_mp4(str(out))
    defaults = tiny.TINY_DEFAULTS
    assert frames.shape == (defaults["num_frames"], defaults["height"], defaults["width"], 3)
    audio = read_mp4_audio(str(out))
    assert audio is not None, "the mp4 has no audio stream"
    waveform, rate = audio
    assert rate == 16000 and waveform.shape[0] == 2
    assert abs(waveform.shape[1] / rate - 0.69) <= 1e-3, waveform.shape
    assert np.abs(waveform).max() > 0  # sound, not silence
    probe = subprocess.run([__import__("imageio_ffmpeg").get_ffmpeg_exe(), "-hide_banner", "-i", str(out)],
                           capture_output=True, text=True).stderr
    assert "24 fps" in probe, probe


def test_write_mp4_refuses_bad_audio_in_one_line(tmp_path):
    from raydit.runtime.video import read_mp4_audio, write_mp4

    frames = np.zeros((3, 32, 32, 3), np.uint8)
    for audio, message in [((np.zeros((3, 100)), 16000), "1 or 2 channels"),
                           ((np.zeros((1, 100)), 16000.5), "sample_rate 16000.5 must be an integer"),
                           ((np.full((1, 100), np.nan), 16000), "NaN or infinite")]:
        with pytest.raises(ValueError, match=message) as err:
            write_mp4(str(tmp_path / "a.mp4"), frames, audio=audio)
        assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing written, no leftovers
    write_mp4(str(tmp_path / "silent.mp4"), frames)
    assert read_mp4_audio(str(tmp_path / "silent.mp4")) is None
