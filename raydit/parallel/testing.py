"""Run a function on N local processes joined in a torch.distributed group (tests, benchmarks).

The parent owns a TCPStore on a free port (port 0: the OS picks, no race), starts N spawned
children that join it, and collects each child's return value. A child's exception is
re-raised in the parent with the child's traceback; nothing waits longer than `timeout`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class DistributedError(RuntimeError):
    """A child failed with an exception that could not be sent back as itself."""


def _report_error(results, rank) -> None:
    # The time of the failure lets the parent blame the first failing rank, not the ranks
    # whose collectives broke because it died.
    failed_at = time.time()
    text = traceback.format_exc()
    exc = sys.exc_info()[1]
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)
    except Exception:  # noqa: BLE001 - an exception that does not survive pickling
        payload = None
    results.put((rank, "error", (failed_at, payload, text)))


def _child(fn, rank, world_size, host, port, backend, timeout, threads, args, kwargs, results) -> None:
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        _report_error(results, rank)
        return
    try:
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensor storages into the bytes (no shared memory that would
        # die with this process).
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001
        _report_error(results, rank)  # before the group is torn down, which breaks peers
    finally:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120,
    threads: int | None = 1,
    **kwargs: Any,
) -> list:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` processes; return values by rank.

    `fn` must be importable (module level); `threads` sets torch's intra-op threads in each child.
    """
    if world_size < 1:
        raise ValueError(f"world_size {world_size} must be >= 1")
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, host, store.port, backend, timeout, threads, args, kwargs, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    env_before = os.environ.get("OMP_NUM_THREADS")
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by spawned children at start
    try:
        for p in procs:
            p.start()
    finally:
        if threads is not None:
            if env_before is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_before

    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout} s")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and not p.is_alive() and p.exitcode != 0]
                if dead:
                    # Give a dying child's queued message a moment to arrive before blaming it.
                    try:
                        rank, status, payload = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise DistributedError(f"ranks {dead} died without a result (exit codes {codes})") from None
                else:
                    continue
            if status == "ok":
                values[rank] = pickle.loads(payload)
                continue
            # Other ranks usually fail right after, from broken collectives: collect for a
            # moment and report the earliest failure.
            errors = [(payload[0], rank, payload[1], payload[2])]
            grace = time.monotonic() + 2.0
            while time.monotonic() < grace and len(errors) + len(values) < world_size:
                try:
                    r, st, pl = results.get(timeout=max(0.0, grace - time.monotonic()))
                except queue_mod.Empty:
                    break
                if st == "error":
                    errors.append((pl[0], r, pl[1], pl[2]))
            _, rank, exc_payload, text = min(errors)
            message = f"rank {rank} of {world_size} failed:\n{text}"
            if exc_payload is not None:
                exc = pickle.loads(exc_payload)
                if hasattr(exc, "add_note"):
                    exc.add_note(message)
                    raise exc
            raise DistributedError(message)
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        del store
    return [values[r] for r in range(world_size)]
