"""A checkpoint is resumed only when it is whole, is this model's, is this job's request, and
no engine overwrites another's: each refused in one line, before a wrong video is made.

- a damaged progress.pt (a byte range overwritten inside the latents) is refused naming the
  zip member whose CRC fails (torch.load does not check CRCs);
- a progress.pt that names something able to run code is refused without running it
  (weights_only=True), while everything save_progress writes loads;
- a checkpoint written by another model is refused by Engine.resume naming both models; one
  written before the model was recorded is still taken;
- `--resume DIR` whose job.json and progress.pt are different requests exits 2 naming the fields;
- a second Engine on the same checkpoint root numbers its requests after the first one's.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import zipfile

import numpy as np
import pytest
import torch

from raydit.runtime.queue import PROGRESS_FILE, load_progress, model_identity, next_request_dir, save_progress
from support.cli import raydit

PROMPT = "a red fox"  # within the tiny tokenizer's 16 tokens


def _member_span(path, suffix):
    """(start, end) byte offsets of the stored data of the zip member ending in `suffix`."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    raw = path.read_bytes()
    # local header: 30 bytes + name + extra; torch stores members uncompressed.
    name_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.compress_size


# -- the file itself (no Ray) ---------------------------------------------------------------


def test_a_damaged_progress_file_is_refused_naming_the_member_that_fails_its_crc(tmp_path):
    latents = torch.randn(1, 4, 3, 8, 8)
    path = save_progress(str(tmp_path / "job"), {"prompt": PROMPT}, {"latents": latents, "step_index": 1})
    start, end = _member_span(path, "data/0")
    raw = bytearray(path.read_bytes())
    raw[start + 100:start + 200] = bytes(100)  # inside the latents record
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError) as err:
        load_progress(str(tmp_path / "job"))
    message = str(err.value)
    assert "\n" not in message
    assert "corrupted:" in message and "data/0 fails its CRC check" in message, message
    assert "start the request again without --resume" in message


def test_a_file_that_is_not_a_zip_is_not_a_progress_file(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / PROGRESS_FILE).write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"not a raydit progress file \(BadZipFile"):
        load_progress(str(tmp_path / "job"))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling it creates the marker file


def test_a_progress_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    save_progress(str(tmp_path / "job"), _RunsCode(str(marker)), None)
    with pytest.raises(ValueError, match=r"not a raydit progress file \(UnpicklingError: it names .*open"):
        load_progress(str(tmp_path / "job"))
    assert not marker.exists()


def test_what_save_progress_writes_loads_back_with_weights_only(tmp_path):
    from raydit.models.requests import GenerationRequest

    request = GenerationRequest(prompt=PROMPT, num_frames=9, height=64, width=64, image=b"\x89PNG",
                                lora=(("style", 0.5),), guidance_options={"stg_scale": 1.0})
    checkpoint = {"latents": torch.randn(2, 3), "step_index": 2, "generator_state": torch.ByteTensor(16),
                  "scheduler_state": {"sigmas": np.linspace(1, 0, 5), "scale": np.float64(0.5),
                                      "ids": np.arange(3), "history": [torch.ones(2, dtype=torch.bfloat16), None],
                                      "packed": ("__raydit_tensor__", torch.zeros(2), "cpu")},
                  "carry": {"n": 3}}
    model = {"pipeline": "CogVideoXPipeline", "digest": "0" * 16, "path": "/m"}
    save_progress(str(tmp_path / "job"), request, checkpoint, model=model)
    back, ckpt, saved_model = load_progress(str(tmp_path / "job"), with_model=True)
    assert back == request and saved_model == model
    torch.testing.assert_close(ckpt["latents"], checkpoint["latents"])
    assert ckpt["scheduler_state"]["history"][0].dtype == torch.bfloat16
    assert ckpt["scheduler_state"]["scale"] == 0.5 and ckpt["carry"] == {"n": 3}
    np.testing.assert_array_equal(ckpt["scheduler_state"]["sigmas"], np.linspace(1, 0, 5))
    assert load_progress(str(tmp_path / "job"))[0] == request  # without with_model: (request, checkpoint)


def test_a_new_request_directory_is_numbered_after_the_highest_one_there(tmp_path):
    root = tmp_path / "root"
    (root / "request-0003").mkdir(parents=True)
    (root / "request-0001").mkdir()
    (root / "other").mkdir()
    first = next_request_dir(str(root), 1)
    assert first == str(root / "request-0004")
    assert next_request_dir(str(root), 2) == str(root / "request-0005")
    # The engine's own count is kept when it is already past what is there.
    assert next_request_dir(str(root), 9) == str(root / "request-0009")


# -- through an Engine on the session's Ray --------------------------------------------------


@pytest.fixture(scope="module")
def engine_root(ray_local, tmp_path_factory):
    """A tiny engine checkpointing under a root where a crashed engine left request-0001."""
    from raydit.models.requests import GenerationRequest
    from raydit.runtime.engine import Engine

    root = tmp_path_factory.mktemp("ckroot")
    crashed = GenerationRequest(prompt="the crashed engine's request", num_frames=9, height=64, width=64,
                                num_inference_steps=2)
    save_progress(str(root / "request-0001"), crashed, None)
    engine = Engine(model="tiny", workers=1, device="cpu", show_plan=False, checkpoint_dir=str(root))
    result = engine.generate(PROMPT, num_inference_steps=2, seed=3, progress=False)
    yield {"engine": engine, "root": root, "crashed": crashed, "result": result}
    engine.shutdown()


def test_a_second_engine_on_the_same_root_keeps_the_first_ones_requests(engine_root):
    root = engine_root["root"]
    request, checkpoint = load_progress(str(root / "request-0001"))
    assert request == engine_root["crashed"] and checkpoint is None  # not overwritten
    request, checkpoint = load_progress(str(root / "request-0002"))
    assert request.prompt == PROMPT and checkpoint["step_index"] == 2


def test_a_checkpoint_of_another_model_is_refused_naming_both(engine_root, tmp_path):
    from raydit.models.loading import resolve_model_dir

    engine = engine_root["engine"]
    request, checkpoint, model = load_progress(str(engine_root["root"] / "request-0002"), with_model=True)
    assert model["pipeline"] == "CogVideoXPipeline"
    other = model_identity(str(resolve_model_dir("tiny-wan")))
    save_progress(str(tmp_path / "wan"), request, checkpoint, model=other)
    with pytest.raises(ValueError) as err:
        engine.resume(str(tmp_path / "wan"), progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert "WanPipeline" in message and "CogVideoXPipeline" in message, message
    assert other["digest"] in message and model["digest"] in message


def test_a_checkpoint_written_before_the_model_was_recorded_is_still_resumed(engine_root, tmp_path):
    request, checkpoint = load_progress(str(engine_root["root"] / "request-0002"))
    save_progress(str(tmp_path / "old"), request, checkpoint)  # no model: an older raydit's file
    resumed = engine_root["engine"].resume(str(tmp_path / "old"), progress=False)
    np.testing.assert_array_equal(resumed.latents, engine_root["result"].latents)


# -- the command line -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(ray_local, tmp_path_factory):
    """One finished 2-step CLI run with --checkpoint-dir."""
    tmp = tmp_path_factory.mktemp("saved")
    address = ray_local.get_runtime_context().gcs_address
    res = raydit("generate", "--prompt", PROMPT, "--steps", "2", "--seed", "4", "--device", "cpu", "--workers", "1",
                 "--address", address, "--json", "--out", str(tmp / "a.mp4"), "--checkpoint-dir", str(tmp / "run"),
                 cwd=tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp / "run"


def _one_line_error(res):
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raydit: error:"), res.stderr
    return lines[0]


def test_resume_of_a_damaged_checkpoint_is_refused_with_status_2(saved_run, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(saved_run, damaged)
    path = damaged / PROGRESS_FILE
    start, end = _member_span(path, "data/0")  # the latents, the first tensor saved
    assert end - start > 200, (start, end)  # the latents record is long enough to damage inside
    raw = bytearray(path.read_bytes())
    raw[start + 100:start + 200] = bytes(b ^ 0xFF for b in raw[start + 100:start + 200])
    path.write_bytes(bytes(raw))
    res = raydit("generate", "--resume", str(damaged), "--out", str(tmp_path / "g.mp4"), cwd=tmp_path)
    line = _one_line_error(res)
    assert "corrupted:" in line and "fails its CRC check" in line and "without --resume" in line, line
    assert not (tmp_path / "g.mp4").exists()


def test_resume_where_job_json_and_progress_are_different_requests_is_refused_with_status_2(saved_run, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(saved_run, mixed)
    job = json.loads((mixed / "job.json").read_text())
    assert job["steps"] == 2 and job["seed"] == 4
    job.update(prompt="a blue whale", seed=11)  # another run's request beside this progress.pt
    (mixed / "job.json").write_text(json.dumps(job))
    res = raydit("generate", "--resume", str(mixed), "--out", str(tmp_path / "g.mp4"), cwd=tmp_path)
    line = _one_line_error(res)
    assert "progress.pt is another request than its job.json" in line, line
    assert "prompt 'a red fox' (job.json: 'a blue whale')" in line and "seed 4 (job.json: 11)" in line, line
    assert "steps" not in line  # the same in both: not named


def test_resume_takes_a_job_json_that_leaves_steps_and_guidance_to_the_model(saved_run):
    """job.json's None (the model's own steps / guidance) is not a difference."""
    from raydit.commands import _check_saved_request

    job = json.loads((saved_run / "job.json").read_text())
    _check_saved_request(str(saved_run), {**job, "steps": None, "guidance_scale": None})
    with pytest.raises(ValueError, match=r"steps 2 \(job.json: 3\)"):
        _check_saved_request(str(saved_run), {**job, "steps": 3})
    with pytest.raises(ValueError, match=r"guidance_scale"):
        request, _ = load_progress(str(saved_run))
        _check_saved_request(str(saved_run), {**job, "guidance_scale": request.guidance_scale + 1})
    assert dataclasses.is_dataclass(load_progress(str(saved_run))[0])


@pytest.mark.long  # every tiny pipeline loaded once (about a minute): the second stage
def test_every_familys_checkpoint_loads_back_with_weights_only(tmp_path):
    """Each family's own checkpoint after one step (its scheduler's state: UniPC's model outputs,
    diffusion forcing's windows, LTX-2's audio ...) saved and loaded as --resume loads it, under
    weights_only: a type one family keeps that the allowed list lacks would refuse its resumes."""
    from raydit import model_spec
    from raydit.models.conformance import run_steps
    from raydit.models.requests import GenerationRequest, checker_image, image_to_png
    from raydit.models.loading import load_pipeline, resolve_model_dir
    from raydit.models.registry import families
    from raydit.models.runner import Runner

    for family in families().values():
        for name in family.tiny():
            spec = model_spec(str(resolve_model_dir(name)))
            pipe = load_pipeline(name)
            image = (image_to_png(checker_image(spec.default_height, spec.default_width))
                     if type(pipe).__name__ in family.image_pipelines else None)
            request = GenerationRequest(prompt=PROMPT, num_frames=spec.default_frames, height=spec.default_height,
                                        width=spec.default_width, num_inference_steps=2, seed=1, image=image,
                                        guidance_options={"image_crf": 0} if name == "tiny-ltx2-i2v" else ())
            runner = Runner(pipe)
            try:
                checkpoint = runner.checkpoint(run_steps(runner, request, 1))
            finally:
                runner.close()
            directory = tmp_path / name
            save_progress(str(directory), request, checkpoint)
            loaded_request, loaded = load_progress(str(directory))
            assert loaded_request == request, name
            assert int(loaded["step_index"]) == int(checkpoint["step_index"]) == 1, name
