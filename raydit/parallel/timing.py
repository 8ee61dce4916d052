"""Timing a call on a device: CUDA events on a GPU, a clock (injectable, for tests) on a CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def call_seconds(fn: Callable[[], object], device: torch.device, warmup: int, iters: int,
                 timer: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of each of `iters` calls after `warmup` ones: CUDA events around each call on a
    GPU (one synchronisation at the end), `timer` (seconds, wall time by default) on a CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) / 1e3 for s, e in pairs]
    times = []
    for _ in range(iters):
        t0 = timer()
        fn()
        times.append(timer() - t0)
    return times


def _seconds(fn: Callable[[], object], device: torch.device, warmup: int, iters: int,
             timer: Callable[[], float]) -> float:
    """Median seconds of one call (call_seconds)."""
    return statistics.median(call_seconds(fn, device, warmup, iters, timer))
