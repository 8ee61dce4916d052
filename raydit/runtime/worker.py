"""One Ray actor per rank: loads the pipeline once, joins process groups, runs steps.

The actor is deliberately thin: the denoising math lives in the model layer
(`raydit.models.runner`), the collectives in `raydit.parallel`. The actor owns the
things that only exist inside a Ray worker process: its device, its TCPStore, its
process group, and the warm pipeline that survives across requests and regroupings.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from datetime import timedelta
from typing import Any


def _reported(where: str):
    """Re-raise whatever a call raises as a RankError: the classification (application,
    out of memory, collective broken by a peer) is made here, where the exception's real
    type is known, and travels to the driver as plain values (raydit.runtime.failures)."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                from raydit.runtime.failures import RankError

                raise RankError.wrap(exc, where) from None

        return guarded

    return wrap


class RankWorker:
    """Plain class; the engine wraps it with `ray.remote(...)` and its own options."""

    def __init__(self, model_dir: str, device: str, dtype: str = "float32", threads: int = 1):
        import torch

        torch.set_num_threads(max(1, int(threads)))
        self._model_dir = model_dir
        self._device_kind = device
        self._dtype_name = dtype
        self._pipe = None
        self._runner = None
        self._states: dict = {}  # slot -> the DenoiseState of a request in progress here (a batch: several)
        self._store = None
        self._loras: dict = {}  # name -> LoraSpec of the LoRA adapters loaded here
        self._kernels_seeded = False  # calibration's attention-kernel rates read (once)
        self.load_seconds = 0.0
        # The actor runs two calls at once (max_concurrency 2: pings and aborts answer while
        # a step runs), so a leave_group sent to unblock peers after a failure may overlap
        # the next join_group: joining and leaving take turns.
        self._group_lock = threading.RLock()

    # -- identity ----------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "actor_id": ctx.get_actor_id(),
        }

    def ping(self) -> int:
        return os.getpid()

    def device_memory(self, reset: bool = False) -> dict[str, float]:
        """This rank's device memory in GB: the peak torch allocated since the last reset and
        what its allocator holds now (zeros on a CPU rank). reset: start a new peak."""
        import torch

        if self._device_kind != "cuda" or not torch.cuda.is_initialized():
            return {"peak_gb": 0.0, "reserved_gb": 0.0}
        device = self._device()
        out = {"peak_gb": torch.cuda.max_memory_allocated(device) / 1e9,
               "reserved_gb": torch.cuda.memory_reserved(device) / 1e9}
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return out

    def weight_shards(self) -> dict[str, int]:
        """What this rank holds of the transformers' block weights (raydit.models.sharded): the
        replica size they are sharded over (1: whole), the bytes of its shards, the most it
        held at once during the steps since the group formed."""
        sharded = getattr(self._runner, "sharded", None) or []
        return {"ranks": sharded[0].handle.ranks if sharded else 1,
                "shard_bytes": sum(s.handle.resident_bytes - sum(f.numel() for f in s.handle._full.values())
                                   for s in sharded),
                "peak_bytes": sum(s.handle.peak_bytes for s in sharded)}

    # -- model -------------------------------------------------------------------------

    def _device(self):
        import torch

        if self._device_kind == "cuda":
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is always index 0 here.
            return torch.device("cuda", 0)
        return torch.device("cpu")

    def load(self) -> float:
        """Load the pipeline once; later calls are free. Returns the seconds it took."""
        if self._pipe is not None:
            return 0.0
        import torch

        from raydit.models.loading import load_pipeline

        t0 = time.perf_counter()
        dtype = getattr(torch, self._dtype_name)
        # Loaded in host memory: the runner of each group moves it to the device, after a rank
        # that does not encode prompts dropped its text encoder (raydit.models.text_encoding),
        # so that encoder never occupies this rank's device.
        self._pipe = load_pipeline(self._model_dir, device=None, dtype=dtype)
        self.load_seconds = time.perf_counter() - t0
        return self.load_seconds

    @_reported("sync_loras")
    def sync_loras(self, table: dict) -> list[str]:
        """Hold exactly the LoRA adapters of the engine's table (name -> LoraSpec), so every
        rank holds identical weights: unload what is no longer listed (or listed with another
        file), load what is missing, through diffusers' loaders (raydit.models.lora). The pool
        calls it whenever it forms a group, so a rank that joins later (recovery, growth) gets
        them too; already-loaded adapters cost nothing. Between requests only."""
        from raydit.models import lora
        from raydit.models.registry import family_for_pipeline

        self.load()
        for name in [n for n, spec in self._loras.items() if table.get(n) != spec]:
            lora.unload(self._pipe, name)
            del self._loras[name]
        family = family_for_pipeline(self._pipe)
        for name, spec in table.items():
            if name not in self._loras:
                lora.load(self._pipe, family, spec)
                self._loras[name] = spec
        return sorted(self._loras)

    # -- process groups ----------------------------------------------------------------

    def open_store(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0 hosts the rendezvous store on a port the OS picks (no free-port race)."""
        import ray
        import torch.distributed as dist

        ip = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(
            ip, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        return ip, int(self._store.port)

    @_reported("join_group")
    def join_group(
        self,
        rank: int,
        world_size: int,
        addr: tuple[str, int] | None,
        plan: Any,
        run: Any,
        backend: str,
        timeout_s: float,
    ) -> dict[str, Any]:
        """Join a fresh process group and make the warm pipeline run `plan` (a raydit.planner
        Plan: its degrees and choices) in the run's modes (`run`, a RunConfig)."""
        with self._group_lock:
            return self._join_group(rank, world_size, addr, plan, run, backend, timeout_s)

    def _join_group(self, rank, world_size, addr, plan, run, backend, timeout_s) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from raydit.models.runner import Runner
        from raydit.parallel.mesh import build_mesh

        self.load()
        self.leave_group()
        mesh = None
        if world_size > 1:
            if rank == 0:
                store = self._store
            else:
                host, port = addr
                store = dist.TCPStore(
                    host, port, is_master=False, timeout=timedelta(seconds=timeout_s)
                )
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
                device_id=self._device() if backend == "nccl" else None,
            )
            mesh = build_mesh(
                ulysses=plan.ulysses, ring=plan.ring, cfg=plan.cfg, replicas=1,
                timeout=timedelta(seconds=timeout_s),
            )
        # The plan's choices for this group (sharded weights over 2+ ranks, idle weights in host
        # memory, the audio split); the previous runner's close() rebuilt sharded weights whole.
        group = run.for_group(plan, world_size if mesh is not None else 1)
        # The kernel for the run's attention mode, chosen before the Runner takes the device.
        kernel = self._choose_kernel(ring=plan.ring if mesh is not None else 1, mode=run.attention)
        self._runner = Runner(self._pipe, mesh=mesh, device=self._device(), dtype=getattr(torch, self._dtype_name),
                              run=run, group=group)
        return {"rank": rank, "kernel": kernel,
                # linear layers this rank runs quantized (every transformer; 0 without quantize)
                "quantized": sum(len(q.names) for q in self._runner.quantized)}

    def _choose_kernel(self, ring: int, mode: str = "bf16") -> str:
        """Decide the attention kernel for the model's head dim now, not inside the first
        step: from the calibration cache where it measured this GPU's type, else by one
        bounded probe per process (raydit.parallel.kernels). Later joins reuse the choice.
        Returns the name of the kernel that runs: with ring 1 torch's SDPA (no lse needed),
        unless an 8-bit attention `mode` runs its own kernel (an error names the mode's fix)."""
        import torch

        from raydit.parallel.kernels import kernel_choice, plain_kernel

        if self._device_kind == "cuda" and not self._kernels_seeded:
            from raydit.runtime.calibration_cache import seed_kernel_choices

            seed_kernel_choices()
            self._kernels_seeded = True
        config = getattr(getattr(self._pipe, "transformer", None), "config", None)
        head_dim = getattr(config, "attention_head_dim", None)
        head_dim = head_dim if isinstance(head_dim, int) else None
        dtype = getattr(torch, self._dtype_name)
        lse_kernel = kernel_choice(self._device(), dtype, head_dim, mode)
        from raydit.parallel.kernels.lowbit import KERNELS as LOWBIT_KERNELS

        if lse_kernel.name not in LOWBIT_KERNELS and ring == 1 and plain_kernel(self._device(), dtype, lse_kernel.head_dim) is not None:
            return "sdpa"
        return lse_kernel.name

    def leave_group(self) -> None:
        """Undo the parallelization and destroy the process group (safe to call twice)."""
        from raydit.parallel.mesh import leave_default_group

        with self._group_lock:
            if self._runner is not None:
                self._runner.close()
                self._runner = None
            self._states = {}
            leave_default_group()
        # The store is kept: rank 0 may already have opened the next group's store, and a
        # new group always gets a new store on a new port (reusing one hangs).

    def abort_group(self) -> bool:
        """Called from the actor's second thread while a collective hangs in the first: an
        NCCL survivor of a dead peer would otherwise wait out the collective timeout
        (RAY-NOTES.md). Aborting the communicators makes the hung call raise. gloo needs no
        abort (a dead peer's closed socket already fails the call) and does not support it."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return False
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
        return True

    # -- one request -------------------------------------------------------------------

    @_reported("prepare")
    def prepare(self, request, checkpoint: dict | None = None, slot: int = 0) -> dict[str, Any]:
        """Prepare (or resume) `request` in `slot` (a batch holds several requests, one per slot)."""
        from raydit.runtime.wire import from_wire

        t0 = time.perf_counter()
        state = self._states[slot] = self._runner.prepare(request, checkpoint=from_wire(checkpoint))
        return {
            "seconds": time.perf_counter() - t0,
            "num_steps": int(state.num_steps),
            "step_index": int(state.step_index),
            "timesteps": [float(t) for t in state.timesteps],
            "warmup_seconds": float(self._runner.warmup_seconds),  # compiling for a new shape
        }

    @_reported("step")
    def step(self, want_checkpoint: bool, slots: list | None = None) -> dict | None:
        """One denoising step of the requests in `slots` (default: slot 0 alone), as one batch
        (Runner.step_batch), collective across the group. Rank 0 returns the checkpoints so
        the driver always holds the last finished step where no worker can lose it:
        {"checkpoints": {slot: its wire form (raydit.runtime.wire)}, "seconds": the step here,
        up to the checkpoints on the host}. The host copy waits for the step's device work, so
        those seconds are the rank's own step; the driver's round trip adds Ray's part."""
        from raydit.runtime.wire import to_wire

        slots = [0] if slots is None else list(slots)
        t0 = time.perf_counter()
        states = [self._states[s] for s in slots]
        states = [self._runner.step(states[0])] if len(states) == 1 else self._runner.step_batch(states)
        self._states.update(zip(slots, states))
        if not want_checkpoint:
            return None
        checkpoints = {s: to_wire(self._runner.checkpoint(state)) for s, state in zip(slots, states)}
        return {"checkpoints": checkpoints, "seconds": time.perf_counter() - t0}

    def forget(self, slot: int = 0) -> None:
        """Drop the request in `slot` (a request that left its batch unfinished)."""
        self._states.pop(slot, None)

    @_reported("decode")
    def decode(self, all_ranks: bool = False, slot: int = 0):
        """Frames of the request in `slot`, which then leaves it. all_ranks: every rank of the
        group is called and the decode is split over them; rank 0 returns (frames, ranks that
        decoded, audio, latents), the others None. audio: the sound the family made with the
        video (raydit.models.family.Audio) or None; latents: (video, audio or None) float32
        arrays in the pipeline's output_type="latent" layout (Runner.output_latents)."""
        import torch
        import torch.distributed as dist

        state = self._states.pop(slot)
        with torch.no_grad():
            if not all_ranks:
                return self._runner.decode(state)
            frames = self._runner.decode(state, on_ranks=True)
            if dist.is_initialized() and dist.get_rank() != 0:
                return None
            out = self._runner.output_latents(state)
        video, audio = out if isinstance(out, tuple) else (out, None)
        arrays = tuple(None if t is None else t.to(torch.float32).numpy() for t in (video, audio))
        return frames, self._runner.decode_ranks, self._runner.decoded_audio, arrays
