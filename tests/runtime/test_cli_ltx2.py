"""LTX-2 from the command line: `raydit generate --model tiny-ltx2` writes an mp4 with a video
stream and an audio stream (the sound the model made, muxed as AAC by the generic writer), and
`--save-latents` writes what LTX2Pipeline(output_type="latent") returns.

Read back: the frame count is the request's, and the sound lasts as long as the pipeline makes
it (num_frames / 24 s, less the audio VAE's causal trim: here 69 mel frames x 160 samples at
16 kHz = 0.69 s) within 1 ms, in 2 channels at the vocoder's 16 kHz. The mp4 plays at 24 fps,
the rate the sound was made for, when --fps is not given.

The run is on a copy of tiny-ltx2 whose VAEs carry random latents_mean / latents_std (the tiny
built-in's are 0 and 1, under which normalized and denormalized latents are the same numbers):
the saved video and audio latents are held to the pipeline's own, each stream in its layout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.long  # stage two: a whole CLI run of LTX-2 with its audio (~55 s)

PROMPT = "a dog barks"
STEPS, SEED = 2, 3
# A 2-rank plan against diffusers on one process, float32 on the CPU: the runtime tests' rule
# (rtol 1e-4, atol 1e-4; test_conformance's LATENT_TOL), every element of each stream.
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def address(ray_local):
    return ray_local.get_runtime_context().gcs_address


def _variant(target) -> str:
    """tiny-ltx2 saved again with random latents_mean / latents_std in both VAEs."""
    import torch
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video

    from raydit.models.loading import resolve_model_dir

    shutil.copytree(resolve_model_dir("tiny-ltx2"), target)
    g = torch.Generator().manual_seed(5)
    for folder, cls in (("vae", AutoencoderKLLTX2Video), ("audio_vae", AutoencoderKLLTX2Audio)):
        vae = cls.from_pretrained(str(target / folder))
        vae.latents_mean.copy_(torch.randn(vae.latents_mean.shape, generator=g))
        vae.latents_std.copy_(0.5 + torch.rand(vae.latents_std.shape, generator=g))
        vae.save_pretrained(str(target / folder))
    return str(target)


@pytest.fixture(scope="module")
def generated(address, tmp_path_factory):
    """One `raydit generate` on 2 ranks with --save-latents NAME.npy (the audio goes beside it)."""
    tmp = tmp_path_factory.mktemp("ltx2-cli")
    model = _variant(tmp / "tiny-ltx2-norm")
    out, latents = tmp / "ltx2.mp4", tmp / "ltx2.npy"
    res = subprocess.run(
        [sys.executable, "-m", "raydit.cli", "generate", "--model", model, "--prompt", PROMPT,
         "--steps", str(STEPS), "--seed", str(SEED), "--guidance-scale", "3.0", "--device", "cpu",
         "--address", address, "--json", "--workers", "2", "--out", str(out), "--save-latents", str(latents)],
        capture_output=True, text=True, timeout=600, cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"model": model, "out": out, "latents": latents, "summary": json.loads(res.stdout.strip().splitlines()[-1])}


def test_generate_tiny_ltx2_writes_video_and_audio(generated):
    from raydit.models.families.ltx2 import tiny
    from raydit.runtime.video import read_mp4, read_mp4_audio

    out, summary = generated["out"], generated["summary"]
    assert summary["plan"]["world_size"] == 2  # 1 rank passed too; the suite keeps the parallel run
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


def test_saved_latents_are_what_ltx2_pipeline_returns(generated):
    """--save-latents NAME.npy: the video latents [1, C, F, H, W] in NAME.npy and the audio
    latents [1, C, L, mel bins] in NAME.audio.npy, what LTX2Pipeline(output_type="latent") returns
    called directly with the request's prompt, size, steps and seed and diffusers' defaults for
    everything else (guidance 3, STG, modality, rescale, 1024 prompt tokens), within TOL."""
    import torch
    from diffusers import LTX2Pipeline

    from raydit.models.families.ltx2 import tiny

    summary, path = generated["summary"], generated["latents"]
    audio_path = path.with_name("ltx2.audio.npy")
    assert (summary["latents"], summary["audio_latents"]) == (str(path), str(audio_path))
    pipe = LTX2Pipeline.from_pretrained(generated["model"])
    pipe.set_progress_bar_config(disable=True)
    d = tiny.TINY_DEFAULTS
    video, audio = pipe(prompt=PROMPT, num_frames=d["num_frames"], height=d["height"], width=d["width"],
                        num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(SEED),
                        output_type="latent", return_dict=False)
    assert video.ndim == 5 and audio.ndim == 4
    for name, saved, expected in (("video", np.load(path), video), ("audio", np.load(audio_path), audio)):
        saved = torch.from_numpy(saved)
        assert saved.dtype == torch.float32 and saved.shape == expected.shape, (name, saved.shape, expected.shape)
        torch.testing.assert_close(saved, expected, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_save_latents_writes_every_stream_or_refuses_the_path_in_one_line(tmp_path):
    """GenerationResult.save_latents (what --save-latents calls): .npy holds the video latents
    and, with sound, NAME.audio.npy the audio's; .npz holds both (keys latents, audio_latents);
    a silent model writes no audio file; any other suffix is one ValueError line."""
    from raydit.runtime.engine import GenerationResult

    video, audio = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 2, 2), np.ones((1, 2, 3, 4), np.float32)

    def result(audio_latents):
        return GenerationResult(frames=np.zeros((1, 2, 2, 3), np.uint8), latents=video, plan=None, timings={},
                                request=None, audio_latents=audio_latents)

    written = result(audio).save_latents(str(tmp_path / "a.npy"))
    assert written == {"latents": str(tmp_path / "a.npy"), "audio_latents": str(tmp_path / "a.audio.npy")}
    assert np.array_equal(np.load(tmp_path / "a.npy"), video) and np.array_equal(np.load(tmp_path / "a.audio.npy"), audio)
    written = result(audio).save_latents(str(tmp_path / "b.NPZ"))  # the suffix as given, no second one added
    with np.load(tmp_path / "b.NPZ") as both:
        assert sorted(both) == ["audio_latents", "latents"]
        assert np.array_equal(both["latents"], video) and np.array_equal(both["audio_latents"], audio)
    assert written == {"latents": str(tmp_path / "b.NPZ"), "audio_latents": str(tmp_path / "b.NPZ")}
    assert result(None).save_latents(str(tmp_path / "c.npy")) == {"latents": str(tmp_path / "c.npy"),
                                                                  "audio_latents": None}
    assert result(None).save_latents(str(tmp_path / "d.npz")) == {"latents": str(tmp_path / "d.npz"),
                                                                  "audio_latents": None}
    with np.load(tmp_path / "d.npz") as one:
        assert list(one) == ["latents"]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert before == ["a.audio.npy", "a.npy", "b.NPZ", "c.npy", "d.npz"]
    (tmp_path / "e.audio.npy").mkdir()
    for bad, message in (("lat.pt", "lat.pt' must end in .npy (the video latents; a model with sound adds"),
                         ("e.npy", "e.audio.npy' is a directory")):
        with pytest.raises(ValueError) as err:
            result(audio).save_latents(str(tmp_path / bad))
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before + ["e.audio.npy"]


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
