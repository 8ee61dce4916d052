"""Rank feasible plans, best first.

Predicted step time of the fastest replica (what one request waits per step) decides; step
times within TIE_TOLERANCE (0.5%) count as equal; then throughput (replicas add it), then
fewer pad tokens, then the split (frames, rows, tokens), then fewer devices, then published
practice (TensorRT-LLM, SGLang): cfg parallel first, then Ulysses up to the head limit, then
ring. The cost model decides; the practice only breaks its ties.
"""

from __future__ import annotations

from raydit.planner import cost as costmod
from raydit.planner.plans import Plan

TIE_TOLERANCE = 0.005


def _tie_key(p: Plan, best_throughput: float):
    """Among plans tied on step time: throughput (within TIE_TOLERANCE of the group's best
    counts as the best: one replica's throughput is 1 / its step time, so comparing it
    exactly would break every tie by time again), then less padding, aligned splits, fewer
    devices, then published practice (cfg first, then Ulysses, then ring)."""
    tp = p.throughput_steps_per_second
    behind = tp * (1 + TIE_TOLERANCE) < best_throughput
    return (behind, -tp if behind else 0.0, p.pad_tokens, costmod.SPLIT_ORDER[p.split],
            p.world_size, -p.cfg, -p.ulysses)


def rank_plans(plans) -> list[Plan]:
    """Plans best first. Step time decides, except between plans within TIE_TOLERANCE of the
    fastest plan not yet placed: those form one tie group, ordered by `_tie_key`. (Groups are
    anchored at their fastest member, so two plans 0.1% apart always tie; fixed buckets of
    log time would split them when a bucket boundary fell between them.)"""
    by_time = sorted(plans, key=lambda p: p.predicted_step_seconds)
    ranked: list[Plan] = []
    i = 0
    while i < len(by_time):
        limit = by_time[i].predicted_step_seconds * (1 + TIE_TOLERANCE)
        j = i + 1
        while j < len(by_time) and by_time[j].predicted_step_seconds <= limit:
            j += 1
        best_tp = max(p.throughput_steps_per_second for p in by_time[i:j])
        ranked += sorted(by_time[i:j], key=lambda p: _tie_key(p, best_tp))
        i = j
    return ranked

