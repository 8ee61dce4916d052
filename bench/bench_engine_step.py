"""One denoising step: raydit's Engine (one Ray worker) against diffusers' own pipeline.

The same saved pipeline directory and the same request on every side, one thread each:

- diffusers: `WanPipeline.__call__` (loaded with diffusers' from_pretrained), per-step time
  from `callback_on_step_end` stamps (the step's transformer calls, guidance and scheduler
  step), in this process;
- runner: raydit's bare `Runner.step` on the same loaded pipeline, in this process (what the
  model layer costs apart from Ray);
- engine: `Engine(model=dir, workers=1, device="cpu")`, per-step time as the driver sees it
  (`result.timings["step_seconds"]`: the remote call and rank 0's checkpoint back), and rank 0's
  own time of the same steps (`rank_step_seconds`), whose difference is Ray's part.

The model: a Wan-2.1-1.3B-shaped transformer (12 heads x 128, FFN 8960, random weights) with
`--layers` layers (2 by default, so a step takes about a second on one CPU thread) behind the
tiny Wan pipeline's tokenizer, umT5 and VAE; guidance on (two transformer calls a step);
UniPC, whose multistep history is part of every checkpoint. This process runs at the
niceness Ray gives its workers (15), so both sides compete for the CPU alike.

Rounds alternate the sides (the order rotates every round) while all stay warm; the first
step of every run is dropped; a round's figure is the median of its steps; the ratio is the
median over rounds of engine / diffusers from the same round. Target (issue 30): <= 1.02.

    python bench/bench_engine_step.py [--rounds 5] [--steps 6] [--layers 2] [--name engine-step]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

TARGET = 1.02
PROMPT = "a red fox"
GEOMETRY = {"num_frames": 9, "height": 128, "width": 128}  # 3 x 8 x 8 = 192 video tokens


def diffusers_steps(pipe, request: dict) -> list[float]:
    """Seconds of each step of one diffusers call (the first one dropped: it holds the prompt
    encoding and the initial latents)."""
    import torch

    marks: list[float] = []

    def stamp(p, i, t, kwargs):
        marks.append(time.perf_counter())
        return kwargs

    t0 = time.perf_counter()
    with torch.no_grad():
        pipe(prompt=request["prompt"], num_frames=request["num_frames"], height=request["height"],
             width=request["width"], num_inference_steps=request["num_inference_steps"],
             guidance_scale=request["guidance_scale"], max_sequence_length=request["max_sequence_length"],
             generator=torch.Generator("cpu").manual_seed(request["seed"]), output_type="latent",
             callback_on_step_end=stamp)
    return [b - a for a, b in zip([t0] + marks[:-1], marks)][1:]


def runner_steps(runner, request: dict) -> list[float]:
    from raydit.models.requests import GenerationRequest

    state = runner.prepare(GenerationRequest(**{k: v for k, v in request.items() if k != "max_sequence_length"}))
    out = []
    for _ in range(request["num_inference_steps"]):
        t0 = time.perf_counter()
        state = runner.step(state)
        out.append(time.perf_counter() - t0)
    return out[1:]


def engine_steps(engine, request: dict) -> tuple[list[float], list[float]]:
    result = engine.generate(**{k: v for k, v in request.items() if k != "max_sequence_length"})
    return result.timings["step_seconds"][1:], result.timings["rank_step_seconds"][1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--name", default="engine-step")
    ap.add_argument("--max-wait", type=float, default=30.0, help="seconds to wait for a quiet machine per round")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = ap.parse_args(argv)
    os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
    import torch

    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner
    from raydit.runtime.engine import Engine

    torch.set_num_threads(1)
    model_dir = benchlib.wan_bench_dir(layers=args.layers, dtype="float32", defaults=GEOMETRY)
    request = dict(prompt=PROMPT, **GEOMETRY, num_inference_steps=args.steps, guidance_scale=5.0, seed=0,
                   max_sequence_length=512)
    pipe = load_pipeline(model_dir)
    runner = Runner(pipe)
    rounds = []
    with Engine(model=model_dir, workers=1, device="cpu", show_plan=False) as engine:
        # Ray starts its workers at niceness 15: run this process's sides at the same.
        worker_nice = os.getpriority(os.PRIO_PROCESS, engine.group.members[0].info["pid"])
        os.nice(max(0, worker_nice - os.nice(0)))
        engine_steps(engine, dict(request, num_inference_steps=2))  # warm the worker
        diffusers_steps(pipe, dict(request, num_inference_steps=2))
        sides = ["diffusers", "runner", "engine"]
        for r in range(args.rounds):
            waited = benchlib.wait_for_quiet(args.max_wait)
            order = sides[r % 3:] + sides[: r % 3]
            got: dict = {"order": order, "waited_s": waited, "load": benchlib.loadavg()}
            for side in order:
                if side == "diffusers":
                    got["diffusers"] = statistics.median(diffusers_steps(pipe, request))
                elif side == "runner":
                    got["runner"] = statistics.median(runner_steps(runner, request))
                else:
                    steps, rank = engine_steps(engine, request)
                    got["engine"], got["engine_rank"] = statistics.median(steps), statistics.median(rank)
            got["engine_over_diffusers"] = got["engine"] / got["diffusers"]
            got["runner_over_diffusers"] = got["runner"] / got["diffusers"]
            got["ray_part_s"] = got["engine"] - got["engine_rank"]
            rounds.append(got)
            print(f"round {r + 1}: diffusers {got['diffusers']:.4f} s, runner {got['runner']:.4f} s, "
                  f"engine {got['engine']:.4f} s (rank 0 {got['engine_rank']:.4f} s); engine / diffusers "
                  f"{got['engine_over_diffusers']:.4f}, runner / diffusers {got['runner_over_diffusers']:.4f}",
                  flush=True)
    ratio = benchlib.summary([g["engine_over_diffusers"] for g in rounds])
    result = {
        "machine": benchlib.machine(),
        "command": "python bench/bench_engine_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {"dir": model_dir, "transformer": dict(benchlib.WAN_1_3B, num_layers=args.layers), **GEOMETRY,
                  "guidance_scale": 5.0, "steps": args.steps, "dtype": "float32", "threads": 1},
        "rounds": rounds,
        "diffusers_step_s": benchlib.summary([g["diffusers"] for g in rounds]),
        "runner_step_s": benchlib.summary([g["runner"] for g in rounds]),
        "engine_step_s": benchlib.summary([g["engine"] for g in rounds]),
        "engine_rank_step_s": benchlib.summary([g["engine_rank"] for g in rounds]),
        "ray_part_s": benchlib.summary([g["ray_part_s"] for g in rounds]),
        "engine_over_diffusers": ratio,
        "runner_over_diffusers": benchlib.summary([g["runner_over_diffusers"] for g in rounds]),
        "target": TARGET,
        "met": ratio["median"] <= TARGET,
    }
    print(f"engine / diffusers per step: {benchlib.fmt(ratio, unit='x', digits=4)} "
          f"(target <= {TARGET}: {'met' if result['met'] else 'NOT met'}); Ray's part per step "
          f"{benchlib.fmt(result['ray_part_s'], digits=4)}")
    print("wrote", benchlib.write_json(args.name, result, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
