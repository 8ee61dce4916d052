"""Step-wise denoising for any family: prepare -> step ... step -> decode, resumable anywhere.

The loop is ours (so the Ray runtime can run one step at a time, checkpoint between steps
and resume on another set of ranks); what a step means for a model comes from its family
(`raydit.models.family`): prompt encoding, initial latents, which transformer and inputs,
guidance scale, the scheduler step, the decode. The runner adds what is the same for every
family: sequence parallelism of every transformer the pipeline holds, classifier-free
guidance across ranks, and the state between steps as plain CPU tensors.

Guidance branches across ranks: a step's branches (`Family.guidance_branches`: uncond and cond
for classifier-free guidance, up to four passes for LTX-2) are shared out over the mesh's cfg
groups, the branch degree C (a divisor of the family's `max_branches`): group g evaluates the
g-th of C equal consecutive shares (on cfg 2, cfg_rank 0 the unconditional branch, 1 the
conditional one), they all-gather the predictions over the cfg group, and every rank combines
them the same way, does the same scheduler step and holds the same latents. A request with one
branch (guidance off) on a cfg mesh runs it on every group (no exchange): the same result as
one group, with no regroup.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from raydit.models.family import DenoiseState
from raydit.models.requests import GenerationRequest
from raydit.models.scheduler_state import live_scheduler_state, load_scheduler_state, pack_scheduler_state
from raydit.models.schedules import own_scheduler
from raydit.models.lora import activate as activate_lora
from raydit.models.lora import fused as fused_loras
from raydit.models.prepare import prepare_pipeline, release
from raydit.models.quantize_options import quantize_lora_refusal
from raydit.models.precision import run_precision
from raydit.models.text_encoding import (
    EncodeFailed,
    broadcast_branches,
    replica_size,
)
from raydit.models.sparse_steps import check_sparse_request, sparse_setting, sparse_step
from raydit.planner.runconfig import GroupModes, RunConfig


class Runner:
    """Runs one pipeline's requests step by step, alone or as one rank of a mesh."""

    def __init__(self, pipe, mesh=None, device="cpu", dtype: torch.dtype = torch.float32,
                 run: RunConfig | None = None, group: GroupModes | None = None,
                 init_dtype: torch.dtype | None = None):
        """run: the run's modes (raydit.planner.runconfig.RunConfig, the same on every rank for
        the Engine's life; default: none). group: what the group's plan adds (GroupModes:
        sharded weights, idle weights in host memory, the adapter's parallel options; the
        Engine's ranks derive it with RunConfig.for_group); default: `run`'s shard_weights as
        given, nothing else. The model is made ready by raydit.models.prepare (quantized,
        sharded, placed, parallelized, compiled) once, here.
        init_dtype: draw each request's initial state (its noise, the image's latents) as a
        run in that dtype does, then carry on in `dtype`: a float64 reference of a bf16 run
        starts from the bf16 run's very noise (raydit verify; CogVideoX and HunyuanVideo 1.5
        draw their noise in the run's dtype, and bf16 and float64 draws differ).
        full_precision_steps N (RunConfig): the first N and the last N steps of every request
        run without the quantized modes (the FP8 linears on their unquantized weights, which
        quantize then keeps beside the FP8 ones; attention on the run dtype's kernels), each
        such step equal to the unquantized model's step bit for bit."""
        from raydit.models.registry import family_for_pipeline

        run = RunConfig() if run is None else run
        if not isinstance(run, RunConfig):
            raise ValueError(f"run {run!r} must be a raydit.planner.runconfig.RunConfig")
        group = GroupModes(shard_weights=bool(run.shard_weights)) if group is None else group
        self.run = run
        self.quantize, self.attention = run.quantize, run.attention
        self.full_precision_steps, self.fp8_granularity = run.full_precision_steps, run.fp8_granularity
        self.family = family_for_pipeline(pipe)
        self.branch_degree = 1 if mesh is None else mesh.cfg
        most = self.family.max_branches
        if most % self.branch_degree:
            fits = ", ".join(str(d) for d in range(1, most + 1) if most % d == 0)
            raise ValueError(f"cfg_degree {mesh.cfg} does not divide the {most} guidance branches a "
                             f"{type(pipe).__name__} step runs at most; use {fits}")
        self.cfg_parallel = self.branch_degree > 1
        self._model_calls: dict = {}  # id(state.branches) -> idle passes per step (sharded weights)
        self.handles, self.sharded, self.compiled = [], [], []
        self._step_cache = None  # raydit.models.cache.StepCache, installed by the first cached request
        self._prepared = prepare_pipeline(pipe, self.family, mesh, torch.device(device), dtype, run, group)
        self.pipe = self._prepared.pipe
        self.encodes, self.offload_idle = self._prepared.encodes, self._prepared.offload_idle
        self.quantized, self.sharded = self._prepared.quantized, self._prepared.sharded
        self.handles, self.compiled = self._prepared.handles, self._prepared.compiled
        self.attention_mesh = self._prepared.attention_mesh
        self.device = torch.device(device)
        self.dtype = dtype
        self.init_dtype = init_dtype or dtype
        self.mesh = mesh
        self._last_state: DenoiseState | None = None
        # compile: the first request of each shape compiles the blocks in `prepare` (the
        # warm-up), so steps are timed without it. `warmup_seconds`: the last prepare's warm-up
        # (0: none needed).
        self.warmup_seconds = 0.0
        self._warm: set = set()

    @property
    def transformer(self):
        return self.family.transformers(self.pipe)[0]

    def close(self) -> None:
        """Restore the unparallelized transformers (sharded weights rebuilt whole: from the
        checkpoint files, or gathered over the replica for a model built in memory)."""
        if self._step_cache is not None:
            self._step_cache.remove()
            self._step_cache = None
        prepared = getattr(self, "_prepared", None)
        if prepared is not None:  # the step cache wrapped the compiled forwards: removed first
            release(prepared)
        self.handles, self.sharded, self.compiled = [], [], []
    # -- prepare -------------------------------------------------------------------------
    def _branches(self, request: GenerationRequest, positive: dict, negative: dict | None) -> tuple[tuple, int]:
        """(the model inputs of the transformer calls that evaluate this rank's share of the
        guidance branches, the number of branches of a step on all groups)."""
        branches = self.family.guidance_branches(self.pipe, request, positive, negative)
        n, C = len(branches), self.branch_degree
        if n > self.family.max_branches:
            raise RuntimeError(f"{self.family.name} made {n} guidance branches, more than its max_branches "
                               f"{self.family.max_branches}")
        shares = [branches]
        if n > 1 and C > 1:
            if n % C:
                raise ValueError(f"this request runs {n} guidance branches per step, which the mesh's cfg degree "
                                 f"{C} does not share out evenly; run it on a plan of cfg 1")
            k = n // C
            shares = [branches[g * k:(g + 1) * k] for g in range(C)]
            branches = shares[self.mesh.cfg_rank]
        calls = tuple(self.family.group_calls(branches))
        if self.sharded:
            # Sharded weights are gathered over the whole replica, cfg groups included: a group
            # that runs fewer transformer calls per step (LTX-2 shares four passes unevenly)
            # joins the others' block gathers with as many idle passes (`_idle_passes`).
            runs = [sum(map(self.family.call_runs_model, self.family.group_calls(s))) for s in shares]
            self._model_calls[id(calls)] = max(runs) - sum(map(self.family.call_runs_model, calls))
            while len(self._model_calls) > 4096:  # requests long gone (a live tuple's id is its own)
                del self._model_calls[next(iter(self._model_calls))]
        return calls, n

    @torch.no_grad()
    def prepare(self, request: GenerationRequest, checkpoint: dict | None = None) -> DenoiseState:
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"request must be a GenerationRequest, got {type(request).__name__}")
        family, pipe = self.family, self.pipe
        family.check_request(pipe, request)
        if request.true_cfg_scale != 1.0 and not family.true_cfg:
            raise ValueError(
                f"true_cfg_scale {request.true_cfg_scale:g} is for pipelines whose guidance is embedded in the model "
                f"(HunyuanVideo); {type(pipe).__name__} guides with guidance_scale: drop true_cfg_scale"
            )
        unknown = [name for name, _ in request.guidance_options if name not in family.option_names]
        if unknown:
            takes = ", ".join(family.option_names) or "none"
            raise ValueError(f"guidance option(s) {', '.join(unknown)} are not taken by {type(pipe).__name__} "
                             f"(it takes: {takes}); drop them")
        if request.lora and self.quantize is not None and not fused_loras(pipe):
            raise ValueError(quantize_lora_refusal(self.quantize, [f"LoRA {[name for name, _ in request.lora]}"]))
        if request.lora and self.compiled:
            raise ValueError(
                f"LoRA adapters {[name for name, _ in request.lora]} cannot run on compiled blocks (switching "
                "adapters would recompile them); fuse the LoRA into the weights or run without compile"
            )
        # The request's LoRA adapters (none: every transformer's base layers alone), set
        # before anything runs; adapters stay loaded, so switching costs no reload.
        activate_lora(pipe, family.transformers(pipe), request.lora)
        positive, negative = self._encode(request)
        # The generator lives on the CPU so latents and scheduler noise are the same on
        # every device and every world size.
        generator = torch.Generator("cpu").manual_seed(request.seed)
        # The request's own scheduler object (its class, options and step list), set up by init.
        scheduler = own_scheduler(pipe.scheduler, request)
        with self._scheduler_of(scheduler):
            prepared = family.init(pipe, request, generator, self.device, self.init_dtype)
        if self.init_dtype != self.dtype:
            prepared = dataclasses.replace(prepared, latents=self._from_init_dtype(prepared.latents),
                                           context={k: self._from_init_dtype(v) for k, v in prepared.context.items()})
        calls, branch_count = self._branches(request, positive, negative)
        state = DenoiseState(
            request=request,
            latents=prepared.latents,
            step_index=0,
            timesteps=prepared.timesteps,
            branches=calls,
            branch_count=branch_count,
            context=prepared.context,
            scheduler_state=live_scheduler_state(scheduler),
            carry=prepared.carry,
            generator_state=generator.get_state(),
            scheduler=scheduler,
        )
        check_sparse_request(family, pipe, state)
        if checkpoint is not None:
            state = self._resume(state, checkpoint)
        self._last_state = state
        self.warmup_seconds = self._warm_up(state) if self.compiled else 0.0
        return state

    def _from_init_dtype(self, value):
        """A tensor init made in init_dtype, in the run's dtype (others as they are: Wan's
        float32 latents stay float32 in any run, as in its pipelines)."""
        if isinstance(value, torch.Tensor) and value.dtype == self.init_dtype:
            return value.to(self.dtype)
        return value

    def _warm_up(self, state: DenoiseState) -> float:
        """Compile for this request's shapes, once per shape: one transformer call per branch
        and per expert the remaining steps use (Wan 2.2 A14B switches at a boundary), at the
        first step that expert runs, results dropped. Collective like a step (every rank
        prepares). Returns the seconds it took (0.0 when these shapes ran before)."""
        import time

        shapes = tuple(tuple(v.shape) for b in state.branches for v in b.values() if isinstance(v, torch.Tensor))
        key = (tuple(state.latents.shape), shapes)
        if key in self._warm or state.done:
            return 0.0
        t0 = time.perf_counter()
        experts: set[int] = set()
        for t in state.timesteps[state.step_index:]:
            expert = self.family.active_transformer(self.pipe, state, t)
            if id(expert) in experts:
                continue
            experts.add(id(expert))
            if self.offload_idle:
                self._place_expert(state, t)
            # full_precision_steps: the unquantized variant is a graph of its own
            for full in (False, True) if self.full_precision_steps else (False,):
                with self._precision(full):
                    for branch in state.branches:
                        self.family.predict(self.pipe, state, t, branch)
                self._idle_passes(state, t)
        self._warm.add(key)
        return time.perf_counter() - t0

    def _encode(self, request: GenerationRequest):
        """(positive, negative) on every rank: encoded on the encoding rank and broadcast over
        the replica (collective). A failed encoding reaches every rank, so none waits."""
        if replica_size(self.mesh) == 1:
            return self._encode_here(request)
        if not self.encodes:
            branches = broadcast_branches(None, self.mesh, self.device)
        else:
            try:
                branches = self._encode_here(request)
            except Exception as exc:
                broadcast_branches(EncodeFailed(f"{type(exc).__name__}: {exc}"), self.mesh, self.device)
                raise
            broadcast_branches(branches, self.mesh, self.device)
        if isinstance(branches, EncodeFailed):
            raise RuntimeError(f"the prompt encoding failed on the replica's encoding rank: {branches.message}")
        return branches

    def _encode_here(self, request: GenerationRequest):
        if not self.offload_idle:
            return self.family.encode(self.pipe, request, self.device, self.dtype)
        encoders = self.family.encoders(self.pipe)
        for module in encoders:
            module.to(self.device)
        try:
            return self.family.encode(self.pipe, request, self.device, self.dtype)
        finally:
            for module in encoders:
                module.to("cpu")

    def _place_expert(self, state: DenoiseState, t) -> None:
        """Offloading: the expert this step runs on the device, the others in host memory."""
        active = self.family.active_transformer(self.pipe, state, t)
        for transformer in self.family.transformers(self.pipe):
            if transformer is not active and transformer.device.type != "cpu":
                transformer.to("cpu")
        if active.device != self.device:
            active.to(self.device)

    def _resume(self, state: DenoiseState, checkpoint: dict) -> DenoiseState:
        saved = checkpoint.get("request")
        if saved is not None and GenerationRequest(**saved) != state.request:
            brief = {k: v for k, v in saved.items() if k != "image"}
            raise ValueError(f"checkpoint belongs to request {brief}, not this one; resume it with the same request")
        latents = checkpoint["latents"]
        if tuple(latents.shape) != tuple(state.latents.shape):
            raise ValueError(f"checkpoint latents {tuple(latents.shape)} do not match the request's {tuple(state.latents.shape)}")
        step_index = int(checkpoint["step_index"])
        if not 0 <= step_index <= state.num_steps:
            raise ValueError(f"checkpoint step_index {step_index} is outside 0..{state.num_steps}")
        carry = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v)
                 for k, v in (checkpoint.get("carry") or {}).items()}
        # A family that keeps the scheduler's dtype has bf16 latents after step 1 where init
        # gave float32: the checkpoint's dtype is then the run's at that step, kept, so a resumed
        # run equals an uninterrupted one. Otherwise the latents always have init's dtype.
        dtype = latents.dtype if self.family.keeps_scheduler_dtype else state.latents.dtype
        return dataclasses.replace(
            state,
            latents=latents.to(self.device, dtype),
            step_index=step_index,
            scheduler_state=checkpoint.get("scheduler_state", state.scheduler_state),
            carry=carry,
            generator_state=checkpoint["generator_state"].clone(),
        )

    # -- step ----------------------------------------------------------------------------
    def _gather_branches(self, rows: torch.Tensor) -> torch.Tensor:
        """cfg > 1: this group's branch predictions (one row each) -> every branch's, in
        `guidance_branches` order, on every rank."""
        rows = rows.contiguous()
        gathered = [torch.empty_like(rows) for _ in range(self.branch_degree)]
        # The cfg group's ranks ascend with cfg_rank, so position c holds cfg_rank c's share.
        dist.all_gather(gathered, rows, group=self.mesh.cfg_group)
        return torch.cat(gathered)

    @torch.no_grad()
    def step(self, state: DenoiseState) -> DenoiseState:
        """One denoising step. Collective: every rank of the mesh calls it with its state."""
        if state.done:
            raise ValueError(f"all {state.num_steps} steps are done; call decode(state)")
        family, pipe = self.family, self.pipe
        # The request's own scheduler, with this state's attributes loaded (an older state of
        # the same request may be stepped again), is the pipeline's for the step.
        with self._scheduler_of(state.scheduler, state):
            t = state.timesteps[state.step_index]
            if self.offload_idle:
                self._place_expert(state, t)

            cache = self._cache_step(state)
            # step caching may skip blocks; float64 stays float64
            with cache, run_precision(self.dtype), self._precision(self._full_precision(state)), \
                    self._sparse(state, sparse_setting(state)):
                noises = [family.predict(pipe, state, t, branch) for branch in state.branches]
            self._idle_passes(state, t)
            return self._advance(state, t, noises, cache)

    @contextlib.contextmanager
    def _scheduler_of(self, scheduler, state: DenoiseState | None = None):
        """`scheduler` (None: the pipeline's own) as `pipe.scheduler` while the family uses it,
        with `state`'s scheduler attributes loaded into it."""
        pipe = self.pipe
        base = pipe.scheduler
        own = base if scheduler is None else scheduler
        # Not `pipe.scheduler = ...`: DiffusionPipeline.__setattr__ would rewrite its config.
        object.__setattr__(pipe, "scheduler", own)
        try:
            if state is not None:
                load_scheduler_state(own, state.scheduler_state, self.device)
            yield own
        finally:
            object.__setattr__(pipe, "scheduler", base)

    def _full_precision(self, state: DenoiseState) -> bool:
        """Whether this step of the request is one of its first or last full_precision_steps."""
        n = self.full_precision_steps
        return bool(n) and (state.step_index < n or state.step_index >= state.num_steps - n)

    def _precision(self, full: bool):
        """The context a step's transformer calls run in: as asked, or (`full`) without the
        quantized modes (raydit.models.quantize.unquantized, full_precision_attention)."""
        stack = contextlib.ExitStack()
        if full:
            if self.quantize is not None:
                from raydit.models.quantize import unquantized

                stack.enter_context(unquantized(self.family.transformers(self.pipe)))
            if self.attention != "bf16":
                from raydit.parallel.attention import full_precision_attention

                stack.enter_context(full_precision_attention())
        return stack

    def _sparse(self, state: DenoiseState, config):
        """The context of a step's calls under sparse setting `config` (None: dense)."""
        grid = None if config is None else self.family.token_grid(self.pipe, state)
        return sparse_step(self.family, self.pipe, config, grid, self.attention, bool(self.handles))

    def _idle_passes(self, state: DenoiseState, t) -> None:
        """Sharded weights: the block gathers of the transformer calls this cfg group has fewer
        of than another group, this step (collective over the replica)."""
        missing = self._model_calls.get(id(state.branches), 0) if self.sharded else 0
        if missing:
            active = self.family.active_transformer(self.pipe, state, t)
            for sharded in self.sharded:
                if sharded.transformer is active:
                    for _ in range(missing):
                        sharded.handle.idle_pass()

    @torch.no_grad()
    def step_batch(self, states: list[DenoiseState]) -> list[DenoiseState]:
        """One denoising step of several requests whose transformer calls run as one batch
        (step-level batching): each at its own step and timestep, with its own guidance,
        seed, scheduler state and step count; their `Family.batch_key` must be equal and not
        None. Each returned state equals what `step` gives it alone (up to the batch size's
        rounding of the dtype). Collective like `step`: every rank calls it with the same
        requests in the same order."""
        if len(states) == 1:
            return [self.step(states[0])]
        family, pipe = self.family, self.pipe
        keys = {family.batch_key(pipe, s.request) for s in states}
        if len(keys) != 1 or None in keys:
            raise ValueError("these requests cannot share a step: their geometry, guidance, LoRA or caching "
                             "differ, or the family runs each alone (Family.batch_key)")
        if self.offload_idle:
            raise ValueError("requests cannot share a step with idle experts offloaded to host memory")
        for s in states:
            if s.done:
                raise ValueError(f"all {s.num_steps} steps are done; call decode(state)")
        ts = [s.timesteps[s.step_index] for s in states]
        noises: list[list] = [[] for _ in states]
        # Requests at timesteps on different experts (Wan 2.2 A14B) share calls per expert, and
        # requests at a full-precision step, or at a dense step of a sparse setting, share
        # theirs apart from the others.
        experts: dict[tuple, list[int]] = {}
        for i, (s, t) in enumerate(zip(states, ts)):
            key = (id(family.active_transformer(pipe, s, t)), self._full_precision(s), sparse_setting(s))
            experts.setdefault(key, []).append(i)
        with run_precision(self.dtype):
            for (_, full, sparse), part in experts.items():
                with self._precision(full), self._sparse(states[part[0]], sparse):
                    for call in range(len(states[part[0]].branches)):
                        out = family.predict_batch(pipe, [states[i] for i in part], [ts[i] for i in part],
                                                   [states[i].branches[call] for i in part])
                        for i, rows in zip(part, out.chunk(len(part))):
                            noises[i].append(rows)
                self._idle_passes(states[part[0]], ts[part[0]])
        out = []
        for s, t, n in zip(states, ts, noises):
            with self._scheduler_of(s.scheduler, s):
                out.append(self._advance(s, t, n))
        return out

    def _advance(self, state: DenoiseState, t, noises: list, cache=None) -> DenoiseState:
        """The transformer calls' rows of one step -> guidance (gathered over the cfg group,
        combined) and the scheduler's step -> the new state (the scheduler holds this
        request's state)."""
        family, pipe = self.family, self.pipe
        noise = torch.cat(noises) if len(noises) > 1 else noises[0]
        if state.branch_count > 1:  # one row per branch: this group's share, then all of them
            rows = self._gather_branches(noise) if self.cfg_parallel else noise
            noise = family.combine_guidance(pipe, state, t, *rows.chunk(state.branch_count))

        generator = torch.Generator("cpu")
        generator.set_state(state.generator_state)
        latents, carry = family.scheduler_step(pipe, state, noise, t, generator)
        if cache is not None:
            carry = cache.merge(carry)
        if not family.keeps_scheduler_dtype:
            latents = latents.to(state.latents.dtype)
        new = dataclasses.replace(
            state,
            latents=latents,
            step_index=state.step_index + 1,
            scheduler_state=live_scheduler_state(pipe.scheduler),
            carry=carry,
            generator_state=generator.get_state(),
        )
        self._last_state = new
        return new

    def _cache_step(self, state: DenoiseState):
        """The step cache's driver for this step (a no-op for a request without caching)."""
        from raydit.models.cache import NO_CACHE, StepCache

        if state.request.cache is None:
            return NO_CACHE
        if self._step_cache is None:
            self._step_cache = StepCache(self)
        return self._step_cache.begin(state)

    # -- checkpoint / decode -------------------------------------------------------------
    def checkpoint(self, state: DenoiseState) -> dict:
        """Plain CPU tensors and Python values; enough to resume on any mesh."""
        return {
            "request": state.request.to_dict(),
            "latents": state.latents.detach().to("cpu", copy=True),
            "step_index": state.step_index,
            "num_steps": state.num_steps,
            "scheduler_state": pack_scheduler_state(state.scheduler_state),
            "carry": {k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                      for k, v in state.carry.items()},
            "generator_state": state.generator_state.clone(),
        }

    @torch.no_grad()
    def output_latents(self, state: DenoiseState | None = None):
        """The final latents of `state` (default: the last state this runner prepared or stepped)
        as the family's pipeline returns them with output_type="latent" (Family.output_latents:
        LTX-2 unpacks and denormalizes its video and audio, a (video, audio) pair; Kandinsky 5
        I2V renormalizes its first frames), CPU copies: what GenerationResult.latents (and
        .audio_latents) and `raydit generate --save-latents` hold."""
        state = state if state is not None else self._last_state
        if state is None:
            raise ValueError("no latents yet: prepare a request first")
        out = self.family.output_latents(self.pipe, state)
        if isinstance(out, tuple):
            return tuple(t.detach().to("cpu", copy=True) for t in out)
        return out.detach().to("cpu", copy=True)

    @torch.no_grad()
    def decode(self, state: DenoiseState | None = None, latents: torch.Tensor | None = None,
               on_ranks: bool = False) -> np.ndarray | None:
        """uint8 frames [frames, height, width, 3] of `state` (default: the last state this
        runner prepared or stepped), optionally with other `latents` of the same request.

        on_ranks: a collective call on every rank of the mesh; the VAE decode is split by
        latent rows over them (raydit.models.vae_parallel, exact), the video is gathered to
        rank 0 and post-processed there alone: rank 0 returns the frames, the others None.
        `self.decode_ranks` says how many decoded; `self.decoded_audio` holds the sound the
        family made with the video (raydit.models.family.Audio, decoded where the frames are
        returned), or None."""
        state = state if state is not None else self._last_state
        if state is None:
            raise ValueError("nothing to decode: prepare a request first")
        latents = state.latents if latents is None else latents
        self.decode_ranks = 1
        self.decoded_audio = None
        if on_ranks and self.mesh is not None and self.mesh.world_size > 1:
            from raydit.models.vae_parallel import decode_on_ranks, supports_vae

            vae = getattr(self.pipe, "vae", None)
            if supports_vae(vae):
                with decode_on_ranks(vae) as info:  # the video lands on group rank 0
                    video = self.family.decode_video(self.pipe, state, latents)
                self.decode_ranks = info["ranks"]
                if dist.get_rank() != 0:
                    return None  # a placeholder video: nothing to post-process
                self.decoded_audio = self.family.decode_audio(self.pipe, state, latents)
                return self.family.postprocess(self.pipe, state, video)
        if on_ranks and self.mesh is not None and self.mesh.world_size > 1 and dist.get_rank() != 0:
            # A VAE decoded whole on every rank: the sound too is rank 0's alone.
            return self.family.decode(self.pipe, state, latents)
        self.decoded_audio = self.family.decode_audio(self.pipe, state, latents)
        return self.family.decode(self.pipe, state, latents)
