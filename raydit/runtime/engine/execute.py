"""Running one request on a replica, for the dispatcher: its job, progress bar, callback,
durable checkpoint and result; a request that can share steps runs as a batch (Batching).

Design decision: the denoising loop is driven from the driver one step at a time. Each
step is one remote call per rank (the ranks then talk to each other directly over their
process group); rank 0 returns the checkpoint of the finished step (latents and
scheduler state, a few MB at most), so the driver always holds the last finished step
where no worker can take it with it. That is what lets a later regrouping resume a
request mid-way, and it is also where `callback_on_step_end` runs. The cost is one
round trip per step, measured by bench/ against a torch.multiprocessing launch.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from raydit.runtime.controller import Job
from raydit.runtime.engine.result import GenerationResult
from raydit.runtime.engine.validation import note_frames
from raydit.runtime.errors import Interrupted
from raydit.runtime.queue import Item, save_progress
from raydit.runtime.wire import from_wire, to_wire


class RequestRunner:
    """Runs the dispatcher's requests on replicas. `pipe`: what a step callback gets as its
    pipeline argument (the Engine, diffusers' convention); `may_grow`: an elastic Engine
    that grows between requests; `model_identity`: recorded in every durable checkpoint."""

    def __init__(self, batching, events, model_dir: str, vae_temporal: int, model_identity: dict,
                 may_grow: bool, pipe: Any):
        self.batching = batching
        self._events = events
        self.model_dir = model_dir
        self.vae_temporal = vae_temporal
        self.model_identity = model_identity
        self.may_grow = may_grow
        self.pipe = pipe
        self.interrupted = False  # Ctrl-C ended the Engine's block: running requests stop at their next step

    def run(self, replica: Any, item: Item, queue=None) -> GenerationResult:
        """Run (or resume) `item` on `replica` (the dispatcher's call; `queue`: the dispatcher,
        which batch partners are taken from). Raises HandBack when the replica cannot finish
        it; the dispatcher then gives it, with its progress, to another. With max_batch > 1 a
        request that can share steps runs as a batch (Batching.run; no `queue`: alone, as the
        warm-up runs, returning its result)."""
        key = self.batching.key(item.request) if queue is not None else None
        if key is not None and self.batching.limit(replica) > 1:
            return self.batching.run(self, queue, replica, item, key)
        job = self.begin(replica, item)
        on_step, bar = self.step_hooks(item)
        try:
            replica.controller.run(job, on_step=on_step)
        finally:
            if bar is not None:
                bar.close()
        return self.result(replica, item)

    def warm_up(self, replicas: list, request, timings: dict) -> None:
        """`request` (the planned size, two steps, guidance on) alone on each of `replicas`,
        before any user's: the kernel choice, the allocator's growth, a compiled Engine's
        compilation and the decode are paid here (`timings["warmup_seconds"]`), not by the
        first video."""
        t0 = time.perf_counter()
        for replica in list(replicas):
            t_replica = time.perf_counter()
            item = Item(request=request, future=Future(), callback=None, progress=False, checkpoint_dir=None)
            result = self.run(replica, item)  # no queue: no user's request joins it
            self._events("warmed_up", replica=replica.index, frames=request.num_frames, height=request.height,
                         width=request.width, seconds=time.perf_counter() - t_replica,
                         compile_seconds=result.timings["compile_seconds"])
        timings.setdefault("warmup_seconds", time.perf_counter() - t0)

    def begin(self, replica: Any, item: Item, slot: int = 0, alone: bool = True) -> Job:
        """`item`'s job, to be (re-)prepared on `replica` in `slot`, from its checkpoint.
        `alone`: no other request is in progress on the replica, so it may grow (a regroup
        would drop the prepared state of requests already running in a batch)."""
        request = item.request
        if item.job is None:
            item.job = Job(request=request)
        job = item.job
        job.slot = slot
        if not item.t_start:
            item.first_event, item.t_start = len(self._events), time.perf_counter()
        else:
            self._events("request_resumed", replica=replica.index, step=job.step_index)
        job.prepared = False  # (re-)prepared on this replica, from job.checkpoint
        if item.on_start is not None:
            try:
                item.on_start()
            except Exception as exc:  # the caller's hook; the request runs on
                self._events("on_start_failed", tag=item.tag, error=f"{type(exc).__name__}: {exc}")
        if self.may_grow and alone:
            # Steps left: the job's own count once prepared (diffusion forcing runs more than
            # num_inference_steps), the request's before.
            steps = job.num_steps or request.num_inference_steps
            replica.controller.maybe_grow(replica.plan, steps - job.step_index, job)
        return job

    def step_hooks(self, item: Item):
        """(on_step(job) after each finished step: progress bar, the caller's callback, the
        durable checkpoint; the bar, to close)."""
        request = item.request
        bar = _progress(request.num_inference_steps, enabled=item.progress, initial=item.job.step_index)

        def on_step(job: Job) -> None:
            if bar is not None:
                if job.num_steps and bar.total != job.num_steps:  # diffusion forcing: its real steps
                    bar.total = job.num_steps
                bar.update(1)
                if request.cache is not None:
                    bar.set_postfix(cached=_cached_steps(job), refresh=False)
            if item.callback is not None:
                self._run_callback(item.callback, job)
            if item.checkpoint_dir is not None:
                save_progress(item.checkpoint_dir, request, from_wire(job.checkpoint), model=self.model_identity)
            if self.interrupted:  # Ctrl-C ended the Engine's block: stop here
                where = f"; finish it with resume({item.checkpoint_dir!r})" if item.checkpoint_dir else ""
                raise Interrupted(f"interrupted after step {job.step_index} of {job.num_steps or '?'}{where}")

        return on_step, bar

    def result(self, replica: Any, item: Item) -> GenerationResult:
        job = item.job
        request = item.request
        timings = dict(job.timings)
        timings["step_seconds"] = list(job.step_seconds)
        # Rank 0's own time of each step: step_seconds less these is what Ray's round trip
        # and the checkpoint's travel cost per step.
        timings["rank_step_seconds"] = list(job.rank_step_seconds)
        timings["denoise_seconds"] = float(sum(job.step_seconds))
        timings["cached_steps"] = _cached_steps(job)
        timings["compile_seconds"] = float(job.timings.get("compile_seconds", 0.0))
        timings["total_seconds"] = time.perf_counter() - item.t_start
        # Issue 13's names: encode (prepare: prompt encoding + initial latents), denoise,
        # decode seconds, and how many ranks the decode was split over.
        timings["encode"] = float(job.timings.get("prepare_seconds", 0.0))
        timings["denoise"] = timings["denoise_seconds"]
        timings["decode"] = float(job.timings.get("decode_seconds", 0.0))
        timings["decode_ranks"] = int(job.timings.get("decode_ranks", 1))
        if np.ndim(job.frames) == 4:
            note_frames(self.model_dir, self.vae_temporal, request.num_frames, int(np.shape(job.frames)[0]))
        return GenerationResult(
            # A copy the result owns: Ray's zero-copy array would pin the frames in the object
            # store for as long as the user keeps the result (raydit.runtime.raygc).
            frames=np.array(job.frames) if isinstance(job.frames, np.ndarray) else job.frames,
            audio=getattr(job, "audio", None),
            latents=job.output_latents[0],
            audio_latents=job.output_latents[1],
            plan=replica.plan,
            timings=timings,
            request=request,
            events=self._events.since(item.first_event),
            replica=replica.index,
            batched_with=list(getattr(item, "batched_with", [])),
            tag=item.tag,
        )

    def _run_callback(self, callback, job: Job) -> None:
        """diffusers' convention: callback(pipe, step, timestep, callback_kwargs) -> dict, with
        the engine as `pipe`; callback_kwargs: the latents, and `num_steps`, the steps this
        request runs in all (num_inference_steps, except diffusion forcing's iterations over
        its windows), for progress.

        A callback may return new latents; they reach the workers through the same resume
        path a regrouping uses, so every rank continues from them."""
        import torch

        step = job.step_index - 1
        latents = from_wire(job.checkpoint["latents"])
        # An edit in place (diffusers' `kw["latents"].mul_(...)`) counts too: torch bumps a
        # tensor's version counter at every in-place op, so no copy is kept to compare with.
        version = latents._version
        out = callback(self.pipe, step, job.timesteps[step], {"latents": latents, "num_steps": job.num_steps})
        if isinstance(out, dict) and "latents" in out and (out["latents"] is not latents
                                                           or latents._version != version):
            checkpoint = dict(job.checkpoint)
            checkpoint["latents"] = to_wire(torch.as_tensor(out["latents"]).to(latents.dtype))
            job.checkpoint = checkpoint
            job.prepared = False



def _cached_steps(job: Job) -> int:
    """Steps of the job served from the step cache (raydit.models.cache), from its checkpoint."""
    from raydit.models.cache import CACHED_STEPS

    carry = (job.checkpoint or {}).get("carry") or {}
    return int(from_wire(carry.get(CACHED_STEPS, 0)))


def _progress(total: int, enabled: bool, initial: int = 0):
    if not enabled or os.environ.get("RAYDIT_NO_PROGRESS"):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="denoising", unit="step")

