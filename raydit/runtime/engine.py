"""The engine: plan on a Ray cluster, start one actor per rank, serve generations.

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
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from raydit.runtime.cluster import RayCluster
from raydit.runtime.controller import Controller, ElasticPolicy, Job

DEVICES = ("auto", "cuda", "cpu")


@dataclass
class GenerationResult:
    """What one `generate` call returns."""

    frames: np.ndarray  # uint8, frames x height x width x 3
    latents: np.ndarray  # float32, the final latents as the transformer sees them
    plan: Any
    timings: dict[str, float]
    request: Any
    events: list[dict] = field(default_factory=list)

    def save(self, path: str, fps: int = 8) -> str:
        """Write the frames as an H.264 mp4 with imageio-ffmpeg."""
        from raydit.runtime.video import write_mp4

        write_mp4(path, self.frames, fps=fps)
        return path


class Engine:
    """A warm set of Ray actors running one model with one parallel plan.

    >>> with Engine(model="tiny", workers=2, device="cpu") as engine:
    ...     result = engine.generate("a red fox", num_inference_steps=4)
    ...     result.save("fox.mp4")

    `workers` given: exactly that many ranks (the best plan of that size); None: the
    planner's best plan on every device of the cluster. When ranks are lost mid-request
    the engine re-plans on what is left and resumes from the last finished step.
    """

    def __init__(
        self,
        model: str = "tiny",
        workers: int | None = None,
        device: str = "auto",
        ulysses: int | None = None,
        ring: int | None = None,
        cfg: int | None = None,
        address: str | None = None,
        *,
        dtype: str | None = None,
        frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        placement_timeout_s: float = 60.0,
        collective_timeout_s: float = 120.0,
        step_timeout_s: float | None = None,
        elastic: bool = True,
        grow: str = "auto",
        show_plan: bool = True,
    ):
        from raydit.models.loading import resolve_model_dir
        from raydit.planner import model_spec

        if device not in DEVICES:
            raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers {workers!r} must be a positive integer")
        for name, value in (("ulysses", ulysses), ("ring", ring), ("cfg", cfg)):
            if value is not None and value < 1:
                raise ValueError(f"{name} {value} must be at least 1")
        # Resolve the model and check the request before touching Ray: a typo costs no
        # cluster start.
        self.model = model
        self.model_dir = str(resolve_model_dir(model))
        self.spec = model_spec(self.model_dir)
        self.spec.geometry(frames, height, width)
        self._geometry = (frames, height, width)
        self._workers = workers
        self._collective_timeout_s = collective_timeout_s
        if grow not in ("auto", "always", "never"):
            raise ValueError(f"grow {grow!r} is not one of auto, always, never")
        self._grow = grow
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.elastic = elastic
        self.events: list[dict] = []
        self._timings: dict[str, float] = {}
        self.group = None
        t0 = time.perf_counter()
        self.cluster = RayCluster.connect(address=address, want_workers=workers)
        try:
            self.device = self.cluster.resolve_device(device)
            self.dtype = dtype or ("bfloat16" if self.device == "cuda" else "float32")
            self.plan_result = self.cluster.plan(
                self.spec, frames=frames, height=height, width=width, device=self.device,
                workers=workers, ulysses=ulysses, ring=ring, cfg=cfg,
            )
            self.plan = self.plan_result.best
            if show_plan:
                print(self.describe_plan(), flush=True)
            self._timings["plan_seconds"] = time.perf_counter() - t0
            self.group = self.cluster.start_pool(
                self.plan,
                model_dir=self.model_dir,
                device=self.device,
                dtype=self.dtype,
                placement_timeout_s=placement_timeout_s,
            )
            self._timings["group_seconds"] = self.group.form(self.plan, collective_timeout_s)
        except BaseException:
            if self.group is not None:
                self.group.close()
                self.group = None
            self.cluster.close()
            raise
        self._timings.update(self.group.timings)
        self._timings["startup_seconds"] = time.perf_counter() - t0
        self.controller = Controller(
            self.group,
            replan=self._replan,
            policy=ElasticPolicy(
                max_recoveries=8 if elastic else 0, grow_margin=0.0 if grow == "always" else 1.0,
                always_grow=grow == "always",
            ),
            events=self.events,
            on_plan=self._set_plan,
            regroup_cost_s=self._regroup_cost,
            step_timeout_s=step_timeout_s,
            collective_timeout_s=collective_timeout_s,
        )
        self._event("started", plan=_plan_brief(self.plan), seconds=self._timings["startup_seconds"])

    # -- information -------------------------------------------------------------------

    def describe_plan(self) -> str:
        from raydit.planner.report import format_plan_table

        return format_plan_table(self.plan_result, limit=5)

    @property
    def kernel(self) -> str:
        return self.group.kernel

    @property
    def timings(self) -> dict[str, float]:
        return dict(self._timings)

    def _event(self, kind: str, **data) -> None:
        self.events.append({"event": kind, "time": time.time(), **data})

    # -- planning ------------------------------------------------------------------------

    def _replan(self, capacity: int):
        """Best plan for `capacity` devices: the pool's surviving members plus the
        cluster's free devices. With `workers` fixed by the user (or grow="always") the
        plan uses as many ranks as it may, up to `workers`; otherwise the planner's best."""
        counts: dict[str, int] = {}
        for m in self.group.members:
            counts[m.node_id] = counts.get(m.node_id, 0) + 1
        for node, free in self.group.free_slots().items():
            counts[node] = counts.get(node, 0) + free
        frames, height, width = self._geometry
        result = self.cluster.plan(
            self.spec, frames=frames, height=height, width=width, device=self.device,
            counts=counts,
        )
        limit = capacity if self._workers is None else min(capacity, self._workers)
        fits = [p for p in result.candidates if p.world_size <= limit]
        if not fits:
            raise ValueError(f"no feasible plan fits {limit} device(s)")
        if self._workers is not None or self._grow == "always":
            return max(fits, key=lambda p: (p.world_size, -p.predicted_step_seconds))
        return fits[0]

    def _set_plan(self, plan) -> None:
        self.plan = plan

    def _regroup_cost(self) -> float:
        t = self._timings
        return t.get("actors_seconds", 0.0) + t.get("load_seconds", 0.0) + t.get("group_seconds", 0.0)

    def regroup(self, ulysses: int | None = None, ring: int | None = None, cfg: int | None = None):
        """Re-plan on this engine's warm workers with other degrees (fewer ranks is fine),
        keeping the actors and their loaded weights; an infeasible layout is refused with
        the planner's reason."""
        if self.group is None:
            raise RuntimeError("engine is shut down; create a new Engine")
        counts: dict[str, int] = {}
        for m in self.group.members:
            counts[m.node_id] = counts.get(m.node_id, 0) + 1
        frames, height, width = self._geometry
        result = self.cluster.plan(
            self.spec, frames=frames, height=height, width=width, device=self.device,
            ulysses=ulysses, ring=ring, cfg=cfg, counts=counts,
        )
        plan = result.best
        self.group.reset_group()
        seconds = self.group.form(plan, self._collective_timeout_s)
        self.plan_result, self.plan = result, plan
        self._event("regrouped", reason="requested", plan=_plan_brief(plan), seconds=seconds)
        return plan

    # -- generation --------------------------------------------------------------------

    def generate(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        guidance_scale: float = 6.0,
        seed: int = 0,
        callback_on_step_end: Callable | None = None,
        progress: bool = True,
    ) -> GenerationResult:
        """Generate one video and wait for it (the simple blocking call)."""
        return self.submit(
            prompt, negative_prompt=negative_prompt, num_frames=num_frames, height=height,
            width=width, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
            seed=seed, callback_on_step_end=callback_on_step_end, progress=progress,
        ).result()

    def submit(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        guidance_scale: float = 6.0,
        seed: int = 0,
        callback_on_step_end: Callable | None = None,
        progress: bool = False,
    ) -> Future:
        """Queue a request; returns a future whose `.result()` is the GenerationResult.

        Requests run in submission order, each exactly once: a request interrupted by a lost
        rank resumes from its last finished step, and the ones behind it wait their turn."""
        from raydit.models.runner import GenerationRequest

        if self.group is None:
            raise RuntimeError("engine is shut down; create a new Engine")
        request = GenerationRequest(
            prompt=prompt,
            negative_prompt=negative_prompt or "",
            num_frames=num_frames or self.spec.default_frames,
            height=height or self.spec.default_height,
            width=width or self.spec.default_width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            seed=seed,
        )
        # Validate with the planner's rules before any worker sees the request.
        self.spec.geometry(request.num_frames, request.height, request.width)
        self._check_guidance(guidance_scale)
        future: Future = Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("engine is shutting down; create a new Engine")
            self._queue.put((request, callback_on_step_end, progress, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="raydit-engine", daemon=True)
                self._thread.start()
        return future

    def _check_guidance(self, guidance_scale: float) -> None:
        if self.plan.cfg == 2 and guidance_scale <= 1.0:
            raise ValueError(
                f"guidance_scale {guidance_scale} turns classifier-free guidance off, but the "
                "plan runs it on 2 groups (cfg 2); use guidance_scale > 1 or an Engine with cfg=1"
            )

    def _serve(self) -> None:
        """The engine's request loop: one request at a time through the controller."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            request, callback, progress, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._execute(request, callback, progress))
            except BaseException as exc:  # the caller of .result() sees it
                future.set_exception(exc)

    def _execute(self, request, callback_on_step_end, progress) -> GenerationResult:
        if self.group is None:
            raise RuntimeError("engine is shut down; create a new Engine")
        self._check_guidance(request.guidance_scale)
        first_event = len(self.events)
        job = Job(request=request)
        if self.elastic and self._grow != "never":
            self.controller.maybe_grow(self.plan, request.num_inference_steps, job)
        bar = _progress(request.num_inference_steps, enabled=progress)
        t_start = time.perf_counter()

        def on_step(job: Job) -> None:
            if bar is not None:
                bar.update(1)
            if callback_on_step_end is not None:
                self._run_callback(callback_on_step_end, job)

        try:
            self.controller.run(job, on_step=on_step)
        finally:
            if bar is not None:
                bar.close()
        timings = dict(job.timings)
        timings["step_seconds"] = list(job.step_seconds)
        timings["denoise_seconds"] = float(sum(job.step_seconds))
        timings["total_seconds"] = time.perf_counter() - t_start
        return GenerationResult(
            frames=job.frames,
            latents=_to_numpy(job.checkpoint["latents"]),
            plan=self.plan,
            timings=timings,
            request=request,
            events=self.events[first_event:],
        )

    def _run_callback(self, callback, job: Job) -> None:
        """diffusers' convention: callback(pipe, step, timestep, callback_kwargs) -> dict.

        A callback may return new latents; they reach the workers through the same resume
        path a regrouping uses, so every rank continues from them."""
        step = job.step_index - 1
        latents = job.checkpoint["latents"]
        out = callback(self, step, job.timesteps[step], {"latents": latents})
        if isinstance(out, dict) and "latents" in out and out["latents"] is not latents:
            import torch

            checkpoint = dict(job.checkpoint)
            checkpoint["latents"] = torch.as_tensor(out["latents"]).to(latents.dtype)
            job.checkpoint = checkpoint
            job.prepared = False

    # -- lifetime ----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish nothing more: cancel queued requests, kill the actors, release their
        reservations, disconnect what we connected."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            with lock:
                self._closing = True
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[3].cancel()
                if self._thread is not None:
                    self._queue.put(None)
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=60)
        group, self.group = getattr(self, "group", None), None
        if group is not None:
            group.close()
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):  # a forgotten engine must not leave actors pinning GPUs
        try:
            if getattr(self, "group", None) is not None:
                self.shutdown()
        except Exception:
            pass


def _plan_brief(plan) -> dict:
    return {
        "ulysses": plan.ulysses, "ring": plan.ring, "cfg": plan.cfg,
        "world_size": plan.world_size, "predicted_step_seconds": plan.predicted_step_seconds,
    }


def _to_numpy(t) -> np.ndarray:
    import torch

    if isinstance(t, torch.Tensor):
        return t.detach().to(torch.float32).cpu().numpy()
    return np.asarray(t, dtype=np.float32)


def _progress(total: int, enabled: bool):
    if not enabled or os.environ.get("RAYDIT_NO_PROGRESS"):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="denoising", unit="step")
