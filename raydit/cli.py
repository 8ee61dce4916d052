"""`raydit` command line: one small function per subcommand.

To add a subcommand: write `add_<name>_arguments(parser)` and `cmd_<name>(args) -> int`, and
add one line to SUBCOMMANDS. User errors (ValueError from raydit, missing files, bad YAML,
bad arguments) print one line `raydit: error: ...` to stderr and exit 2, never a traceback.
With `--json`, stdout carries the one JSON object alone: anything else the command or a library
writes to stdout while it runs goes to stderr; the command prints its object to `args.json_stdout`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Callable, NamedTuple

USER_ERROR = 2


class UsageError(Exception):
    """Raised by the parser instead of printing usage and exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage block and call sys.exit
        _, _, command = self.prog.partition(" ")  # "raydit plan" -> "plan"
        raise UsageError(f"{command}: {message}" if command else message)


# -- plan ----------------------------------------------------------------------------------


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The plan's own flags here; those it shares with `raydit generate` / `serve` (their type,
    choices, metavar) from raydit.runtime.options, with help saying what the plan does with them."""
    from raydit.planner.devicemodel import DEFAULT_STEPS
    from raydit.planner.modes import DEFAULT_ATTENTION_MODE, DEFAULT_QUANTIZE_MODE
    from raydit.runtime.options import add_flag, option

    add_flag(p, option("model"), "built-in name (e.g. cogvideox-2b, tiny) or a local diffusers pipeline directory",
             required=True)
    add_flag(p, option("frames"), "video frames (default: the model's)")
    add_flag(p, option("height"), "pixels (default: the model's)")
    add_flag(p, option("width"), "pixels (default: the model's)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpus", type=int, help="number of devices of --gpu-type")
    where.add_argument("--cluster", help="YAML file listing nodes, device types, counts, links")
    add_flag(where, option("address"), "plan for a running Ray cluster: HOST:PORT, or 'auto' (RAY_ADDRESS, "
                                       "else the local cluster); its GPUs, or CPU slots when it has none")
    p.add_argument("--gpu-type", dest="gpu_type",
                   help="device type for --gpus (default H100; see raydit.planner.DEVICE_TYPES)")
    p.add_argument("--per-node", dest="per_node", type=int,
                   help="devices per node for --gpus (default: the type's usual node, 8 for H100)")
    add_flag(p, option("ulysses"), "force the Ulysses degree")
    add_flag(p, option("ring"), "force the ring degree")
    # No choices: the planner says which degrees share the model's guidance branches evenly.
    add_flag(p, option("cfg"), "force the CFG (guidance branch) degree: 1, 2, or 4 for LTX-2", choices=None)
    add_flag(p, option("replicas"), "force the number of replicas", aliases=False)
    p.add_argument("--world-size", dest="world_size", type=int,
                   help="only layouts that use exactly this many devices")
    add_flag(p, option("shard_weights"), "every layout shards the transformer blocks' weights over its replica's "
                                         "ranks (default: the layouts that fit more devices with it)")
    p.add_argument("--no-cfg", dest="guidance", action="store_false",
                   help="classifier-free guidance off: one branch per step, cfg 1")
    add_flag(p, option("quantize"), "price the GEMMs in fp8 (default none: bf16; fp8-sim is priced as bf16: "
                                    "emulated numerics, no speed)", default=DEFAULT_QUANTIZE_MODE)
    add_flag(p, option("attention"), "price the attention kernel in this precision (default bf16; auto is "
                                     "priced as bf16)", default=DEFAULT_ATTENTION_MODE)
    add_flag(p, option("compile"), "price the step compiled (fused elementwise ops)", default=False)
    add_flag(p, option("full_precision_steps"),
             "with --quantize or 8-bit --attention: the first and last N of a request's --steps run in bf16; "
             "price the mean step and the bf16 weights kept beside the FP8 ones (never sharded)", default=0)
    add_flag(p, option("steps"), f"the request's steps: the whole request (text encoding and decode included) "
                                 f"and the full-precision ones are priced over them (default {DEFAULT_STEPS})",
             default=DEFAULT_STEPS, metavar="S")
    add_flag(p, option("sparse_attention"), "price the steps with this sparse attention at the request's token "
                                            "grid (its density, the dense steps of --steps)")
    add_flag(p, option("sparse_option"), "a setting of --sparse-attention (repeatable)")
    add_flag(p, option("dense_steps"), "--sparse-attention's dense first steps (default: the method's fraction)")
    p.add_argument("--top", type=int, default=10,
                   help="feasible plans to list (default 10; 0 for all)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


# `raydit plan`'s flags that are generate's / serve's options, checked by the table's checks.
PLAN_SHARED = ("model", "frames", "height", "width", "address", "ulysses", "ring", "cfg", "replicas",
               "shard_weights", "quantize", "attention", "compile", "full_precision_steps", "steps", "dense_steps")


def _sparse_mode(args: argparse.Namespace, mode):
    """`mode` with --sparse-attention's share of dense attention's work at the request's grid."""
    import dataclasses

    from raydit import model_spec
    from raydit.planner.sparse import attention_work
    from raydit.runtime.options import sparse_from_options

    config = sparse_from_options(vars(args))
    if config is None:
        return mode
    spec = model_spec(args.model)
    g = spec.geometry(args.frames, args.height, args.width)
    work = attention_work(config, (g.token_frames, g.token_rows, g.token_cols), args.steps, spec.layers)
    return dataclasses.replace(mode, attention_work=work)


def cmd_plan(args: argparse.Namespace) -> int:
    from raydit import plan  # the planner with the model families loaded (pipeline directories)
    from raydit.planner.devicemodel import run_mode
    from raydit.planner.modes import DEFAULT_ATTENTION_MODE, DEFAULT_QUANTIZE_MODE
    from raydit.planner.report import format_plan_table

    if args.top < 0:
        raise ValueError(f"--top {args.top} must be 0 (all) or more")
    from raydit.runtime.options import option

    for key in PLAN_SHARED:
        o, value = option(key), getattr(args, key)
        if o.check is not None and o.engine_value is None and value is not None:
            o.check(o.flag, value)
    if args.full_precision_steps and (args.quantize, args.attention) == (DEFAULT_QUANTIZE_MODE, DEFAULT_ATTENTION_MODE):
        raise ValueError(f"--full-precision-steps {args.full_precision_steps} leaves the quantized modes for those "
                         "steps, and none is asked; add --quantize fp8 or --attention int8|fp8, or drop it")
    cluster = args.cluster
    if args.address is not None:
        if args.gpu_type is not None or args.per_node is not None:
            raise ValueError("--gpu-type / --per-node go with --gpus; with --address the live "
                             "cluster says each node's type and count")
        # Ray loads only here: `raydit plan --gpus/--cluster` stays pure Python.
        from raydit.runtime.topology import attached, read_live_cluster

        with attached(args.address):
            live = read_live_cluster("auto")
        for note in live.notes:
            print(f"raydit: note: {note}", file=sys.stderr)
        cluster = live.spec
    result = plan(
        args.model, args.frames, args.height, args.width,
        gpus=args.gpus, gpu_type=args.gpu_type,
        per_node=args.per_node, cluster=cluster,
        ulysses=args.ulysses, ring=args.ring, cfg=args.cfg, replicas=args.replicas,
        guidance=args.guidance, world_size=args.world_size, shard_weights=args.shard_weights,
        mode=_sparse_mode(args, run_mode(args.quantize, args.attention, args.compile, args.full_precision_steps,
                                         args.steps)),
    )
    top = args.top or None
    from raydit.planner.report import format_request_line, request_seconds, request_shares

    if args.json:
        e2e = request_seconds(result, args.steps)
        whole = {**e2e.to_dict(), "shares": {k: round(v, 4) for k, v in request_shares(e2e).items()}}
        print(json.dumps({**result.to_dict(top=top), "request": whole}, indent=1),
              file=getattr(args, "json_stdout", sys.stdout))
    else:
        print(format_plan_table(result, limit=top))
        print(format_request_line(result, args.steps))
    return 0


# -- registry --------------------------------------------------------------------------------


class Subcommand(NamedTuple):
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _runtime(name: str) -> Callable:
    """The runtime sub-commands live in raydit.commands (torch and Ray load only when used)."""

    def run(args: argparse.Namespace) -> int:
        from raydit import commands

        return getattr(commands, f"cmd_{name}")(args)

    return run


def _runtime_arguments(name: str) -> Callable:
    def add(p: argparse.ArgumentParser) -> None:
        from raydit import commands

        getattr(commands, f"add_{name}_arguments")(p)

    return add


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("plan", "rank every parallel layout for a model, a video and a cluster",
               add_plan_arguments, cmd_plan),
    Subcommand("generate", "generate a video on a Ray cluster (a local one if none is given)",
               _runtime_arguments("generate"), _runtime("generate")),
    Subcommand("verify", "check every parallel plan against one rank on this cluster",
               _runtime_arguments("verify"), _runtime("verify")),
    Subcommand("doctor", "versions, kernels, NCCL/gloo and the Ray cluster, said up front",
               _runtime_arguments("doctor"), _runtime("doctor")),
    Subcommand("serve", "an HTTP video service on Ray Serve speaking OpenAI's Videos API",
               _runtime_arguments("serve"), _runtime("serve")),
]


def build_parser() -> argparse.ArgumentParser:
    from raydit import __version__

    parser = _Parser(prog="raydit", description="Elastic sequence-parallel video diffusion on Ray.")
    parser.add_argument("--version", action="version", version=f"raydit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for s in SUBCOMMANDS:
        sp = sub.add_parser(s.name, help=s.help, description=s.help)
        s.add_arguments(sp)
        sp.set_defaults(_run=s.run)
    return parser


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def _run(args: argparse.Namespace) -> int:
    if not getattr(args, "json", False):
        return int(args._run(args) or 0)
    # The JSON alone on stdout, for `| jq` and for programs: Ray's driver prints the messages the
    # raylet pushes to a job (a worker slow to start on a busy node, a pending task) to stdout
    # whether or not log_to_driver is set, and a library may print too. They go to stderr.
    args.json_stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return int(args._run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        if getattr(args, "_run", None) is None:
            parser.print_help(sys.stderr)
            return USER_ERROR
        code = _run(args)
        sys.stdout.flush()  # here, where a reader gone away is caught, not at the interpreter's exit
        return code
    except UsageError as exc:
        print(f"raydit: error: {_one_line(exc)}", file=sys.stderr)
        return USER_ERROR
    except BrokenPipeError:  # the reader went away (`raydit plan ... | head`): nothing to say, nowhere to say it
        _silence_stdout()
        return 141  # as a shell reports a process ended by SIGPIPE
    except (ValueError, OSError) as exc:  # PlanError is a ValueError; missing files are OSError
        print(f"raydit: error: {_one_line(exc)}", file=sys.stderr)
        return USER_ERROR
    except RuntimeError as exc:  # a run that failed after it started (e.g. every worker lost)
        print(f"raydit: failed: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the running request stopped at its next step (Engine.__exit__)
        kept = getattr(args, "resume", None) or getattr(args, "checkpoint_dir", None)
        print("raydit: interrupted" + (f"; its finished steps are in {kept}: finish it with raydit generate "
                                       f"--resume {kept}" if kept else ""), file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit finds no closed pipe."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout already closed or not a file
        pass


if __name__ == "__main__":
    sys.exit(main())
