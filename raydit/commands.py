"""The runtime sub-commands of `raydit`: generate, doctor, verify, serve.

`raydit.cli` owns argument parsing and the exit-status rule (user errors: one line,
status 2); each `add_<command>_arguments` declares a command's flags and each `cmd_<command>`
does its work and returns the process exit status. `raydit plan` is the planner's alone and
lives in `raydit.cli`.

- generate: options resolved (defaults < --config YAML < the command line, or a saved run with
  --resume) and checked before Ray starts, then one `Engine` runs one request and the video
  (and --save-latents) is written. Its flags, YAML keys and saved job keys come from the
  options table (raydit.runtime.options); a run's options are saved beside its checkpoints
  (job.json), so that --resume DIR needs nothing else.
- doctor: versions, kernels and the cluster (raydit.doctor); --calibrate measures each device
  type (and a --model's own step) for the planner's cache (raydit.runtime.calibrate).
- verify: every plan up to --workers ranks against one rank (raydit.verify).
- serve: the HTTP service (raydit.serve: options resolved in serve.config, run in serve.launch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from raydit.runtime import options as _options


def parse_guidance_options(items) -> tuple:
    """--guidance-option NAME=VALUE strings -> GenerationRequest.guidance_options (sorted pairs);
    VALUE: true/false, a number, or integers separated by commas (block indices)."""
    from raydit.models.requests import normalize_options

    out = {}
    for item in items or ():
        name, sep, text = str(item).partition("=")
        if not sep or not name.strip() or not text.strip():
            raise ValueError(f"--guidance-option {item!r} must be NAME=VALUE, e.g. stg_scale=0")
        text = text.strip()
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        elif "," in text:
            try:
                value = tuple(int(v) for v in text.split(","))
            except ValueError:
                raise ValueError(f"--guidance-option {item!r}: a list must be integers separated by commas") from None
        else:
            try:
                value = int(text) if text.lstrip("-").isdigit() else float(text)
            except ValueError:
                raise ValueError(f"--guidance-option {item!r}: {text!r} is not a number, true/false or a list") from None
        out[name.strip()] = value
    return normalize_options(out)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """generate's flags: the options table's entries for the command (raydit.runtime.options)."""
    from raydit.runtime.options import add_arguments

    add_arguments(p, "generate")


# What defines the request: with --resume it comes from the saved run, not the command line.
REQUEST_OPTIONS = _options.request_keys()
JOB_FILE = "job.json"
GENERATE_DEFAULTS = _options.command_defaults("generate")


def resolve_generate_options(args: argparse.Namespace) -> dict:
    """Merge defaults < --config file < command line, and check what is required."""
    from raydit.jobconfig import GENERATE_OPTIONS, load_job_config

    opts = dict(GENERATE_DEFAULTS)
    from_file = load_job_config(args.config) if args.config else {}
    opts.update(from_file)
    resume = getattr(args, "resume", None) or opts.get("resume")
    if resume:
        # The request is the saved run's: one given again, on the line or in the file, is refused.
        given = ["--" + k.replace("_", "-") for k in REQUEST_OPTIONS if getattr(args, k, None) is not None]
        in_file = [k for k in REQUEST_OPTIONS if k in from_file]
        if in_file:
            given.append(", ".join(f"'{k}:'" for k in in_file) + f" from config file {args.config!r}")
        if given:
            raise ValueError(f"--resume {resume} takes the request from the saved run; drop " + "; ".join(given))
        other = getattr(args, "checkpoint_dir", None) or from_file.get("checkpoint_dir")
        if other is not None and os.path.abspath(other) != os.path.abspath(resume):
            raise ValueError(f"--resume {resume} keeps its checkpoints there, and --checkpoint-dir {other} names "
                             "another directory; drop --checkpoint-dir")
        opts.update(_saved_job(resume))
        opts.update(from_file)  # the file's other options (out, json, workers, ...) win, as the line's do
        opts["checkpoint_dir"] = resume
    for key in GENERATE_OPTIONS:
        value = getattr(args, key, None)
        if value is not None:
            opts[key] = value
    if not opts.get("prompt"):
        raise ValueError("--prompt is required (on the command line or as 'prompt:' in --config)")
    _options.check_given(opts, "generate")
    from raydit.runtime.video import check_latents_path, check_output_path

    # Where the results go is checked before the run, not found unwritable after it.
    check_output_path(opts["out"], "--out")
    if opts.get("save_latents"):
        check_latents_path(opts["save_latents"])
    from raydit.models.cache_options import check_cache

    check_cache(opts.get("cache"), opts.get("cache_threshold"))
    opts["guidance_options"] = parse_guidance_options(opts.get("guidance_option"))
    resolve_schedule_options(opts)
    _options.sparse_from_options(opts)  # an unknown method or option: refused before Ray starts
    true_cfg = opts.get("true_cfg_scale")
    if true_cfg is not None and not (math.isfinite(true_cfg) and true_cfg >= 0):
        raise ValueError(f"--true-cfg-scale {true_cfg} must be a finite number >= 0 (1 disables true guidance)")
    if opts.get("cfg") not in (None, 1, 2, 4):  # the command line's choices; a --config file skips them
        raise ValueError(f"--cfg {opts['cfg']} must be 1, 2 or 4 (4: LTX-2's four guidance branches)")
    from raydit.models.lora_options import lora_options

    opts["lora_table"], opts["lora_choice"] = lora_options(opts)
    if opts.get("fuse_lora") and len(opts["lora_table"]) != 1:
        raise ValueError(f"--fuse-lora fuses one LoRA into the weights, but {len(opts['lora_table'])} are given; "
                         "give exactly one --lora (or one loras: entry), or drop --fuse-lora")
    check_compile(opts)
    from raydit.models.quantize_options import check_precision_options

    check_precision_options(opts)
    _options.check_shard_weights(opts.get("shard_weights"), opts.get("fuse_lora"), opts.get("workers"))
    return opts


def resolve_schedule_options(opts: dict) -> None:
    """--scheduler-option NAME=VALUE -> opts["scheduler_options"]; --sigmas / --timesteps (text
    from the line, a list from a file) -> tuples of floats; the step count from a list (a
    --steps that disagrees is refused)."""
    from raydit.models.schedules import parse_options, parse_steps, steps_of_list

    opts["scheduler_options"] = parse_options(opts.get("scheduler_option"))
    for key in ("sigmas", "timesteps"):
        if opts.get(key) is not None:
            opts[key] = parse_steps(f"--{key}", opts[key])
    if opts.get("sigmas") is not None and opts.get("timesteps") is not None:
        raise ValueError("give --sigmas or --timesteps, not both: either list sets every step")
    opts["steps"] = steps_of_list(opts.get("steps"), opts.get("sigmas"), opts.get("timesteps"))


def check_compile(opts: dict) -> None:
    """--compile's own checks (generate and serve), before Ray starts."""
    if opts.get("compile") not in (None, True, False):  # a --config file can give anything
        raise ValueError(f"compile {opts['compile']!r} must be true or false")
    if opts.get("compile") and opts.get("lora_table") and not opts.get("fuse_lora"):
        raise ValueError("--compile cannot switch LoRA adapters per request (each switch would recompile the blocks); "
                         "add --fuse-lora to merge the one --lora into the weights, or drop --compile")


def engine_kwargs(o: dict) -> dict:
    """The Engine's arguments from resolved generate options (`workers` too: cmd_generate
    replaces a None by its own default)."""
    return _options.engine_kwargs(o, "generate")


def cmd_generate(args: argparse.Namespace) -> int:
    """`raydit generate`: one video (or a --resume'd run finished) on an Engine; the image, the
    model, the steps and the frames are checked before Ray starts. Prints a line (or --json)."""
    from raydit.runtime.engine import Engine

    o = resolve_generate_options(args)
    # The image and the model are checked before Ray starts: a wrong pair costs nothing.
    from raydit.models.requests import image_to_png
    from raydit.models.loading import resolve_model_dir, takes_image

    resume = o.get("resume")
    if o.get("checkpoint_dir") and not resume:
        _save_job(o)
    image = image_to_png(o["image"]) if o.get("image") and not resume else None
    image_model = takes_image(resolve_model_dir(o["model"])) and not resume
    if resume:  # progress.pt must be the saved job's own request, before Ray starts
        _check_saved_request(resume, o)
    if not resume:  # the scheduler's limit, before Ray starts
        from raydit.runtime.engine import check_steps

        if o.get("steps") is not None:  # left out: the model's pipeline's own count (the Engine's call_defaults)
            check_steps(str(resolve_model_dir(o["model"])), o["steps"])
        from raydit.models.schedules import check_for_model

        check_for_model(str(resolve_model_dir(o["model"])), o.get("scheduler"), o["scheduler_options"],
                        o.get("sigmas"), o.get("timesteps"))
        if o.get("frames") is not None:  # a count the VAE cannot take: rounded as diffusers does, said once
            from raydit import model_spec
            from raydit.runtime.engine import round_frames

            model_dir = str(resolve_model_dir(o["model"]))
            o["frames"] = round_frames(model_dir, model_spec(model_dir).vae_temporal, o["frames"])
    if not resume and o.get("sparse_attention") is not None:
        _check_sparse(o)
    if image is not None and not image_model:
        raise ValueError(f"--image {o['image']!r}: model {o['model']!r} is text-to-video and takes no image; "
                         "drop --image or use an image-to-video checkpoint")
    if image is None and image_model:
        raise ValueError(f"model {o['model']!r} is image-to-video: give --image PATH")
    workers = o.get("workers")
    device = o["device"]
    if workers is None and device != "cuda" and o.get("address") is None:
        # On a CPU machine the default is 2 ranks: the smallest parallel run.
        workers = None if _has_gpu_cluster() else 2
    with Engine(**{**engine_kwargs(o), "workers": workers}) as engine:
        result = engine.resume(resume, progress=not o["json"]) if resume else engine.generate(
            **_options.request_kwargs(o, "generate", image=image, lora=o["lora_choice"], progress=not o["json"],
                                      guidance_options=o.get("guidance_options") or (),
                                      scheduler_options=o.get("scheduler_options") or ()))
        result.save(o["out"], fps=o["fps"])
        saved = result.save_latents(o["save_latents"]) if o.get("save_latents") else {}
        summary = {
            "out": o["out"],
            "latents": saved.get("latents"),
            "audio_latents": saved.get("audio_latents"),
            "frames": list(result.frames.shape),
            "plan": result.plan.to_dict(),
            "kernel": engine.kernel,
            "timings": {k: v for k, v in result.timings.items() if k != "step_seconds"},
            "startup": engine.timings,
        }
    if o["json"]:
        print(json.dumps(summary), file=getattr(args, "json_stdout", sys.stdout))
    else:
        t = result.timings
        print(
            f"wrote {o['out']}: {result.frames.shape[0]} frames {result.frames.shape[2]}x"
            f"{result.frames.shape[1]}, {len(t['step_seconds'])} steps in "
            f"{t['denoise_seconds']:.2f} s, total {t['total_seconds']:.2f} s"
            + (f", {t['cached_steps']} served from the {o['cache']} cache" if o.get("cache") else "")
            + (f", compiled in {t['compile_seconds']:.2f} s before them" if o.get("compile") else "")
        )
    return 0


def _check_sparse(o: dict) -> None:
    """--sparse-attention against the request's steps and token grid, before Ray starts."""
    from raydit import model_spec
    from raydit.models.loading import resolve_model_dir
    from raydit.models.sparse_steps import check_sparse_for_model

    config = _options.sparse_from_options(o)
    if o.get("steps") is not None:
        config.dense_step_count(o["steps"])
    model_dir = str(resolve_model_dir(o["model"]))
    g = model_spec(model_dir).geometry(o.get("frames"), o.get("height"), o.get("width"))
    check_sparse_for_model(model_dir, config, (g.token_frames, g.token_rows, g.token_cols))


def _save_job(o: dict) -> None:
    """The run's options beside its progress, so --resume DIR needs nothing else."""
    from pathlib import Path

    directory = Path(o["checkpoint_dir"])
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--checkpoint-dir {str(directory)!r} is a file; give a directory (made if missing)")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{JOB_FILE}.tmp"
    tmp.write_text(json.dumps({k: v for k, v in o.items() if k not in ("resume", "config", "lora_table", "lora_choice")},
                              indent=1))
    tmp.replace(directory / JOB_FILE)


# What _save_job writes: the config file's keys (not `resume`) and the parsed --guidance-option
# and --scheduler-option.
SAVED_OPTIONS = {**{k: t for k, t in _options.config_types("generate").items() if k != "resume"},
                 "guidance_options": list, "scheduler_options": list}


def _saved_job(directory: str) -> dict:
    """The run saved in `directory`, its values checked as a --config file's are."""
    from pathlib import Path

    from raydit.jobconfig import check_option_types

    path = Path(directory) / JOB_FILE
    if not path.is_file():
        raise ValueError(f"--resume {directory}: no {JOB_FILE} there; give a directory a run wrote with "
                         "--checkpoint-dir")
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        raise ValueError(f"--resume {directory}: {path} is not valid JSON") from None
    if not isinstance(saved, dict):
        raise ValueError(f"--resume {directory}: {path} must be a JSON object of option: value, "
                         f"got {type(saved).__name__}")
    saved = check_option_types(saved, SAVED_OPTIONS, f"--resume {directory}: {path}")
    if not saved.get("prompt"):
        raise ValueError(f"--resume {directory}: {path} has no prompt; give a directory a run wrote with "
                         "--checkpoint-dir")
    return saved


# job.json's request options -> the GenerationRequest field progress.pt holds each as.
_SAVED_REQUEST_FIELDS = _options.request_fields("generate")


def _check_saved_request(directory: str, o: dict) -> None:
    """Refuse a --resume DIR whose progress.pt holds another request than its job.json (a
    progress.pt copied from another run would finish that run's video under this one's name).
    A job.json value of None (steps, guidance, geometry: the model's own) is not compared."""
    from raydit.runtime.queue import load_progress

    request, _ = load_progress(directory)
    differ = []
    for key, field in _SAVED_REQUEST_FIELDS.items():
        wanted = o.get(key)
        if wanted is None or not hasattr(request, field):
            continue
        saved = getattr(request, field)
        if key == "frames" and wanted != saved:  # job.json keeps the count as given, the run rounds it
            from raydit import model_spec
            from raydit.models.loading import resolve_model_dir
            from raydit.runtime.engine.validation import round_frames

            model_dir = str(resolve_model_dir(o["model"]))
            wanted = round_frames(model_dir, model_spec(model_dir).vae_temporal, wanted)
        if wanted != saved:
            differ.append(f"{key} {saved!r} (job.json: {o.get(key)!r})")
    if differ:
        raise ValueError(f"--resume {directory}: its progress.pt is another request than its job.json: "
                         + ", ".join(differ) + "; the progress belongs to another run: start this one again "
                         "without --resume, or resume the directory that run wrote")


def _has_gpu_cluster() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    """doctor's flags (its own: no request, nothing from the options table)."""
    p.add_argument("--address", help="Ray cluster to inspect (default: RAY_ADDRESS)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure every device type of the cluster (a local Ray if none is "
                        "given) and cache the figures the planner then uses")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="with --calibrate: which devices to measure")
    p.add_argument("--model", help="with --calibrate: a diffusers pipeline directory whose own step is "
                                    "timed on one device of each type, so the planner predicts that model "
                                    "from its own rates (norms, embeddings and attention at its shape)")
    p.add_argument("--frames", type=int, help="with --model: the request timed (default: the model's)")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--json", action="store_true")


def cmd_doctor(args: argparse.Namespace) -> int:
    """`raydit doctor`: with --calibrate, measure first (a --model's geometry checked before Ray
    starts); then the report of versions, kernels and the cluster."""
    from raydit.doctor import collect, format_report

    geometry = {k: getattr(args, k) for k in ("frames", "height", "width") if getattr(args, k) is not None}
    if (args.model or geometry) and not args.calibrate:
        raise ValueError("--model, --frames, --height and --width go with --calibrate")
    if geometry and not args.model:
        raise ValueError("--frames, --height and --width choose the request --model is timed at; give --model DIR")
    model = None
    if args.model:
        from raydit.models.loading import resolve_model_dir
        from raydit.planner import model_spec

        model = str(resolve_model_dir(args.model))
        model_spec(model).geometry(geometry.get("frames"), geometry.get("height"), geometry.get("width"))
    if args.calibrate:
        _calibrate(args.address, args.device, model, geometry)
    info = collect(args.address)
    if args.json:
        print(json.dumps(info, indent=2), file=getattr(args, "json_stdout", sys.stdout))
    else:
        print(format_report(info))
    return 0


def _calibrate(address: str | None, device: str, model: str | None = None, geometry: dict | None = None) -> None:
    """Measure the cluster at `address` (RAY_ADDRESS; none: a local Ray started here and shut
    down after) and file the figures in the calibration cache; its notes go to stderr."""
    import os

    import ray

    from raydit.runtime.calibrate import calibrate_cluster

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        from raydit.runtime.topology import reachable_address

        ray.init(address=reachable_address(address), logging_level="ERROR")
    else:
        from raydit.runtime.raygc import RAYLET_GC_REQUESTS_OFF

        ray.init(address="local", include_dashboard=False, logging_level="ERROR",
                 num_cpus=max(2, os.cpu_count() or 1), object_store_memory=128 * 1024 * 1024,
                 _system_config=dict(RAYLET_GC_REQUESTS_OFF))
    try:
        for note in calibrate_cluster(device, force=True, model=model, geometry=geometry):
            print(f"raydit doctor: {note}", file=sys.stderr)
    finally:
        ray.shutdown()


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    """verify's flags (its own: the checked run is not a user's request)."""
    p.add_argument("--model", default="tiny")
    p.add_argument("--workers", type=int, default=4, help="largest world size to check")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--frames", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--rtol", type=float, default=1e-4, help="float32 / float64: the pass tolerance")
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"],
                   help="the dtype the plans run in (default: bfloat16 on GPUs, float32 on CPUs); in bfloat16 "
                        "and float16 a plan passes by its error against float64, not by --rtol / --atol")
    p.add_argument("--address")
    p.add_argument("--json", action="store_true")


def cmd_verify(args: argparse.Namespace) -> int:
    """`raydit verify`: the table of every plan against one rank; exit status 1 when a plan is
    out of tolerance."""
    from raydit.verify import format_verify_table, verify

    rows = verify(
        model=args.model,
        workers=args.workers,
        device=args.device,
        steps=args.steps,
        frames=args.frames,
        height=args.height,
        width=args.width,
        rtol=args.rtol,
        atol=args.atol,
        address=args.address,
        dtype=args.dtype,
    )
    if args.json:
        print(json.dumps(rows), file=getattr(args, "json_stdout", sys.stdout))
    else:
        print(format_verify_table(rows, rtol=args.rtol, atol=args.atol))
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print(f"raydit verify: {len(bad)} plan(s) out of tolerance", file=sys.stderr)
        return 1
    return 0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """serve's flags (raydit.serve.config: the options table's entries for serve)."""
    from raydit.serve.config import add_serve_arguments as add

    add(p)


def cmd_serve(args: argparse.Namespace) -> int:
    """`raydit serve`: the HTTP service until it is stopped (raydit.serve.launch)."""
    from raydit.serve.config import resolve_serve_options
    from raydit.serve.launch import run_server

    return run_server(resolve_serve_options(args))
