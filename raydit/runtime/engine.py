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
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from raydit.runtime.cluster import RayCluster, WorkerPool

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
        collective_timeout_s: float = 300.0,
        show_plan: bool = True,
    ):
        from raydit.models.loading import resolve_model_dir
        from raydit.planner import model_spec

        if device not in DEVICES:
            raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
        if workers is not None and workers < 1:
            raise ValueError(f"workers {workers} must be at least 1")
        for name, value in (("ulysses", ulysses), ("ring", ring), ("cfg", cfg)):
            if value is not None and value < 1:
                raise ValueError(f"{name} {value} must be at least 1")
        # Resolve the model before touching Ray: a typo costs no cluster start.
        self.model = model
        self.model_dir = str(resolve_model_dir(model))
        self.spec = model_spec(self.model_dir)
        self._timings: dict[str, float] = {}
        t0 = time.perf_counter()
        self.cluster = RayCluster.connect(address=address, want_workers=workers)
        try:
            self.device = self.cluster.resolve_device(device)
            self.dtype = dtype or ("bfloat16" if self.device == "cuda" else "float32")
            self.plan_result = self.cluster.plan(
                self.spec,
                frames=frames,
                height=height,
                width=width,
                device=self.device,
                workers=workers,
                ulysses=ulysses,
                ring=ring,
                cfg=cfg,
            )
            self.plan = self.plan_result.best
            if show_plan:
                print(self.describe_plan(), flush=True)
            self._timings["plan_seconds"] = time.perf_counter() - t0
            self.group: WorkerPool = self.cluster.start_pool(
                self.plan,
                model_dir=self.model_dir,
                device=self.device,
                dtype=self.dtype,
                placement_timeout_s=placement_timeout_s,
            )
            self._timings["group_seconds"] = self.group.form(self.plan, collective_timeout_s)
        except BaseException:
            if getattr(self, "group", None) is not None:
                self.group.close()
            self.cluster.close()
            raise
        self._collective_timeout_s = collective_timeout_s
        self._workers = workers
        self._timings.update(self.group.timings)
        self._timings["startup_seconds"] = time.perf_counter() - t0
        self.events: list[dict] = [
            {"event": "started", "plan": self.plan.to_dict(), "time": time.time()}
        ]

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

    def actor_ids(self) -> list[str]:
        return [info["actor_id"] for info in self.group.infos]

    def regroup(self, ulysses: int | None = None, ring: int | None = None, cfg: int | None = None):
        """Re-plan on this engine's workers with other degrees, keeping the actors and
        their loaded weights; the planner refuses an infeasible layout with its reason."""
        result = self.cluster.plan(
            self.spec,
            frames=None,
            height=None,
            width=None,
            device=self.device,
            workers=len(self.group.actors),
            ulysses=ulysses,
            ring=ring,
            cfg=cfg,
        )
        seconds = self.group.form(result.best, self._collective_timeout_s)
        self.plan_result, self.plan = result, result.best
        self.events.append(
            {"event": "regrouped", "plan": self.plan.to_dict(), "seconds": seconds, "time": time.time()}
        )
        return self.plan

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
        # Validate the geometry with the planner's rules before any worker sees it.
        self.spec.geometry(request.num_frames, request.height, request.width)
        if self.plan.cfg == 2 and guidance_scale <= 1.0:
            raise ValueError(
                f"guidance_scale {guidance_scale} turns classifier-free guidance off, but the "
                "plan runs it on 2 groups (cfg 2); use guidance_scale > 1 or an Engine with cfg=1"
            )
        timings: dict[str, float] = {}
        t_start = time.perf_counter()
        prep = self.group.prepare(request)
        timings["prepare_seconds"] = time.perf_counter() - t_start

        step_seconds = []
        checkpoint = None
        bar = _progress(prep["num_steps"], enabled=progress)
        t_loop = time.perf_counter()
        try:
            step = prep["step_index"]
            while step < prep["num_steps"]:
                t_step = time.perf_counter()
                checkpoint = self.group.step()
                step_seconds.append(time.perf_counter() - t_step)
                if bar is not None:
                    bar.update(1)
                if callback_on_step_end is not None:
                    checkpoint = self._run_callback(
                        callback_on_step_end, request, step, prep["timesteps"][step], checkpoint
                    )
                step += 1
        finally:
            if bar is not None:
                bar.close()
        timings["denoise_seconds"] = time.perf_counter() - t_loop
        timings["step_seconds"] = step_seconds
        t_dec = time.perf_counter()
        frames = self.group.decode()
        timings["decode_seconds"] = time.perf_counter() - t_dec
        timings["total_seconds"] = time.perf_counter() - t_start
        latents = checkpoint["latents"] if checkpoint is not None else self.group.latents()
        return GenerationResult(
            frames=frames,
            latents=_to_numpy(latents),
            plan=self.plan,
            timings=timings,
            request=request,
        )

    def _run_callback(self, callback, request, step, timestep, checkpoint):
        """diffusers' convention: callback(pipe, step, timestep, callback_kwargs) -> dict.

        A callback may return new latents; they are pushed to the workers through the
        same resume path a regrouping uses, so every rank continues from them.
        """
        latents = checkpoint["latents"]
        out = callback(self, step, timestep, {"latents": latents})
        if isinstance(out, dict) and "latents" in out and out["latents"] is not latents:
            import torch

            checkpoint = dict(checkpoint)
            checkpoint["latents"] = torch.as_tensor(out["latents"]).to(latents.dtype)
            self.group.prepare(request, checkpoint=checkpoint)
        return checkpoint

    # -- lifetime ----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, disconnect what we connected."""
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
