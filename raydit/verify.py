"""`raydit verify`: does every parallel plan give the one-rank video on this cluster?

OpenDiT's authors found their text-token bug by eye (FIELD.md item 5). raydit runs a short
generation on one rank, then on every feasible (ulysses, ring, cfg) up to N ranks on the
same warm actors, and reports the largest difference of the final latents from one rank.
"""

from __future__ import annotations

import math

import numpy as np


def feasible_layouts(heads: int, max_world: int) -> list[tuple[int, int, int]]:
    """All (ulysses, ring, cfg) with ulysses | heads and ulysses*ring*cfg <= max_world."""
    out = []
    for cfg in (1, 2):
        for ulysses in range(1, max_world + 1):
            if heads % ulysses:
                continue
            for ring in range(1, max_world + 1):
                if ulysses * ring * cfg <= max_world:
                    out.append((ulysses, ring, cfg))
    out.sort(key=lambda d: (d[0] * d[1] * d[2], d[2], d[1], d[0]))
    return out


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
) -> list[dict]:
    from raydit.runtime.engine import Engine

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
    with Engine(
        model=model, workers=workers, device=device, address=address, show_plan=False,
        frames=frames, height=height, width=width, grow="never",
    ) as engine:
        kw = dict(
            num_frames=frames, height=height, width=width, num_inference_steps=steps,
            guidance_scale=6.0, seed=1234, progress=False,
        )
        engine.regroup(ulysses=1, ring=1, cfg=1)
        reference = engine.generate(prompt, **kw).latents
        for ulysses, ring, cfg in feasible_layouts(engine.spec.heads, workers):
            engine.regroup(ulysses=ulysses, ring=ring, cfg=cfg)
            latents = engine.generate(prompt, **kw).latents
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
                }
            )
    return rows


def format_verify_table(rows: list[dict], rtol: float, atol: float) -> str:
    lines = [
        f"final latents against one rank (pass: |diff| <= {atol:g} + {rtol:g} * |reference|)",
        f"{'ulysses':>7} {'ring':>4} {'cfg':>3} {'world':>5} {'max |diff|':>12} {'kernel':<24} result",
    ]
    for r in rows:
        lines.append(
            f"{r['ulysses']:>7} {r['ring']:>4} {r['cfg']:>3} {r['world_size']:>5} "
            f"{r['max_abs_diff']:>12.3e} {r['kernel']:<24} {'ok' if r['ok'] else 'OUT OF TOLERANCE'}"
        )
    return "\n".join(lines)
