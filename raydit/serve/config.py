"""`raydit serve` options: the command line, `--config serve.yaml`, and their checks.

Every option can come from a YAML file (keys are the long option names, dashes or
underscores), validated like `job.yaml` (raydit.jobconfig): an unknown key or a wrong type
is refused with the key named. Command line > file > defaults. Pure Python: no Ray here.
"""

from __future__ import annotations

import argparse
import os

from raydit.jobconfig import check_option_types, load_job_config
from raydit.runtime import options as _options

# key -> the type the command line parses it to; the defaults (raydit.runtime.options declares both).
SERVE_OPTIONS: dict[str, type] = _options.config_types("serve")
SERVE_DEFAULTS: dict = _options.command_defaults("serve")

DEFAULT_TOKEN_FILE = "~/.raydit/api_token"
BUILDER_ARGS = "raydit.serve.app:build args"  # where a builder dict's options come from, in messages
DEVICES = _options.DEVICES


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    _options.add_arguments(p, "serve")


def resolve_serve_options(args: argparse.Namespace | dict) -> dict:
    """Merge defaults < --config file < command line and check every value."""
    if isinstance(args, argparse.Namespace):
        given = vars(args)
    else:  # a builder's `args` (Serve config / RayService): checked key by key as serve.yaml is
        if not isinstance(args, dict):
            raise ValueError(f"{BUILDER_ARGS} {args!r} must be a mapping of option: value")
        given = check_option_types(args, {"config": str, **SERVE_OPTIONS}, BUILDER_ARGS, what="option")
    opts = dict(SERVE_DEFAULTS)
    if given.get("config"):
        opts.update(load_job_config(given["config"], options=SERVE_OPTIONS))
    for key in SERVE_OPTIONS:
        if given.get(key) is not None:
            opts[key] = given[key]
    check_serve_options(opts)
    return opts


def check_serve_options(opts: dict) -> None:
    for key in ("workers", "replicas", "ulysses", "ring", "frames", "height", "width",
                "max_steps", "default_steps", "fps", "max_replicas", "max_batch"):
        value = opts.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"--{key.replace('_', '-')} {value!r} must be a positive integer")
    if opts.get("max_replicas") is not None and opts["max_replicas"] < opts.get("replicas", 1):
        raise ValueError(f"--max-replicas {opts['max_replicas']} is below --replicas {opts.get('replicas', 1)}: "
                         "give at least as many")
    for key in ("scale_up_wait", "scale_down_idle"):
        value = opts.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value < float("inf")):
            raise ValueError(f"--{key.replace('_', '-')} {value!r} must be a number of seconds >= 0")
    if opts.get("cfg") not in (None, 1, 2, 4):
        raise ValueError(f"--cfg {opts['cfg']!r} must be 1, 2 or 4 (4: LTX-2's four guidance branches)")
    if opts["max_queue"] < 0:
        raise ValueError(f"--max-queue {opts['max_queue']} must be 0 or more")
    if not 1 <= opts["port"] <= 65535:
        raise ValueError(f"--port {opts['port']} must be between 1 and 65535")
    if opts["device"] not in DEVICES:
        raise ValueError(f"device {opts['device']!r} must be one of {', '.join(DEVICES)}")
    if opts.get("default_steps") is not None and opts["default_steps"] > opts["max_steps"]:
        raise ValueError(
            f"--default-steps {opts['default_steps']} is more than --max-steps {opts['max_steps']}; "
            "raise --max-steps or lower --default-steps"
        )
    from raydit.models.cache_options import check_cache

    check_cache(opts.get("cache"), opts.get("cache_threshold"))
    from raydit.runtime.options import sparse_from_options

    sparse_from_options(opts)  # an unknown method or option: refused before Ray starts
    if not opts.get("host"):
        raise ValueError("--host must not be empty (127.0.0.1 serves this machine only, 0.0.0.0 every interface)")
    check_lora_options(opts)
    from raydit.models.quantize_options import check_precision_options

    check_precision_options(opts)


def check_lora_options(opts: dict) -> None:
    """--lora-dir must be a directory (kept as an absolute path: the serving replica's working
    directory is not ours); --lora / --lora-scale as for `raydit generate`, resolved to
    absolute files in `opts["lora_table"]` / `opts["lora_choice"]`; --fuse-lora needs one --lora."""
    from raydit.models.lora_options import lora_options

    if opts.get("lora_dir") is not None:
        path = os.path.abspath(os.path.expanduser(str(opts["lora_dir"])))
        if not os.path.isdir(path):
            raise ValueError(f"--lora-dir {opts['lora_dir']!r} is not a directory; create it and put LoRAs there")
        opts["lora_dir"] = path
    opts["lora_table"], opts["lora_choice"] = lora_options(opts)
    if opts.get("fuse_lora") and len(opts["lora_table"]) != 1:
        raise ValueError(f"--fuse-lora fuses one LoRA into the weights, but {len(opts['lora_table'])} --lora "
                         "are given; give exactly one --lora, or drop --fuse-lora")
    for flag in ("compile", "warmup"):
        if opts.get(flag) not in (None, True, False):  # a builder's args dict is not typed by argparse
            raise ValueError(f"{flag} {opts[flag]!r} must be true or false")
    from raydit.runtime.options import check_shard_weights

    check_shard_weights(opts.get("shard_weights"), opts.get("fuse_lora"), opts.get("workers"))
    if opts.get("compile"):
        # Compiled blocks would recompile at every switch of adapters (Dynamo guards on peft's
        # layers); one fused LoRA is plain weights.
        switching = [flag for flag, on in (("--lora without --fuse-lora", opts["lora_table"] and not opts.get("fuse_lora")),
                                           ("--lora-dir", opts.get("lora_dir") is not None)) if on]
        if switching:
            raise ValueError(f"--compile cannot switch LoRA adapters per request, but {' and '.join(switching)} "
                             "asks for it; fuse one LoRA (--fuse-lora) or drop --compile")


def engine_kwargs(opts: dict) -> dict:
    """The Engine's arguments from resolved serve options."""
    return _options.engine_kwargs(opts, "serve")


def token_file_path(opts: dict) -> str | None:
    """The token file in use, or None when the token comes from $RAYDIT_API_TOKEN."""
    if opts.get("token_file"):
        return os.path.expanduser(opts["token_file"])
    if os.environ.get("RAYDIT_API_TOKEN"):
        return None
    return os.path.expanduser(DEFAULT_TOKEN_FILE)
