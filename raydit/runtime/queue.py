"""The request queue: requests in submission order to the fastest idle replica, each
exactly once, and none lost while any capacity is left.

A replica that cannot finish a request (its ranks are gone and nothing is free) hands it
back with its progress (`HandBack`); the request goes to the front of the queue, another
replica resumes it from its last checkpoint, and the replica that gave it back leaves
rotation until a repair makes it whole again (repairs are tried whenever a request waits).
A request fails for want of capacity only when no replica is running, none can be
repaired, and so none ever could run it.

Durable progress: with a checkpoint directory, the request and each finished step's
checkpoint are written atomically to `DIR/progress.pt` (`save_progress`), so a job
resubmitted after its driver died finishes with the same latents (`load_progress`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from raydit.runtime.controller import NO_CAPACITY, Job
from raydit.runtime.errors import HandBack, NoCapacity

PROGRESS_FILE = "progress.pt"
# What `execute` returns when it has set the item's future itself (a batch resolves each of its
# requests as it leaves).
RESOLVED = type("Resolved", (), {"__repr__": lambda self: "RESOLVED"})()


@dataclass
class Item:
    """One queued request and what it has done so far (`job` moves between replicas)."""

    request: Any
    future: Future
    callback: Callable | None = None
    progress: bool = False
    checkpoint_dir: str | None = None
    job: Job | None = None
    first_event: int = 0
    t_start: float = 0.0
    handbacks: list = field(default_factory=list)  # reasons, in order
    started: bool = False  # the future is marked running (it can no longer be cancelled)
    queued_at: float = field(default_factory=time.monotonic)  # when it joined the queue
    tag: str = ""  # the request's name in results (step-level batching: whom it shared steps with)
    batched_with: list = field(default_factory=list)  # the tags of the requests it shared a step with
    on_start: Callable | None = None  # called when a replica starts it (submit's on_start)


class Dispatcher:
    """Hands each item to `runner.run(replica, item, queue)` (the Engine's RequestRunner; the
    queue is this dispatcher, which batch partners are taken from) on a thread per running
    replica.

    `replicas`: objects with `index`, `busy`, `in_rotation` and `plan` (the fastest idle
    one, by predicted step time, goes first). `repair(replica) -> bool` tries to make an
    out-of-rotation replica whole. `capacity()` describes what is left, for the message
    when nothing is.
    """

    def __init__(self, replicas: list, runner: Any, repair: Callable, capacity: Callable[[], str],
                 retry_repair_s: float = 2.0):
        self.replicas = replicas
        self._runner = runner
        self._repair = repair
        self._capacity = capacity
        self.retry_repair_s = retry_repair_s
        self.cond = threading.Condition()
        self._items: deque[Item] = deque()
        self._thread: threading.Thread | None = None
        self._running: list[threading.Thread] = []
        self._closing = False

    def put(self, item: Item) -> Future:
        with self.cond:
            if self._closing:
                raise RuntimeError("engine is shutting down; create a new Engine")
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="raydit-dispatch", daemon=True)
                self._thread.start()
            self.cond.notify_all()
        return item.future

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        last_repair = 0.0
        while True:
            with self.cond:
                while not self._closing and not self._items:
                    self.cond.wait()
                if self._closing:
                    return
                item = self._items[0]
                if not item.started and item.future.cancelled():
                    self._items.popleft()  # cancelled while it waited
                    continue
                idle = [r for r in self.replicas if not r.busy and r.in_rotation]
                broken = [r for r in self.replicas if not r.busy and not r.in_rotation]
                running = any(r.busy for r in self.replicas)
                if not idle and broken and (not running or time.monotonic() - last_repair >= self.retry_repair_s):
                    for r in broken:
                        r.busy = True  # repairing: nobody else touches it
                else:
                    broken = []
                if idle:
                    # Running (no longer cancellable) only once a replica takes it: a request
                    # at the head of the queue, waiting for one, can still be cancelled.
                    if not item.started:
                        if not item.future.set_running_or_notify_cancel():
                            self._items.popleft()  # cancelled before it ran
                            continue
                        item.started = True
                    replica = min(idle, key=lambda r: (r.plan.predicted_step_seconds, r.index))
                    replica.busy = True
                    self._items.popleft()
                    self._start(replica, item)
                    continue
                if not broken:
                    if running:
                        self.cond.wait(timeout=self.retry_repair_s)
                        continue
                    self._items.popleft()
                    if item.started or item.future.set_running_or_notify_cancel():
                        item.future.set_exception(self._no_capacity(item))
                    continue
            # Repairs start actors and form groups (seconds): outside the lock.
            last_repair = time.monotonic()
            for r in broken:
                try:
                    whole = bool(self._repair(r))
                except Exception:
                    whole = False
                with self.cond:
                    r.in_rotation = whole
                    r.busy = False
                    self.cond.notify_all()
            with self.cond:
                if (not any(r.in_rotation for r in self.replicas) and not any(r.busy for r in self.replicas)
                        and self._items and self._items[0] is item):
                    self._items.popleft()
                    item.future.set_exception(self._no_capacity(item))

    # -- step-level batching -------------------------------------------------------------

    def take_matching(self, match: Callable[[Any], bool], n: int, passing: bool = True) -> list[Item]:
        """Up to `n` queued items whose request `match`es, in queue order, taken out of the
        queue and marked running (a cancelled one is dropped): they join a running batch.
        `passing` False: only those ahead of the first waiting item that does not match."""
        taken: list[Item] = []
        with self.cond:
            if self._closing:
                return taken
            for item in list(self._items):
                if len(taken) >= n:
                    break
                if not match(item.request):
                    if not passing and (item.started or not item.future.cancelled()):
                        break  # it waits for a replica: nobody passes it
                    continue
                self._items.remove(item)
                if not item.started:
                    if not item.future.set_running_or_notify_cancel():
                        continue  # cancelled while it waited
                    item.started = True
                taken.append(item)
        return taken

    def hand_back(self, items: list[Item]) -> None:
        """Items a batch could not finish go back to the front of the queue, in order."""
        with self.cond:
            for item in reversed(items):
                if self._closing:
                    item.future.set_exception(RuntimeError("engine shut down before the request finished"))
                else:
                    self._items.appendleft(item)
            self.cond.notify_all()

    # -- replicas that follow the queue (Engine's autoscaler) ------------------------------

    def oldest_wait(self) -> float:
        """Seconds the longest-waiting queued request has waited (0.0: none waits)."""
        with self.cond:
            if not self._items:
                return 0.0
            return time.monotonic() - min(item.queued_at for item in self._items)

    def add_replica(self, replica) -> None:
        """A new replica joins the rotation; queued requests may start on it at once."""
        with self.cond:
            self.replicas.append(replica)
            self.cond.notify_all()

    def take_idle_replica(self, idle_s: float, keep: int):
        """Take out of the rotation, and return, a replica idle for `idle_s` seconds or more
        while nothing waits, when more than `keep` are in rotation; None otherwise."""
        with self.cond:
            if self._items or self._closing:
                return None
            serving = [r for r in self.replicas if r.in_rotation]
            if len(serving) <= keep:
                return None
            now = time.monotonic()
            idle = [r for r in serving if not r.busy and now - r.idle_since >= idle_s]
            if not idle:
                return None
            replica = max(idle, key=lambda r: (r.plan.predicted_step_seconds, r.index))  # the slowest goes
            self.replicas.remove(replica)
            return replica

    def _no_capacity(self, item: Item) -> NoCapacity:
        step = f" at step {item.job.step_index}" if item.job is not None and item.job.prepared else ""
        try:
            left = self._capacity()
        except Exception as exc:  # the cluster could not be asked: the answer must still be given
            left = f"what is left is unknown: {type(exc).__name__}: {exc}"
        return NoCapacity(f"request stopped{step}: {NO_CAPACITY} ({left})")

    def _start(self, replica, item: Item) -> None:
        t = threading.Thread(target=self._run_on, args=(replica, item), name=f"raydit-replica-{replica.index}",
                             daemon=True)
        self._running = [x for x in self._running if x.is_alive()] + [t]
        t.start()

    def _run_on(self, replica, item: Item) -> None:
        handed_back, outcome = False, None
        try:
            result = self._runner.run(replica, item, self)
        except HandBack as exc:
            handed_back = True
            item.handbacks.append(f"replica {replica.index}: {exc.reason}")
        except BaseException as exc:  # the caller of .result() sees it
            outcome = (False, exc)
        else:
            if result is not RESOLVED:
                outcome = (True, result)
        self._idle(replica, item, handed_back)
        # Answered once the replica is idle again: whoever sees the result (and submits the
        # next request at once, or reads `busy`) sees the replica free.
        if outcome is not None and not item.future.done():
            ok, value = outcome
            if ok:
                item.future.set_result(value)
            else:
                item.future.set_exception(value)

    def _idle(self, replica, item: Item, handed_back: bool) -> None:
        with self.cond:
            replica.busy = False
            replica.idle_since = time.monotonic()
            if handed_back:
                replica.in_rotation = False
                if item.future.done():
                    pass  # it finished in a batch before the batch was handed back
                elif self._closing:
                    item.future.set_exception(RuntimeError("engine shut down before the request finished"))
                else:
                    self._items.appendleft(item)
            self.cond.notify_all()

    # -- lifetime ------------------------------------------------------------------------

    def close(self, join_s: float = 120.0) -> None:
        """Cancel queued requests, let running ones finish, stop the loop."""
        with self.cond:
            self._closing = True
            while self._items:
                item = self._items.popleft()
                if not item.started:
                    item.future.cancel()
                elif not item.future.done():  # handed back with its progress: it ran, unfinished
                    item.future.set_exception(RuntimeError("engine shut down before the request finished"))
            self.cond.notify_all()
        me = threading.current_thread()
        for t in [self._thread, *self._running]:
            if t is not None and t is not me:
                t.join(timeout=join_s)


# -- durable progress ----------------------------------------------------------------------


def model_identity(model_dir: str) -> dict:
    """What a checkpoint records of the model that wrote it: the pipeline class (model_index.json's
    `_class_name`) and a digest of model_index.json and transformer/config.json (a file absent
    counts as absent). Another model's latents resumed here would decode into garbage."""
    import hashlib
    import json

    root = Path(model_dir)
    digest = hashlib.sha256()
    pipeline = None
    for name in ("model_index.json", "transformer/config.json"):
        f = root / name
        data = f.read_bytes() if f.is_file() else b""
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        if name == "model_index.json" and data:
            try:
                pipeline = json.loads(data).get("_class_name")
            except ValueError:
                pipeline = None
    return {"pipeline": pipeline, "digest": digest.hexdigest()[:16], "path": str(root)}


def next_request_dir(root: str, n: int = 1) -> str:
    """A new ROOT/request-NNNN for an engine's n-th request: numbered after the highest one
    already in ROOT (another engine's, perhaps one that crashed with a request unfinished) and
    created here (mkdir fails on one that exists), so no directory is ever reused."""
    import re

    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    taken = [int(m.group(1)) for e in os.listdir(base) if (m := re.fullmatch(r"request-(\d+)", e))]
    k = max(n, max(taken, default=0) + 1)
    while True:
        path = base / f"request-{k:04d}"
        try:
            path.mkdir()
            return str(path)
        except FileExistsError:  # claimed meanwhile by another engine on the same root
            k += 1


def save_progress(directory: str, request, checkpoint: dict | None, model: dict | None = None) -> Path:
    """Write the request and its last finished step atomically (a temporary file renamed
    into place): a reader sees the previous step or this one, never half of one. `model`:
    `model_identity` of the model that runs it, checked by Engine.resume."""
    import torch

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    target = path / PROGRESS_FILE
    tmp = path / f".{PROGRESS_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
    data = {"version": 1, "request": request, "checkpoint": checkpoint}
    if model is not None:
        data["model"] = model
    torch.save(data, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    return target


def _safe_globals() -> list:
    """What a progress file may name beyond weights_only's defaults (tensors, dicts, lists,
    tuples, numbers, strings, bytes): the request's class, and NumPy arrays and scalars (a
    scheduler's state may hold them). Nothing that can run code when unpickled."""
    import numpy as np

    from raydit.models.requests import GenerationRequest

    try:
        from numpy._core import multiarray
    except ImportError:  # NumPy 1.x
        from numpy.core import multiarray
    dtypes = {type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDGUSV"}
    return [GenerationRequest, multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def _check_zip(target: Path) -> None:
    """torch.load reads the zip's members without checking their CRCs: a flipped byte in the
    latents would resume into a wrong video. Check every member's CRC first."""
    import zipfile

    try:
        with zipfile.ZipFile(target) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ValueError(f"{target}: not a raydit progress file ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # a damaged header: zlib.error, struct.error, ...
        raise ValueError(f"{target}: corrupted: {type(exc).__name__}: {exc}; start the request again "
                         "without --resume (or with another checkpoint directory)") from None
    if bad is not None:
        raise ValueError(f"{target}: corrupted: {bad} fails its CRC check; the file was damaged after it was "
                         "written, so its progress cannot be trusted: start the request again without --resume "
                         "(or with another checkpoint directory)")


def load_progress(directory: str, with_model: bool = False):
    """(request, checkpoint or None) from `save_progress`'s file; ValueError when absent,
    damaged (every zip member's CRC is checked) or not one. `with_model`: (request,
    checkpoint, model identity or None: a file written before it was recorded).
    Loaded with weights_only=True: a crafted file cannot run code here."""
    import torch

    target = Path(directory) / PROGRESS_FILE
    if not target.is_file():
        raise ValueError(f"no saved progress in {str(directory)!r} (no {PROGRESS_FILE}); "
                         "give the directory a run wrote with --checkpoint-dir")
    _check_zip(target)
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            data = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as exc:
        import re

        text = " ".join(str(exc).split())
        unsafe = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", text)
        if unsafe:  # weights_only's refusal: the file names something that could run code
            text = f"it names {unsafe.group(1)}, which a progress file never holds; not loaded"
        raise ValueError(f"{target}: not a raydit progress file ({type(exc).__name__}: {text[:300]})") from None
    if not isinstance(data, dict) or data.get("version") != 1 or "request" not in data:
        raise ValueError(f"{target}: not a raydit progress file")
    if with_model:
        return data["request"], data["checkpoint"], data.get("model")
    return data["request"], data["checkpoint"]
