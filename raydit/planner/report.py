"""The readable form of a PlanResult: best plan, ranked alternatives, rejections by reason."""

from __future__ import annotations

from raydit.planner.plans import Plan, PlanResult

_PARTS = (("denoise", "denoising"), ("text_encode", "text encoding"), ("decode", "decode"))


def _degrees(p) -> str:
    return f"cfg {p.cfg} x ulysses {p.ulysses} x ring {p.ring} x replicas {p.replicas}"


def _compact(degrees: list[tuple[int, int, int, int]]) -> str:
    """(cfg, ulysses, ring, replicas) tuples as 'cfg/ulysses/ring/replicas' items."""
    shown = ", ".join(f"{c}/{u}/{r}/{k}" for c, u, r, k in degrees[:8])
    return shown + (f", ... ({len(degrees)} layouts)" if len(degrees) > 8 else "")


def _row(i: int, p: Plan) -> str:
    return (f"{i:>4}  {p.cfg:>3} {p.ulysses:>7} {p.ring:>4} {p.replicas:>8} {p.world_size:>5}  "
            f"{p.predicted_step_seconds:>9.4f} {p.throughput_steps_per_second:>9.2f} "
            f"{p.memory_gb_per_gpu:>7.1f}  {p.split:<6} {p.pad_tokens:>5}  {p.kind}")


def _fp8_weights(m) -> str:
    """What of the weights quantize fp8 keeps in one byte (nothing said in bf16)."""
    if not m.fp8_weights:
        return ""
    if not m.fp8_params:
        return f" (its FP8 weights are not counted: priced at {m.bytes_per_param} bytes each)"
    return f" ({m.fp8_params * m.experts / 1e9:.2f} B of them FP8, one byte each)"


def format_plan_table(result: PlanResult, limit: int | None = None) -> str:
    """Best plan with its explanation, then up to `limit` ranked candidates, then every
    rejected layout grouped by reason."""
    m, g, best = result.model, result.geometry, result.best
    cl = result.cluster
    types = ", ".join(f"{sum(n.count for n in cl.nodes if n.device.name == t)} x {t}" for t in cl.types)
    text = (f" + {g.text_tokens} text = {g.sequence_tokens} tokens" if g.text_tokens
            else f" tokens (+ {g.cross_text_tokens} cross-attended text)")
    if g.audio_tokens:
        text += (f" + {g.audio_tokens} audio tokens, "
                 + ("split over the sp ranks" if best.cost.audio_split else "whole on every rank"))
    lines = [
        f"model   {m.name}: {m.heads} heads x {m.head_dim}, {m.layers} layers, "
        f"{m.weight_bytes / 1e9:.1f} GB of weights" + _fp8_weights(m),
        f"request {g.frames} frames x {g.height} x {g.width} -> {g.token_frames} x {g.token_rows} x "
        f"{g.token_cols} patches = {g.video_tokens} video{text}",
        f"cluster {cl.total} devices ({types}) on {len(cl.nodes)} node{'s' if len(cl.nodes) != 1 else ''}; "
        f"guidance {'on' if result.guidance else 'off'}",
        f"rates   mode {result.mode.label}; " + "; ".join(result.rates_sources),
        "",
        f"best    {_degrees(best)} on {best.world_size} devices: "
        f"{best.predicted_step_seconds:.4f} s/step, {best.memory_gb_per_gpu:.1f} GB/device",
        f"        split {best.split}: {best.split_cost}",
    ]
    lines += [f"        {n}" for n in best.notes]
    c = best.cost
    lines.append(f"        step = compute {c.compute:.4f} + all-to-all {c.all_to_all:.4f} + ring exposed "
                 f"{c.ring_exposed:.4f} + edges {c.edges:.4f}"
                 + (f" + audio gather {c.audio_gather:.4f}" if c.audio_gather else "")
                 + (f" + audio exchange {c.audio_exchange:.4f}" if c.audio_exchange else "") + " s"
                 + (f" (compute holds the audio stream's {c.audio_compute:.4f})" if c.audio_compute else ""))
    if best.decode is not None:
        d = best.decode
        lines.append(f"        decode {d.seconds:.3f} s per video on {d.ranks} rank{'s' if d.ranks != 1 else ''} "
                     f"({'latent rows split' if d.ranks > 1 else 'not split'}), peak {d.peak_gb:.2f} GB per rank")
    shown = result.candidates if limit is None else result.candidates[:limit]
    lines += ["", f"feasible ({len(result.candidates)}, ranked by step time, then throughput):",
              "rank  cfg ulysses ring replicas  gpus     step_s   steps/s  GB/dev  split    pad  kind"]
    lines += [_row(i + 1, p) for i, p in enumerate(shown)]
    if len(shown) < len(result.candidates):
        lines.append(f"      ... {len(result.candidates) - len(shown)} more")
    if result.rejected:
        by_reason: dict[str, list] = {}
        for r in result.rejected:
            by_reason.setdefault(r.reason, []).append((r.cfg, r.ulysses, r.ring, r.replicas))
        lines += ["", f"rejected ({len(result.rejected)} layouts, as cfg/ulysses/ring/replicas):"]
        for reason, degs in by_reason.items():
            lines.append(f"  {_compact(degs)}: {reason}")
    return "\n".join(lines)


def request_seconds(result: PlanResult, steps: int, plan: Plan | None = None):
    """One whole request of `steps` steps on `plan` (default: the best) on its first rank's
    device: the steps, the text encoding (one prompt per guidance branch, at most 2, and the
    embeddings' broadcast) and the VAE decode split over the replica's ranks
    (raydit.planner.endtoend.end_to_end). At a few steps the parts around the steps are no longer small."""
    from raydit.planner import cost as costmod
    from raydit.planner.devicemodel import device_elementwise_gb_s
    from raydit.planner.endtoend import end_to_end

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps {steps!r} must be a positive integer")
    plan = plan if plan is not None else result.best
    first = plan.placement[0]
    node = next(n for n in result.cluster.nodes if n.name == first.node)
    ranks = plan.world_size // plan.replicas
    link = costmod.Link(node.intra_gb_s, node.device.link_latency_us, node.intra_kind) if ranks > 1 else None
    return end_to_end(result.model, plan.predicted_step_seconds, steps, result.branches,
                      node.device.flops_per_second, geo=result.geometry, ranks=ranks, link=link,
                      elementwise_gb_s=device_elementwise_gb_s(node.device.name))


def request_shares(e2e) -> dict:
    """{part: its share of the request's seconds} for the denoising steps, text encoding, decode."""
    total = e2e.total or 1.0
    return {key: getattr(e2e, key) / total for key, _ in _PARTS}


def format_request_line(result: PlanResult, steps: int) -> str:
    """One line: the whole request on the best plan and each part's share."""
    e2e = request_seconds(result, steps)
    shares = request_shares(e2e)
    branches = "guidance off: 1 branch" if result.branches == 1 else f"{result.branches} guidance branches"
    parts = " + ".join(f"{label} {getattr(e2e, key):.3g} s ({shares[key]:.0%})" for key, label in _PARTS)
    return f"whole request, {steps} steps ({branches}) on the best plan: {e2e.total:.3g} s = {parts}"
