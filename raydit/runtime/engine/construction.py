"""The Engine: a thin facade over its parts (one module each), built here.

    options.EngineConfig   its settings, declared once with the command line's and serve's
    planner.RunConfig      the run's modes, built once here and given unchanged to every rank
    validation             what is checked before Ray starts (frames, steps, the family)
    events                 the event log every part records to
    loras                  LoraTable: the LoRA table every rank holds
    planning               Planning: the model's spec, its plans, re-planning, fitting a request
    replicas               Replicas: start, controllers, repair, LoRA sync, regroup; Autoscaler
    api                    Requests: a call made a request, its checks, its queue
    execute                RequestRunner: one request's run on a replica (the dispatcher's worker)
    batching               Batching: step-level batching of requests that share a batch key
    lifecycle              Lifecycle: shutdown in order, the context manager
    result                 GenerationResult

No part reads another's private state: each gets the parts it uses at construction.
"""

from __future__ import annotations

import time

from raydit.runtime.cluster import RayCluster
from raydit.runtime.engine.api import Requests
from raydit.runtime.engine.batching import Batching
from raydit.runtime.engine.events import EventLog
from raydit.runtime.engine.execute import RequestRunner
from raydit.runtime.engine.lifecycle import Lifecycle
from raydit.runtime.engine.loras import LoraTable
from raydit.runtime.engine.planning import Planning, plan_brief
from raydit.runtime.engine.replicas import Autoscaler, PoolSettings, Replicas
from raydit.runtime.engine.result import GenerationResult
from raydit.runtime.engine.validation import family_of, num_train_timesteps, round_frames
from raydit.runtime.options import EngineConfig, call_controls, engine_signature, submit_signature
from raydit.planner.runconfig import RunConfig
from raydit.runtime.queue import Dispatcher, model_identity

_SUBMIT = submit_signature()
_GENERATE = submit_signature(progress=True, tag=False)
_CONTROLS = call_controls()


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
    apart from `step_seconds` and `encode`. `quantize="fp8"`: the transformer blocks' linear
    layers as FP8 GEMMs on every rank (torchao; GPUs of compute capability 8.9+), "fp8-sim" the
    same numbers emulated on any device (raydit.models.quantize); `attention`: the attention
    kernels' mode (raydit.planner.modes.ATTENTION_MODES); `full_precision_steps=N`: the
    first and last N steps of every request run without those modes (a quantized run keeps its
    linears' bf16 weights for them, unsharded). `shard_weights=True`: each rank of a
    replica keeps 1/N of every transformer block's weights and gathers a block just before it
    runs (raydit.models.sharded; None: where the planner needs it to fit, False: never).
    `warmup=True`: before the constructor returns,
    every replica runs one two-step request at the planned size (kernel choice, allocator
    growth, compilation, decode), so no user's request pays them; `timings["warmup_seconds"]`.
    `max_replicas=K` (> replicas): replicas follow the queue: one more (the planner's best
    layout, on free devices) while a request has waited `scale_up_wait_s`, up to K; one idle
    for `scale_down_idle_s` with nothing waiting is taken out, down to `replicas`.
    `max_batch=N` (> 1): step-level batching: queued requests that can share a step with the
    one a replica runs (the family's batch key, Family.batch_key: same geometry, guidance
    branches, LoRA, no caching) join it at the next step boundary, up to N and what the plan's
    memory model holds, each with its own timestep, seed, steps and guidance scale, and leave
    when their own steps are done; `result.batched_with` names the requests (their `tag`s)
    each shared a step with.

    Every keyword is an EngineConfig field (raydit.runtime.options declares them once, with
    the command line's and serve's); `Engine.from_config(config)` takes one built already.
    """

    def __init__(self, *args, **kwargs):
        self._construct(EngineConfig(*args, **kwargs))

    @classmethod
    def from_config(cls, config) -> "Engine":
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config {config!r} must be an EngineConfig (raydit.runtime.options)")
        engine = cls.__new__(cls)
        engine._construct(config)
        return engine

    def _construct(self, c) -> None:
        from raydit.models.loading import resolve_model_dir, takes_image
        from raydit.models.quantize_options import check_quantize_device
        from raydit.planner import model_spec

        self.config = c
        self.lifecycle = Lifecycle()
        # The run's modes, checked once here, before Ray, and constant for the Engine's life: the
        # pool, every worker and every Runner get this very object. fp8 on an explicit CPU run is
        # refused here, on a resolved device below.
        self.run_config = RunConfig(compile=c.compile, quantize=c.quantize, attention=c.attention,
                                    full_precision_steps=c.full_precision_steps, shard_weights=c.shard_weights)
        if c.device == "cpu":
            check_quantize_device(self.run_config.quantize, c.device)
        # Resolve the model and check the request before touching Ray: a typo costs no
        # cluster start.
        self.model = c.model
        self.model_dir = str(resolve_model_dir(c.model))
        self.takes_image = takes_image(self.model_dir)
        spec = model_spec(self.model_dir)
        # What a request leaves out of steps and guidance: the model's diffusers pipeline's own.
        self.call_defaults = family_of(self.model_dir).call_defaults(self.model_dir)
        if not c.guidance:  # a distilled deployment: a request that leaves guidance out runs one branch
            self.call_defaults = {**self.call_defaults, "guidance_scale": 1.0}
        frames = round_frames(self.model_dir, spec.vae_temporal, c.frames)
        spec.geometry(frames, c.height, c.width)
        # Step caching for every request (off by default; checked by EngineConfig).
        self.cache, self.cache_threshold = c.cache, c.cache_threshold
        self.checkpoint_dir = c.checkpoint_dir
        self.elastic = c.elastic
        self.max_batch = c.max_batch
        self.min_replicas, self.max_replicas = c.replicas, c.max_replicas or c.replicas
        self._events = EventLog()
        self.loras_table = LoraTable(self.model_dir, self.run_config, c.loras, c.fuse_lora)  # checked before Ray
        t0 = time.perf_counter()
        self.cluster = RayCluster.connect(
            address=c.address, want_workers=None if c.workers is None else c.workers * c.replicas
        )
        self.lifecycle.add(self.cluster.close)
        self.replicas_part = None
        try:
            self.device = self.cluster.resolve_device(c.device)
            check_quantize_device(self.run_config.quantize, self.device)  # a GPU's capability: its Runner checks
            self.dtype = c.dtype or ("bfloat16" if self.device == "cuda" else "float32")
            if c.workers is not None:
                # Fail early, naming the numbers, when K replicas of N cannot fit.
                self.cluster.cluster_spec(self.device, c.workers * c.replicas)
            self.planning = Planning(
                self.cluster, spec, self.device, (frames, c.height, c.width),
                self.run_config.mode(steps=self.call_defaults["num_inference_steps"]),
                {"ulysses": c.ulysses, "ring": c.ring, "cfg": c.cfg}, c.workers, c.grow, self._events,
                guidance=c.guidance)
            self.planning.with_adapter_bytes(self.loras_table.adapter_bytes())
            # re-plans after a loss take the planner's choice: one survivor runs unsharded
            plan = self.planning.plan_start(workers=c.workers, ulysses=c.ulysses, ring=c.ring, cfg=c.cfg,
                                            shard_weights=self.run_config.shard_weights).best
            if c.show_plan:
                print(self.describe_plan(), flush=True)
            self.replicas_part = Replicas(
                PoolSettings(model_dir=self.model_dir, device=self.device, dtype=self.dtype, run=self.run_config,
                             placement_timeout_s=c.placement_timeout_s, collective_timeout_s=c.collective_timeout_s,
                             step_timeout_s=c.step_timeout_s, elastic=c.elastic, grow=c.grow, workers=c.workers),
                self.planning, self.loras_table, self._events.events, self._events)
            self.replicas_part.timings["plan_seconds"] = time.perf_counter() - t0
            for k in range(c.replicas):
                # The first replica goes where the plan placed it; the others are packed
                # onto what is left (each is checked against the cluster when reserved).
                self.replicas_part.start(k, plan, plan.placement if k == 0 else None)
        except BaseException:
            if self.replicas_part is not None:
                self.replicas_part.close()
            self.lifecycle.shutdown()
            raise
        timings = self.replicas_part.timings
        for key, value in self.replicas_part.items[0].pool.timings.items():
            timings[key] = value
        timings["startup_seconds"] = time.perf_counter() - t0
        for r in self.replicas_part.items:
            self.replicas_part.attach_controller(r)
        self.runner = RequestRunner(
            Batching(self.model_dir, c.max_batch, self.planning, self._events), self._events, self.model_dir,
            spec.vae_temporal, model_identity(self.model_dir), may_grow=c.elastic and c.grow != "never", pipe=self)
        self._dispatcher = Dispatcher(self.replicas_part.items, self.runner, self.replicas_part.repair,
                                      self.replicas_part.capacity_left)
        self.requests = Requests(
            model=self.model, model_dir=self.model_dir, takes_image=self.takes_image,
            call_defaults=self.call_defaults, cache=self.cache, cache_threshold=self.cache_threshold,
            checkpoint_dir=self.checkpoint_dir, num_train_timesteps=num_train_timesteps(self.model_dir),
            model_identity=model_identity(self.model_dir), planning=self.planning, loras=self.loras_table,
            replicas=self.replicas_part, queue=self._dispatcher, events=self._events,
            sparse_attention=c.sparse_attention)
        warm_up = (lambda replicas: self.runner.warm_up(replicas, self.requests.warm_up_request(), timings)
                   ) if c.warmup else None
        self.autoscaler = Autoscaler(self.replicas_part, self._dispatcher, self.min_replicas, self.max_replicas,
                                     c.scale_up_wait_s, c.scale_down_idle_s, c.replicas, warm_up, self._events)
        # Shut down in this order: no new replica, the queue drained, the actors, the cluster.
        self.lifecycle.add(self.replicas_part.close, first=True)
        self.lifecycle.add(self._dispatcher.close, first=True)
        self.lifecycle.add(self.autoscaler.stop, first=True)
        self._events("started", plan=plan_brief(plan), replicas=len(self.replicas_part.items),
                     seconds=timings["startup_seconds"])
        if warm_up is not None:
            try:
                warm_up(self.replicas_part.items)
            except BaseException:
                self.shutdown()
                raise
        self.autoscaler.start()

    # -- what a user (and the tests, serve and the CLI) read --------------------------------

    @property
    def replicas(self) -> list:
        return self.replicas_part.items if self.replicas_part is not None else []

    @property
    def events(self) -> list[dict]:
        return self._events.events

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

    @property
    def plan_result(self):
        return self.planning.plan_result

    @property
    def spec(self):
        return self.planning.spec

    @property
    def kernel(self) -> str:
        return self.group.kernel

    @property
    def timings(self) -> dict[str, float]:
        return dict(self.replicas_part.timings)

    def describe_plan(self) -> str:
        return self.planning.describe()

    # -- requests ---------------------------------------------------------------------------

    def generate(self, *args, **kwargs) -> GenerationResult:
        """Generate one video and wait for it: `submit(...).result()`, with a progress bar by
        default. `image` (a PIL image, a path or a uint8 array) conditions an image-to-video
        pipeline."""
        call = _GENERATE.bind(self, *args, **kwargs)
        call.apply_defaults()
        # By name: generate has no `tag`, so its parameters do not line up with submit's.
        return self.submit(**{k: v for k, v in call.arguments.items() if k != "self"}).result()

    def submit(self, *args, **kwargs):
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
        call = _SUBMIT.bind(self, *args, **kwargs)
        call.apply_defaults()
        given = {k: v for k, v in call.arguments.items() if k != "self"}
        control = {k: given.pop(k) for k in _CONTROLS}
        request = self.requests.build(given)
        self.requests.check(request)
        return self.requests.enqueue(request, control["callback_on_step_end"], control["progress"],
                                     control["checkpoint_dir"], tag=control["tag"], on_start=control["on_start"])

    def resume(self, directory: str, callback_on_step_end=None, progress: bool = True) -> GenerationResult:
        """Finish the request saved in `directory` (written with `checkpoint_dir`) from its
        last finished step, e.g. after the driver that ran it died; returns its result."""
        return self.requests.resume(directory, callback_on_step_end, progress)

    def regroup(self, ulysses: int | None = None, ring: int | None = None, cfg: int | None = None):
        """Re-plan a single-replica engine's warm workers with other degrees (fewer ranks is
        fine), keeping the actors and their loaded weights; an infeasible layout is refused
        with the planner's reason. Not while requests are running."""
        return self.replicas_part.regroup(self._dispatcher.cond, ulysses, ring, cfg)

    # -- LoRA adapters ------------------------------------------------------------------------

    def loras(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> path of the .safetensors file."""
        return self.loras_table.paths()

    @property
    def fused_lora(self) -> dict[str, float] | None:
        """{name: scale} of the LoRA fused into the weights (fuse_lora), or None."""
        return self.loras_table.fused_lora

    def load_lora(self, path, name: str | None = None, target: str = "transformer") -> str:
        """Load a LoRA on every rank of every replica (once; requests then choose it by name
        with `lora=`). `target`: "transformer", "transformer_2" (Wan 2.2 A14B's low-noise
        expert) or "both". Waits for running requests to finish. Returns the name."""
        return self.loras_table.load(path, name, target, self._sync_loras)

    def unload_lora(self, name: str) -> None:
        """Unload a LoRA from every rank; later requests cannot name it."""
        self.loras_table.unload(name, self._sync_loras)

    def _sync_loras(self, table: dict, previous: dict) -> None:
        self.replicas_part.sync_loras(self._dispatcher.cond, table, previous)

    # -- lifetime -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Cancel queued requests, wait for running ones, kill the actors, release their
        reservations, disconnect what we connected."""
        lifecycle = getattr(self, "lifecycle", None)
        if lifecycle is not None:
            lifecycle.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and getattr(self, "runner", None):
            # Ctrl-C: running requests stop at their next step (each finished step is in its
            # checkpoint directory, if it has one) instead of running to the end before shutdown.
            self.runner.interrupted = True
        self.shutdown()

    def __del__(self):  # a forgotten engine must not leave actors pinning GPUs
        try:
            if getattr(self, "replicas_part", None) is not None and self.replicas:
                self.shutdown()
        except Exception:
            pass


Engine.__init__.__signature__ = engine_signature()
Engine.generate.__signature__ = _GENERATE
Engine.submit.__signature__ = _SUBMIT
