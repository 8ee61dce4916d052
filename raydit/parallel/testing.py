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
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


class DistributedError(RuntimeError):
    """A child failed with an exception that could not be sent back as itself."""


def _child(fn, rank, world_size, host, port, backend, timeout, threads, args, kwargs, results) -> None:
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensor storages into the bytes (no shared memory that would
        # die with this process).
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
        except Exception:  # noqa: BLE001
            payload = None
        results.put((rank, "error", (payload, text)))


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
            exc_payload, text = payload
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
