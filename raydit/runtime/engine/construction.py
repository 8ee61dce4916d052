"""The Engine: its construction, and the rooms it is built of (one module each).

    options.EngineConfig   its settings, declared once with the command line's and serve's
    validation             what is checked before Ray starts (frames, steps, the family)
    replicas               replicas: start, controllers, warm-up, autoscaling, repair
    planning               re-planning after a loss or a join; regroup; fitting a request
    api                    generate / submit / resume, the request's checks, one request's run
    batching               step-level batching of requests that share a batch key
    loras                  the LoRA table every rank holds
    lifecycle              shutdown and the context manager
"""

from __future__ import annotations

import threading
import time

from raydit.runtime.cluster import RayCluster
from raydit.runtime.engine.api import ApiPart
from raydit.runtime.engine.batching import BatchingPart
from raydit.runtime.engine.lifecycle import LifecyclePart
from raydit.runtime.engine.loras import LoraPart
from raydit.planner.runconfig import RunConfig
from raydit.runtime.engine.planning import PlanningPart, plan_brief
from raydit.runtime.engine.replicas import Replica, ReplicasPart
from raydit.runtime.engine.validation import family_of, num_train_timesteps, round_frames
from raydit.runtime.options import EngineConfig, engine_signature
from raydit.runtime.queue import Dispatcher


class Engine(ApiPart, BatchingPart, ReplicasPart, PlanningPart, LoraPart, LifecyclePart):
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
    kernels' mode (raydit.parallel.kernels.ATTENTION_MODES); `full_precision_steps=N`: the
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
        from raydit.planner import model_spec

        self.config = c
        from raydit.models.quantize_options import check_quantize_device

        # The run's modes, checked once here, before Ray, and constant for the Engine's life: the
        # pool, every worker and every Runner get this very object (RunConfig). fp8 on an
        # explicit CPU run is refused here, on a resolved device below.
        self.run_config = RunConfig(compile=c.compile, quantize=c.quantize, attention=c.attention,
                                    full_precision_steps=c.full_precision_steps, shard_weights=c.shard_weights)
        if c.device == "cpu":
            check_quantize_device(self.run_config.quantize, c.device)
        # shard_weights: True: each rank of a replica keeps 1/N of every transformer block's
        # weights (raydit.models.sharded); False: never; None: where the planner needs it.
        if c.shard_weights not in (None, True, False):
            raise ValueError(f"shard_weights {c.shard_weights!r} must be True, False or None (the planner's choice)")
        if c.shard_weights and c.fuse_lora:
            raise ValueError("shard_weights cannot keep a LoRA fused into the weights (a regroup rebuilds the shards "
                             "from the checkpoint files, without it); drop fuse_lora or shard_weights")
        if c.shard_weights and c.workers == 1:
            raise ValueError("shard_weights needs 2 or more workers per replica to share the weights, workers is 1 "
                             "(every weight is resident on one rank anyway); drop shard_weights or use more workers")
        # Resolve the model and check the request before touching Ray: a typo costs no
        # cluster start.
        self.model = c.model
        self.model_dir = str(resolve_model_dir(c.model))
        self.takes_image = takes_image(self.model_dir)
        self.spec = model_spec(self.model_dir)
        # What a request leaves out of steps and guidance: the model's diffusers pipeline's own.
        self.call_defaults = family_of(self.model_dir).call_defaults(self.model_dir)
        self.plan_mode = self.run_config.mode(steps=self.call_defaults["num_inference_steps"])
        frames = round_frames(self.model_dir, self.spec.vae_temporal, c.frames)
        self.spec.geometry(frames, c.height, c.width)
        self._geometry = (frames, c.height, c.width)
        # Step caching for every request (off by default; checked by EngineConfig).
        self.cache, self.cache_threshold = c.cache, c.cache_threshold
        self._init_loras(c.loras, c.fuse_lora)  # checked against the model before Ray starts
        self._workers = c.workers
        self._forced = {"ulysses": c.ulysses, "ring": c.ring, "cfg": c.cfg}
        self._collective_timeout_s = c.collective_timeout_s
        self.checkpoint_dir = c.checkpoint_dir
        # request-NNNN under checkpoint_dir: numbered after any an earlier engine left there
        # (next_request_dir), so a second engine on the same root never overwrites one.
        self._submitted = 0
        from raydit.runtime.queue import model_identity

        self._model_identity = model_identity(self.model_dir)  # recorded in every checkpoint
        self._num_train_timesteps = num_train_timesteps(self.model_dir)
        self._grow = c.grow
        self.elastic = c.elastic
        self.events: list[dict] = []
        self._timings: dict[str, float] = {}
        self._dispatcher: Dispatcher | None = None
        # One recovery, repair or growth at a time takes from the cluster's free devices.
        self._capacity_lock = threading.RLock()
        # Request numbering has a lock of its own: submit() must not wait behind a recovery,
        # which holds the capacity lock while it regroups (seconds to minutes).
        self._count_lock = threading.Lock()
        self.replicas: list[Replica] = []
        t0 = time.perf_counter()
        self.cluster = RayCluster.connect(
            address=c.address, want_workers=None if c.workers is None else c.workers * c.replicas
        )
        try:
            self.device = self.cluster.resolve_device(c.device)
            check_quantize_device(self.run_config.quantize, self.device)  # a GPU's capability: its Runner checks
            self.dtype = c.dtype or ("bfloat16" if self.device == "cuda" else "float32")
            if c.workers is not None:
                # Fail early, naming the numbers, when K replicas of N cannot fit.
                self.cluster.cluster_spec(self.device, c.workers * c.replicas)
            self.plan_result = self.cluster.plan(
                self.spec, frames=frames, height=c.height, width=c.width, device=self.device,
                workers=c.workers, ulysses=c.ulysses, ring=c.ring, cfg=c.cfg,
                # re-plans after a loss take the planner's choice: one survivor runs unsharded
                shard_weights=self.run_config.shard_weights, mode=self.plan_mode,
            )
            plan = self.plan_result.best
            if c.show_plan:
                print(self.describe_plan(), flush=True)
            self._timings["plan_seconds"] = time.perf_counter() - t0
            self._placement_timeout_s = c.placement_timeout_s
            for k in range(c.replicas):
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
        self._step_timeout_s = c.step_timeout_s
        for r in self.replicas:
            self._attach_controller(r)
        self._dispatcher = Dispatcher(self.replicas, self._execute, self._repair, self._capacity_left)
        self.max_batch = c.max_batch
        self._tags = 0
        self._family = None  # the model's Family, for batch keys (looked up once)
        # Replicas that follow the queue: between `replicas` and `max_replicas`.
        self.min_replicas, self.max_replicas = c.replicas, c.max_replicas or c.replicas
        self.scale_up_wait_s, self.scale_down_idle_s = float(c.scale_up_wait_s), float(c.scale_down_idle_s)
        self._warmup = c.warmup
        self._next_index = c.replicas
        self._autoscaler: threading.Thread | None = None
        self._stop_scaling = threading.Event()
        self._event(
            "started", plan=plan_brief(plan), replicas=len(self.replicas),
            seconds=self._timings["startup_seconds"],
        )
        if c.warmup:
            try:
                self._warm_up()
            except BaseException:
                self.shutdown()
                raise
        if self.max_replicas > self.min_replicas:
            self._autoscaler = threading.Thread(target=self._autoscale_loop, name="raydit-autoscale", daemon=True)
            self._autoscaler.start()


Engine.__init__.__signature__ = engine_signature()
