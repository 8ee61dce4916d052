"""The Engine's API: generate / submit / resume, the checks a request passes on the driver,
and one request's run on a replica (its job, progress, callback, durable checkpoint, result).

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
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from raydit.runtime.controller import Job
from raydit.runtime.engine.validation import check_steps, note_frames, round_frames
from raydit.runtime.errors import Interrupted
from raydit.runtime.options import ENGINE_DEFAULT, call_controls, submit_signature
from raydit.runtime.queue import Item, load_progress, model_identity, next_request_dir, save_progress
from raydit.runtime.wire import from_wire, to_wire

_SUBMIT = submit_signature()
_GENERATE = submit_signature(progress=True, tag=False)
_CONTROLS = call_controls()


@dataclass
class GenerationResult:
    """What one `generate` call returns."""

    frames: np.ndarray  # uint8, frames x height x width x 3
    # float32, the final video latents as the model's pipeline returns them with
    # output_type="latent" (Family.output_latents: e.g. LTX-2's [1, C, F, H, W], denormalized)
    latents: np.ndarray
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
    # float32, the final audio latents as the pipeline returns them (LTX-2: [1, C, L, mel bins]);
    # None for a model without sound
    audio_latents: np.ndarray | None = None

    def save(self, path: str, fps: int | None = None) -> str:
        """Write the frames as an H.264 mp4 with imageio-ffmpeg, with the sound as an AAC stream
        when the model made one. fps None: the frame rate the sound was made for, else 8."""
        from raydit.runtime.video import playback_fps, write_mp4

        if fps is None:
            fps = playback_fps(getattr(self.audio, "frame_rate", None))
        write_mp4(path, self.frames, fps=fps, audio=self.audio)
        return path

    def save_latents(self, path: str) -> dict:
        """Write the latents (check_latents_path says where): PATH.npy holds the video latents,
        and a model with sound adds PATH-less-.npy + .audio.npy beside it; PATH.npz holds both
        (keys latents, audio_latents; the second only with sound). Returns {"latents": path,
        "audio_latents": its path or None}."""
        from raydit.runtime.video import audio_latents_path, check_latents_path

        check_latents_path(path)
        text = os.fspath(path)
        sound = self.audio_latents is not None
        if text.lower().endswith(".npz"):
            arrays = {"latents": self.latents, **({"audio_latents": self.audio_latents} if sound else {})}
            with open(text, "wb") as f:  # a file object: numpy adds no suffix of its own
                np.savez(f, **arrays)
            return {"latents": text, "audio_latents": text if sound else None}
        written = {"latents": text, "audio_latents": audio_latents_path(text) if sound else None}
        for key, array in (("latents", self.latents), ("audio_latents", self.audio_latents)):
            if written[key] is not None:
                with open(written[key], "wb") as f:
                    np.save(f, array)
        return written


class ApiPart:
    """The Engine's API (a part of raydit.runtime.engine.Engine)."""

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
    def kernel(self) -> str:
        return self.group.kernel

    @property
    def timings(self) -> dict[str, float]:
        return dict(self._timings)

    def _event(self, kind: str, **data) -> None:
        self.events.append({"event": kind, "time": time.time(), **data})

    def generate(self, *args, **kwargs) -> GenerationResult:
        """Generate one video and wait for it: `submit(...).result()`, with a progress bar by
        default. `image` (a PIL image, a path or a uint8 array) conditions an image-to-video
        pipeline."""
        call = _GENERATE.bind(self, *args, **kwargs)
        call.apply_defaults()
        # By name: generate has no `tag`, so its parameters do not line up with submit's.
        return self.submit(**{k: v for k, v in call.arguments.items() if k != "self"}).result()

    def submit(self, *args, **kwargs) -> Future:
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
        request = self._request(given)
        self._check_request(request)
        return self._enqueue(request, control["callback_on_step_end"], control["progress"],
                             control["checkpoint_dir"], tag=control["tag"], on_start=control["on_start"])

    def _request(self, given: dict):
        """submit's request keywords -> the GenerationRequest: the model's defaults for what is
        not given (steps and guidance: its diffusers pipeline's own, `call_defaults`), the image
        as PNG, the Engine's step caching and fused LoRA unless named."""
        from raydit.models.family import GenerationRequest, image_to_png

        if not self.replicas:
            raise RuntimeError("engine is shut down; create a new Engine")
        image = given["image"]
        if image is not None and not self.takes_image:
            raise ValueError(
                f"model {self.model!r} is a text-to-video pipeline and takes no image; drop the image "
                "or load an image-to-video checkpoint"
            )
        if image is None and self.takes_image:
            raise ValueError(f"model {self.model!r} is an image-to-video pipeline; give image=PIL.Image or a path")
        num_frames = round_frames(self.model_dir, self.spec.vae_temporal, given["num_frames"])
        return GenerationRequest(**{
            **given,
            "negative_prompt": given["negative_prompt"] or "",
            **{name: value for name, value in self.call_defaults.items() if given[name] is None},
            "num_frames": self.spec.default_frames if num_frames is None else num_frames,
            "height": self.spec.default_height if given["height"] is None else given["height"],
            "width": self.spec.default_width if given["width"] is None else given["width"],
            "image": None if image is None else image_to_png(image),
            "guidance_options": given["guidance_options"] or (),
            **self._cache_choice(given["cache"], given["cache_threshold"]),
            "lora": self._fused_default(given["lora"]),
        })

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
        request, checkpoint, model = load_progress(directory, with_model=True)
        # A file written before the model was recorded (model None) is taken as it is.
        if model is not None:
            mine = model_identity(self.model_dir)
            if (model.get("pipeline"), model.get("digest")) != (mine["pipeline"], mine["digest"]):
                raise ValueError(
                    f"{directory}: saved by model {model.get('path')!r} ({model.get('pipeline')}, config "
                    f"{model.get('digest')}), but this engine runs {mine['path']!r} ({mine['pipeline']}, config "
                    f"{mine['digest']}); resume it with that model, or start the request again without --resume")
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

    def _enqueue(self, request, callback, progress, checkpoint_dir, job: Job | None = None,
                 tag: str | None = None, on_start: Callable | None = None) -> Future:
        if checkpoint_dir is None and self.checkpoint_dir is not None:
            with self._count_lock:
                self._submitted += 1
                n = self._submitted
            checkpoint_dir = next_request_dir(self.checkpoint_dir, n)
        if checkpoint_dir is not None and job is None:
            save_progress(checkpoint_dir, request, None, model=self._model_identity)  # the request, before step 0
        with self._count_lock:
            self._tags += 1
            n = self._tags
        item = Item(request=request, future=Future(), callback=callback, progress=progress,
                    checkpoint_dir=checkpoint_dir, job=job, tag=tag or f"request-{n}", on_start=on_start)
        return self._dispatcher.put(item)

    def _execute(self, replica: Any, item: Item, batch: bool = True) -> GenerationResult:
        """Run (or resume) `item` on `replica`. Raises HandBack when the replica cannot
        finish it; the dispatcher then gives it, with its progress, to another. With
        max_batch > 1 a request that can share steps runs as a batch (_execute_batch;
        `batch` False: alone, as the warm-up runs, returning its result)."""
        key = self._batch_key(item.request) if batch else None
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

    def _begin(self, replica: Any, item: Item, slot: int = 0, alone: bool = True) -> Job:
        """`item`'s job, to be (re-)prepared on `replica` in `slot`, from its checkpoint.
        `alone`: no other request is in progress on the replica, so it may grow (a regroup
        would drop the prepared state of requests already running in a batch)."""
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
        if item.on_start is not None:
            try:
                item.on_start()
            except Exception as exc:  # the caller's hook; the request runs on
                self._event("on_start_failed", tag=item.tag, error=f"{type(exc).__name__}: {exc}")
        if self.elastic and self._grow != "never" and alone:
            # Steps left: the job's own count once prepared (diffusion forcing runs more than
            # num_inference_steps), the request's before.
            steps = job.num_steps or request.num_inference_steps
            replica.controller.maybe_grow(replica.plan, steps - job.step_index, job)
        return job

    def _step_hooks(self, item: Item):
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
                save_progress(item.checkpoint_dir, request, from_wire(job.checkpoint), model=self._model_identity)
            if getattr(self, "_interrupted", False):  # Ctrl-C ended the Engine's block: stop here
                where = f"; finish it with resume({item.checkpoint_dir!r})" if item.checkpoint_dir else ""
                raise Interrupted(f"interrupted after step {job.step_index} of {job.num_steps or '?'}{where}")

        return on_step, bar

    def _result(self, replica: Any, item: Item) -> GenerationResult:
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
            note_frames(self.model_dir, self.spec.vae_temporal, request.num_frames, int(np.shape(job.frames)[0]))
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
            events=self.events[item.first_event:],
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
        out = callback(self, step, job.timesteps[step], {"latents": latents, "num_steps": job.num_steps})
        if isinstance(out, dict) and "latents" in out and (out["latents"] is not latents
                                                           or latents._version != version):
            checkpoint = dict(job.checkpoint)
            checkpoint["latents"] = to_wire(torch.as_tensor(out["latents"]).to(latents.dtype))
            job.checkpoint = checkpoint
            job.prepared = False


ApiPart.generate.__signature__ = _GENERATE
ApiPart.submit.__signature__ = _SUBMIT


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
