"""Failures as a user of `raydit generate` meets them, against the session's real Ray:

- a request the scheduler cannot take (20 steps on a scheduler trained with 10) is refused
  on the driver, before any worker sees it: status 2, one line, diffusers' limit named;
- an error raised inside the workers (a scheduler config diffusers refuses when it sets
  its timesteps) is reported at once with the original message, never retried, in a time
  close to a healthy run's (the bound is generous: the machine is shared);
- a run whose driver is SIGKILLed mid-way finishes with `--resume DIR` with the same
  latents as an uninterrupted run (rtol 1e-4, atol 1e-4, float32).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from support.cli import raydit

PROMPT = "a red fox"  # within the tiny tokenizer's 16 tokens: no truncation warning


def _variant(tmp_path, name: str, **scheduler) -> str:
    """The tiny pipeline saved again with a different scheduler config (diffusers' format)."""
    from raydit.models.loading import resolve_model_dir

    target = tmp_path / name
    shutil.copytree(resolve_model_dir("tiny"), target)
    config_path = target / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config.update(scheduler)
    config_path.write_text(json.dumps(config))
    return str(target)


@pytest.fixture(scope="module")
def healthy(ray_local, tmp_path_factory):
    """One healthy 2-rank CLI run on the session's Ray: its latents."""
    tmp = tmp_path_factory.mktemp("healthy")
    address = ray_local.get_runtime_context().gcs_address
    res = raydit("generate", "--prompt", PROMPT, "--steps", "6", "--seed", "4", "--device", "cpu", "--workers", "2",
                 "--address", address, "--json", "--out", str(tmp / "full.mp4"),
                 "--save-latents", str(tmp / "full.npy"), cwd=tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    return {"address": address, "latents": np.load(tmp / "full.npy")}


def _args(address, model, steps):
    return ["generate", "--prompt", PROMPT, "--model", model, "--steps", str(steps), "--device", "cpu",
            "--workers", "2", "--address", address, "--json"]


def test_steps_beyond_the_scheduler_are_refused_on_the_driver(healthy, tmp_path):
    model = _variant(tmp_path, "ten-timesteps", num_train_timesteps=10)
    res = raydit(*_args(healthy["address"], model, 20), cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raydit: error:"), res.stderr
    assert "num_inference_steps 20 is more than the 10 timesteps" in lines[0]
    assert "in the workers" not in lines[0]  # the driver said it, not a worker


@pytest.mark.long  # stage two: ~45 s
def test_an_error_raised_in_the_workers_is_reported_at_once_and_never_retried(healthy, tmp_path):
    model = _variant(tmp_path, "bad-spacing", timestep_spacing="sideways")
    res = raydit(*_args(healthy["address"], model, 6), cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raydit: error:"), res.stderr
    # diffusers' own message, from the workers, on one line; not retried: only a failure
    # that is not recovered gets that ending (a retried one ends in the controller's
    # "failed at step ... twice" instead), whatever the run's duration.
    assert "sideways is not supported" in lines[0]
    assert lines[0].endswith("(raised in the workers during prepare; not retried)"), lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.long  # 74 s: the second stage (stage one at a76bbd5 ran 21:02)
def test_a_run_whose_driver_died_finishes_with_resume_and_the_same_latents(healthy, tmp_path):
    saved = tmp_path / "run"
    args = ["generate", "--prompt", PROMPT, "--steps", "6", "--seed", "4", "--device", "cpu", "--workers", "2",
            "--address", healthy["address"], "--json", "--out", str(tmp_path / "a.mp4"),
            "--checkpoint-dir", str(saved)]
    proc = subprocess.Popen([sys.executable, "-m", "raydit.cli", *args], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_at = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (saved / "progress.pt").is_file():
                try:
                    ckpt = torch.load(saved / "progress.pt", weights_only=False)["checkpoint"]
                except Exception:  # pragma: no cover - renamed into place atomically
                    ckpt = None
                if ckpt is not None and ckpt["step_index"] >= 1:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed_at = ckpt["step_index"]
                    break
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert killed_at is not None and killed_at < 6, "the run ended before it could be stopped mid-way"
    res = raydit("generate", "--resume", str(saved), "--address", healthy["address"],
                 "--out", str(tmp_path / "b.mp4"), "--save-latents", str(tmp_path / "b.npy"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])  # --json came from the saved run
    assert summary["out"] == str(tmp_path / "b.mp4")
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "b.npy")),
                               torch.from_numpy(healthy["latents"]), rtol=1e-4, atol=1e-4)
    # The request cannot be changed on resume: told, not ignored.
    res = raydit("generate", "--resume", str(saved), "--prompt", "another", cwd=tmp_path)
    assert res.returncode == 2 and "drop --prompt" in res.stderr


def _resolve(*argv):
    """The options `raydit generate ARGV` would run with: checked before Ray starts."""
    import argparse

    from raydit.commands import add_generate_arguments, resolve_generate_options

    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    return resolve_generate_options(parser.parse_args(list(argv)))


def _saved_run(tmp_path, **job):
    saved = tmp_path / "run"
    saved.mkdir()
    (saved / "job.json").write_text(json.dumps(job))
    return saved


def test_resume_from_a_config_file_refuses_its_request_keys_and_takes_its_other_options(tmp_path):
    saved = _saved_run(tmp_path, prompt="saved", steps=2, out=str(tmp_path / "saved.mp4"))
    config = tmp_path / "rc.yaml"
    config.write_text(f"out: {tmp_path / 'from_config.mp4'}\nprompt: other\nsteps: 7\nresume: {saved}\n")
    # The file's request is not dropped in favour of the saved run's: refused, the file named.
    with pytest.raises(ValueError, match=r"drop 'prompt:', 'steps:' from config file .*rc\.yaml"):
        _resolve("--config", str(config))
    # Its other options win over the saved run's, as the command line's do.
    config.write_text(f"out: {tmp_path / 'from_config.mp4'}\njson: true\nresume: {saved}\n")
    o = _resolve("--config", str(config))
    assert (o["prompt"], o["steps"], o["out"], o["json"]) == ("saved", 2, str(tmp_path / "from_config.mp4"), True)
    assert _resolve("--config", str(config), "--out", str(tmp_path / "line.mp4"))["out"] == str(tmp_path / "line.mp4")
    # The checkpoints are the saved run's: another directory would start the run afresh there.
    with pytest.raises(ValueError, match="keeps its checkpoints there, and --checkpoint-dir .* names another "
                                         "directory; drop --checkpoint-dir"):
        _resolve("--resume", str(saved), "--checkpoint-dir", str(tmp_path / "elsewhere"))
    assert _resolve("--resume", str(saved), "--checkpoint-dir", str(saved))["checkpoint_dir"] == str(saved)


@pytest.mark.parametrize("job, needle", [
    ([1, 2], "must be a JSON object of option: value, got list"),
    ({"prompt": "x", "model": "tiny", "steps": "2"}, "key 'steps' must be int, got '2'"),
    ({"prompt": "x", "model": "tiny", "out": 5}, "key 'out' must be str, got 5"),
    ({"prompt": "x", "stepz": 2}, "unknown key 'stepz'"),
    ({}, "has no prompt"),
])
def test_resume_refuses_a_malformed_saved_job_in_one_line_naming_the_file(tmp_path, job, needle):
    saved = tmp_path / "run"
    saved.mkdir()
    (saved / "job.json").write_text(json.dumps(job))
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        _resolve("--resume", str(saved))
    assert str(saved / "job.json") in str(err.value) and "\n" not in str(err.value)


def test_resume_takes_a_saved_job_as_written(tmp_path):
    """A whole number where a float is due, and a float JSON writes with an exponent, are the
    saved run's values, not refused; what a run writes is what --resume takes back."""
    saved = _saved_run(tmp_path, prompt="x", model="tiny", guidance_scale=6, cache="fbcache", cache_threshold=5e-05,
                       guidance_options=[], out=str(tmp_path / "a.mp4"))
    o = _resolve("--resume", str(saved))
    assert (o["guidance_scale"], o["cache_threshold"], o["checkpoint_dir"]) == (6.0, 5e-05, str(saved))
    from raydit.commands import REQUEST_OPTIONS, _save_job

    first = _resolve("--prompt", "x", "--checkpoint-dir", str(tmp_path / "written"), "--guidance-option", "stg_scale=0",
                     "--cache", "teacache", "--cache-threshold", "0.00005", "--json")
    _save_job(first)
    again = _resolve("--resume", str(tmp_path / "written"))
    assert {k: again.get(k) for k in REQUEST_OPTIONS} == {k: first.get(k) for k in REQUEST_OPTIONS}
    assert again["guidance_options"] == first["guidance_options"] and again["json"] is True


def test_resume_with_a_malformed_saved_job_is_one_line_and_status_2(tmp_path):
    saved = _saved_run(tmp_path, prompt="x", model="tiny", steps="2")
    res = raydit("generate", "--resume", str(saved), cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raydit: error:") and "key 'steps' must be int" in lines[0], res.stderr


def test_a_file_where_a_directory_is_due_and_back_are_named_so(tmp_path):
    """--checkpoint-dir naming a file said "[Errno 17] File exists"; --image naming a
    directory said it did not exist."""
    from raydit.commands import _save_job
    from raydit.models.requests import image_to_png

    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=r"--checkpoint-dir '.*afile' is a file; give a directory"):
        _save_job({"checkpoint_dir": str(afile), "prompt": "x"})
    with pytest.raises(ValueError, match=r"image '.*' is a directory; give the path of a PNG or JPEG file"):
        image_to_png(str(tmp_path))
