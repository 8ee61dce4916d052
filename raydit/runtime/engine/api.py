"""The Engine's requests: a call's keywords made a GenerationRequest (the model's defaults,
the Engine's step caching and fused LoRA), the checks a request passes on the driver before
any worker sees it, its checkpoint directory, and the queue it waits in (the dispatcher)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

from raydit.runtime.controller import Job
from raydit.runtime.engine.validation import check_steps, round_frames
from raydit.runtime.options import ENGINE_DEFAULT
from raydit.runtime.queue import Item, load_progress, model_identity, next_request_dir, save_progress


class Requests:
    """Requests in, futures out. `queue`: the dispatcher (raydit.runtime.queue.Dispatcher);
    `planning`, `loras`, `replicas`: the parts a request is checked against."""

    def __init__(self, *, model: str, model_dir: str, takes_image: bool, call_defaults: dict, cache, cache_threshold,
                 checkpoint_dir, num_train_timesteps, model_identity: dict, planning, loras, replicas, queue, events,
                 sparse_attention=None):
        self.model, self.model_dir, self.takes_image = model, model_dir, takes_image
        self.call_defaults = call_defaults
        self.cache, self.cache_threshold = cache, cache_threshold
        self.sparse_attention = sparse_attention  # the Engine's default SparseConfig (None: dense)
        self.checkpoint_dir = checkpoint_dir
        self.num_train_timesteps = num_train_timesteps
        self.model_identity = model_identity
        self.planning, self.loras, self.replicas, self.queue = planning, loras, replicas, queue
        self._events = events
        # request-NNNN under checkpoint_dir: numbered after any an earlier engine left there
        # (next_request_dir), so a second engine on the same root never overwrites one.
        self._submitted = 0
        self._tags = 0
        # Request numbering has a lock of its own: submit() must not wait behind a recovery,
        # which holds the capacity lock while it regroups (seconds to minutes).
        self._count_lock = threading.Lock()

    def warm_up_request(self):
        """One request at the planned size, two steps, guidance on: the step a request runs,
        and a scheduler past its first step (the Engine's warm-up)."""
        from raydit.models.requests import GenerationRequest, image_to_png
        from raydit.models.requests import checker_image

        frames, height, width = self.planning.planned_geometry()
        return GenerationRequest(
            prompt="warm-up", num_frames=frames, height=height, width=width, num_inference_steps=2,
            guidance_scale=6.0, seed=0, image=image_to_png(checker_image(height, width)) if self.takes_image else None,
            cache=self.cache, cache_threshold=self.cache_threshold, lora=self.loras.fused_default(None))

    def build(self, given: dict):
        """submit's request keywords -> the GenerationRequest: the model's defaults for what is
        not given (steps and guidance: its diffusers pipeline's own, `call_defaults`), the image
        as PNG, the Engine's step caching and fused LoRA unless named."""
        from raydit.models.requests import GenerationRequest, image_to_png

        if not self.replicas.items:
            raise RuntimeError("engine is shut down; create a new Engine")
        cache = self.cache_choice(given["cache"], given["cache_threshold"])
        spec = self.planning.spec
        image = given["image"]
        if image is not None and not self.takes_image:
            raise ValueError(
                f"model {self.model!r} is a text-to-video pipeline and takes no image; drop the image "
                "or load an image-to-video checkpoint"
            )
        if image is None and self.takes_image:
            raise ValueError(f"model {self.model!r} is an image-to-video pipeline; give image=PIL.Image or a path")
        num_frames = round_frames(self.model_dir, spec.vae_temporal, given["num_frames"])
        return GenerationRequest(**{
            **given,
            "negative_prompt": given["negative_prompt"] or "",
            **{name: value for name, value in self.call_defaults.items() if given[name] is None},
            **self.steps_of_list(given),
            "num_frames": spec.default_frames if num_frames is None else num_frames,
            "height": spec.default_height if given["height"] is None else given["height"],
            "width": spec.default_width if given["width"] is None else given["width"],
            "image": None if image is None else image_to_png(image),
            "guidance_options": given["guidance_options"] or (),
            **cache,
            # the Engine's sparse setting unless the call names one (None: dense for this request)
            "sparse_attention": (self.sparse_attention if given["sparse_attention"] is ENGINE_DEFAULT
                                 else given["sparse_attention"]),
            "lora": self.loras.fused_default(given["lora"]),
        })

    @staticmethod
    def steps_of_list(given: dict) -> dict:
        """A step list given without num_inference_steps sets it (the model's default count
        never overrides a list); a count that disagrees is refused."""
        from raydit.models.schedules import steps_of_list

        lists = [given[k] if isinstance(given[k], (list, tuple)) else None for k in ("sigmas", "timesteps")]
        if given["num_inference_steps"] is not None or all(v is None for v in lists):
            return {}  # a count given: GenerationRequest holds it to the list's length
        return {"num_inference_steps": steps_of_list(None, *lists, flag="num_inference_steps")}

    def cache_choice(self, cache, cache_threshold) -> dict:
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
        self.check(request)
        job = None
        if checkpoint is not None:
            job = Job(request=request, checkpoint=checkpoint, step_index=int(checkpoint["step_index"]))
            self._events("resumed", directory=str(directory), step=job.step_index)
        return self.enqueue(request, callback_on_step_end, progress, str(directory), job).result()

    def check(self, request) -> None:
        """Refuse on the driver, before any worker sees it, what the workers would refuse:
        geometry (the planner's rules), more steps than the scheduler has timesteps, a
        size beyond what every replica's plan can hold, a LoRA that is not loaded."""
        from raydit.models.schedules import check_for_model

        g = self.planning.spec.geometry(request.num_frames, request.height, request.width)
        check_for_model(self.model_dir, request.scheduler, request.scheduler_options, request.sigmas,
                        request.timesteps)
        if request.sparse_attention is not None:  # the family's grid, the tiles against it
            from raydit.models.sparse_steps import check_sparse_for_model

            check_sparse_for_model(self.model_dir, request.sparse_attention,
                                   (g.token_frames, g.token_rows, g.token_cols))
        self.loras.check_request(request)
        self.say_one_branch_on_cfg(request)
        check_steps(self.num_train_timesteps, request.num_inference_steps)
        planned = self.planning.planned_geometry()
        if (request.num_frames, request.height, request.width) != planned:
            frames, height, width = planned
            if request.num_frames * request.height * request.width > frames * height * width:
                for r in self.replicas.items:
                    self.planning.check_fits(r, request)

    def say_one_branch_on_cfg(self, request) -> None:
        """A request without guidance on a replica planned with a cfg degree runs its one branch
        on every cfg group: said in one logged line (the fix: an Engine made with guidance=False)."""
        if request.do_cfg or request.true_cfg_scale > 1:
            return
        cfg = max((r.plan.cfg for r in self.replicas.items if r.plan is not None), default=1)
        if cfg > 1:
            import logging

            logging.getLogger("raydit").warning(
                "raydit: guidance_scale %g runs one guidance branch, but the plan has cfg %d: each cfg group runs "
                "that branch; for such requests make the Engine with guidance=False (--no-cfg) so the plan gives "
                "those devices to Ulysses, ring or replicas", request.guidance_scale, cfg)

    def enqueue(self, request, callback, progress, checkpoint_dir, job: Job | None = None,
                 tag: str | None = None, on_start: Callable | None = None) -> Future:
        if checkpoint_dir is None and self.checkpoint_dir is not None:
            with self._count_lock:
                self._submitted += 1
                n = self._submitted
            checkpoint_dir = next_request_dir(self.checkpoint_dir, n)
        if checkpoint_dir is not None and job is None:
            save_progress(checkpoint_dir, request, None, model=self.model_identity)  # the request, before step 0
        with self._count_lock:
            self._tags += 1
            n = self._tags
        item = Item(request=request, future=Future(), callback=callback, progress=progress,
                    checkpoint_dir=checkpoint_dir, job=job, tag=tag or f"request-{n}", on_start=on_start)
        return self.queue.put(item)

