"""`raydit generate`'s scheduler flags (--scheduler, --scheduler-option, --sigmas / --timesteps)
and --lora-target: refused before Ray starts with one line and status 2, and a sigma-list run
equal to one process's Runner on the same request (float32: rtol 1e-4, atol 1e-4, as
test_cli_jobs.py's plans)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


RECIPES = sorted((Path(__file__).resolve().parents[2] / "examples" / "distilled").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_distilled_recipe_is_a_valid_job_whose_schedule_fits_wan(path):
    """examples/distilled/*.yaml: valid job configs (keys, types), their schedule resolved as the
    command line does (options parsed, the step count from the list) and taken by a Wan
    pipeline's scheduler config (the tiny one's: UniPC with flow_shift, as the real ones); the
    LoRA entries name their targets. Model and LoRA paths are placeholders, not checked."""
    from raydit.commands import resolve_schedule_options
    from raydit.jobconfig import load_job_config
    from raydit.models.loading import resolve_model_dir
    from raydit.models.schedules import check_for_model

    opts = load_job_config(str(path))
    assert opts["no_cfg"] is True and opts["guidance_scale"] == 1.0 and opts["prompt"]
    resolve_schedule_options(opts)
    assert opts["steps"] in (3, 4, 8)
    check_for_model(str(resolve_model_dir("tiny-wan")), opts["scheduler"], opts["scheduler_options"],
                    opts.get("sigmas"), opts.get("timesteps"))
    targets = opts.get("lora_target") or [e.get("target", "transformer") for e in opts.get("loras") or []]
    assert len(targets) <= len(opts.get("lora") or opts.get("loras") or [])


def test_a_shifted_sigma_list_runs_as_the_recipes_say():
    """The README's and the recipes' claim: shift 5 turns 1, 0.75, 0.5, 0.25 into 1, 0.9375,
    0.8333, 0.625 (diffusers' FlowMatchEulerDiscreteScheduler, built from Wan's config)."""
    from raydit.models.loading import resolve_model_dir
    from raydit.models.schedules import _model_scheduler, own_scheduler

    base = _model_scheduler(str(resolve_model_dir("tiny-wan")))
    scheduler = own_scheduler(base, name="FlowMatchEulerDiscreteScheduler", options=(("shift", 5),),
                              sigmas=(1.0, 0.75, 0.5, 0.25))
    scheduler.set_timesteps(4)
    expected = torch.tensor([1.0, 0.9375, 5 / 6, 0.625], dtype=torch.float64)
    torch.testing.assert_close(scheduler.sigmas[:4].double(), expected, rtol=0, atol=1e-6)
