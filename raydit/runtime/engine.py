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

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from raydit.runtime.cluster import RayCluster, WorkerPool
from raydit.runtime.controller import Controller, ElasticPolicy, Job
from raydit.runtime.errors import HandBack
from raydit.runtime.queue import RESOLVED, Dispatcher, Item, load_progress, save_progress
from raydit.runtime.wire import from_wire, to_wire

DEVICES = ("auto", "cuda", "cpu")
# `generate(cache=...)` left out: the Engine's step caching (None is a choice: caching off).
ENGINE_DEFAULT = type("EngineDefault", (), {"__repr__": lambda self: "ENGINE_DEFAULT"})()


@dataclass
class GenerationResult:
    """What one `generate` call returns."""

    frames: np.ndarray  # uint8, frames x height x width x 3
    latents: np.ndarray  # float32, the final latents as the transformer sees them
    plan: Any
    timings: dict[str, float]
    request: Any
    events: list[dict] = field(default_factory=list)
    replica: int = 0
    audio: Any = None  # raydit.models.family.Audio: the sound the model made with the video, or None
    # Step-level batching: the requests (their `tag`s) this one shared a step with, in the
    # order they joined; empty when it ran alone. tag: this request's (submit's, else request-N).
    batched_with: list = field(default_factory=list)
    tag: str = ""

    def save(self, path: str, fps: int | None = None) -> str:
        """Write the frames as an H.264 mp4 with imageio-ffmpeg, with the sound as an AAC stream
        when the model made one. fps None: the frame rate the sound was made for, else 8."""
        from raydit.runtime.video import write_mp4

        if fps is None:
            rate = getattr(self.audio, "frame_rate", None) or 8
            fps = int(rate) if float(rate).is_integer() else rate
        write_mp4(path, self.frames, fps=fps, audio=self.audio)
        return path


@dataclass
class Replica:
    """One independent copy of the model: its pool of ranks, its controller, its plan."""

    index: int
    pool: Any
    controller: Any = None
    plan: Any = None
    busy: bool = False
    in_rotation: bool = True  # False after it handed a request back, until repaired
    batch_size: int = 0  # requests in its running batch (step-level batching; 1: one alone)
    idle_since: float = field(default_factory=time.monotonic)  # when it last finished a request


class Engine:
    """Warm Ray actors running one model: one or more replicas, each a parallel plan.

    >>> with Engine(model="tiny", workers=2, device="cpu") as engine:
    ...     result = engine.generate("a red fox", num_inference_steps=4)
    ...     result.save("fox.mp4")

    `workers` given: exactly that many ranks per replica (the best plan of that size);
    None: the planner's best plan on the cluster's devices. `replicas=K` starts K copies
    that serve the `submit` queue side by side, the fastest idle one first. When ranks are
    lost mid-request a replica re-plans on what is left and resumes from its last step.
    `cache="fbcache" | "teacache"` (with `cache_threshold`, default per method) turns on
    step caching for every request (raydit.models.cache); `result.timings["cached_steps"]`
    counts the steps it served. `compile=True`: regional torch.compile of the transformer
    blocks on every rank (raydit.models.compile); the first request of each shape compiles
    while it is prepared, reported as `result.timings["compile_seconds"]` (0 once warm),
    apart from `step_seconds` and `encode`. `warmup=True`: before the constructor returns,
    every replica runs one two-step request at the planned size (kernel choice, allocator
    growth, compilation, decode), so no user's request pays them; `timings["warmup_seconds"]`.
    `max_replicas=K` (> replicas): replicas follow the queue: one more (the planner's best
    layout, on free devices) while a request has waited `scale_up_wait_s`, up to K; one idle
    for `scale_down_idle_s` with nothing waiting is taken out, down to `replicas`.
    `max_batch=N` (> 1): step-level batching: queued requests that can share a step with the
    one a replica runs (the family's batch key: same geometry, guidance branches, LoRA, no
    caching; Wan and CogVideoX today) join it at the next step boundary, up to N and what the
    plan's memory model holds, each with its own timestep, seed, steps and guidance scale, and leave when
    their own steps are done; `result.batched_with` names the requests (their `tag`s) each
    shared a step with.
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
        replicas: int = 1,
        dtype: str | None = None,
        frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        placement_timeout_s: float = 60.0,
        collective_timeout_s: float = 30.0,
        step_timeout_s: float | None = None,
        elastic: bool = True,
        grow: str = "auto",
        show_plan: bool = True,
        checkpoint_dir: str | None = None,
        loras: dict | None = None,
        fuse_lora=None,
        cache: str | None = None,
        cache_threshold: float | None = None,
        compile: bool = False,
        warmup: bool = False,
        max_replicas: int | None = None,
        scale_up_wait_s: float = 30.0,
        scale_down_idle_s: float = 300.0,
        max_batch: int = 1,
    ):
        from raydit.models.loading import resolve_model_dir, takes_image
        from raydit.planner import model_spec

        if device not in DEVICES:
            raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
        for name, value in (("workers", workers), ("ulysses", ulysses), ("ring", ring), ("cfg", cfg), ("replicas", replicas),
                            ("max_batch", max_batch)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} {value!r} must be a positive integer")
        if max_replicas is not None and (isinstance(max_replicas, bool) or not isinstance(max_replicas, int)
                                         or max_replicas < replicas):
            raise ValueError(f"max_replicas {max_replicas!r} must be an integer >= replicas ({replicas}), the "
                             "replicas the engine starts with and keeps")
        for name, value in (("scale_up_wait_s", scale_up_wait_s), ("scale_down_idle_s", scale_down_idle_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} {value!r} must be a finite number of seconds >= 0")
        if grow not in ("auto", "always", "never"):
            raise ValueError(f"grow {grow!r} is not one of auto, always, never")
        for flag, value in (("compile", compile), ("warmup", warmup)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag} {value!r} must be True or False")
        self.compile = compile
        # Resolve the model and check the request before touching Ray: a typo costs no
        # cluster start.
        self.model = model
        self.model_dir = str(resolve_model_dir(model))
        self.takes_image = takes_image(self.model_dir)
        self.spec = model_spec(self.model_dir)
        frames = round_frames(self.model_dir, self.spec.vae_temporal, frames)
        self.spec.geometry(frames, height, width)
        self._geometry = (frames, height, width)
        # Step caching for every request (off by default): checked before Ray starts.
        from raydit.models.cache_options import check_cache

        check_cache(cache, cache_threshold)
        self.cache, self.cache_threshold = cache, cache_threshold
        # LoRA adapters (name -> LoraSpec), checked against the model before Ray starts;
        # every rank of every replica loads them once (WorkerPool.form).
        self._loras: dict = {}
        self._lora_lock = threading.Lock()
        for name, entry in (loras or {}).items():
            spec = self._lora_spec(entry, name)
            self._loras[spec.name] = spec
        # fuse_lora (True, a name or {name: scale}): the engine's one LoRA merged into the
        # weights on every rank (no per-step cost); every request then runs with it.
        from raydit.models.lora import adapter_bytes, fuse_choice

        self._fused = fuse_choice(fuse_lora, self._loras)
        if self._fused is not None:
            name, scale = self._fused
            self._loras[name] = dataclasses.replace(self._loras[name], fuse_scale=scale)
        self._refuse_if_compiled([n for n in self._loras if self._fused is None or n != self._fused[0]])
        # The planner counts the adapters' bytes on every rank (0 for a fused one).
        self.spec = dataclasses.replace(self.spec, adapter_bytes=float(sum(adapter_bytes(s) for s in self._loras.values())))
        self._workers = workers
        self._forced = {"ulysses": ulysses, "ring": ring, "cfg": cfg}
        self._collective_timeout_s = collective_timeout_s
        self.checkpoint_dir = checkpoint_dir
        self._submitted = 0
        self._num_train_timesteps = _num_train_timesteps(self.model_dir)
        self._grow = grow
        self.elastic = elastic
        self.events: list[dict] = []
        self._timings: dict[str, float] = {}
        self._dispatcher: Dispatcher | None = None
        # One recovery, repair or growth at a time takes from the cluster's free devices.
        self._capacity_lock = threading.RLock()
        self.replicas: list[Replica] = []
        t0 = time.perf_counter()
        self.cluster = RayCluster.connect(
            address=address, want_workers=None if workers is None else workers * replicas
        )
        try:
            self.device = self.cluster.resolve_device(device)
            self.dtype = dtype or ("bfloat16" if self.device == "cuda" else "float32")
            if workers is not None:
                # Fail early, naming the numbers, when K replicas of N cannot fit.
                self.cluster.cluster_spec(self.device, workers * replicas)
            self.plan_result = self.cluster.plan(
                self.spec, frames=frames, height=height, width=width, device=self.device,
                workers=workers, ulysses=ulysses, ring=ring, cfg=cfg,
            )
            plan = self.plan_result.best
            if show_plan:
                print(self.describe_plan(), flush=True)
            self._timings["plan_seconds"] = time.perf_counter() - t0
            self._placement_timeout_s = placement_timeout_s
            for k in range(replicas):
                # The first replica goes where the plan placed it; the others are packed
                # onto what is left (each is checked against the cluster when reserved).
                self._start_replica(k, plan, plan.placement if k == 0 else None, self.replicas.append)
        except BaseException:
            for r in self.replicas:
                r.pool.close()
            self.replicas = []
            self.cluster.close()
            raise
        for key, value in self.replicas[0].pool.timings.items():
            self._timings[key] = value
        self._timings["startup_seconds"] = time.perf_counter() - t0
        self._step_timeout_s = step_timeout_s
        for r in self.replicas:
            self._attach_controller(r)
        self._dispatcher = Dispatcher(self.replicas, self._execute, self._repair, self._capacity_left)
        self.max_batch = max_batch
        self._tags = 0
        self._family = None  # the model's Family, for batch keys (looked up once)
        # Replicas that follow the queue: between `replicas` and `max_replicas`.
        self.min_replicas, self.max_replicas = replicas, max_replicas or replicas
        self.scale_up_wait_s, self.scale_down_idle_s = float(scale_up_wait_s), float(scale_down_idle_s)
        self._warmup = warmup
        self._next_index = replicas
        self._autoscaler: threading.Thread | None = None
        self._stop_scaling = threading.Event()
        self._event(
            "started", plan=_plan_brief(plan), replicas=len(self.replicas),
            seconds=self._timings["startup_seconds"],
        )
        if warmup:
            try:
                self._warm_up()
            except BaseException:
                self.shutdown()
                raise
        if self.max_replicas > self.min_replicas:
            self._autoscaler = threading.Thread(target=self._autoscale_loop, name="raydit-autoscale", daemon=True)
            self._autoscaler.start()

    # -- replicas ------------------------------------------------------------------------

    def _start_replica(self, index: int, plan, placement, add) -> "Replica":
        """Start the ranks of one replica of `plan` (at `placement`, or packed onto free
        devices), load the model and form its groups; `add(replica)` puts it in the engine's
        list as soon as it holds actors, so a failure below still closes them."""
        pool = WorkerPool.start(
            plan.world_size, placement=placement, model_dir=self.model_dir, device=self.device, dtype=self.dtype,
            placement_timeout_s=self._placement_timeout_s,
        )
        replica = Replica(index=index, pool=pool, plan=plan)
        add(replica)
        pool.loras = dict(self._loras)
        pool.compile = self.compile
        seconds = pool.form(plan, self._collective_timeout_s)
        self._timings.setdefault("group_seconds", seconds)
        return replica

    def _attach_controller(self, r: "Replica") -> None:
        r.controller = Controller(
            r.pool,
            replan=lambda capacity, min_sp=None, r=r: self._replan(r, capacity, min_sp),
            policy=ElasticPolicy(
                max_recoveries=8 if self.elastic else 0,
                grow_margin=1.0,
                always_grow=self._grow == "always",
                max_world=self._workers,
            ),
            events=self.events,
            on_plan=lambda p, r=r: setattr(r, "plan", p),
            regroup_cost_s=self._regroup_cost,
            step_timeout_s=self._step_timeout_s,
            collective_timeout_s=self._collective_timeout_s,
            plan=r.plan,
            capacity_lock=self._capacity_lock,
        )

    def _autoscale_loop(self) -> None:
        """Add a replica while a request has waited `scale_up_wait_s` and free devices hold
        one (up to `max_replicas`); take one out after `scale_down_idle_s` idle with nothing
        waiting (down to `replicas`). One change at a time; every change is an event."""
        tick = max(0.05, min(1.0, self.scale_up_wait_s / 4, self.scale_down_idle_s / 4))
        while not self._stop_scaling.wait(tick):
            try:
                self._autoscale_once()
            except Exception as exc:  # the queue keeps running on the replicas it has
                self._event("autoscale_failed", error=f"{type(exc).__name__}: {exc}")
                self._stop_scaling.wait(max(5.0, self.scale_up_wait_s))

    def _autoscale_once(self) -> None:
        dispatcher = self._dispatcher
        waited = dispatcher.oldest_wait()
        if waited >= self.scale_up_wait_s and waited > 0 and len(self.replicas) < self.max_replicas:
            plan = self.plan_result.best
            with self._capacity_lock:
                if self.replicas[0].pool.free_slot_count() < plan.world_size:
                    return  # no room: the queue waits for the replicas it has
                index, self._next_index = self._next_index, self._next_index + 1
                t0 = time.perf_counter()
                started: list = []
                try:
                    replica = self._start_replica(index, plan, None, started.append)
                except BaseException:
                    for r in started:
                        r.pool.close()
                    raise
            self._attach_controller(replica)
            if self._warmup:
                self._warm_up([replica])
            if self._stop_scaling.is_set():
                replica.pool.close()
                return
            dispatcher.add_replica(replica)
            self._event("replica_added", replica=index, plan=_plan_brief(plan), waited=round(waited, 3),
                        seconds=round(time.perf_counter() - t0, 3), replicas=len(self.replicas))
            return
        replica = dispatcher.take_idle_replica(self.scale_down_idle_s, keep=self.min_replicas)
        if replica is not None:
            replica.pool.close()
            self._event("replica_removed", replica=replica.index, idle=round(time.monotonic() - replica.idle_since, 3),
                        replicas=len(self.replicas))

    def _warm_up(self, replicas=None) -> None:
        """One request at the planned size on every replica, before any user's: the kernel
        choice, the allocator's growth, a compiled Engine's compilation and the decode are
        paid here (`timings["warmup_seconds"]`), not by the first video. Two steps, guidance
        on: the step a request runs, and a scheduler past its first step."""
        from raydit.models.family import GenerationRequest, checker_image, image_to_png

        frames, height, width = self._planned_geometry()
        request = GenerationRequest(
            prompt="warm-up", num_frames=frames, height=height, width=width, num_inference_steps=2,
            guidance_scale=6.0, seed=0, image=image_to_png(checker_image(height, width)) if self.takes_image else None,
            cache=self.cache, cache_threshold=self.cache_threshold, lora=self._fused_default(None))
        t0 = time.perf_counter()
        for replica in list(self.replicas if replicas is None else replicas):
            t_replica = time.perf_counter()
            item = Item(request=request, future=Future(), callback=None, progress=False, checkpoint_dir=None)
            result = self._execute(replica, item)
            self._event("warmed_up", replica=replica.index, frames=frames, height=height, width=width,
                        seconds=time.perf_counter() - t_replica,
                        compile_seconds=result.timings["compile_seconds"])
        self._timings.setdefault("warmup_seconds", time.perf_counter() - t0)

    # -- information -------------------------------------------------------------------

    @property
    def group(self):
        """The first replica's worker pool (the only one unless replicas > 1)."""
        return self.replicas[0].pool if self.replicas else None

    @property
    def controller(self):
        return self.replicas[0].controller if self.replicas else None

    @property
    def plan(self):
        return self.replicas[0].plan if self.replicas else None

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

    def _replan(self, replica: Replica, capacity: int, min_sp: int | None = None):
        """Best plan for `capacity` devices: the replica's surviving members plus the
        cluster's free devices. With `workers` fixed by the user (or grow="always") the
        plan uses as many ranks as it may, up to `workers`; otherwise the planner's best.
        Degrees the user forced hold; when no plan with them fits what is left, the best
        plan without them runs and an event says what and why. `min_sp`: only plans with
        at least that much sequence parallelism (after running out of memory)."""
        counts = replica.pool.member_counts()
        for node, free in replica.pool.free_slots().items():
            counts[node] = counts.get(node, 0) + free
        frames, height, width = self._geometry
        limit = capacity if self._workers is None else min(capacity, self._workers)

        def best(**forced):
            result = self.cluster.plan(
                self.spec, frames=frames, height=height, width=width, device=self.device,
                counts=counts, **forced,
            )
            fits = [p for p in result.candidates if p.world_size <= limit
                    and (min_sp is None or p.ulysses * p.ring >= min_sp)]
            if not fits:
                raise ValueError(f"no feasible plan fits {limit} device(s)"
                                 + (f" with sequence parallelism >= {min_sp}" if min_sp else ""))
            if self._workers is not None or self._grow == "always":
                return max(fits, key=lambda p: (p.world_size, -p.predicted_step_seconds))
            return fits[0]

        forced = {k: v for k, v in self._forced.items() if v is not None}
        if not forced:
            return best()
        try:
            return best(**forced)
        except ValueError as exc:
            plan = best()
            said = ", ".join(f"{k} {v}" for k, v in forced.items())
            self._event("forced_degrees_dropped", replica=replica.index, forced=forced, plan=_plan_brief(plan),
                        reason=f"{said} cannot run on the {limit} device(s) left ({exc}); running ulysses "
                               f"{plan.ulysses} x ring {plan.ring} x cfg {plan.cfg} instead")
            return plan

    def _regroup_cost(self) -> float:
        t = self._timings
        return t.get("actors_seconds", 0.0) + t.get("load_seconds", 0.0) + t.get("group_seconds", 0.0)

    def regroup(self, ulysses: int | None = None, ring: int | None = None, cfg: int | None = None):
        """Re-plan a single-replica engine's warm workers with other degrees (fewer ranks is
        fine), keeping the actors and their loaded weights; an infeasible layout is refused
        with the planner's reason. Not while requests are running."""
        if not self.replicas:
            raise RuntimeError("engine is shut down; create a new Engine")
        if len(self.replicas) > 1:
            raise ValueError("regroup works on a single-replica engine; this one has "
                             f"{len(self.replicas)} replicas")
        replica = self.replicas[0]
        with self._dispatcher.cond:
            if replica.busy:
                raise RuntimeError("regroup while a request runs; wait for it to finish")
            replica.busy = True
        try:
            counts = replica.pool.member_counts()
            frames, height, width = self._geometry
            result = self.cluster.plan(
                self.spec, frames=frames, height=height, width=width, device=self.device,
                ulysses=ulysses, ring=ring, cfg=cfg, counts=counts,
            )
            plan = result.best
            replica.pool.reset_group()
            seconds = replica.pool.form(plan, self._collective_timeout_s)
            self.plan_result, replica.plan = result, plan
            replica.controller.on_plan(plan)
            self._event("regrouped", reason="requested", plan=_plan_brief(plan), seconds=seconds)
            return plan
        finally:
            with self._dispatcher.cond:
                replica.busy = False
                self._dispatcher.cond.notify_all()

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
        image=None,
        guidance_scale_2: float | None = None,
        checkpoint_dir: str | None = None,
        lora=None,
        true_cfg_scale: float = 1.0,
        cache=ENGINE_DEFAULT,
        cache_threshold=ENGINE_DEFAULT,
        guidance_options=None,
    ) -> GenerationResult:
        """Generate one video and wait for it (the simple blocking call). `image` (a PIL
        image, a path or a uint8 array) conditions an image-to-video pipeline."""
        return self.submit(
            prompt, negative_prompt=negative_prompt, num_frames=num_frames, height=height,
            width=width, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
            seed=seed, callback_on_step_end=callback_on_step_end, progress=progress, image=image,
            guidance_scale_2=guidance_scale_2, checkpoint_dir=checkpoint_dir, lora=lora,
            true_cfg_scale=true_cfg_scale, cache=cache, cache_threshold=cache_threshold,
            guidance_options=guidance_options,
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
        image=None,
        guidance_scale_2: float | None = None,
        checkpoint_dir: str | None = None,
        lora=None,
        true_cfg_scale: float = 1.0,
        cache=ENGINE_DEFAULT,
        cache_threshold=ENGINE_DEFAULT,
        guidance_options=None,
        tag: str | None = None,
    ) -> Future:
        """Queue a request; returns a future whose `.result()` is the GenerationResult.

        Requests start in submission order on the fastest idle replica, each exactly once:
        a request interrupted by a lost rank resumes from its last finished step, on
        another replica if its own cannot go on. `checkpoint_dir`: write the request and
        each finished step there (default: a directory per request under the Engine's
        `checkpoint_dir`, if any); `Engine.resume(dir)` finishes it. `lora`: None (the base
        model), the name of a loaded LoRA (scale 1.0) or {name: scale, ...}: active for this
        request only. `cache` (None, "fbcache", "teacache") and `cache_threshold` override the
        Engine's step caching for this request only (left out: the Engine's; a method given
        without a threshold takes that method's default). `true_cfg_scale` > 1 with a
        negative prompt runs true classifier-free guidance where guidance is embedded in the
        model (HunyuanVideo). `guidance_options`: the family's further guidance knobs,
        {name: value} (GenerationRequest.guidance_options; LTX-2: stg_scale, modality_scale ...)."""
        from raydit.models.family import GenerationRequest, image_to_png

        if not self.replicas:
            raise RuntimeError("engine is shut down; create a new Engine")
        if image is not None and not self.takes_image:
            raise ValueError(
                f"model {self.model!r} is a text-to-video pipeline and takes no image; drop the image "
                "or load an image-to-video checkpoint"
            )
        if image is None and self.takes_image:
            raise ValueError(f"model {self.model!r} is an image-to-video pipeline; give image=PIL.Image or a path")
        num_frames = round_frames(self.model_dir, self.spec.vae_temporal, num_frames)
        request = GenerationRequest(
            prompt=prompt,
            negative_prompt=negative_prompt or "",
            num_frames=self.spec.default_frames if num_frames is None else num_frames,
            height=self.spec.default_height if height is None else height,
            width=self.spec.default_width if width is None else width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            guidance_scale_2=guidance_scale_2,
            seed=seed,
            image=None if image is None else image_to_png(image),
            true_cfg_scale=true_cfg_scale,
            guidance_options=guidance_options or (),
            **self._cache_choice(cache, cache_threshold),
            lora=self._fused_default(lora),
        )
        self._check_request(request)
        return self._enqueue(request, callback_on_step_end, progress, checkpoint_dir, tag=tag)

    def _cache_choice(self, cache, cache_threshold) -> dict:
        """A request's step caching: the Engine's unless the call names it. Only the request
        carries it (the workers install the hooks per request), so nothing is re-planned and
        the next request is back on the Engine's choice."""
        if cache is ENGINE_DEFAULT:
            cache = self.cache
            if cache_threshold is ENGINE_DEFAULT:
                cache_threshold = self.cache_threshold
        if cache_threshold is ENGINE_DEFAULT:
            cache_threshold = None  # a method named for this request: that method's default
        return {"cache": cache, "cache_threshold": cache_threshold}

    def resume(self, directory: str, callback_on_step_end: Callable | None = None,
               progress: bool = True) -> GenerationResult:
        """Finish the request saved in `directory` (written with `checkpoint_dir`) from its
        last finished step, e.g. after the driver that ran it died; returns its result."""
        request, checkpoint = load_progress(directory)
        self._check_request(request)
        job = None
        if checkpoint is not None:
            job = Job(request=request, checkpoint=checkpoint, step_index=int(checkpoint["step_index"]))
            self._event("resumed", directory=str(directory), step=job.step_index)
        return self._enqueue(request, callback_on_step_end, progress, str(directory), job).result()

    def _check_request(self, request) -> None:
        """Refuse on the driver, before any worker sees it, what the workers would refuse:
        geometry (the planner's rules), more steps than the scheduler has timesteps, a
        size beyond what every replica's plan can hold, a LoRA that is not loaded."""
        self.spec.geometry(request.num_frames, request.height, request.width)
        if self._fused is not None and request.lora != (self._fused,):
            name, scale = self._fused
            raise ValueError(
                f"this engine serves LoRA {name!r} fused into its weights at scale {scale:g} (fuse_lora / "
                f"--fuse-lora), so every request runs with it; this one asks for "
                f"{dict(request.lora) or 'the base model'}: leave lora out (or give {{{name!r}: {scale:g}}}), "
                "or use an engine without fuse_lora to switch adapters per request"
            )
        for name, _ in request.lora:
            if name not in self._loras:
                raise ValueError(
                    f"LoRA {name!r} is not loaded; loaded: {', '.join(sorted(self._loras)) or 'none'} "
                    "(load it with Engine.load_lora(path, name) or --lora PATH)"
                )
        check_steps(self._num_train_timesteps, request.num_inference_steps)
        planned = self._planned_geometry()
        if (request.num_frames, request.height, request.width) != planned:
            frames, height, width = planned
            if request.num_frames * request.height * request.width > frames * height * width:
                for r in self.replicas:
                    self._check_fits(r, request)

    def _planned_geometry(self) -> tuple[int, int, int]:
        frames, height, width = self._geometry
        return (frames or self.spec.default_frames, height or self.spec.default_height,
                width or self.spec.default_width)

    def _check_fits(self, replica: Replica, request) -> None:
        """A request larger than the plan was made for: the planner checks that the
        replica's layout still holds it in memory (a clear error, not an OOM on the ranks)."""
        from raydit.planner import PlanError

        plan = replica.plan
        try:
            self.cluster.plan(
                self.spec, frames=request.num_frames, height=request.height, width=request.width,
                device=self.device, counts=replica.pool.member_counts(),
                ulysses=plan.ulysses, ring=plan.ring, cfg=plan.cfg,
            )
        except PlanError as exc:
            raise ValueError(
                f"{request.num_frames} frames at {request.height}x{request.width} do not fit the running plan "
                f"(ulysses {plan.ulysses} x ring {plan.ring} x cfg {plan.cfg}): {exc}; create the Engine with "
                f"frames/height/width of this size so it plans for them"
            ) from None

    def _enqueue(self, request, callback, progress, checkpoint_dir, job: Job | None = None,
                 tag: str | None = None) -> Future:
        if checkpoint_dir is None and self.checkpoint_dir is not None:
            with self._capacity_lock:
                self._submitted += 1
                n = self._submitted
            checkpoint_dir = os.path.join(self.checkpoint_dir, f"request-{n:04d}")
        if checkpoint_dir is not None and job is None:
            save_progress(checkpoint_dir, request, None)  # the request itself, before step 0
        with self._capacity_lock:
            self._tags += 1
            n = self._tags
        item = Item(request=request, future=Future(), callback=callback, progress=progress,
                    checkpoint_dir=checkpoint_dir, job=job, tag=tag or f"request-{n}")
        return self._dispatcher.put(item)

    def _execute(self, replica: Replica, item: Item) -> GenerationResult:
        """Run (or resume) `item` on `replica`. Raises HandBack when the replica cannot
        finish it; the dispatcher then gives it, with its progress, to another. With
        max_batch > 1 a request that can share steps runs as a batch (_execute_batch)."""
        key = self._batch_key(item.request)
        if key is not None and self._batch_limit(replica) > 1:
            return self._execute_batch(replica, item, key)
        job = self._begin(replica, item)
        on_step, bar = self._step_hooks(item)
        try:
            replica.controller.run(job, on_step=on_step)
        finally:
            if bar is not None:
                bar.close()
        return self._result(replica, item)

    def _begin(self, replica: Replica, item: Item, slot: int = 0) -> Job:
        """`item`'s job, to be (re-)prepared on `replica` in `slot`, from its checkpoint."""
        request = item.request
        if item.job is None:
            item.job = Job(request=request)
        job = item.job
        job.slot = slot
        if not item.t_start:
            item.first_event, item.t_start = len(self.events), time.perf_counter()
        else:
            self._event("request_resumed", replica=replica.index, step=job.step_index)
        job.prepared = False  # (re-)prepared on this replica, from job.checkpoint
        if self.elastic and self._grow != "never" and slot == 0:
            replica.controller.maybe_grow(replica.plan, request.num_inference_steps - job.step_index, job)
        return job

    def _step_hooks(self, item: Item):
        """(on_step(job) after each finished step: progress bar, the caller's callback, the
        durable checkpoint; the bar, to close)."""
        request = item.request
        bar = _progress(request.num_inference_steps, enabled=item.progress, initial=item.job.step_index)

        def on_step(job: Job) -> None:
            if bar is not None:
                bar.update(1)
                if request.cache is not None:
                    bar.set_postfix(cached=_cached_steps(job), refresh=False)
            if item.callback is not None:
                self._run_callback(item.callback, job)
            if item.checkpoint_dir is not None:
                save_progress(item.checkpoint_dir, request, from_wire(job.checkpoint))

        return on_step, bar

    # -- step-level batching -------------------------------------------------------------

    def _batch_key(self, request):
        """Requests with equal keys share steps on a replica (Family.batch_key); None: alone."""
        if self.max_batch <= 1:
            return None
        if self._family is None:
            from raydit.models.loading import pipeline_class
            from raydit.models.registry import family_for_class

            self._family = family_for_class(pipeline_class(Path(self.model_dir)))
        return self._family.batch_key(None, request)  # the driver holds no pipeline

    def _batch_limit(self, replica: Replica) -> int:
        """The most requests `replica` carries per step: max_batch, within its plan's memory."""
        from raydit.planner.search import batch_capacity

        return min(self.max_batch, batch_capacity(self.plan_result, replica.plan))

    def _execute_batch(self, replica: Replica, first: Item, key) -> Any:
        """Run `first` and the queued requests of the same batch key that join it, each at
        the step boundary after it arrives, up to the replica's batch limit; each leaves when
        its own steps are done (its future is resolved then). A request whose callback raises
        (a cancel) or whose own prepare or decode fails leaves alone; a failure of the shared
        step fails them all; a replica that must hand back gives every request back with its
        progress. Returns RESOLVED: every future is set here."""
        limit = self._batch_limit(replica)
        batch: list[Item] = []
        hooks: dict[int, tuple] = {}

        def admit(item: Item) -> None:
            used = {it.job.slot for it in batch}
            slot = min(s for s in range(limit) if s not in used)
            self._begin(replica, item, slot)
            hooks[id(item)] = self._step_hooks(item)
            item.batched_with = []
            if batch:
                self._event("batch_joined", replica=replica.index, tag=item.tag, slot=slot,
                            batch=[it.tag for it in batch] + [item.tag])
            batch.append(item)

        def leave(item: Item, exc: BaseException | None = None, result=None) -> None:
            batch.remove(item)
            bar = hooks.pop(id(item))[1]
            if bar is not None:
                bar.close()
            if exc is not None:
                if item.job.prepared and not item.job.done:
                    replica.pool.forget(item.job.slot)
                item.future.set_exception(exc)
            else:
                item.future.set_result(result)

        admit(first)
        replica.batch_size = 1
        try:
            while batch:
                if len(batch) < limit:
                    for item in self._dispatcher.take_matching(lambda r: self._batch_key(r) == key, limit - len(batch)):
                        admit(item)
                replica.batch_size = len(batch)
                jobs = [it.job for it in batch]
                try:
                    what, did = replica.controller.tick_batch(jobs)
                except HandBack:  # every request left goes back with its progress; `first`, if
                    # still here, by the dispatcher (which requeues no finished request)
                    self._dispatcher.hand_back([it for it in batch if it is not first])
                    raise
                except Exception as exc:
                    failed = getattr(exc, "failed_job", None)
                    owner = [it for it in batch if it.job is failed]
                    for item in (owner or list(batch)):
                        leave(item, exc)
                    continue
                by_job = {id(it.job): it for it in batch}
                if what == "stepped":
                    tags = [by_job[id(j)].tag for j in did]
                    for job in did:
                        item = by_job[id(job)]
                        for tag in tags:
                            if tag != item.tag and tag not in item.batched_with:
                                item.batched_with.append(tag)
                        try:
                            hooks[id(item)][0](job)
                        except BaseException as exc:  # a callback's refusal (a cancel): it alone leaves
                            leave(item, exc)
                elif what == "decoded":
                    item = by_job[id(did[0])]
                    leave(item, result=self._result(replica, item))
        finally:
            replica.batch_size = 0
            for item in list(batch):
                bar = hooks.pop(id(item), (None, None))[1]
                if bar is not None:
                    bar.close()
        return RESOLVED

    def _result(self, replica: Replica, item: Item) -> GenerationResult:
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
        return GenerationResult(
            frames=job.frames,
            audio=getattr(job, "audio", None),
            latents=_to_numpy(from_wire(job.checkpoint["latents"])),
            plan=replica.plan,
            timings=timings,
            request=request,
            events=self.events[item.first_event:],
            replica=replica.index,
            batched_with=list(getattr(item, "batched_with", [])),
            tag=item.tag,
        )

    def _repair(self, replica: Replica) -> bool:
        """Make a replica that handed its request back whole again: its survivors plus
        free devices, re-planned (the dispatcher calls this while a request waits)."""
        whole = replica.controller.repair()
        if whole:
            self._event("repaired", replica=replica.index, plan=_plan_brief(replica.plan))
        return whole

    def _capacity_left(self) -> str:
        ranks = ", ".join(f"replica {r.index}: {len(r.pool.members)} rank(s)" for r in self.replicas)
        free = self.replicas[0].pool.free_slot_count() if self.replicas else 0
        key = "GPUs" if self.device == "cuda" else "CPU slots"
        return f"{ranks}; {free} free {key} in the cluster"

    def _run_callback(self, callback, job: Job) -> None:
        """diffusers' convention: callback(pipe, step, timestep, callback_kwargs) -> dict.

        A callback may return new latents; they reach the workers through the same resume
        path a regrouping uses, so every rank continues from them."""
        step = job.step_index - 1
        latents = from_wire(job.checkpoint["latents"])
        out = callback(self, step, job.timesteps[step], {"latents": latents})
        if isinstance(out, dict) and "latents" in out and out["latents"] is not latents:
            import torch

            checkpoint = dict(job.checkpoint)
            checkpoint["latents"] = to_wire(torch.as_tensor(out["latents"]).to(latents.dtype))
            job.checkpoint = checkpoint
            job.prepared = False

    # -- LoRA adapters -----------------------------------------------------------------

    def _lora_spec(self, entry, name: str | None = None):
        """A path (or {"path": P, "target": T}) -> a LoraSpec checked against this model on
        the driver (raydit.models.lora.check_for_model: no weights loaded, no Ray)."""
        from raydit.models import lora

        target = "transformer"
        if isinstance(entry, dict):
            unknown = set(entry) - {"path", "target"}
            if unknown or "path" not in entry:
                raise ValueError(f"LoRA entry {entry!r} must be a path or {{'path': P, 'target': T}}")
            entry, target = entry["path"], entry.get("target", target)
        if not isinstance(entry, (str, os.PathLike)):
            raise ValueError(f"LoRA path {entry!r} must be a path to a .safetensors file or a directory holding one")
        if target not in lora.TARGETS:
            raise ValueError(f"LoRA target {target!r} is not one of {', '.join(lora.TARGETS)}")
        spec = lora.LoraSpec(name=lora.check_name(name if name is not None else lora.default_name(entry)),
                             path=str(lora.lora_file(entry)), target=target)
        if spec.name in self._loras:
            raise ValueError(f"a LoRA named {spec.name!r} is already loaded; unload it first or give another name")
        lora.check_for_model(self.model_dir, spec)
        return spec

    def _fused_default(self, lora):
        """On a fused engine a request that names no LoRA runs with the fused one."""
        from raydit.models.lora import normalize_choice

        if self._fused is not None and not normalize_choice(lora):
            return {self._fused[0]: self._fused[1]}
        return lora

    @property
    def fused_lora(self) -> dict[str, float] | None:
        """{name: scale} of the LoRA fused into the weights (fuse_lora), or None."""
        return None if self._fused is None else {self._fused[0]: self._fused[1]}

    def _refuse_if_fused(self, what: str) -> None:
        if self._fused is not None:
            raise ValueError(
                f"cannot {what}: LoRA {self._fused[0]!r} is fused into this engine's weights (fuse_lora); "
                "start an engine without fuse_lora to load and unload adapters"
            )

    def _refuse_if_compiled(self, names: list) -> None:
        # peft's layers in a compiled block: every switch of adapters or scales would
        # recompile the blocks (Dynamo guards on them). A fused LoRA is plain weights.
        if self.compile and names:
            raise ValueError(
                f"LoRA {', '.join(map(str, names))} cannot be switched per request on compiled blocks (compile=True); "
                "fuse one LoRA into the weights (fuse_lora / --fuse-lora) or drop compile"
            )

    def loras(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> path of the .safetensors file."""
        return {name: spec.path for name, spec in self._loras.items()}

    def load_lora(self, path, name: str | None = None, target: str = "transformer") -> str:
        """Load a LoRA on every rank of every replica (once; requests then choose it by name
        with `lora=`). `target`: "transformer", "transformer_2" (Wan 2.2 A14B's low-noise
        expert) or "both". Waits for running requests to finish. Returns the name."""
        self._refuse_if_fused("load a LoRA")
        self._refuse_if_compiled([name or str(path)])
        with self._lora_lock:
            spec = self._lora_spec({"path": path, "target": target}, name)
            self._sync_loras({**self._loras, spec.name: spec})
            return spec.name

    def unload_lora(self, name: str) -> None:
        """Unload a LoRA from every rank; later requests cannot name it."""
        self._refuse_if_fused("unload a LoRA")
        with self._lora_lock:
            if name not in self._loras:
                raise ValueError(f"LoRA {name!r} is not loaded; loaded: {', '.join(sorted(self._loras)) or 'none'}")
            self._sync_loras({n: s for n, s in self._loras.items() if n != name})

    def _sync_loras(self, table: dict) -> None:
        """Make every member of every replica hold `table`, between requests: each replica is
        claimed as it becomes idle (the dispatcher starts nothing on it meanwhile). On a
        failure every rank goes back to the previous table and the error is raised."""
        import ray

        if not self.replicas:
            raise RuntimeError("engine is shut down; create a new Engine")
        cond = self._dispatcher.cond
        claimed: list = []
        with cond:
            while len(claimed) < len(self.replicas):
                for r in self.replicas:
                    if r not in claimed and not r.busy:
                        r.busy = True
                        claimed.append(r)
                if len(claimed) < len(self.replicas):
                    cond.wait(timeout=1.0)
        try:
            previous = dict(self._loras)
            actors = [m.actor for r in self.replicas for m in r.pool.members]
            try:
                ray.get([a.sync_loras.remote(table) for a in actors], timeout=300)
            except Exception as exc:
                from raydit.runtime.failures import classify

                try:
                    ray.get([a.sync_loras.remote(previous) for a in actors], timeout=300)
                except Exception:  # a rank that cannot even go back is replaced at the next form
                    for r in self.replicas:
                        r.pool.reset_group()
                raise ValueError(classify(exc).message) from None
            self._loras = dict(table)
            from raydit.models.lora import adapter_bytes

            self.spec = dataclasses.replace(self.spec, adapter_bytes=float(sum(adapter_bytes(s) for s in table.values())))
            for r in self.replicas:
                r.pool.loras = dict(table)
            self._event("loras", loaded=sorted(table))
        finally:
            with cond:
                for r in claimed:
                    r.busy = False
                cond.notify_all()

    # -- lifetime ----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Cancel queued requests, wait for running ones, kill the actors, release their
        reservations, disconnect what we connected."""
        stop = getattr(self, "_stop_scaling", None)
        if stop is not None:
            stop.set()
            scaler = getattr(self, "_autoscaler", None)
            if scaler is not None and scaler is not threading.current_thread():
                scaler.join(timeout=600)
        dispatcher = getattr(self, "_dispatcher", None)
        if dispatcher is not None:
            dispatcher.close()
        for r in getattr(self, "replicas", []):
            r.pool.close()
        self.replicas = []
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):  # a forgotten engine must not leave actors pinning GPUs
        try:
            if getattr(self, "replicas", None):
                self.shutdown()
        except Exception:
            pass


def check_steps(limit: int | str | None, steps: int) -> None:
    """Refuse more inference steps than the scheduler has training timesteps (diffusers
    would raise it on every rank). `limit`: the figure, or a pipeline directory."""
    if isinstance(limit, str):
        limit = _num_train_timesteps(limit)
    if limit is not None and steps > limit:
        raise ValueError(
            f"num_inference_steps {steps} is more than the {limit} timesteps the model's scheduler "
            f"was trained with; use {limit} steps or fewer"
        )


def round_frames(model_dir: str, vae_temporal: int, frames):
    """A frame count the VAE cannot take as it is ((frames - 1) not a multiple of its temporal
    factor) -> the count the model's diffusers pipeline runs instead (its family's rule, e.g.
    Wan rounds 12 to 13, CogVideoX 10 to 9), said in one logged line; others unchanged."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % vae_temporal == 0:
        return frames
    from pathlib import Path

    from raydit.models.loading import pipeline_class
    from raydit.models.registry import family_for_class

    pipeline = pipeline_class(Path(model_dir))
    rounded = family_for_class(pipeline).round_frames(frames, vae_temporal)
    logging.getLogger("raydit").warning(
        "raydit: frames %d -> %d: the VAE takes %d k + 1 frames; rounded as diffusers' %s does",
        frames, rounded, vae_temporal, pipeline)
    return rounded


def _num_train_timesteps(model_dir: str) -> int | None:
    """The scheduler's training timesteps (the most inference steps it can take), read
    from the pipeline's scheduler config without loading anything."""
    import json
    from pathlib import Path

    config = Path(model_dir) / "scheduler" / "scheduler_config.json"
    try:
        value = json.loads(config.read_text()).get("num_train_timesteps")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def _plan_brief(plan) -> dict:
    return {
        "ulysses": plan.ulysses, "ring": plan.ring, "cfg": plan.cfg,
        "world_size": plan.world_size, "predicted_step_seconds": plan.predicted_step_seconds,
    }


def _cached_steps(job: Job) -> int:
    """Steps of the job served from the step cache (raydit.models.cache), from its checkpoint."""
    from raydit.models.cache import CACHED_STEPS

    carry = (job.checkpoint or {}).get("carry") or {}
    return int(from_wire(carry.get(CACHED_STEPS, 0)))


def _to_numpy(t) -> np.ndarray:
    import torch

    if isinstance(t, torch.Tensor):
        return t.detach().to(torch.float32).cpu().numpy()
    return np.asarray(t, dtype=np.float32)


def _progress(total: int, enabled: bool, initial: int = 0):
    if not enabled or os.environ.get("RAYDIT_NO_PROGRESS"):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="denoising", unit="step")
