"""A generation's options, declared once.

Each `Option` below is one option wherever it appears; everything else is built from this
table and nowhere else:

- `raydit generate` / `raydit serve` flags (`add_arguments(parser, command)`);
- the keys of `--config job.yaml` / `serve.yaml` and their types (`config_types(command)`);
- the command's defaults (`command_defaults(command)`);
- what defines a saved run (`request_keys()`, the CLI's REQUEST_OPTIONS: with --resume they
  come from the run, not the command line);
- serve's POST /v1/videos fields (`form_fields()`, turned into a pydantic model by
  raydit.serve.schema);
- the Engine's keyword arguments (`EngineConfig`, the one config object of an Engine:
  `Engine(**kw)` builds it) and those of `Engine.submit` / `Engine.generate`
  (`submit_signature()`);
- resolved command options -> the Engine's arguments (`engine_kwargs(opts, command)`);
- `raydit plan`'s flags it shares with these commands (`add_flag(parser, option(key))`);
- serve's request resolution passes every form field on (raydit.serve.schema.FORM_REQUEST);
- the command lines' checks of given values (`check_given`), EngineConfig's of its fields.

Adding an option is one entry: say which commands take it (`commands`), which Engine keyword
it sets (`engine`, with its `default` and a `check`), and which request keyword (`request`).
A request option is also GenerationRequest's field (raydit.models.requests: the models layer
cannot import this table), held one to one with the table when this module loads.
Pure Python: no torch, no Ray (the command line builds its parser from it).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from raydit.planner.modes import ATTENTION_MODES, QUANTIZE_MODES
from raydit.planner.sparse import METHODS as SPARSE_METHODS

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("float32", "float64", "bfloat16", "float16")  # Engine(dtype=): torch's names
COMMANDS = ("generate", "serve")
# `submit(cache=...)` left out: the Engine's step caching (None is a choice: caching off).
ENGINE_DEFAULT = type("EngineDefault", (), {"__repr__": lambda self: "ENGINE_DEFAULT"})()
_UNSET = type("Unset", (), {"__repr__": lambda self: "UNSET"})()
REQUIRED = inspect.Parameter.empty


from raydit.runtime.option_checks import (  # noqa: F401  (the table's checks, used by its entries)
    positive_int,
    whole_number,
    finite_seconds,
    positive_seconds,
    true_or_false,
    one_of,
    or_none,
    model_name,
    a_path,
    ray_address,
    lora_table,
    comma_list,
    sparse_setting,
    sparse_from_options,
)


@dataclass(frozen=True)
class Option:
    """One option. `key`: its name on the command line (`--key-with-dashes`) and in config
    files; None for an Engine keyword no command takes."""

    key: str | None
    type: type = str
    commands: tuple[str, ...] = ()  # whose command line and config file take it
    help: str | dict = ""  # one text, or {command: text}
    flags: tuple[str, ...] = ()  # further flags beside --key
    action: str | None = None  # argparse's: "append", "store_true"
    choices: tuple | None = None  # argparse's choices
    metavar: str | None = None
    in_file: bool = True  # a config-file key (all but --config)
    on_line: bool = True  # a command-line flag (all but the file-only `loras`)
    defaults: dict = field(default_factory=dict)  # {command: its default when not given}
    saved: bool = False  # defines the run saved beside its checkpoints (comes from it on --resume)
    # The Engine's keyword: its name, default, whether it may be given by position, its check,
    # and how resolved command options give its value (default: the option's own value).
    engine: str | None = None
    default: Any = None
    positional: bool = False
    check: Callable | None = None
    engine_value: Callable[[dict], Any] | None = None
    engine_type: Any = None  # the Engine keyword's type where it is not `type`
    # Engine.submit's keyword (GenerationRequest's field) and default; `cli_request`: the
    # command line's value goes with the request (False: the Engine's option only).
    request: str | None = None
    request_default: Any = _UNSET
    cli_request: bool = True
    as_given: bool = True  # the command line's value is the request field's (not so: an image's path)
    control: bool = False  # steers submit's call (progress, callback ...), not a GenerationRequest field
    # Serve's POST /v1/videos field, named `request` (else `key`): {"annotation": type, and
    # pydantic Field's keyword arguments}; None: not a field.
    form: dict | None = None

    def help_for(self, command: str) -> str:
        return self.help.get(command, "") if isinstance(self.help, dict) else self.help

    @property
    def flag(self) -> str:
        return "--" + str(self.key).replace("_", "-")

    @property
    def form_name(self) -> str:
        return self.request or self.key


_CACHE_HELP = ("step caching, off by default: fbcache (first-block cache) or teacache (timestep "
               "embedding); steps whose change is below --cache-threshold reuse cached residuals")
_BOTH = ("generate", "serve")
_GEN = ("generate",)
_SERVE = ("serve",)

OPTIONS: tuple[Option, ...] = (
    Option("config", commands=_BOTH, in_file=False,
           help="YAML file with any of the options below (command line wins)"),
    # -- the request (Engine.submit's keywords, in its positional order) --------------------------
    Option("prompt", commands=_GEN, saved=True, request="prompt", request_default=REQUIRED,
           help="text prompt (required, here or in --config)", form={"annotation": str, "min_length": 1,
                                                                     "max_length": 20_000}),
    Option("negative_prompt", commands=_GEN, saved=True, request="negative_prompt", defaults={"generate": ""},
           form={"annotation": str | None, "default": None, "max_length": 20_000}),
    Option("model", commands=_BOTH, saved=True, engine="model", default="tiny", positional=True, check=model_name,
           defaults={"generate": "tiny", "serve": "tiny"}, form={"annotation": str | None, "default": None},
           help={"generate": "a built-in tiny model ('tiny' (default), 'tiny-wan', ...) or a local diffusers "
                             "pipeline directory",
                 "serve": "'tiny' (default), a built-in name, or a local diffusers pipeline directory"}),
    Option("size", form={"annotation": str | None, "default": None,
                         "description": "WIDTHxHEIGHT in pixels, e.g. 720x480"}),
    Option("seconds", type=float, form={"annotation": float | None, "default": None, "gt": 0, "le": 3600}),
    Option("frames", int, commands=_BOTH, saved=True, engine="frames", request="num_frames",
           form={"annotation": int | None, "default": None, "ge": 1},
           help={"serve": "largest frame count served; the plan is made for it (default: the model's)"}),
    Option("height", int, commands=_BOTH, saved=True, engine="height", request="height",
           help={"serve": "largest height served (default: the model's)"}),
    Option("width", int, commands=_BOTH, saved=True, engine="width", request="width",
           help={"serve": "largest width served (default: the model's)"}),
    Option("steps", int, commands=_GEN, saved=True, request="num_inference_steps", request_default=None,
           check=positive_int,
           help="denoising steps (default: the model's diffusers pipeline's, e.g. 50; Mochi 64, LTX-2 30)",
           form={"annotation": int | None, "default": None, "ge": 1}),
    Option("guidance_scale", float, commands=_GEN, saved=True, request="guidance_scale", request_default=None,
           help="classifier-free guidance scale (default: the model's diffusers pipeline's, e.g. CogVideoX 6, "
                "Wan 5, LTX 3, Mochi 4.5)", form={"annotation": float | None, "default": None, "ge": 0, "le": 100}),
    Option("seed", int, commands=_GEN, saved=True, request="seed", request_default=0, defaults={"generate": 0},
           form={"annotation": int | None, "default": None, "ge": 0, "le": 2**63 - 1}),
    Option(None, request="callback_on_step_end", control=True),
    Option(None, request="progress", request_default=False, control=True),
    Option("image", commands=_GEN, saved=True, request="image", as_given=False,
           help="image (PNG, JPEG ...) conditioning an image-to-video model"),
    Option("guidance_scale_2", float, commands=_GEN, saved=True, request="guidance_scale_2",
           help="guidance of the second expert (Wan 2.2 A14B; default: --guidance-scale)"),
    Option("checkpoint_dir", commands=_GEN, request="checkpoint_dir", control=True,
           help="write the request and each finished step there (atomically); a run whose "
                "driver or head died finishes with --resume DIR"),
    # --lora: paths on the command line (loaded at start; this video's choice); in a form, the
    # name of a loaded LoRA or {name: scale}, as JSON text.
    Option("lora", list, commands=_BOTH, saved=True, action="append", metavar="PATH", request="lora",
           engine="loras", engine_type=dict, engine_value=lambda o: o.get("lora_table"), check=or_none(lora_table),
           form={"annotation": str | dict[str, Any] | None, "default": None},
           help={"generate": "a diffusers-format LoRA (a .safetensors file or a directory holding one), loaded on "
                             "every rank and active for this video; repeatable",
                 "serve": "a LoRA loaded on every rank at start (requests name it in `lora`); repeatable"}),
    Option("true_cfg_scale", float, commands=_GEN, saved=True, request="true_cfg_scale", request_default=1.0,
           metavar="S", help="true classifier-free guidance where guidance is embedded in the model (HunyuanVideo): "
                             "> 1 with --negative-prompt runs the cond/uncond pair (default 1: off)"),
    Option("cache", commands=_BOTH, saved=True, engine="cache", request="cache", request_default=ENGINE_DEFAULT,
           cli_request=False, metavar="METHOD", form={"annotation": str | None, "default": None},
           help={"generate": _CACHE_HELP,
                 "serve": "step caching for every request: fbcache or teacache (default off)"}),
    Option("cache_threshold", float, commands=_BOTH, saved=True, engine="cache_threshold",
           request="cache_threshold", request_default=ENGINE_DEFAULT, cli_request=False, metavar="X",
           form={"annotation": float | None, "default": None, "gt": 0, "allow_inf_nan": False},
           help={"generate": "relative L1 change below which a step is served from the cache (default: "
                             "0.05 for fbcache, 0.1 for teacache); larger is faster and less exact",
                 "serve": "relative change below which a step is served from the cache (default per method)"}),
    # --guidance-option NAME=VALUE (repeatable) -> GenerationRequest.guidance_options; a form
    # sends the {name: value} object as JSON text.
    Option("guidance_option", list, commands=_GEN, saved=True, action="append", metavar="NAME=VALUE",
           request="guidance_options", form={"annotation": dict[str, Any] | str | None, "default": None},
           help="a guidance knob of the model's family, repeatable (LTX-2: stg_scale=0, stg_blocks=28,29, "
                "use_cross_timestep=false ...); a number, true/false, or integers separated by commas"),
    # -- distilled recipes: the request's scheduler and step list (raydit.models.schedules; a list sets
    # the step count), no CFG, per-expert LoRAs. A form's options: JSON; its lists: JSON or "1,0.5".
    Option("scheduler", commands=_GEN, saved=True, request="scheduler", metavar="CLASS",
           form={"annotation": str | None, "default": None, "max_length": 200},
           help="a diffusers scheduler class built from the model's scheduler config, e.g. FlowMatchLCMScheduler"),
    Option("scheduler_option", list, commands=_GEN, saved=True, action="append", metavar="NAME=VALUE",
           request="scheduler_options", form={"annotation": dict[str, Any] | str | None, "default": None},
           help="a config value of the scheduler, over the model's own, repeatable (shift=5, "
                "use_dynamic_shifting=false ...); a number, true/false or a word"),
    Option("sigmas", list, commands=_GEN, saved=True, request="sigmas", metavar="S1,S2,...",
           form={"annotation": list[float] | str | None, "default": None},
           help="the steps as sigmas, falling within (0, 1], given to the scheduler's set_timesteps (a "
                "flow-matching scheduler applies its shift to them): 1,0.75,0.5,0.25 is 4 steps"),
    Option("timesteps", list, commands=_GEN, saved=True, request="timesteps", metavar="T1,T2,...",
           form={"annotation": list[float] | str | None, "default": None},
           help="the steps as timesteps, falling, > 0 (e.g. 1000,750,500,250); not with --sigmas"),
    Option("no_cfg", bool, commands=_BOTH, action="store_true", engine="guidance", default=True,
           engine_value=lambda o: not o.get("no_cfg"), check=true_or_false,
           help="requests run without classifier-free guidance (a distilled model or LoRA: guidance 1 by "
                "default), so the plan has no cfg degree: those devices go to Ulysses, ring or replicas"),
    Option("lora_target", list, commands=_BOTH, saved=True, action="append", metavar="NAME",
           help="each --lora's component, in its order (default transformer; Wan 2.2's low noise: transformer_2)"),
    # -- sparse attention (raydit.planner.sparse): the request's SparseConfig, the Engine's default
    # from the command line's three flags (sparse_from_options); a form names the method or sends
    # {"method": ..., option: value} as JSON text.
    Option("sparse_attention", commands=_BOTH, saved=True, metavar="METHOD", choices=SPARSE_METHODS,
           engine="sparse_attention", engine_type=Any, engine_value=lambda o: sparse_from_options(o),
           check=or_none(sparse_setting), request="sparse_attention", request_default=ENGINE_DEFAULT,
           cli_request=False, form={"annotation": str | dict[str, Any] | None, "default": None},
           help="block-sparse attention over the video tokens (not exact against dense): sta (sliding tile) "
                "or radial; text stays dense, the first steps dense (--dense-steps). Default: dense"),
    Option("sparse_option", list, commands=_BOTH, saved=True, action="append", metavar="KEY=VALUE",
           help="a setting of --sparse-attention, repeatable: tile=6,8,8 window=3,3,3 (sta), near=1 decay=1 "
                "block=128 dense_layers=1 (radial), dense_fraction=0.3"),
    Option("dense_steps", int, commands=_BOTH, saved=True, metavar="N", check=whole_number,
           help="with --sparse-attention, the first N steps run dense (default: the method's published "
                "fraction of the request's steps: sta 0.3, radial 0.24); N above the steps is refused"),
    Option(None, request="tag", control=True),
    # on_start(): called on the driver when a replica starts the request (again after a hand-back).
    Option(None, request="on_start", control=True),
    # -- the Engine (its keywords: EngineConfig) ---------------------------------------------------
    Option("lora_scale", list, commands=_BOTH, saved=True, action="append", metavar="S",
           help={"generate": "scale of each --lora, in the same order (default 1.0); repeatable",
                 "serve": "scale of each --lora, in the same order (default 1.0; what --fuse-lora fuses at)"}),
    Option("loras", list, commands=_GEN, saved=True, on_line=False),  # paths, or {path, scale, name, target}
    Option("fuse_lora", bool, commands=_BOTH, saved=True, action="store_true", engine="fuse_lora", engine_type=Any,
           engine_value=lambda o: o.get("lora_choice") if o.get("fuse_lora") else None,
           help={"generate": "merge the one --lora into the weights at its --lora-scale on every rank (diffusers' "
                             "fuse_lora): no per-step cost, but the engine can then run only that LoRA",
                 "serve": "merge the one --lora into the weights (no per-step cost); every video then uses it "
                          "and the LoRA routes cannot change it"}),
    Option("compile", bool, commands=_BOTH, action="store_true", engine="compile", default=False,
           check=true_or_false,
           help={"generate": "regional torch.compile of the transformer blocks on every rank: the first request of "
                             "a size compiles (reported as compile seconds, apart from the steps); not with unfused "
                             "--lora",
                 "serve": "regional torch.compile of the transformer blocks on every rank; the first video of "
                          "each size compiles. Not with per-request LoRAs (--lora without --fuse-lora, --lora-dir)"}),
    # FP8 linear layers and the attention kernels' mode change the numbers: saved with a run.
    Option("quantize", commands=_BOTH, saved=True, choices=QUANTIZE_MODES, engine="quantize",
           help={"generate": "FP8 linear layers in the transformer blocks on every rank: fp8 (torchao; NVIDIA GPUs of "
                             "compute capability 8.9+; pip install torchao), fp8-sim (the same numbers emulated on any "
                             "device: numerics only, no speed) or none (default); not with unfused --lora",
                 "serve": "FP8 linear layers in the transformer blocks on every rank: fp8 (torchao; NVIDIA GPUs of "
                          "compute capability 8.9+), fp8-sim (emulated on any device: numerics only, no speed) or "
                          "none (default). Not with per-request LoRAs (--lora without --fuse-lora, --lora-dir)"}),
    Option("attention", commands=_BOTH, saved=True, choices=ATTENTION_MODES, metavar="MODE", engine="attention",
           help="attention kernels: bf16 (default: the run's dtype), auto (the fastest that passed its float64 "
                "check), int8 or fp8 (8-bit QK^T; raydit.parallel.lowbit)"),
    Option("full_precision_steps", int, commands=_BOTH, saved=True, metavar="N", engine="full_precision_steps",
           default=0, check=whole_number,
           help="run the first N and the last N steps of every video without --quantize / an 8-bit --attention "
                "(their bf16 weights and kernels; a quantized run keeps the linears' bf16 weights on every rank "
                "for them, so it never shards them): less of the mode's error for 2N slower steps (default 0)"),
    Option("shard_weights", bool, commands=_BOTH, action="store_true", engine="shard_weights", engine_type=Any,
           engine_value=lambda o: True if o.get("shard_weights") else None,
           help="each rank of a replica keeps 1/N of every transformer block's weights and gathers a block "
                "just before it runs (big models on small GPUs); needs 2 or more ranks per replica, "
                "not with --fuse-lora. Default: where the planner finds the model fits only so"),
    Option("warmup", bool, commands=_SERVE, action="store_true", engine="warmup", default=False,
           check=true_or_false,
           help="before the first request is admitted, run one at the planned size on every replica "
                "(kernel choice, allocator growth, --compile's compilation, the decode), so no user waits for them"),
    Option("workers", int, commands=_BOTH, engine="workers", positional=True, check=positive_int,
           help={"generate": "ranks to use (default: all GPUs, or 2 CPU slots)",
                 "serve": "ranks per replica (default: the planner's best on the cluster)"}),
    Option("device", commands=_BOTH, choices=DEVICES, engine="device", default="auto", positional=True,
           check=one_of(*DEVICES), defaults={"generate": "auto", "serve": "auto"}),
    Option("ulysses", int, commands=_BOTH, engine="ulysses", positional=True, check=positive_int),
    Option("ring", int, commands=_BOTH, engine="ring", positional=True, check=positive_int),
    Option("cfg", int, commands=_BOTH, choices=(1, 2, 4), engine="cfg", positional=True, check=positive_int),
    Option("address", commands=_BOTH, engine="address", positional=True, check=or_none(ray_address),
           help="Ray address (default: RAY_ADDRESS, else a local Ray)"),
    Option("replicas", int, commands=_SERVE, flags=("--min-replicas",), engine="replicas", default=1,
           check=positive_int, defaults={"serve": 1},
           help="copies of the model serving the queue side by side (default 1); with --max-replicas, the fewest kept"),
    Option("max_replicas", int, commands=_SERVE, engine="max_replicas",
           help="add a replica (planned like the first, on free devices) while a request has waited "
                "--scale-up-wait seconds, up to this many; take one out after --scale-down-idle seconds idle"),
    Option("scale_up_wait", float, commands=_SERVE, metavar="S", engine="scale_up_wait_s", default=30.0,
           check=finite_seconds, help="seconds a request waits before a replica is added (default 30)"),
    Option("scale_down_idle", float, commands=_SERVE, metavar="S", engine="scale_down_idle_s", default=300.0,
           check=finite_seconds, help="seconds a replica idles before it is taken out (default 300)"),
    Option("max_batch", int, commands=_SERVE, metavar="N", engine="max_batch", default=1, check=positive_int,
           help="step-level batching: up to N requests of one geometry share a replica's steps, each "
                "joining at a step boundary (within the plan's memory; default 1: one at a time)"),
    Option(None, engine="dtype", check=or_none(one_of(*DTYPES))),
    Option(None, float, engine="placement_timeout_s", default=60.0, check=positive_seconds),
    Option(None, float, engine="collective_timeout_s", default=30.0, check=positive_seconds),
    Option(None, float, engine="step_timeout_s", check=or_none(positive_seconds)),
    Option(None, bool, engine="elastic", default=True, check=true_or_false),
    Option(None, engine="grow", default="auto", check=one_of("auto", "always", "never")),
    # --json: a JSON summary instead of the plan table and progress bars.
    Option("json", bool, commands=_GEN, action="store_true", engine="show_plan", default=True,
           engine_value=lambda o: not o.get("json"), defaults={"generate": False}, check=true_or_false,
           help="print a JSON summary"),
    Option(None, engine="checkpoint_dir", check=or_none(a_path)),  # a directory per request under it (Engine(checkpoint_dir=))
    # -- the command only --------------------------------------------------------------------------
    Option("out", commands=_GEN, defaults={"generate": "video.mp4"}, help="mp4 to write (default video.mp4)"),
    Option("save_latents", commands=_GEN, help="write the final latents (the pipeline's output_type='latent'): "
           ".npy (video; with sound also NAME.audio.npy) or .npz (latents, audio_latents)"),
    Option("fps", int, commands=_BOTH, defaults={"generate": None, "serve": None}, check=positive_int,
           help={"generate": "mp4 frame rate (default 8, or the rate a model's sound was made for)",
                 "serve": "frames per second of the mp4 and of `seconds` (default 8, or the rate a model's sound "
                          "was made for: LTX-2 24)"}),
    Option("resume", commands=_GEN, help="finish the run saved in this --checkpoint-dir from its last finished "
                                         "step, with the same latents (its request and options come from there)"),
    Option("host", commands=_SERVE, defaults={"serve": "127.0.0.1"},
           help="address to listen on (default 127.0.0.1: this machine only)"),
    Option("port", int, commands=_SERVE, defaults={"serve": 8000}, help="HTTP port (default 8000)"),
    Option("token_file", commands=_SERVE,
           help="bearer token for /v1 (default: $RAYDIT_API_TOKEN, else ~/.raydit/api_token, "
                "created with mode 0600 if absent)"),
    Option("output_dir", commands=_SERVE, defaults={"serve": "raydit-videos"},
           help="where videos and their status JSON are kept, named by id (default ./raydit-videos)"),
    Option("max_queue", int, commands=_SERVE, defaults={"serve": 64},
           help="requests waiting at most; one more is answered 429 with Retry-After (default 64)"),
    Option("max_steps", int, commands=_SERVE, defaults={"serve": 200},
           help="most denoising steps a request may ask for (default 200)"),
    Option("default_steps", int, commands=_SERVE,
           help="steps for a request that does not say (default: the model's diffusers pipeline's, e.g. 50)"),
    Option("lora_dir", commands=_SERVE, metavar="DIR",
           help="POST /v1/loras loads LoRAs from under this directory only (default: no loading over HTTP)"),
)


def _check_table() -> None:
    for command in COMMANDS:
        keys = [o.key for o in OPTIONS if command in o.commands]
        assert len(keys) == len(set(keys)), f"{command}: an option declared twice"
    for attr in ("engine", "request"):
        names = [getattr(o, attr) for o in OPTIONS if getattr(o, attr)]
        assert len(names) == len(set(names)), f"an Engine {attr} keyword declared twice"


def _check_request_fields() -> None:
    """The table's request options are GenerationRequest's fields, one to one."""
    from dataclasses import fields

    from raydit.models.requests import GenerationRequest

    table = {o.request for o in OPTIONS if o.request is not None and not o.control}
    have = {f.name for f in fields(GenerationRequest)}
    if table != have:
        raise RuntimeError(f"GenerationRequest's fields {sorted(have - table)} have no request option, and the "
                           f"request options {sorted(table - have)} no GenerationRequest field: declare each in both "
                           "(raydit.runtime.options.OPTIONS, raydit.models.requests.GenerationRequest)")


_check_table()
_check_request_fields()


def options_of(command: str) -> list[Option]:
    if command not in COMMANDS:
        raise ValueError(f"command {command!r} is not one of {', '.join(COMMANDS)}")
    return [o for o in OPTIONS if command in o.commands]


# -- the command line and config files -----------------------------------------------------------


def option(key: str) -> Option:
    """The table's entry of command-line option `key`."""
    for o in OPTIONS:
        if o.key == key:
            return o
    raise ValueError(f"option {key!r} is not in raydit.runtime.options.OPTIONS")


def add_flag(parser, o: Option, help: str = "", aliases: bool = True, **overrides) -> None:
    """`o`'s flag on an argparse parser, its type, action, choices and metavar from the table;
    default None unless `overrides` (another command's default ...) say otherwise; `aliases`:
    its further flags too (`--min-replicas`)."""
    kwargs: dict = {"dest": o.key}
    if o.action is not None:
        kwargs["action"] = o.action
        if o.action == "store_true":
            kwargs["default"] = None
    elif o.type in (int, float):
        kwargs["type"] = o.type
    elif o.type is list:
        kwargs["type"] = comma_list
    if o.choices is not None:
        kwargs["choices"] = list(o.choices)
    if o.metavar is not None:
        kwargs["metavar"] = o.metavar
    if help:
        kwargs["help"] = help
    kwargs.update(overrides)
    parser.add_argument(o.flag, *(o.flags if aliases else ()), **kwargs)


def add_arguments(parser, command: str) -> None:
    """`command`'s flags on an argparse parser; every default None (`command_defaults` and the
    config file fill in what is not given)."""
    for o in options_of(command):
        if o.on_line:
            add_flag(parser, o, o.help_for(command))


def check_given(opts: dict, command: str) -> None:
    """The table's checks of `command`'s options that the line or a file gave (the Engine's
    are checked again by EngineConfig, the request's by GenerationRequest: other boundaries)."""
    for o in options_of(command):
        if o.check is not None and o.engine_value is None and opts.get(o.key) is not None:
            o.check(o.flag, opts[o.key])


def config_types(command: str) -> dict[str, type]:
    """The keys of `command`'s config file (job.yaml, serve.yaml) -> the type each must have."""
    return {o.key: o.type for o in options_of(command) if o.in_file}


def command_defaults(command: str) -> dict:
    """What `command` uses for the options not given (on the line or in the file)."""
    return {o.key: o.defaults[command] for o in options_of(command) if command in o.defaults}


def request_keys() -> tuple[str, ...]:
    """The options that define a saved run (`raydit generate --resume` takes them from it)."""
    return tuple(o.key for o in options_of("generate") if o.saved)


def engine_kwargs(opts: dict, command: str) -> dict:
    """Resolved `command` options -> the Engine's keyword arguments: every Engine option the
    command takes, left out where not given and the Engine's default is not None."""
    out = {}
    for o in options_of(command):
        if o.engine is None:
            continue
        value = o.engine_value(opts) if o.engine_value is not None else opts.get(o.key)
        if value is None and o.default is not None:
            if o.type is not bool:
                continue
            value = False
        if o.type is float and value is not None:
            value = float(value)
        out[o.engine] = value
    return out


def request_fields(command: str) -> dict[str, str]:
    """`command`'s options whose value is the request field's as the line gives it -> that
    GenerationRequest field (a saved run's request is compared with them)."""
    return {o.key: o.request for o in options_of(command)
            if o.request and o.cli_request and not o.control and o.action is None and o.as_given}


def request_kwargs(opts: dict, command: str, **resolved) -> dict:
    """Resolved `command` options -> Engine.submit's keyword arguments for what the command
    line gave (the rest keep submit's defaults); `resolved`: request values the command made
    from its options (the image as PNG, the LoRA choice, the parsed guidance options)."""
    out = {}
    for o in options_of(command):
        if o.request is not None and o.cli_request and opts.get(o.key) is not None:
            out[o.request] = opts[o.key]
    out.update(resolved)
    return out


# -- serve's form -------------------------------------------------------------------------------


def form_fields() -> dict[str, dict]:
    """POST /v1/videos's fields: name -> {"annotation": type, pydantic Field keywords}."""
    return {o.form_name: dict(o.form) for o in OPTIONS if o.form is not None}


# -- the Engine ---------------------------------------------------------------------------------


def _engine_options() -> list[Option]:
    found = [o for o in OPTIONS if o.engine is not None]
    # Positional ones first, in the table's order; then the keyword-only ones.
    return [o for o in found if o.positional] + [o for o in found if not o.positional]


def _engine_post_init(self) -> None:
    for o in _engine_options():
        if o.check is not None:
            o.check(o.engine, getattr(self, o.engine))
    if self.max_replicas is not None and (isinstance(self.max_replicas, bool) or not isinstance(self.max_replicas, int)
                                          or self.max_replicas < self.replicas):
        raise ValueError(f"max_replicas {self.max_replicas!r} must be an integer >= replicas ({self.replicas}), the "
                         "replicas the engine starts with and keeps")
    from raydit.models.cache_options import check_cache

    check_cache(self.cache, self.cache_threshold)
    if not self.guidance and self.cfg not in (None, 1):
        raise ValueError(f"cfg {self.cfg} runs guidance branches on separate groups, but guidance is False (no_cfg): "
                         "a request runs one branch; drop cfg or guidance=False")
    check_shard_weights(self.shard_weights, self.fuse_lora, self.workers)


def _make_engine_config():
    fields = []
    for o in _engine_options():
        default = o.default
        f = dataclasses.field(default=default, kw_only=not o.positional)
        kind = o.engine_type or o.type
        annotation = kind if default is not None or kind is Any else kind | None
        fields.append((o.engine, annotation, f))
    cls = dataclasses.make_dataclass(
        "EngineConfig", fields, frozen=True,
        namespace={"__post_init__": _engine_post_init,
                   "__doc__": "An Engine's settings, checked where built (every option: raydit.runtime.options)."},
    )
    cls.__module__ = __name__  # pickles by name
    return cls


EngineConfig = _make_engine_config()


def engine_signature() -> inspect.Signature:
    """Engine(...)'s parameters: EngineConfig's, after `self`."""
    params = list(inspect.signature(EngineConfig).parameters.values())
    return inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params])


def call_controls() -> tuple[str, ...]:
    """submit's keywords that steer the call rather than make the GenerationRequest."""
    return tuple(o.request for o in OPTIONS if o.request and o.control)


def submit_signature(progress: bool = False, tag: bool = True) -> inspect.Signature:
    """Engine.submit's parameters (Engine.generate's: `progress` True, no `tag`)."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD)]
    for o in OPTIONS:
        if o.request is None or (o.request == "tag" and not tag):
            continue
        default = None if o.request_default is _UNSET else o.request_default
        if o.request == "progress":
            default = progress
        params.append(P(o.request, P.POSITIONAL_OR_KEYWORD, default=default))
    return inspect.Signature(params)


def check_shard_weights(shard_weights, fuse_lora=None, workers=None) -> None:
    """shard_weights' rules, written once: EngineConfig checks them where an Engine is made, and
    the command line (generate, serve) calls this with its options before Ray starts."""
    if shard_weights not in (None, True, False):  # a --config file or a caller can give anything
        raise ValueError(f"shard_weights {shard_weights!r} must be True, False or None (the planner's choice)")
    if shard_weights and fuse_lora:
        raise ValueError("shard_weights cannot keep a LoRA fused into the weights (a regroup rebuilds the shards "
                         "from the checkpoint files, without it); drop fuse_lora or shard_weights")
    if shard_weights and workers == 1:
        raise ValueError("shard_weights needs 2 or more workers per replica to share the weights, workers is 1 "
                         "(every weight is resident on one rank anyway); drop shard_weights or use more workers")
