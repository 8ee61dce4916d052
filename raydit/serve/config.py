"""`raydit serve` options: the command line, `--config serve.yaml`, and their checks.

Every option can come from a YAML file (keys are the long option names, dashes or
underscores), validated like `job.yaml` (raydit.jobconfig): an unknown key or a wrong type
is refused with the key named. Command line > file > defaults. Pure Python: no Ray here.
"""

from __future__ import annotations

import argparse
import os

from raydit.jobconfig import load_job_config

# key -> the type the command line parses it to.
SERVE_OPTIONS: dict[str, type] = {
    "model": str,
    "workers": int,
    "replicas": int,
    "device": str,
    "ulysses": int,
    "ring": int,
    "cfg": int,
    "address": str,
    "host": str,
    "port": int,
    "token_file": str,
    "output_dir": str,
    "max_queue": int,
    "frames": int,
    "height": int,
    "width": int,
    "max_steps": int,
    "default_steps": int,
    "fps": int,
    "cache": str,  # step caching for every request: fbcache or teacache (raydit.models.cache)
    "cache_threshold": float,
    "lora_dir": str,  # POST /v1/loras loads only from under this directory (unset: no HTTP loading)
    "lora": list,  # LoRAs loaded at start (paths, as --lora repeated)
    "lora_scale": list,  # their scales (as --lora-scale repeated; used with fuse_lora)
    "fuse_lora": bool,  # merge the one --lora into the weights (diffusers' fuse_lora)
    "compile": bool,  # regional torch.compile of the transformer blocks (raydit.models.compile)
    "quantize": str,  # FP8 linear layers: none, fp8 or fp8-sim (raydit.models.quantize)
    "attention": str,  # attention kernels: bf16, auto, int8 or fp8 (raydit.parallel.kernels)
    "shard_weights": bool,  # each rank keeps 1/N of the blocks' weights (raydit.models.sharded)
    "warmup": bool,  # one request at the planned size on every replica before the first is admitted
    "max_replicas": int,  # replicas follow the queue between --replicas and this
    "scale_up_wait": float,  # seconds a request waits before a replica is added
    "scale_down_idle": float,  # seconds a replica idles before it is taken out
    "max_batch": int,  # step-level batching: requests of one geometry sharing a replica's steps
}

SERVE_DEFAULTS: dict = {
    "model": "tiny",
    "replicas": 1,
    "device": "auto",
    "host": "127.0.0.1",
    "port": 8000,
    "output_dir": "raydit-videos",
    "max_queue": 64,
    "max_steps": 200,
    "default_steps": 50,
    "fps": 8,
}

DEFAULT_TOKEN_FILE = "~/.raydit/api_token"
DEVICES = ("auto", "cuda", "cpu")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with any of the options below (command line wins)")
    p.add_argument("--model", help="'tiny' (default), a built-in name, or a local diffusers pipeline directory")
    p.add_argument("--workers", type=int, help="ranks per replica (default: the planner's best on the cluster)")
    p.add_argument("--replicas", "--min-replicas", dest="replicas", type=int,
                   help="copies of the model serving the queue side by side (default 1); with --max-replicas, "
                        "the fewest kept")
    p.add_argument("--max-replicas", dest="max_replicas", type=int,
                   help="add a replica (planned like the first, on free devices) while a request has waited "
                        "--scale-up-wait seconds, up to this many; take one out after --scale-down-idle seconds idle")
    p.add_argument("--scale-up-wait", dest="scale_up_wait", type=float, metavar="S",
                   help="seconds a request waits before a replica is added (default 30)")
    p.add_argument("--scale-down-idle", dest="scale_down_idle", type=float, metavar="S",
                   help="seconds a replica idles before it is taken out (default 300)")
    p.add_argument("--max-batch", dest="max_batch", type=int, metavar="N",
                   help="step-level batching: up to N requests of one geometry share a replica's steps, each "
                        "joining at a step boundary (within the plan's memory; default 1: one at a time)")
    p.add_argument("--device", choices=DEVICES)
    p.add_argument("--ulysses", type=int)
    p.add_argument("--ring", type=int)
    p.add_argument("--cfg", type=int, choices=[1, 2, 4])
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--token-file", dest="token_file",
                   help=f"bearer token for /v1 (default: $RAYDIT_API_TOKEN, else {DEFAULT_TOKEN_FILE}, "
                        "created with mode 0600 if absent)")
    p.add_argument("--output-dir", dest="output_dir",
                   help="where videos and their status JSON are kept, named by id (default ./raydit-videos)")
    p.add_argument("--max-queue", dest="max_queue", type=int,
                   help="requests waiting at most; one more is answered 429 with Retry-After (default 64)")
    p.add_argument("--frames", type=int, help="largest frame count served; the plan is made for it (default: the model's)")
    p.add_argument("--height", type=int, help="largest height served (default: the model's)")
    p.add_argument("--width", type=int, help="largest width served (default: the model's)")
    p.add_argument("--max-steps", dest="max_steps", type=int, help="most denoising steps a request may ask for (default 200)")
    p.add_argument("--default-steps", dest="default_steps", type=int,
                   help="steps for a request that does not say (default 50)")
    p.add_argument("--fps", type=int, help="frames per second of the mp4 and of `seconds` (default 8)")
    p.add_argument("--cache", metavar="METHOD", help="step caching for every request: fbcache or teacache (default off)")
    p.add_argument("--cache-threshold", dest="cache_threshold", type=float, metavar="X",
                   help="relative change below which a step is served from the cache (default per method)")
    p.add_argument("--lora-dir", dest="lora_dir", metavar="DIR",
                   help="POST /v1/loras loads LoRAs from under this directory only (default: no loading over HTTP)")
    p.add_argument("--lora", action="append", metavar="PATH",
                   help="a LoRA loaded on every rank at start (requests name it in `lora`); repeatable")
    p.add_argument("--lora-scale", dest="lora_scale", action="append", metavar="S",
                   help="scale of each --lora, in the same order (default 1.0; what --fuse-lora fuses at)")
    p.add_argument("--fuse-lora", dest="fuse_lora", action="store_true", default=None,
                   help="merge the one --lora into the weights (no per-step cost); every video then uses it "
                        "and the LoRA routes cannot change it")
    p.add_argument("--compile", action="store_true", default=None,
                   help="regional torch.compile of the transformer blocks on every rank; the first video of "
                        "each size compiles. Not with per-request LoRAs (--lora without --fuse-lora, --lora-dir)")
    p.add_argument("--quantize", metavar="MODE",
                   help="FP8 linear layers in the transformer blocks on every rank: fp8 (torchao; NVIDIA GPUs of "
                        "compute capability 8.9+), fp8-sim (emulated on any device: numerics only, no speed) or "
                        "none (default). Not with per-request LoRAs (--lora without --fuse-lora, --lora-dir)")
    p.add_argument("--attention", metavar="MODE",
                   help="attention kernels: bf16 (default), auto (the fastest that passed its float64 check), "
                        "int8 or fp8")
    p.add_argument("--shard-weights", dest="shard_weights", action="store_true", default=None,
                   help="each rank of a replica keeps 1/N of every transformer block's weights and gathers a block "
                        "just before it runs (big models on small GPUs); needs 2 or more ranks per replica, "
                        "not with --fuse-lora. Default: where the planner finds the model fits only so")
    p.add_argument("--warmup", action="store_true", default=None,
                   help="before the first request is admitted, run one at the planned size on every replica "
                        "(kernel choice, allocator growth, --compile's compilation, the decode), so no user waits "
                        "for them")


def resolve_serve_options(args: argparse.Namespace | dict) -> dict:
    """Merge defaults < --config file < command line and check every value."""
    if isinstance(args, argparse.Namespace):
        given = vars(args)
    else:  # a builder's `args` (Serve config / RayService): nothing unknown passes silently
        given = dict(args)
        unknown = sorted(set(given) - set(SERVE_OPTIONS) - {"config"})
        if unknown:
            known = ", ".join(SERVE_OPTIONS)
            raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))}; known: {known}")
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
    if opts["default_steps"] > opts["max_steps"]:
        raise ValueError(
            f"--default-steps {opts['default_steps']} is more than --max-steps {opts['max_steps']}; "
            "raise --max-steps or lower --default-steps"
        )
    from raydit.models.cache_options import check_cache

    check_cache(opts.get("cache"), opts.get("cache_threshold"))
    if not opts.get("host"):
        raise ValueError("--host must not be empty (127.0.0.1 serves this machine only, 0.0.0.0 every interface)")
    check_lora_options(opts)
    from raydit.models.quantize_options import check_precision_options

    check_precision_options(opts)


def check_lora_options(opts: dict) -> None:
    """--lora-dir must be a directory (kept as an absolute path: the serving replica's working
    directory is not ours); --lora / --lora-scale as for `raydit generate`, resolved to
    absolute files in `opts["lora_table"]` / `opts["lora_choice"]`; --fuse-lora needs one --lora."""
    from raydit.models.lora import lora_options

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
    from raydit.commands import check_shard_weights

    check_shard_weights(opts)
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
    return dict(
        model=opts["model"], workers=opts.get("workers"), device=opts["device"],
        ulysses=opts.get("ulysses"), ring=opts.get("ring"), cfg=opts.get("cfg"),
        replicas=opts.get("replicas", 1), frames=opts.get("frames"),
        height=opts.get("height"), width=opts.get("width"),
        cache=opts.get("cache"), cache_threshold=opts.get("cache_threshold"),
        loras=opts.get("lora_table"),
        fuse_lora=opts.get("lora_choice") if opts.get("fuse_lora") else None,
        compile=bool(opts.get("compile")),
        quantize=opts.get("quantize"),
        attention=opts.get("attention"),
        shard_weights=True if opts.get("shard_weights") else None,
        warmup=bool(opts.get("warmup")),
        max_replicas=opts.get("max_replicas"),
        max_batch=opts.get("max_batch") or 1,
        **{f"{k}_s": float(opts[k]) for k in ("scale_up_wait", "scale_down_idle") if opts.get(k) is not None},
    )


def token_file_path(opts: dict) -> str | None:
    """The token file in use, or None when the token comes from $RAYDIT_API_TOKEN."""
    if opts.get("token_file"):
        return os.path.expanduser(opts["token_file"])
    if os.environ.get("RAYDIT_API_TOKEN"):
        return None
    return os.path.expanduser(DEFAULT_TOKEN_FILE)
