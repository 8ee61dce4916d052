"""The video service: a bounded queue in front of an `Engine`, durable status, metrics.

Independent of HTTP: the Serve deployment (raydit.serve.app) calls `create`, `get`,
`list`, `delete`, `metrics_text`; everything here is thread-safe.

The service keeps its own queue and hands the engine at most two requests per engine
replica slot (a replica runs one request, or up to --max-batch with step-level batching):
one running and one waiting in the engine's own queue, so a replica starts its next request
(or a batch takes a joiner at its next step) with no round trip through this service. A
request is `queued` while it waits here or in the engine's queue (a DELETE drops it: here,
or by cancelling its engine future), also while it waits there for a batch of its own
geometry, and `in_progress` once a replica starts it (the engine's `on_start`).
A running request reports each finished step
through the engine's `callback_on_step_end` (progress, the step counter); a DELETE flags it
and the same callback raises at its next step, which ends the request and frees its
replica. Rank and node loss underneath are the engine's business (it re-plans and resumes
from the last step); the service only counts the recoveries.

Finished videos are encoded to mp4 on a writer thread, so a replica starts its next
request while the previous video is still being written. The encode is background work
beside the ranks' host threads on the same machine: the writer thread runs at a lower
scheduling priority (Linux: its own nice value, which the ffmpeg process it starts
inherits), so a busy core goes to a rank first.
"""

from __future__ import annotations

import asyncio
import collections
import io
import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass

from raydit.runtime.options import submit_signature
from raydit.serve.schema import Limits, RequestError
from raydit.serve.store import FINISHED, VideoJob, VideoStore, new_id, valid_id

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REQUEST_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


def running_mean(mean: float | None, x: float) -> float:
    """The service's running means (a request's run, a denoising step): recent values weigh
    a fifth each."""
    return x if mean is None else 0.8 * mean + 0.2 * x


# Bounds of the poll interval advised to clients (`poll_interval_ms`).
POLL_MIN_MS, POLL_MAX_MS = 250, 10_000
# The longest a GET may hold its answer until the video finishes (`wait_finished`).
MAX_WAIT_S = 60.0
_SUBMIT_KEYWORDS = tuple(submit_signature().parameters)[1:]


def poll_interval_ms(status: str, step_s: float | None, wait_s: float | None = None) -> int | None:
    """How long a client should wait before asking about a video again, sent as OpenAI's
    `openai-poll-after-ms` header (the openai client's videos.poll / create_and_poll follow it
    and otherwise ask every second): one denoising step while the video runs (its progress
    changes once a step), a tenth of its expected wait while it is queued but never less than
    a step; within POLL_MIN_MS..POLL_MAX_MS. None once it is finished, or while no step has
    been timed yet (the client's own default then applies)."""
    if status in FINISHED or step_s is None:
        return None
    seconds = step_s if status == "in_progress" else max(step_s, (wait_s or 0.0) / 10)
    return int(min(POLL_MAX_MS, max(POLL_MIN_MS, round(seconds * 1000))))


# Added to the writer thread's nice value, capped at 19: from 0 to 10 its share of a core it
# contends for falls to about a tenth; in a Ray worker (started at 15) it goes to 19.
WRITER_NICE = 10


def lower_thread_priority(increment: int) -> bool:
    """Raise the calling thread's nice value by `increment` (Linux only, where a thread id
    names the thread alone; elsewhere the same call would renice a whole process, so it is
    skipped). Returns whether the priority was lowered. Never raises."""
    if not sys.platform.startswith("linux") or increment <= 0:
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        return True
    except OSError:
        return False


class RequestStopped(Exception):
    """Raised from the step callback to end a request early (deleted, or server stopping)."""


@dataclass
class _Running:
    job: VideoJob
    stop: str | None = None  # "deleted" | "shutdown"
    submitted: float = 0.0
    future: object | None = None  # the engine's Future, once submitted
    last_step: float | None = None  # time.monotonic() of its last finished step
    started: bool = False  # a replica started it (the engine's on_start): in_progress


class VideoService:
    @property
    def capacity(self) -> int:
        """Replicas serving now (the engine's, which may follow the queue; or as given)."""
        if self._fixed_capacity:
            return self._fixed_capacity
        # Step-level batching: a replica runs up to max_batch requests at once.
        batch = max(1, int(getattr(self.engine, "max_batch", 1) or 1))
        return max(1, len(getattr(self.engine, "replicas", []) or [1])) * batch

    def __init__(self, engine, store: VideoStore, limits: Limits, max_queue: int = 64,
                 capacity: int | None = None):
        self.engine = engine
        self.store = store
        self.limits = limits
        self.max_queue = max_queue
        self._fixed_capacity = capacity
        # Requests handed to the engine at once: one running and one waiting per replica slot it
        # may have (an engine whose replicas follow the queue adds one when requests wait in
        # its own queue, so they must reach it; with step-level batching a replica has max_batch).
        batch = max(1, int(getattr(engine, "max_batch", 1) or 1))
        self.depth = 2 * max(self.capacity, int(getattr(engine, "max_replicas", 0) or 0) * batch)
        self._cond = threading.Condition()
        self._jobs: dict[str, VideoJob] = {}
        # Long-polling GETs, by video id: (their event loop, the event that wakes them).
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._queue: collections.deque[str] = collections.deque()
        self._running: dict[str, _Running] = {}
        self._closing = False
        self._mean_request_s: float | None = None
        self._step_s: float | None = None  # running mean of a denoising step's seconds
        self._accepts_image = bool(getattr(engine, "takes_image", False))
        self._metrics = _Metrics(self)
        self.notes: list[str] = []
        jobs, self.notes = store.load_all()
        for job in jobs:
            self._jobs[job.id] = job
            if job.status in ("queued", "in_progress"):
                # Interrupted by a restart: run it again from the start.
                job.status, job.progress = "queued", 0
                self._queue.append(job.id)
        self._writes: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="raydit-serve-writer", daemon=True)
        self._writer.start()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="raydit-serve-dispatch", daemon=True)
        self._dispatcher.start()

    @property
    def accepts_image(self) -> bool:
        return self._accepts_image

    # -- requests --------------------------------------------------------------------------

    def create(self, params: dict, image_png: bytes | None = None) -> VideoJob:
        """Queue a checked request (schema.resolve's parameters). Raises RequestError 429
        with Retry-After when the queue is full."""
        if image_png is not None and not self._accepts_image:
            raise RequestError(
                f"input_reference: model {self.limits.model!r} is a text-to-video pipeline and takes "
                "no image", param="input_reference",
            )
        if image_png is None and self._accepts_image:
            raise RequestError(
                f"input_reference: model {self.limits.model!r} is an image-to-video pipeline; upload "
                "the first frame as input_reference", param="input_reference",
            )
        job = VideoJob(id=new_id(), model=self.limits.model, prompt=params["prompt"], params=dict(params),
                       fps=self.limits.fps, has_image=image_png is not None)
        with self._cond:
            if self._closing:
                raise RequestError("the server is shutting down", status=503, code="unavailable")
            waiting = self._waiting_locked()
            idle = self.capacity - self._started_locked()
            # max_queue counts requests that wait; those an idle replica takes at once do not.
            if waiting >= self.max_queue + max(0, idle):
                self._metrics.rejected.inc()
                retry = self._retry_after_locked()
                raise RequestError(
                    f"the queue is full ({waiting} request(s) waiting, --max-queue {self.max_queue}); "
                    f"retry in about {retry} s",
                    status=429, code="queue_full", headers={"Retry-After": str(retry)},
                )
            if image_png is not None:
                self.store.save_image(job.id, image_png)
            self.store.save(job)
            self._jobs[job.id] = job
            self._queue.append(job.id)
            self._cond.notify_all()
        return job

    def get(self, video_id: str) -> VideoJob | None:
        if not valid_id(video_id):
            return None
        with self._cond:
            return self._jobs.get(video_id)

    def video_object(self, job: VideoJob) -> dict:
        """The video object of `job` as one moment saw it: its status, progress and completion
        time change together under the lock (read without it, a poll could see `completed`
        with no completed_at)."""
        with self._cond:
            return job.to_object()

    def video_state(self, job: VideoJob) -> tuple[dict, int | None]:
        """`job`'s video object and the poll interval to advise with it, read at one moment
        (an unfinished object with its interval; a finished one with none)."""
        with self._cond:
            return job.to_object(), self.poll_after_ms(job)

    def list(self, after: str | None = None, limit: int = 20, order: str = "desc") -> tuple[list[VideoJob], bool]:
        with self._cond:
            jobs = sorted(self._jobs.values(), key=lambda j: (j.created_at, j.id), reverse=order == "desc")
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise RequestError(f"after: no video with id {after!r}", param="after", status=404,
                                   code="not_found")
            jobs = jobs[ids.index(after) + 1:]
        return jobs[:limit], len(jobs) > limit

    def delete(self, video_id: str) -> bool:
        """Remove a video: a queued request leaves the queue, a running one stops at its next
        step (its replica is then free), a finished one's files are deleted."""
        with self._cond:
            job = self._jobs.pop(video_id, None) if valid_id(video_id) else None
            if job is None:
                return False
            if video_id in self._running:
                run = self._running[video_id]
                run.stop = "deleted"
                if run.future is not None and job.status == "queued":
                    run.future.cancel()  # still in the engine's queue: it never starts
            else:
                try:
                    self._queue.remove(video_id)
                except ValueError:
                    pass
            self._metrics.requests.labels("deleted").inc()
            self.store.delete(video_id)
            self._wake_locked(video_id)
        return True

    async def wait_finished(self, video_id: str, timeout_s: float) -> None:
        """Return once the video is finished (completed or failed), deleted, or the server
        is closing, or after `timeout_s`: a long poll, so that a client learns of the end at
        once and asks once instead of every poll interval. Runs on the caller's event loop;
        the writer and request threads wake it."""
        if timeout_s <= 0:
            return
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            job = self._jobs.get(video_id)
            if job is None or job.status in FINISHED or self._closing:
                return
            self._waiters.setdefault(video_id, []).append((loop, event))
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._cond:
                waiting = self._waiters.get(video_id, [])
                if (loop, event) in waiting:
                    waiting.remove((loop, event))
                if not waiting:
                    self._waiters.pop(video_id, None)

    def _wake_locked(self, video_id: str | None = None) -> None:
        """Wake the long polls on `video_id` (all of them when None)."""
        ids = list(self._waiters) if video_id is None else [video_id]
        for vid in ids:
            for loop, event in self._waiters.pop(vid, []):
                try:
                    loop.call_soon_threadsafe(event.set)
                except RuntimeError:  # that loop is closed: nobody waits there any more
                    pass

    def poll_after_ms(self, job: VideoJob) -> int | None:
        """The poll interval to advise for `job` (poll_interval_ms), from the running mean
        of a step and, while it waits, the requests ahead of it."""
        with self._cond:
            wait = None
            if job.status == "queued" and self._mean_request_s is not None:
                waiting = [vid for vid, run in self._running.items() if not run.started] + list(self._queue)
                ahead = waiting.index(job.id) if job.id in waiting else 0
                # The running requests finish first, then those ahead, `capacity` at a time.
                wait = self._mean_request_s * (ahead // self.capacity + 1)
            return poll_interval_ms(job.status, self._step_s, wait)

    def retry_after(self) -> int:
        with self._cond:
            return self._retry_after_locked()

    def _retry_after_locked(self) -> int:
        mean = self._mean_request_s or 5.0
        ahead = len(self._queue) + len(self._running)
        return int(min(3600, max(1, math.ceil(mean * max(1, ahead) / self.capacity))))

    # -- running -----------------------------------------------------------------------------

    def _started_locked(self) -> int:
        """Requests the engine runs now (a replica started them: submit's on_start)."""
        return sum(1 for run in self._running.values() if run.started)

    def _waiting_locked(self) -> int:
        """Requests waiting: here, and in the engine's queue (for a replica, or for a batch of
        their own geometry while one of another runs)."""
        return len(self._queue) + len(self._running) - self._started_locked()

    def _on_start(self, run: _Running) -> None:
        """A replica started `run` (the engine's on_start, on its thread): in_progress from now."""
        with self._cond:
            if run.started:
                return  # resumed after a hand-back: it was running already
            run.started = True
            run.submitted = time.time()  # the request's own run time starts here
            if run.job.status == "queued" and run.stop is None and run.job.id in self._jobs:
                run.job.status, run.job.progress = "in_progress", 0
                self.store.save(run.job, durable=False)

    def _dispatch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing and (not self._queue or len(self._running) >= self.depth):
                    self._cond.wait()
                if self._closing:
                    return
                job = self._jobs[self._queue.popleft()]
                run = _Running(job=job, submitted=time.time())
                self._running[job.id] = run
            try:
                future = self.engine.submit(**self._submit_args(run))
            except Exception as exc:  # refused by the engine (e.g. a layout it cannot run)
                self._writes.put((run, None, exc))  # before the release, as _on_done
                self._release(run)
                continue
            with self._cond:
                run.future = future
                if run.stop is not None:
                    future.cancel()  # deleted, or the server began to stop, while it was being submitted
            future.add_done_callback(lambda f, run=run: self._on_done(run, f))

    def _submit_args(self, run: _Running) -> dict:
        """The video's parameters (Engine.submit's keywords, as raydit.serve.schema.resolve made
        them; cache only where the body set it, else the engine's) and the service's hooks."""
        p = run.job.params
        args = {k: p[k] for k in _SUBMIT_KEYWORDS if k in p}
        if "guidance_options" in args and not args["guidance_options"]:
            args["guidance_options"] = None  # no knob given: the family's defaults
        args.update(progress=False, tag=run.job.id, on_start=lambda: self._on_start(run),
                    callback_on_step_end=lambda engine, step, timestep, kwargs: self._on_step(
                        run, step, kwargs.get("num_steps")))
        if run.job.has_image:
            from PIL import Image

            with open(self.store.image_path(run.job.id), "rb") as f:
                args["image"] = Image.open(io.BytesIO(f.read())).convert("RGB")
        return args

    def _on_step(self, run: _Running, step: int, num_steps: int | None = None) -> None:
        """Runs on the driver after every finished step (diffusers' callback convention);
        `num_steps`: the steps the request runs in all (diffusion forcing: more than
        num_inference_steps), else num_inference_steps."""
        self._metrics.steps.inc()
        now = time.monotonic()
        if run.last_step is not None:  # the first step's time includes the request's start
            self._step_s = running_mean(self._step_s, now - run.last_step)
        run.last_step = now
        if run.stop is not None:
            raise RequestStopped(run.stop)
        if not run.started:  # an engine that says no on_start
            self._on_start(run)
        total = num_steps or run.job.params["num_inference_steps"]
        # 100 is kept for when the mp4 is on disk.
        run.job.progress = min(99, int(100 * (step + 1) / total))
        return None

    def _release(self, run: _Running) -> None:
        with self._cond:
            self._running.pop(run.job.id, None)
            self._cond.notify_all()

    def _on_done(self, run: _Running, future) -> None:
        # Runs on the engine's thread: free the slot at once, write the video elsewhere. Queued
        # for the writer before the release: close() ends the writer once nothing runs, so an
        # outcome queued after that would never be stored.
        exc = future.exception() if not future.cancelled() else RequestStopped("cancelled")
        self._writes.put((run, None if exc else future.result(), exc))
        self._release(run)

    def _write_loop(self) -> None:
        lower_thread_priority(WRITER_NICE)
        while True:
            item = self._writes.get()
            if item is None:
                return
            run, result, exc = item
            try:
                self._finish(run, result, exc)
            except Exception as err:  # never let one video stop the writer
                self._fail(run.job, "write_failed", f"could not store the video: {err}")

    def _finish(self, run: _Running, result, exc) -> None:
        job = run.job
        if run.stop == "deleted":
            if run.started:  # a DELETE of one still queued stopped nothing that ran
                self._metrics.cancelled.inc()
            self.store.delete(job.id)  # anything written meanwhile
            return
        if run.stop == "shutdown" and exc is not None:  # stopped (or never started): kept for the next start
            with self._cond:
                job.status, job.progress = "queued", 0
                self.store.save(job)
            return
        if exc is not None:
            code = "invalid_request" if isinstance(exc, ValueError) else "generation_failed"
            self._fail(job, code, " ".join((str(exc) or type(exc).__name__).split()))
            return
        self.store.write_video(job.id, result.frames, job.fps, audio=getattr(result, "audio", None))
        timings = result.timings
        recoveries = len(timings.get("recovery_seconds", []) or [])
        for s in timings.get("step_seconds", []):
            self._metrics.step_seconds.observe(s)
        if self._step_s is None and timings.get("step_seconds"):  # 1-step requests time no step apart
            self._step_s = sum(timings["step_seconds"]) / len(timings["step_seconds"])
        self._metrics.recoveries.inc(recoveries)
        if getattr(result, "batched_with", None):
            self._metrics.batched.inc()
        with self._cond:
            if job.id not in self._jobs:  # deleted while its mp4 was being written
                self.store.delete(job.id)
                return
            job.info = {
                "frames": int(result.frames.shape[0]),
                "plan": {"ulysses": result.plan.ulysses, "ring": result.plan.ring, "cfg": result.plan.cfg,
                         "world_size": result.plan.world_size},
                "replica": int(getattr(result, "replica", 0)),
                "batched_with": list(getattr(result, "batched_with", []) or []),  # videos it shared steps with
                "recoveries": recoveries,
                "timings": {k: round(float(v), 4) for k, v in timings.items() if isinstance(v, (int, float))},
            }
            if recoveries:  # every request of a batch records the recovery it went through
                job.info["timings"]["recovery_seconds"] = round(float(sum(timings["recovery_seconds"])), 4)
            job.status, job.progress, job.completed_at = "completed", 100, time.time()
            self.store.save(job)
            self._wake_locked(job.id)
            seconds = job.completed_at - run.submitted
            self._mean_request_s = running_mean(self._mean_request_s, seconds)
        self._metrics.requests.labels("completed").inc()
        self._metrics.request_seconds.observe(job.completed_at - job.created_at)

    def _fail(self, job: VideoJob, code: str, message: str) -> None:
        with self._cond:
            job.status, job.error, job.completed_at = "failed", {"code": code, "message": message}, time.time()
            if job.id in self._jobs:
                self.store.save(job)
            self._wake_locked(job.id)
        self._metrics.failures.inc()
        self._metrics.requests.labels("failed").inc()

    # -- information -------------------------------------------------------------------------

    def counts(self) -> dict:
        with self._cond:
            return {"queued": self._waiting_locked(), "in_progress": self._started_locked(), "videos": len(self._jobs)}

    def metrics_text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self._metrics.registry), CONTENT_TYPE_LATEST

    # -- lifetime ----------------------------------------------------------------------------

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop taking requests; running ones stop at their next step and are kept as queued
        (a restarted server runs them again); then the writer drains and the long polls
        (wait_finished) are answered."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            for run in list(self._running.values()):  # a cancel below releases its run at once
                run.stop = "shutdown"
                if run.future is not None and run.job.status == "queued":
                    run.future.cancel()  # never started: kept as queued for the next start
            self._cond.notify_all()
        deadline = time.time() + timeout_s
        with self._cond:
            while self._running and time.time() < deadline:
                self._cond.wait(timeout=0.5)
        self._writes.put(None)
        self._writer.join(timeout=max(1.0, deadline - time.time()))
        with self._cond:  # the long polls see each video as it is kept (stopped ones: queued)
            self._wake_locked()


class _ReplicaLayouts:
    """raydit_replica_layout{replica, ulysses, ring, cfg, world_size} 1 for every replica the
    engine has at the scrape (they may follow the queue), 0 for none."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("raydit_replica_layout", "Each engine replica and its parallel layout",
                                   labels=["replica", "ulysses", "ring", "cfg", "world_size"])
        for r in list(getattr(self.engine, "replicas", []) or []):
            plan = getattr(r, "plan", None)
            if plan is None:
                continue
            family.add_metric([str(r.index), str(plan.ulysses), str(plan.ring), str(plan.cfg),
                               str(plan.ulysses * plan.ring * plan.cfg)], 1.0)
        yield family
        batch = GaugeMetricFamily("raydit_replica_batch", "Requests in each replica's running batch (step-level "
                                  "batching; 1: one alone, 0: idle)", labels=["replica"])
        for r in list(getattr(self.engine, "replicas", []) or []):
            batch.add_metric([str(r.index)], float(getattr(r, "batch_size", 0)))
        yield batch


class _Metrics:
    """Prometheus metrics in a registry of the service's own."""

    def __init__(self, service: VideoService):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        # Read under the service's lock (counts()): a scrape runs beside the threads that
        # change the queue and the running requests.
        Gauge("raydit_queue_length", "Requests waiting for a replica", registry=r).set_function(
            lambda: service.counts()["queued"])
        Gauge("raydit_requests_in_flight", "Requests running on the engine", registry=r).set_function(
            lambda: service.counts()["in_progress"])
        Gauge("raydit_replicas", "Engine replicas serving the queue", registry=r).set_function(
            lambda: service.capacity)
        r.register(_ReplicaLayouts(service.engine))
        self.requests = Counter("raydit_requests", "Requests by outcome", ["status"], registry=r)
        self.rejected = self.requests.labels("rejected_queue_full")
        self.cancelled = Counter("raydit_cancelled_running", "Running requests stopped by a DELETE", registry=r)
        self.failures = Counter("raydit_failures", "Requests that failed", registry=r)
        self.recoveries = Counter("raydit_recoveries", "Recoveries from lost ranks, counted per request "
                                  "(a regroup under a batch of n requests counts n)", registry=r)
        self.steps = Counter("raydit_denoise_steps", "Denoising steps finished", registry=r)
        self.batched = Counter("raydit_batched_requests", "Requests that shared denoising steps with others",
                               registry=r)
        self.step_seconds = Histogram("raydit_step_seconds", "Seconds per denoising step", buckets=STEP_BUCKETS,
                                      registry=r)
        self.request_seconds = Histogram("raydit_request_seconds", "Seconds from POST to a stored video",
                                         buckets=REQUEST_BUCKETS, registry=r)
