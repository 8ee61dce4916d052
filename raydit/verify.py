"""`raydit verify`: does every parallel plan give the one-rank video on this cluster?

OpenDiT's authors found their text-token bug by eye (FIELD.md item 5). raydit runs a short
generation on one rank, then on every feasible (ulysses, ring, cfg) up to N ranks on the
same warm actors, and reports the largest difference of the final latents from one rank.

In float32 (a CPU's default) a plan passes within a fixed tolerance of one rank. In
bfloat16 or float16 (a GPU's default) no fixed tolerance both holds and catches bugs (sums
taken in another order differ by a few units of the dtype's 8 or 11 bits), so the rule of
raydit.models.precision applies instead: the same request also runs in float64 in this
process (on its CPU), from the low-precision run's own initial noise (`float64_reference`),
and a plan passes when its latents' relative L2 error against that is at most 2x the
one-rank low-precision run's; the report says which rule it used.
"""

from __future__ import annotations

import math

import numpy as np

from raydit.planner.layouts import cfg_degrees, mesh_layouts


DTYPES = ("float32", "float64", "bfloat16", "float16")
LOW_PRECISION = ("bfloat16", "float16")


def feasible_layouts(heads: int, max_world: int, branches: int = 2) -> list[tuple[int, int, int]]:
    """All (ulysses, ring, cfg) with ulysses | heads, cfg | branches (the model's guidance
    branches per step) and ulysses*ring*cfg <= max_world, the smallest first."""
    out = mesh_layouts(heads, max_world, cfg_degrees(branches), exact=False)
    return sorted(out, key=lambda d: (d[0] * d[1] * d[2], d[2], d[1], d[0]))


def verify(
    model: str = "tiny",
    workers: int = 4,
    device: str = "auto",
    steps: int = 2,
    frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-4,
    address: str | None = None,
    prompt: str = "a lighthouse on a cliff at dawn",
    dtype: str | None = None,
) -> list[dict]:
    """Rows, one per plan: its largest differences from one rank and whether it passes; in a
    low-precision dtype (LOW_PRECISION) also its error against float64 and the rule's figures
    (`rule` says which rule judged it). dtype None: the Engine's (bfloat16 on CUDA)."""
    from raydit.runtime.engine import Engine

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if workers < 1:
        raise ValueError(f"workers {workers} must be at least 1")
    # Checked before Ray starts: a tolerance that is negative or NaN would call every plan wrong.
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps {steps!r} must be a positive integer")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} {value!r} must be a finite number >= 0 (the pass bound is "
                             "|diff| <= atol + rtol * |reference|)")
    rows: list[dict] = []
    kw = dict(
        num_frames=frames, height=height, width=width, num_inference_steps=steps,
        guidance_scale=6.0, seed=1234, progress=False,
    )
    with Engine(
        model=model, workers=workers, device=device, address=address, show_plan=False,
        frames=frames, height=height, width=width, grow="never", dtype=dtype,
    ) as engine:
        run_dtype = engine.dtype
        engine.regroup(ulysses=1, ring=1, cfg=1)
        first = engine.generate(prompt, **kw)
        reference, request, model_dir = all_latents(first), first.request, engine.model_dir
        for ulysses, ring, cfg in feasible_layouts(engine.spec.heads, workers, max(2, engine.spec.cfg_branches)):
            engine.regroup(ulysses=ulysses, ring=ring, cfg=cfg)
            latents = all_latents(engine.generate(prompt, **kw))
            diff = np.abs(latents.astype(np.float64) - reference.astype(np.float64))
            bound = atol + rtol * np.abs(reference.astype(np.float64))
            rows.append(
                {
                    "ulysses": ulysses,
                    "ring": ring,
                    "cfg": cfg,
                    "world_size": ulysses * ring * cfg,
                    "max_abs_diff": float(diff.max()),
                    "max_rel_diff": float((diff / np.maximum(np.abs(reference), 1e-12)).max()),
                    "ok": bool((diff <= bound).all() and np.isfinite(latents).all()),
                    "kernel": engine.kernel,
                    "dtype": run_dtype,
                    "rule": "tolerance",
                    "latents": latents,
                }
            )
    if run_dtype in LOW_PRECISION:
        from raydit.models.precision import BF16_ERROR_FACTOR, error_ratio, relative_error

        exact = float64_reference(model_dir, request, steps, run_dtype)
        one_rank = relative_error(reference, exact)
        for row in rows:
            error = relative_error(row["latents"], exact)
            row.update(rule="precision", error=error, one_rank_error=one_rank, ratio=error_ratio(error, one_rank),
                       factor=BF16_ERROR_FACTOR,
                       ok=bool(np.isfinite(row["latents"]).all() and error <= BF16_ERROR_FACTOR * one_rank))
    for row in rows:
        del row["latents"]
    return rows


def all_latents(result) -> np.ndarray:
    """A GenerationResult's latents as one flat array: the video's, then the audio's where the
    model makes sound (a plan must reproduce both)."""
    arrays = [result.latents] + ([] if result.audio_latents is None else [result.audio_latents])
    return np.concatenate([np.asarray(a).ravel() for a in arrays])


def float64_reference(model_dir: str, request, steps: int, run_dtype: str) -> np.ndarray:
    """The request's final latents after `steps` steps of one float64 process here, on the
    CPU, from the very initial state a `run_dtype` run draws (Runner's init_dtype), in the
    layout all_latents gives a result (Family.output_latents, flattened). The CPU holds
    float64 weights of the whole pipeline: fine for the small models verify is for."""
    import torch

    from raydit.models.conformance import run_steps
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    pipe = load_pipeline(model_dir, device="cpu", dtype=torch.float64)
    runner = Runner(pipe, device="cpu", dtype=torch.float64, init_dtype=getattr(torch, run_dtype))
    try:
        out = runner.family.output_latents(pipe, run_steps(runner, request, steps))
        streams = out if isinstance(out, tuple) else (out,)
        return np.concatenate([t.to(torch.float64).reshape(-1).numpy() for t in streams])
    finally:
        runner.close()


def format_verify_table(rows: list[dict], rtol: float, atol: float) -> str:
    precision = bool(rows) and rows[0].get("rule") == "precision"
    if precision:
        r0 = rows[0]
        head = [f"final latents in {r0['dtype']}: no fixed tolerance holds there, so each plan's relative L2 error "
                f"against the same request run in float64 here (one process, from the same noise) must be at most {r0['factor']:g}x the one-rank "
                f"{r0['dtype']} run's ({r0['one_rank_error']:.3e}) (raydit.models.precision)",
                f"{'ulysses':>7} {'ring':>4} {'cfg':>3} {'world':>5} {'max |diff|':>12} {'error':>10} {'x 1 rank':>8} "
                f"{'kernel':<24} result"]
    else:
        head = [f"final latents against one rank (pass: |diff| <= {atol:g} + {rtol:g} * |reference|)",
                f"{'ulysses':>7} {'ring':>4} {'cfg':>3} {'world':>5} {'max |diff|':>12} {'kernel':<24} result"]
    lines = head
    for r in rows:
        figures = f"{r['max_abs_diff']:>12.3e}" + (f" {r['error']:>10.3e} {r['ratio']:>8.2f}" if precision else "")
        lines.append(
            f"{r['ulysses']:>7} {r['ring']:>4} {r['cfg']:>3} {r['world_size']:>5} "
            f"{figures} {r['kernel']:<24} {'ok' if r['ok'] else 'OUT OF TOLERANCE'}"
        )
    return "\n".join(lines)
