"""`raydit generate`'s scheduler flags (--scheduler, --scheduler-option, --sigmas / --timesteps)
and --lora-target: refused before Ray starts with one line and status 2, and a sigma-list run
equal to one process's Runner on the same request (float32: rtol 1e-4, atol 1e-4, as
test_cli_jobs.py's plans)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch


def raydit(*args, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "raydit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.mark.parametrize("args, needle", [
    (["--scheduler", "NoSuchScheduler"], "FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler, "
                                         "FlowMatchLCMScheduler"),  # the fitting ones listed
    (["--sigmas", "1,0.75", "--steps", "3"], "--steps 3 disagrees with the 2 sigmas given"),
    (["--sigmas", "1,0.5", "--timesteps", "900,500"], "give --sigmas or --timesteps, not both"),
    (["--sigmas", "1,0.8,0.9"], "must fall step by step"),
    (["--sigmas", "1.5,0.5"], "sigma 1.5 is outside (0, 1]"),
    (["--sigmas", "1,x"], "must be numbers separated by commas"),
    (["--scheduler", "FlowMatchEulerDiscreteScheduler", "--scheduler-option", "shfit=5"],
     "FlowMatchEulerDiscreteScheduler takes no option shfit"),
    (["--scheduler-option", "shift"], "--scheduler-option 'shift' must be NAME=VALUE"),
    (["--lora-target", "transformer_2"], "--lora-target is given 1 times but --lora 0 times"),
])
def test_schedule_refusals_are_one_line_and_status_2(args, needle, capsys):
    """Each refused before Ray starts: nothing answers at --address 127.0.0.1:9, so a check that
    ran after connecting would fail on the address instead."""
    from raydit.cli import main

    code = main(["generate", "--prompt", "x", "--device", "cpu", "--model", "tiny-wan", "--address", "127.0.0.1:9",
                 *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.long  # two processes on a loaded 2-core machine: minutes
def test_a_sigma_list_from_the_command_line_equals_the_runner(ray_local, tmp_path):
    """`raydit generate --model tiny-wan --scheduler FlowMatchEulerDiscreteScheduler
    --scheduler-option shift=5 --sigmas 1,0.75,0.5` on one worker, no --steps: 3 steps, the
    latents one process's Runner computes for the same request; its job.json holds the
    schedule, so --resume takes it from there."""
    from raydit.commands import _saved_job
    from raydit.models.conformance import run_steps
    from raydit.models.loading import load_pipeline
    from raydit.models.requests import GenerationRequest
    from raydit.models.runner import Runner

    res = raydit(
        "generate", "--model", "tiny-wan", "--prompt", "a heron lands", "--seed", "4", "--frames", "9",
        "--height", "32", "--width", "32", "--guidance-scale", "1", "--scheduler", "FlowMatchEulerDiscreteScheduler",
        "--scheduler-option", "shift=5", "--sigmas", "1,0.75,0.5", "--device", "cpu", "--workers", "1",
        "--address", ray_local.get_runtime_context().gcs_address, "--json", "--out", str(tmp_path / "v.mp4"),
        "--save-latents", str(tmp_path / "v.npy"), "--checkpoint-dir", str(tmp_path / "run"), cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["plan"]["world_size"] == 1
    request = GenerationRequest(prompt="a heron lands", num_frames=9, height=32, width=32, num_inference_steps=3,
                                guidance_scale=1.0, seed=4, scheduler="FlowMatchEulerDiscreteScheduler",
                                scheduler_options={"shift": 5}, sigmas=(1.0, 0.75, 0.5))
    state = run_steps(Runner(load_pipeline("tiny-wan")), request, None)
    assert state.step_index == 3
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "v.npy")), state.latents, rtol=1e-4, atol=1e-4)
    saved = _saved_job(str(tmp_path / "run"))
    assert (saved["scheduler"], saved["scheduler_options"], saved["sigmas"], saved["steps"]) == (
        "FlowMatchEulerDiscreteScheduler", [["shift", 5]], [1.0, 0.75, 0.5], 3)
