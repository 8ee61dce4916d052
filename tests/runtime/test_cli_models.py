"""Request options and the newer families from the command line (issue 18).

- `--true-cfg-scale`: a bad value is one line, status 2, before Ray starts; a family whose
  guidance is not embedded refuses true_cfg_scale in one line.
- Frame counts the VAE cannot take as they are: rounded as each family's diffusers pipeline
  rounds them (proved against diffusers: the pipeline's own latents for the odd count equal
  those for the rounded count) and said in one logged line.
- `raydit generate --model tiny-hunyuan | tiny-hunyuan-i2v | tiny-ltx | tiny-wan | tiny-kandinsky5` writes a
  real mp4; the HunyuanVideo run uses true CFG on 2 ranks, the HunyuanVideo image-to-video
  run (token_replace: the image's latent frame split with the video tokens) sequence
  parallelism on 2 ranks, and the latents of both equal one process's
  (rtol 1e-4, atol 1e-4, float32, as tests/runtime/engine/test_engine.py).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from raydit.models.requests import GenerationRequest
from raydit.models.loading import load_pipeline, resolve_model_dir


def raydit(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "raydit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.mark.parametrize("value, message", [
    ("-1", "--true-cfg-scale -1.0 must be a finite number >= 0"),
    ("nan", "--true-cfg-scale nan must be a finite number >= 0"),
    ("lots", "--true-cfg-scale: invalid float value: 'lots'"),
])
def test_bad_true_cfg_scale_is_one_line_and_status_2(value, message, capsys):
    from raydit.cli import main

    assert main(["generate", "--prompt", "a fox", "--device", "cpu", "--true-cfg-scale", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_true_cfg_scale_on_a_family_without_embedded_guidance_is_refused():
    from raydit.models.runner import Runner

    runner = Runner(load_pipeline("tiny"))
    with pytest.raises(ValueError, match="true_cfg_scale 4 is for pipelines whose guidance is embedded") as info:
        runner.prepare(GenerationRequest(prompt="x", negative_prompt="blur", num_frames=5, height=32, width=32,
                                         num_inference_steps=1, true_cfg_scale=4.0))
    assert "\n" not in str(info.value)


# model, an odd frame count, what diffusers' pipeline runs instead, height, width
ROUNDING = [
    ("tiny", 10, 9, 32, 32),  # CogVideoX: (n - 1) // 4 + 1 latent frames
    ("tiny-wan", 12, 13, 32, 32),  # Wan: n // 4 * 4 + 1
    ("tiny-hunyuan", 7, 5, 32, 32),  # HunyuanVideo: (n - 1) // 4 + 1
    ("tiny-ltx", 12, 9, 32, 32),  # LTX: (n - 1) // 8 + 1
    ("tiny-kandinsky5", 6, 5, 32, 32),  # Kandinsky 5: n // 4 * 4 + 1
    ("tiny-mochi", 10, 7, 32, 32),  # Mochi: (n - 1) // 6 + 1
]


@pytest.mark.parametrize("model, frames, rounded, height, width", ROUNDING)
def test_odd_frame_counts_are_rounded_as_diffusers_does(model, frames, rounded, height, width, caplog):
    from raydit.models.registry import family_for_pipeline
    from raydit.planner import model_spec
    from raydit.runtime.engine import round_frames

    model_dir = str(resolve_model_dir(model))
    t = model_spec(model_dir).vae_temporal
    with caplog.at_level(logging.WARNING, logger="raydit"):
        assert round_frames(model_dir, t, frames) == rounded
    said = [r.getMessage() for r in caplog.records if r.name == "raydit"]
    assert len(said) == 1 and f"frames {frames} -> {rounded}" in said[0], said
    caplog.clear()
    assert round_frames(model_dir, t, rounded) == rounded and not caplog.records  # valid: unchanged, silent
    # diffusers' own pipeline, given the odd count, computes exactly what it computes for the rounded one.
    pipe = load_pipeline(model)
    family = family_for_pipeline(pipe)
    request = dict(prompt="a kite", num_frames=frames, height=height, width=width, num_inference_steps=2, seed=3)
    odd = family.reference_latents(pipe, GenerationRequest(**request))
    same = family.reference_latents(pipe, GenerationRequest(**{**request, "num_frames": rounded}))
    assert torch.equal(odd, same)


SKYREELS_DF_OPTIONS = (("addnoise_condition", 20), ("base_num_frames", 9), ("overlap_history", 5))


@pytest.fixture(scope="module")
def address(ray_local):
    return ray_local.get_runtime_context().gcs_address


@pytest.mark.long  # the second stage (suite time: stage one ran 21:42 at f797430)
def test_generate_tiny_hunyuan_ltx_and_wan_write_mp4s(address, tmp_path):
    from PIL import Image

    from raydit.models.conformance import run_steps
    from raydit.models.requests import image_to_png
    from raydit.models.runner import Runner
    from raydit.runtime.video import read_mp4

    png = tmp_path / "first-frame.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(png)
    runs = {
        # true CFG on 2 ranks; 7 frames are rounded to 5 (said on stderr)
        "tiny-hunyuan": ["--workers", "2", "--frames", "7", "--height", "32", "--width", "32",
                         "--negative-prompt", "blur", "--true-cfg-scale", "4"],
        # image to video on 2 ranks (one guidance branch: sequence parallel)
        "tiny-hunyuan-i2v": ["--workers", "2", "--frames", "5", "--height", "32", "--width", "32",
                             "--image", str(png)],
        "tiny-ltx": ["--workers", "1", "--frames", "9", "--height", "32", "--width", "32"],
        "tiny-wan": ["--workers", "1", "--frames", "5", "--height", "32", "--width", "32"],
        # Kandinsky 5 on 2 ranks (cfg 2 or sequence parallel, as the planner picks)
        "tiny-kandinsky5": ["--workers", "2", "--frames", "5", "--height", "32", "--width", "32",
                            "--negative-prompt", "blur"],
    }
    later = {
        # once the first runs free their slots: Mochi 1 on 2 ranks, sequence parallel (ulysses 2)
        "tiny-mochi": ["--workers", "2", "--ulysses", "2", "--cfg", "1", "--frames", "7", "--height", "32",
                       "--width", "32"],
        # SkyReels-V2 diffusion forcing on 2 ranks: 17 frames in three windows of 9 (overlap 5, re-noised)
        "tiny-skyreels-df": ["--workers", "2", "--frames", "17", "--height", "32", "--width", "32",
                             *(a for o in SKYREELS_DF_OPTIONS for a in ("--guidance-option", f"{o[0]}={o[1]}"))],
    }

    def start(model, extra):
        return subprocess.Popen(
            [sys.executable, "-m", "raydit.cli", "generate", "--model", model, "--prompt", "a kite over the sea",
             "--steps", "2", "--seed", "3", "--device", "cpu", "--address", address, "--json",
             "--out", str(tmp_path / f"{model}.mp4"), "--save-latents", str(tmp_path / f"{model}.npy"), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)

    # The first six runs side by side on the session's Ray (8 of its 8 CPU slots): their start-ups
    # overlap; the rest when they are done.
    results, procs = {}, {}
    try:
        for wave in (runs, later):
            procs = {model: start(model, extra) for model, extra in wave.items()}
            for model, proc in procs.items():
                stdout, stderr = proc.communicate(timeout=600)
                results[model] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for model, res in results.items():
        out, latents = tmp_path / f"{model}.mp4", tmp_path / f"{model}.npy"
        assert res.returncode == 0, f"{model}: {res.stderr[-2000:]}"
        summary = json.loads(res.stdout.strip().splitlines()[-1])
        frames = read_mp4(str(out))
        assert frames.shape[0] == summary["frames"][0] and frames.shape[1:3] == (32, 32), (model, frames.shape)
        assert np.isfinite(np.load(latents)).all()
        if model == "tiny-hunyuan":
            assert summary["plan"]["world_size"] == 2 and summary["frames"][0] == 5
            assert "frames 7 -> 5" in res.stderr and "HunyuanVideoPipeline" in res.stderr
            request = GenerationRequest(prompt="a kite over the sea", negative_prompt="blur", num_frames=5,
                                        height=32, width=32, num_inference_steps=2, seed=3, true_cfg_scale=4.0)
            runner = Runner(load_pipeline(model))
            expected = run_steps(runner, request, 2).latents
            torch.testing.assert_close(torch.from_numpy(np.load(latents)), expected, rtol=1e-4, atol=1e-4)
            # --true-cfg-scale reached the workers: without it the latents are others.
            plain = run_steps(runner, GenerationRequest(**{**request.to_dict(), "true_cfg_scale": 1.0}), 2).latents
            assert not torch.allclose(plain, expected, rtol=1e-2, atol=1e-2)
        if model == "tiny-hunyuan-i2v":
            assert summary["plan"]["world_size"] == 2 and summary["plan"]["cfg"] == 1
            # no --guidance-scale: HunyuanVideoImageToVideoPipeline's default, 1.0 (embedded)
            request = GenerationRequest(prompt="a kite over the sea", num_frames=5, height=32, width=32,
                                        num_inference_steps=2, seed=3, image=image_to_png(png), guidance_scale=1.0)
            expected = run_steps(Runner(load_pipeline(model)), request, 2).latents
            torch.testing.assert_close(torch.from_numpy(np.load(latents)), expected, rtol=1e-4, atol=1e-4)
        if model == "tiny-kandinsky5":
            assert summary["plan"]["world_size"] == 2
            # no --guidance-scale: Kandinsky5T2VPipeline's default, 5.0
            request = GenerationRequest(prompt="a kite over the sea", negative_prompt="blur", num_frames=5,
                                        height=32, width=32, num_inference_steps=2, seed=3, guidance_scale=5.0)
            expected = run_steps(Runner(load_pipeline(model)), request, 2).latents
            torch.testing.assert_close(torch.from_numpy(np.load(latents)), expected, rtol=1e-4, atol=1e-4)
        if model == "tiny-mochi":
            assert (summary["plan"]["world_size"], summary["plan"]["ulysses"]) == (2, 2) and summary["frames"][0] == 7
            # no --guidance-scale: MochiPipeline's default, 4.5
            request = GenerationRequest(prompt="a kite over the sea", num_frames=7, height=32, width=32,
                                        num_inference_steps=2, seed=3, guidance_scale=4.5)
            expected = run_steps(Runner(load_pipeline(model)), request, 2).latents
            torch.testing.assert_close(torch.from_numpy(np.load(latents)), expected, rtol=1e-4, atol=1e-4)
        if model == "tiny-skyreels-df":
            assert summary["plan"]["world_size"] == 2 and summary["frames"][0] == 17
            request = GenerationRequest(prompt="a kite over the sea", num_frames=17, height=32, width=32,
                                        num_inference_steps=2, seed=3, guidance_options=SKYREELS_DF_OPTIONS)
            expected = run_steps(Runner(load_pipeline(model)), request, None).latents  # every window's steps
            assert expected.shape[2] == 5
            torch.testing.assert_close(torch.from_numpy(np.load(latents)), expected, rtol=1e-4, atol=1e-4)


def test_job_config_takes_true_cfg_scale(tmp_path):
    from raydit.jobconfig import load_job_config

    path = tmp_path / "job.yaml"
    path.write_text("prompt: a fox\nmodel: tiny-hunyuan\nnegative-prompt: blur\ntrue-cfg-scale: 4\n")
    assert load_job_config(str(path))["true_cfg_scale"] == 4.0
    path.write_text("prompt: a fox\ntrue_cfg_scale: strong\n")
    with pytest.raises(ValueError, match="key 'true_cfg_scale' must be float"):
        load_job_config(str(path))
