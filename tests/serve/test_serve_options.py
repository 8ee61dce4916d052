"""`raydit serve` without a server: options and serve.yaml, the token file, request bodies
against the limits, the store on disk. Pure Python (no Ray), except the command-line
cases, which run `raydit serve` and expect exit status 2 and one line before Ray starts."""

from __future__ import annotations

import dataclasses

import json
import os
import stat
import subprocess
import sys

import pytest

from raydit.planner import model_spec
from raydit.serve.auth import bearer_ok, load_or_create_token, token_digest
from raydit.serve.config import resolve_serve_options
from raydit.serve.schema import Limits, RequestError, frames_for_seconds, parse_body, parse_size, resolve
from raydit.serve.store import VideoJob, VideoStore, new_id, valid_id

TINY = model_spec("tiny")  # 9 frames x 64 x 64 by default; frames = 1 + 4k; sizes multiples of 16
LIMITS = Limits(model="tiny", max_frames=17, max_height=32, max_width=32, max_steps=50, default_steps=4,
                fps=8, vae_temporal=4)


# -- options -------------------------------------------------------------------------------------


def test_serve_yaml_is_read_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: tiny\nworkers: 2\nmax-queue: 3\nport: 9100\nhost: 0.0.0.0\n")
    opts = resolve_serve_options({"config": str(cfg), "port": 9200})
    assert (opts["workers"], opts["max_queue"], opts["host"], opts["port"]) == (2, 3, "0.0.0.0", 9200)
    assert opts["replicas"] == 1 and opts.get("default_steps") is None  # defaults fill the rest (steps: the model's)


@pytest.mark.parametrize("text, needle", [
    ("modle: tiny\n", "unknown key 'modle'"),
    ("workers: two\n", "key 'workers' must be int"),
    ("port: 0\n", "--port 0"),
    ("max-steps: 10\ndefault-steps: 20\n", "--default-steps 20 is more than --max-steps 10"),
    ("device: tpu\n", "device 'tpu'"),
])
def test_a_bad_serve_yaml_names_the_key(tmp_path, text, needle):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=None) as info:
        resolve_serve_options({"config": str(cfg)})
    assert needle in str(info.value)


def test_builder_args_refuse_unknown_options():
    with pytest.raises(ValueError, match="unknown option.*'worker'"):
        resolve_serve_options({"worker": 2})


@pytest.mark.parametrize("args, needle", [
    ({"port": "8000"}, "option 'port' must be int, got '8000'"),
    ({"max_queue": "5"}, "option 'max_queue' must be int, got '5'"),
    ({"max_queue": 1.5}, "option 'max_queue' must be int, got 1.5"),
    ({"config": 5}, "option 'config' must be str, got 5"),
    ({"host": 5}, "option 'host' must be str, got 5"),
    ({"model": 5}, "option 'model' must be str, got 5"),
    ({"token_file": 5}, "option 'token_file' must be str, got 5"),
    ({"lora": "goodlora"}, "option 'lora' must be list, got 'goodlora'"),
    ({"compile": "yes"}, "option 'compile' must be bool, got 'yes'"),
    ({"workers": True}, "option 'workers' must be int, got True"),
    ({"max-queue": 3, "max_queue": 4}, "option 'max_queue' is given twice"),
])
def test_builder_args_are_typed_like_serve_yaml(args, needle):
    """A Serve config's / RayService's `args` dict gets serve.yaml's per-key type check
    (raydit.jobconfig.check_option_types): one line naming the option, before anything starts."""
    with pytest.raises(ValueError) as info:
        resolve_serve_options(args)
    assert needle in str(info.value) and str(info.value).startswith("raydit.serve.app:build args: ")
    assert "\n" not in str(info.value)


def test_builder_args_of_the_right_types_pass():
    opts = resolve_serve_options({"port": 9100, "max_queue": 0, "host": "0.0.0.0", "scale_up_wait": 5,
                                  "max-steps": 60, "compile": False})
    assert (opts["port"], opts["max_queue"], opts["host"], opts["max_steps"]) == (9100, 0, "0.0.0.0", 60)
    assert opts["scale_up_wait"] == 5.0 and isinstance(opts["scale_up_wait"], float)


def test_example_serve_yaml_is_valid():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "serve.yaml"
    opts = resolve_serve_options({"config": str(path)})
    assert opts["model"] and opts["host"] == "127.0.0.1"


@pytest.mark.parametrize("args, needle", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--frames", "10"], "frames 10"),
    (["--port", "70000"], "--port 70000"),
    (["--workers", "0"], "--workers 0"),
    (["--replicas", "2", "--max-replicas", "1"], "--max-replicas 1 is below --replicas 2"),
    (["--max-replicas", "2", "--scale-up-wait", "-1"], "--scale-up-wait -1.0 must be a number of seconds >= 0"),
])
def test_bad_command_line_is_one_line_and_status_2(tmp_path, args, needle):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYDIT_API_TOKEN")}
    out = subprocess.run(
        [sys.executable, "-m", "raydit.cli", "serve", "--device", "cpu", "--token-file",
         str(tmp_path / "tok"), "--output-dir", str(tmp_path / "out"), *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raydit: error:"), out.stderr
    assert needle in lines[0]


def test_where_the_server_cannot_listen_or_keep_videos_is_one_line_before_ray_starts(tmp_path):
    """A port in use, a host that is not this machine's (198.51.100.7: a documentation address,
    bound locally, no packet sent) and an --output-dir that is a file: before these checks the
    first two were Serve's proxy traceback after Ray had started (exit 1), the third Errno 17."""
    import socket

    (tmp_path / "afile").write_text("x")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    # The --output-dir case gets past the port check first: a port of its own, held bound (not
    # listening, SO_REUSEADDR: the check's bind succeeds), not the default 8000, which anything
    # on the machine may listen on.
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYDIT_API_TOKEN")}
    cases = [
        (["--port", str(port)], f"--port {port} is in use on 127.0.0.1"),
        (["--host", "198.51.100.7"], "cannot listen on 198.51.100.7:8000"),
        (["--output-dir", str(tmp_path / "afile"), "--port", str(held.getsockname()[1])],
         "is a file; give a directory"),
    ]
    try:
        for args, needle in cases:
            out = subprocess.run(
                [sys.executable, "-m", "raydit.cli", "serve", "--device", "cpu", "--token-file",
                 str(tmp_path / "tok"), "--output-dir", str(tmp_path / "out"), *args],
                capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
            )
            assert out.returncode == 2, (args, out.stderr)
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and needle in lines[0], (args, out.stderr)
    finally:
        busy.close()
        held.close()


# -- token ---------------------------------------------------------------------------------------


def test_token_file_is_created_0600_and_read_back(tmp_path):
    path = str(tmp_path / "sub" / "token")
    token, created = load_or_create_token(path)
    assert created and len(token) >= 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again, created = load_or_create_token(path)
    assert again == token and not created
    digest = token_digest(token)
    assert bearer_ok(f"Bearer {token}", digest) and bearer_ok(f"bearer {token}", digest)
    assert not bearer_ok(None, digest) and not bearer_ok(f"Bearer {token}x", digest)
    assert not bearer_ok(token, digest) and not bearer_ok("Basic " + token, digest)


def test_token_readable_by_others_or_too_short_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text("a" * 40)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_or_create_token(str(path))
    path.write_text("short")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="16 or more"):
        load_or_create_token(str(path))
    monkeypatch.delenv("RAYDIT_API_TOKEN", raising=False)
    with pytest.raises(ValueError, match="RAYDIT_API_TOKEN"):
        load_or_create_token(None)
    monkeypatch.setenv("RAYDIT_API_TOKEN", "from-the-environment-0123")
    assert load_or_create_token(None) == ("from-the-environment-0123", False)


# -- request bodies ------------------------------------------------------------------------------


def test_form_strings_and_json_values_parse_alike():
    form = parse_body({"prompt": "a fox", "num_inference_steps": "3", "guidance_scale": "5.5", "seed": "7",
                       "size": "32x16", "seconds": "1"})
    as_json = parse_body({"prompt": "a fox", "num_inference_steps": 3, "guidance_scale": 5.5, "seed": 7,
                          "size": "32x16", "seconds": 1})
    assert form == as_json
    params = resolve(form, LIMITS, TINY)
    assert params == {"prompt": "a fox", "negative_prompt": "", "num_frames": 9, "height": 16, "width": 32,
                      "num_inference_steps": 3, "guidance_scale": 5.5, "seed": 7, "lora": None,
                      "guidance_options": {}}


def test_defaults_come_from_the_limits():
    params = resolve(parse_body({"prompt": "x"}), LIMITS, TINY)
    assert (params["num_frames"], params["height"], params["width"]) == (17, 32, 32)
    assert params["num_inference_steps"] == 4 and 0 <= params["seed"] < 2**31


@pytest.mark.parametrize("seconds, frames", [(0.1, 1), (0.5, 5), (1, 9), (1.1, 9), (1.2, 13), (2, 17), (6, 49)])
def test_seconds_become_the_fewest_frames_the_vae_takes(seconds, frames):
    assert frames_for_seconds(seconds, fps=8, vae_temporal=4) == frames


@pytest.mark.parametrize("body, param, needle", [
    ({"prompt": ""}, "prompt", "at least 1 character"),
    ({}, "prompt", "Field required"),
    ({"prompt": "x", "num_inference_steps": "abc"}, "num_inference_steps", "valid integer"),
    ({"prompt": "x", "num_inference_steps": "2.5"}, "num_inference_steps", "valid integer"),
    ({"prompt": "x", "num_inference_steps": "0"}, "num_inference_steps", "greater than or equal to 1"),
    ({"prompt": "x", "guidance_scale": "lots"}, "guidance_scale", "valid number"),
    ({"prompt": "x", "seed": "-1"}, "seed", "greater than or equal to 0"),
    ({"prompt": "x", "num_inference_step": "2"}, "num_inference_step", "unknown field"),
    # JSON booleans are not numbers (pydantic's lax mode would take true as 1).
    ({"prompt": "x", "num_frames": True}, "num_frames", "valid integer, not a boolean"),
    ({"prompt": "x", "seed": True}, "seed", "valid integer, not a boolean"),
    ({"prompt": "x", "num_inference_steps": True}, "num_inference_steps", "valid integer, not a boolean"),
    ({"prompt": "x", "guidance_scale": False}, "guidance_scale", "valid number, not a boolean"),
    ({"prompt": "x", "seconds": True}, "seconds", "valid number, not a boolean"),
    ({"prompt": "x", "cache_threshold": True}, "cache_threshold", "valid number, not a boolean"),
])
def test_bad_field_is_named(body, param, needle):
    with pytest.raises(RequestError) as info:
        parse_body(body)
    assert info.value.param == param and info.value.status == 400
    assert param in info.value.message and needle in info.value.message


@pytest.mark.parametrize("body, param, needle", [
    ({"num_inference_steps": 51}, "num_inference_steps", "limit of 50 (--max-steps)"),
    ({"num_frames": 21}, "num_frames", "more than the 17 frames this server's plan holds"),
    ({"seconds": 3}, "seconds", "more than the 17 frames"),
    ({"num_frames": 10}, "num_frames", "nearest valid: 9 or 13"),
    ({"size": "48x32"}, "size", "beyond the 32x32"),
    ({"size": "24x16"}, "size", "width 24 is not a multiple of 16"),
    ({"size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"model": "sora-2"}, "model", "this server runs 'tiny'"),
])
def test_beyond_the_limits_is_refused_with_the_limit(body, param, needle):
    with pytest.raises(RequestError) as info:
        resolve(parse_body({"prompt": "x", **body}), LIMITS, TINY)
    assert info.value.param == param and needle in info.value.message, info.value.message


def test_a_cache_threshold_is_judged_against_the_servers_cache():
    """A threshold alone applies to the server's own method (Limits.cache): refused (400, naming
    it) where the server runs no cache, as with "cache": "none"; passed on where it runs one."""
    body = parse_body({"prompt": "x", "cache_threshold": 0.1})
    plain, cached = dataclasses.replace(LIMITS, cache=None), dataclasses.replace(LIMITS, cache="fbcache")
    with pytest.raises(RequestError) as info:
        resolve(body, plain, TINY)
    assert (info.value.param, info.value.status) == ("cache_threshold", 400)
    assert "cache_threshold: 0.1 has no cache method" in info.value.message and "\n" not in info.value.message
    assert resolve(body, cached, TINY)["cache_threshold"] == 0.1
    with_method = resolve(parse_body({"prompt": "x", "cache": "teacache", "cache_threshold": 0.1}), plain, TINY)
    assert (with_method["cache"], with_method["cache_threshold"]) == ("teacache", 0.1)
    assert "cache_threshold" not in resolve(parse_body({"prompt": "x"}), plain, TINY)


# -- store ---------------------------------------------------------------------------------------


def _job(**kw) -> VideoJob:
    params = {"prompt": "x", "negative_prompt": "", "num_frames": 9, "height": 32, "width": 32,
              "num_inference_steps": 2, "guidance_scale": 6.0, "seed": 1}
    return VideoJob(id=new_id(), model="tiny", prompt="x", params=params, fps=8, **kw)


def test_ids_are_the_only_names(tmp_path):
    store = VideoStore(tmp_path)
    assert valid_id(new_id())
    for bad in ("../etc/passwd", "video_../../x", "video_" + "g" * 24, "VIDEO_" + "0" * 24, "video_0"):
        assert not valid_id(bad)
        with pytest.raises(ValueError):
            store.video_path(bad)


def test_store_round_trip_and_a_missing_mp4(tmp_path):
    import numpy as np

    store = VideoStore(tmp_path)
    done, gone, waiting = _job(status="completed", progress=100), _job(status="completed"), _job()
    for j in (done, gone, waiting):
        store.save(j)
    store.write_video(done.id, np.zeros((9, 32, 32, 3), np.uint8), fps=8)
    (tmp_path / "video_broken.json").write_text("{")  # not an id: ignored
    (tmp_path / f"{new_id()}.json").write_text("{not json")
    jobs, notes = store.load_all()
    by_id = {j.id: j for j in jobs}
    assert by_id[done.id].status == "completed" and by_id[done.id].to_object()["progress"] == 100
    assert by_id[gone.id].status == "failed" and "missing" in by_id[gone.id].error["message"]
    assert by_id[waiting.id].status == "queued"
    assert len(notes) == 2  # the unreadable file and the missing mp4
    obj = json.loads(json.dumps(by_id[done.id].to_object()))
    assert obj["object"] == "video" and obj["size"] == "32x32" and obj["seconds"] == "1.125"
    store.delete(done.id)
    assert not store.video_path(done.id).exists()


# -- LoRAs: the `lora` field, POST /v1/loras paths, serve options --------------------------------


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("style", {"style": 1.0}), ('{"style": "0.5", "detail": 2}', {"style": 0.5, "detail": 2.0}),
    ({"style": 0.25}, {"style": 0.25}), ({}, None),
])
def test_lora_field_parses_from_forms_and_json(value, expected):
    body = parse_body({"prompt": "x", "lora": value} if value is not None else {"prompt": "x"})
    assert resolve(body, LIMITS, TINY, loras={"style": "/a", "detail": "/b"})["lora"] == expected


@pytest.mark.parametrize("value, needle", [
    ("nope", "'nope' is not loaded; loaded: detail, style"),
    ('{"style": -1}', ">= 0"),
    ('{"style": "lots"}', "is not a number"),
    ('{"style": 1', "not valid JSON"),
    ({"style": float("inf")}, "finite number"),
    ("../etc", "is not valid"),
    (3, "valid string"),
])
def test_bad_lora_field_is_named(value, needle):
    with pytest.raises(RequestError) as info:
        resolve(parse_body({"prompt": "x", "lora": value}), LIMITS, TINY, loras={"style": "/a", "detail": "/b"})
    assert info.value.param == "lora" and info.value.status == 400 and needle in info.value.message, info.value.message


def test_a_fused_server_runs_its_lora_and_refuses_others():
    fused = {"style": 0.5}
    for value in (None, '{"style": 0.5}'):
        body = parse_body({"prompt": "x", **({"lora": value} if value else {})})
        assert resolve(body, LIMITS, TINY, loras={"style": "/a"}, fused=fused)["lora"] == fused
    for value in ("detail", '{"style": 1}'):
        with pytest.raises(RequestError, match="fused into its weights at scale 0.5") as info:
            resolve(parse_body({"prompt": "x", "lora": value}), LIMITS, TINY, loras={"style": "/a"}, fused=fused)
        assert info.value.param == "lora"


@pytest.fixture
def lora_tree(tmp_path):
    """--lora-dir with a diffusers-style directory and a single file; beside it, outside, a LoRA
    that symlinks inside point to."""
    root, outside = tmp_path / "loras", tmp_path / "outside"
    (root / "style").mkdir(parents=True)
    (root / "style" / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    (root / "detail.safetensors").write_bytes(b"x")
    outside.mkdir()
    (outside / "secret.safetensors").write_bytes(b"x")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "link.safetensors").symlink_to(outside / "secret.safetensors")
    (root / "inner").symlink_to(root / "style", target_is_directory=True)  # inside: allowed
    (root / "sneaky").mkdir()
    (root / "sneaky" / "pytorch_lora_weights.safetensors").symlink_to(outside / "secret.safetensors")
    return root


def test_lora_paths_resolve_inside_the_lora_dir(lora_tree):
    from raydit.serve.schema import lora_path

    assert lora_path(str(lora_tree), "style") == (lora_tree / "style" / "pytorch_lora_weights.safetensors").resolve()
    assert lora_path(str(lora_tree), "detail.safetensors") == (lora_tree / "detail.safetensors").resolve()
    assert lora_path(str(lora_tree), "inner").parent.name == "style"
    assert lora_path(str(lora_tree), "./style/../detail.safetensors").name == "detail.safetensors"


@pytest.mark.parametrize("path, status, needle", [
    ("../outside/secret.safetensors", 400, "leads outside the server's --lora-dir"),
    ("escape/secret.safetensors", 400, "leads outside"),
    ("escape", 400, "leads outside"),
    ("link.safetensors", 400, "leads outside"),
    ("sneaky", 400, "symlink leading outside"),
    ("/etc/passwd", 400, "must be relative"),
    ("missing", 404, "does not exist"),
    ("style/pytorch_lora_weights.txt", 404, "does not exist"),
])
def test_lora_paths_outside_or_missing_are_refused(lora_tree, path, status, needle):
    from raydit.serve.schema import lora_path

    with pytest.raises(RequestError) as info:
        lora_path(str(lora_tree), path)
    assert info.value.param == "path" and info.value.status == status and needle in info.value.message
    assert str(lora_tree.parent) not in info.value.message  # the server's own paths are not shown


def test_no_lora_dir_means_no_loading_over_http():
    from raydit.serve.schema import lora_path

    with pytest.raises(RequestError, match="--lora-dir") as info:
        lora_path(None, "style")
    assert info.value.status == 403


@pytest.mark.parametrize("body, param, needle", [
    ({}, "path", "Field required"),
    ({"path": "style", "scale": "2"}, "scale", "unknown field"),
    ({"path": ["style"]}, "path", "valid string"),
])
def test_bad_lora_bodies_are_named(body, param, needle):
    from raydit.serve.schema import LoraCreate

    with pytest.raises(RequestError) as info:
        parse_body(body, LoraCreate)
    assert info.value.param == param and needle in info.value.message


def test_lora_errors_name_their_field():
    from raydit.serve.schema import lora_error

    cases = [("LoRA name '../x' is not valid; use 1 to 64 letters", "name", 400),
             ("a LoRA named 'style' is already loaded; unload it first", "name", 409),
             ("cannot load a LoRA: LoRA 'a' is fused into this engine's weights (fuse_lora)", "name", 409),
             ("LoRA target 'vae' is not one of transformer, transformer_2, both", "target", 400),
             ("LoRA '/srv/loras/x.safetensors' is not a readable safetensors file", "path", 400)]
    for message, param, status in cases:
        error = lora_error(ValueError(message), "/srv/loras")
        assert (error.param, error.status) == (param, status), message
    assert "/srv/loras" not in lora_error(ValueError(cases[-1][0]), "/srv/loras").message


def test_serve_lora_options(tmp_path):
    (tmp_path / "loras").mkdir()
    (tmp_path / "a.safetensors").write_bytes(b"x")
    opts = resolve_serve_options({"lora_dir": str(tmp_path / "loras"), "lora": [str(tmp_path / "a.safetensors")],
                                  "lora_scale": ["0.5"], "fuse_lora": True})
    assert opts["lora_dir"] == str(tmp_path / "loras")
    assert opts["lora_choice"] == {"a": 0.5} and opts["lora_table"]["a"]["path"] == str(tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="--lora-dir .* is not a directory"):
        resolve_serve_options({"lora_dir": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="--fuse-lora fuses one LoRA"):
        resolve_serve_options({"fuse_lora": True})
    with pytest.raises(ValueError, match=">= 0"):
        resolve_serve_options({"lora": [str(tmp_path / "a.safetensors")], "lora_scale": ["-1"]})


def test_poll_interval_is_a_step_while_running_and_a_tenth_of_the_wait_while_queued():
    from raydit.serve.service import poll_interval_ms

    assert poll_interval_ms("in_progress", 0.5) == 500
    assert poll_interval_ms("in_progress", 0.01) == 250 and poll_interval_ms("in_progress", 60.0) == 10_000
    assert poll_interval_ms("queued", 0.5, wait_s=30.0) == 3000
    assert poll_interval_ms("queued", 2.0, wait_s=10.0) == 2000  # never under a step
    assert poll_interval_ms("queued", 0.5) == 500  # no request finished yet: no wait known
    assert poll_interval_ms("in_progress", None) is None  # no step timed yet: the client's default
    assert poll_interval_ms("completed", 0.5) is None and poll_interval_ms("failed", 0.5) is None


def test_replicas_that_follow_the_queue_reach_the_engine():
    from raydit.serve.config import engine_kwargs

    kw = engine_kwargs(resolve_serve_options({"replicas": 1, "max_replicas": 3, "scale_up_wait": 5,
                                              "scale_down_idle": 60}))
    assert (kw["replicas"], kw["max_replicas"], kw["scale_up_wait_s"], kw["scale_down_idle_s"]) == (1, 3, 5.0, 60.0)
    plain = engine_kwargs(resolve_serve_options({}))
    assert plain["max_replicas"] is None and "scale_up_wait_s" not in plain
