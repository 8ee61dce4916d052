"""Step caching (raydit.models.cache): speedup and fidelity at 3 thresholds per method.

For each model, one process (the generic Runner, float32, one torch thread) runs the same
request uncached and then with `fbcache` and `teacache` at 3 thresholds each; per run it
records the denoising time (wall and this process's CPU seconds: with one thread, CPU time is
the work done, robust to other users of the machine, so the speedups quoted are CPU-time
ratios; wall ratios are listed beside them), the steps served from the cache, and the
relative difference of the final latents to the uncached ones, max |a - b| / max |b|.

Models: the built-in tiny CogVideoX (`tiny`) and tiny Wan 2.1 (`tiny-wan`) pipelines, and a
CogVideoX-2b-shaped transformer (30 heads x 64, time embedding 512, `--layers` of 2b's 30
layers) in the tiny pipeline's text encoder / VAE / DDIM scheduler, 1 frame at 240 x 368
(1 latent frame x 15 x 23 patches = 345 video tokens + 226 text tokens); guidance on (batch 2). All weights are random: with random
weights consecutive steps differ far more than in a trained model (the first block's
residual changes by ~100% a step, where published trained-model thresholds are 0.05-0.2),
so the thresholds are chosen per model from the uncached run: the 25th, 50th and 75th
percentile of the per-step decision quantity (fbcache: relative L1 change of the first
block's residual; teacache: of the timestep embedding). The figures show how speed and
fidelity trade along the threshold, not what a trained model gets at a given value.

    python bench/bench_cache.py [--steps 10] [--layers 4] [--models tiny,tiny-wan,2b] [--out docs/benchmarks/cache.json]

The JSON and the Markdown table beside it are rewritten after each model, so a long run
keeps what it measured so far.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

METHODS = ("fbcache", "teacache")
PERCENTILES = (25, 50, 75)


def models(layers: int, steps: int) -> dict:
    from raydit.models.families.cogvideox import cases as cogvideox_cases
    from raydit.models.families.cogvideox import tiny as cogvideox
    from raydit.models.families.wan import cases as wan_cases
    from raydit.models.families.wan import tiny as wan_tiny

    base = str(cogvideox.tiny_pipeline_dir())
    return {
        "tiny": (
            lambda: cogvideox.load_tiny_pipeline(),
            dict(prompt="a red fox runs", negative_prompt="blur", num_frames=cogvideox.TINY_FRAMES,
                 height=cogvideox.TINY_HEIGHT, width=cogvideox.TINY_WIDTH, num_inference_steps=steps,
                 guidance_scale=6.0, seed=1)),
        "tiny-wan": (
            lambda: wan_cases.wan_pipeline(str(wan_tiny.tiny_pipeline_dir("tiny-wan"))),
            dict(prompt="a red fox runs", negative_prompt="blur", num_frames=9, height=48, width=80,
                 num_inference_steps=steps, guidance_scale=5.0, seed=1)),
        "2b": (
            lambda: cogvideox_cases.cogvideox_pipeline(
                base, num_attention_heads=30, attention_head_dim=64, time_embed_dim=512, num_layers=layers,
                max_text_seq_length=226, sample_height=30, sample_width=46, sample_frames=1),
            dict(prompt="a red fox runs", negative_prompt="blur", num_frames=1, height=240, width=368,
                 num_inference_steps=steps, guidance_scale=6.0, seed=1)),
    }


def run(runner, request):
    from raydit.models.cache import CACHED_STEPS

    state = runner.prepare(request)
    wall, cpu = time.perf_counter(), time.process_time()
    while not state.done:
        state = runner.step(state)
    return state.latents.clone(), time.perf_counter() - wall, time.process_time() - cpu, state.carry.get(CACHED_STEPS, 0)


def quantities(runner, request, method: str) -> list[float]:
    """The per-step decision quantity of an uncached-equivalent run (a threshold nothing passes)."""
    from raydit.models import cache as cache_mod

    seen: list[float] = []
    original = cache_mod._Run._ratio

    def recording(self, sums):
        value = original(self, sums)
        seen.append(value)
        return value

    cache_mod._Run._ratio = recording
    try:
        run(runner, dataclasses.replace(request, cache=method, cache_threshold=1e-12))
    finally:
        cache_mod._Run._ratio = original
    return seen


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def main() -> int:
    import torch

    from raydit.models import GenerationRequest, Runner

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--models", default="tiny,tiny-wan,2b",
                    help="comma-separated: tiny (CogVideoX), tiny-wan (Wan 2.1), 2b (CogVideoX-2b-shaped)")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR / "cache.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    results = []
    table = models(args.layers, args.steps)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"bench_cache: unknown model(s) {unknown}; choose from {', '.join(table)}")
    titles = {"tiny": "tiny (CogVideoX)", "tiny-wan": "tiny-wan (Wan 2.1)",
              "2b": f"CogVideoX-2b-shaped, {args.layers} layers"}
    out = Path(args.out)
    for key in names:
        make, fields = table[key]
        name = titles[key]
        runner = Runner(make())
        request = GenerationRequest(**fields)
        runner.step(runner.prepare(request))  # warm-up (allocations, first-call costs)
        ref, wall0, cpu0, _ = run(runner, request)
        row = {"model": name, "steps": args.steps, "uncached": {"wall_s": round(wall0, 3), "cpu_s": round(cpu0, 3)},
               "runs": []}
        print(f"{name}: uncached {cpu0:.2f} s CPU ({wall0:.2f} s wall)", flush=True)
        for method in METHODS:
            seen = quantities(runner, request, method)
            for p in PERCENTILES:
                threshold = float(f"{percentile(seen, p):.3g}")
                latents, wall, cpu, cached = run(runner, dataclasses.replace(request, cache=method,
                                                                             cache_threshold=threshold))
                diff = float((latents - ref).abs().max() / ref.abs().max())
                entry = dict(method=method, percentile=p, threshold=threshold, cached_steps=int(cached),
                             cpu_s=round(cpu, 3), wall_s=round(wall, 3), speedup_cpu=round(cpu0 / cpu, 3),
                             speedup_wall=round(wall0 / wall, 3), rel_diff=float(f"{diff:.3g}"))
                row["runs"].append(entry)
                print(f"  {method} p{p} threshold {threshold}: {cached}/{args.steps} cached, "
                      f"{entry['speedup_cpu']}x CPU ({entry['speedup_wall']}x wall), rel diff {diff:.3g}", flush=True)
        results.append(row)
        payload = {"benchmark": "cache", "command": "python bench/bench_cache.py " + " ".join(sys.argv[1:]),
                   "machine": benchlib.machine(), "results": results}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(payload))
        print(f"wrote {out} and {out.with_suffix('.md')}", flush=True)
    return 0


def markdown(payload: dict) -> str:
    m = payload["machine"]
    lines = [
        "# Step caching: speed and fidelity (bench/bench_cache.py)",
        "",
        f"`{payload['command']}` on {m.get('processor')} ({m.get('cpu_count')} cores, load average "
        f"{m.get('load_average')}), torch {m.get('torch')}, {m.get('date_utc')} UTC; one process, one thread, float32.",
        "",
        "Speedup = uncached / cached denoising CPU seconds of this process (one thread: the work done;",
        "wall-clock ratios, noisier on a shared machine, in parentheses). Rel. diff = max |cached - uncached|",
        "/ max |uncached| of the final latents. Random weights: the thresholds are the 25th / 50th / 75th",
        "percentile of each model's own per-step change, not values to use with trained weights.",
        "",
    ]
    for row in payload["results"]:
        u = row["uncached"]
        lines += [f"## {row['model']}, {row['steps']} steps (uncached {u['cpu_s']} s CPU, {u['wall_s']} s wall)", "",
                  "| method | threshold (percentile) | cached steps | speedup | rel. diff |", "|---|---|---|---|---|"]
        for r in row["runs"]:
            lines.append(f"| {r['method']} | {r['threshold']} (p{r['percentile']}) | {r['cached_steps']}/{row['steps']} "
                         f"| {r['speedup_cpu']}x ({r['speedup_wall']}x) | {r['rel_diff']} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
