"""A video request (`GenerationRequest`, the same for every family) and what the families share
around it and their diffusers pipelines (pure helpers):

- its image: PNG bytes as a request carries them (`image_to_png`, `png_to_image`), a
  deterministic `checker_image` (warm-ups, calibrations, conformance cases), the decoded
  frames as uint8 (`to_uint8_frames`);
- its geometry checked against the pipeline's VAE, one line per refusal (`check_frames`,
  `check_size`);
- the diffusers reference run of it (`reference_call`: the arguments every family's pipeline
  takes) and the linear-sigma flow-matching schedule two families' pipelines default to.

Imports stay light (no torch, no diffusers at the top): families import this at theirs.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


def image_to_png(image) -> bytes:
    """A PIL image, an array or a path -> PNG bytes (what a request carries: hashable,
    comparable, picklable). Raises ValueError with one line for anything else."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (bytes, bytearray)):
        data = bytes(image)
        try:
            Image.open(io.BytesIO(data)).verify()
        except (UnidentifiedImageError, OSError):
            raise ValueError("image bytes are not a readable image (PNG, JPEG, WebP ...)") from None
        return data
    if isinstance(image, (str, Path)):
        path = Path(image).expanduser()
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ValueError(f"image {str(image)!r} {what}; give the path of a PNG or JPEG file")
        try:
            img = Image.open(path)
            img.load()
        except (UnidentifiedImageError, OSError):
            raise ValueError(f"image {str(image)!r} is not an image file PIL can read (PNG, JPEG, WebP ...)") from None
    elif isinstance(image, Image.Image):
        img = image
    else:
        try:
            import numpy as np

            arr = np.asarray(image)
            if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] not in (3, 4):
                raise TypeError
            img = Image.fromarray(arr)
        except (TypeError, ValueError):
            raise ValueError(
                f"image of type {type(image).__name__} is not supported; give a PIL.Image, a path, "
                "or a uint8 array [height, width, 3]"
            ) from None
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def checker_image(height: int, width: int):
    """A deterministic RGB image with structure in both directions (uint8 [height, width, 3]):
    what a warm-up, a calibration or a conformance case hands an image-to-video pipeline."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 7) % 256, (y * 5) % 256, ((x // 4 + y // 4) % 2) * 255], axis=-1).astype(np.uint8)


def to_uint8_frames(frames):
    """Frames in [0, 1] (the video processor's "np" output) -> uint8, as every family returns."""
    import numpy as np

    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def png_to_image(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def check_frames(num_frames: int, temporal: int) -> None:
    """Refuse (one line) a frame count the VAE cannot take: it must be temporal k + 1."""
    if (num_frames - 1) % temporal:
        lower = num_frames - (num_frames - 1) % temporal
        raise ValueError(f"num_frames {num_frames} must be {temporal}k + 1; nearest: {lower} or {lower + temporal}")


def check_size(request, multiple: int, vae_scale: int | None = None, patch: int | None = None):
    """Refuse (one line) a height or width that is not a multiple of `multiple` (the VAE's scale
    x the patch, where both are given they are named)."""
    for label, value in (("height", request.height), ("width", request.width)):
        if value % multiple:
            lower = value - value % multiple
            nearest = f"{lower} or {lower + multiple}" if lower else f"{multiple}"
            why = f" (VAE scale {vae_scale} x patch {patch})" if vae_scale is not None else ""
            raise ValueError(f"{label} {value} must be a multiple of {multiple}{why}; nearest: {nearest}")


def linear_sigma_timesteps(pipe, steps: int, device, retrieve_timesteps):
    """The timesteps of the flow-matching pipelines whose default sigmas fall linearly from 1
    (np.linspace(1, 0, steps + 1)[:-1]), set on the pipeline's scheduler from its first step;
    `retrieve_timesteps`: the pipeline module's own."""
    import numpy as np

    sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]  # as the pipeline's default
    timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas)
    pipe.scheduler.set_begin_index(0)
    return timesteps


def reference_call(request, *, negative_none: bool = False, **extra) -> dict:
    """The request as a diffusers video pipeline's __call__ takes it for a reference run (the
    runner's results are held to it): prompt, negative prompt (None for an empty one where the
    pipeline expects that), frames, size, steps, guidance, a CPU generator seeded with the
    request's seed and output_type="latent"; `extra`: the family's own arguments."""
    import torch

    return dict(prompt=request.prompt, negative_prompt=(request.negative_prompt or None) if negative_none
                else request.negative_prompt, num_frames=request.num_frames, height=request.height,
                width=request.width, num_inference_steps=request.num_inference_steps,
                guidance_scale=request.guidance_scale,
                generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent", **extra)


def masked_prompt_branches(pipe, request, device, max_sequence_length: int) -> tuple[dict, dict | None]:
    """Both guidance branches' text inputs from a pipeline whose `encode_prompt` gives (embeds,
    mask, negative embeds, negative mask), as LTX-Video's and Mochi's do: the conditional branch,
    and the unconditional one (None without guidance)."""
    embeds, mask, negative, negative_mask = pipe.encode_prompt(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        do_classifier_free_guidance=request.do_cfg,
        max_sequence_length=max_sequence_length,
        device=device,
    )
    cond = {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}
    uncond = {"encoder_hidden_states": negative, "encoder_attention_mask": negative_mask} if request.do_cfg else None
    return cond, uncond


def round_frames_up(num_frames: int, vae_temporal: int) -> int:
    """The frame count Wan's and Kandinsky 5's pipelines run for `num_frames`: num_frames // t *
    t + 1 (their "Rounding to the nearest number"), at least 1."""
    return max(num_frames // vae_temporal * vae_temporal + 1, 1)


def normalize_options(options) -> tuple[tuple[str, Any], ...]:
    """Guidance options as a request keeps them: ((name, value), ...) sorted by name, lists made
    tuples (a checkpoint's JSON form compares equal). Raises ValueError with one line for a
    malformed name or value."""
    import math

    if options is None:
        return ()
    if isinstance(options, Mapping):
        items = list(options.items())
    elif isinstance(options, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2 for e in options):
        items = [tuple(e) for e in options]
    else:
        raise ValueError(f"guidance_options {options!r} must be a dict {{name: value}} or (name, value) pairs")
    out = {}
    for name, value in items:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"guidance option name {name!r} must be an identifier such as 'stg_scale'")
        if name in out:
            raise ValueError(f"guidance option {name!r} is given twice")
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ValueError(f"guidance option {name}={list(value)!r}: a list must hold integers (block indices)")
            value = tuple(value)
        elif isinstance(value, bool):
            pass
        elif isinstance(value, (int, float)):
            if not math.isfinite(value):
                raise ValueError(f"guidance option {name}={value!r} must be a finite number")
        else:
            raise ValueError(f"guidance option {name}={value!r} must be a number, a bool or a list of integers")
        out[name] = value
    return tuple(sorted(out.items()))


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One video request, the same for every family (a family ignores what it has no use for).

    `image`: PNG bytes (see `image_to_png`) for image-to-video pipelines, else None.
    `guidance_scale_2`: guidance of a second expert (Wan 2.2 A14B); None = guidance_scale.
    `true_cfg_scale`: classifier-free guidance of a pipeline whose `guidance_scale` is embedded
    in the model (HunyuanVideo): > 1 with a negative prompt runs the cond/uncond pair.
    `guidance_options`: a family's further guidance knobs by name (a pipeline with several
    guidance terms: their scales, the blocks a perturbed pass skips ...), given as a dict or
    (name, value) pairs and kept as sorted pairs; a value is a number, a bool or a tuple of
    integers. Each family says which names it takes and refuses the others (check_request).
    `scheduler`, `scheduler_options`, `sigmas` / `timesteps`: the request's own scheduler class,
    its config overrides and an explicit step list (raydit.models.schedules); None / () keep
    the pipeline's scheduler and spacing. A list sets the step count: num_inference_steps must
    equal its length.
    `sparse_attention`: block-sparse attention over the video tokens (raydit.planner.sparse:
    a SparseConfig, given as one, a method name or {"method": ..., option: value}); None: dense.
    Its first dense_step_count(num_inference_steps) steps run dense.
    """

    prompt: str
    negative_prompt: str = ""
    num_frames: int
    height: int
    width: int
    num_inference_steps: int = 50
    guidance_scale: float = 6.0
    guidance_scale_2: float | None = None
    true_cfg_scale: float = 1.0
    seed: int = 0
    image: bytes | None = field(default=None, repr=False)
    # LoRA adapters active for this request only: ((name, scale), ...), names of adapters
    # loaded on every rank (raydit.models.lora); () is the base model.
    lora: tuple[tuple[str, float], ...] = ()
    # Step caching (raydit.models.cache): None (every step computed), "fbcache" or "teacache";
    # cache_threshold None: the method's default.
    cache: str | None = None
    cache_threshold: float | None = None
    guidance_options: tuple[tuple[str, Any], ...] = ()
    scheduler: str | None = None
    scheduler_options: tuple[tuple[str, Any], ...] = ()
    sigmas: tuple[float, ...] | None = None
    timesteps: tuple[float, ...] | None = None
    sparse_attention: Any = None  # raydit.planner.sparse.SparseConfig | None

    def __post_init__(self):
        import math

        from raydit.models.lora import normalize_choice
        from raydit.models.schedules import check_request_schedule, normalize_steps
        from raydit.models.schedules import normalize_options as normalize_scheduler_options

        # Normalized here, so a checkpoint's JSON form (lists) compares equal to the request.
        object.__setattr__(self, "lora", normalize_choice(self.lora))
        object.__setattr__(self, "guidance_options", normalize_options(self.guidance_options))
        object.__setattr__(self, "scheduler_options", normalize_scheduler_options(self.scheduler_options))
        object.__setattr__(self, "sigmas", normalize_steps("sigmas", self.sigmas))
        object.__setattr__(self, "timesteps", normalize_steps("timesteps", self.timesteps))

        if not isinstance(self.prompt, str):
            raise ValueError(f"prompt {self.prompt!r} must be a string")
        if not isinstance(self.negative_prompt, str):
            raise ValueError(f"negative_prompt {self.negative_prompt!r} must be a string")
        for name in ("num_frames", "height", "width", "num_inference_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        if self.height % 8 or self.width % 8:
            raise ValueError(f"height {self.height} and width {self.width} must be multiples of 8 (the VAE's scale)")
        for name in ("guidance_scale", "guidance_scale_2", "true_cfg_scale"):
            value = getattr(self, name)
            if value is None and name == "guidance_scale_2":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} {value!r} must be a finite number >= 0 (1 disables guidance)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed {self.seed!r} must be an integer in [0, 2**63)")
        from raydit.models.cache_options import check_cache

        check_cache(self.cache, self.cache_threshold)
        check_request_schedule(self)
        from raydit.planner.sparse import as_sparse_config

        object.__setattr__(self, "sparse_attention", as_sparse_config(self.sparse_attention))
        if self.sparse_attention is not None:
            self.sparse_attention.dense_step_count(self.num_inference_steps)  # an N above the steps: refused
        if self.image is not None and not isinstance(self.image, bytes):
            raise ValueError("request image must be PNG bytes; build requests with image_to_png(image)")

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1.0

    def option(self, name: str, default=None):
        """The value of guidance option `name`, or `default` when the request does not set it."""
        return dict(self.guidance_options).get(name, default)

    def to_dict(self) -> dict:
        """Plain values for checkpoints and logs (the image as its bytes)."""
        from dataclasses import asdict

        return asdict(self)
