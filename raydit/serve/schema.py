"""Request bodies of the Videos API and their checks against what the server's plan holds.

`POST /v1/videos` arrives as multipart/form-data (the `openai` client; every field a
string) or JSON. pydantic parses both the same way (lax mode turns "8" into 8); a field
it refuses, an unknown field, and a value beyond the server's limits all become a
`RequestError` naming the field, which the app answers with 400 and OpenAI's error shape.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model
from pydantic_core import PydanticCustomError

from raydit.models.schedules import steps_of_list
from raydit.runtime.options import OPTIONS, form_fields


class RequestError(ValueError):
    """A request the server refuses: HTTP status, the field (OpenAI's `param`), a message."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str = "invalid_value", headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.headers = headers or {}


def _not_a_bool(kind: type):
    """A numeric field's check before pydantic's: JSON's true / false is refused (lax mode
    would make `"num_frames": true` one frame)."""
    wanted = "a valid integer" if kind is int else "a valid number"

    def check(value):
        if isinstance(value, bool):
            raise PydanticCustomError("bool_not_number", f"Input should be {wanted}, not a boolean")
        return value

    return BeforeValidator(check)


def _video_create() -> type[BaseModel]:
    """POST /v1/videos's body, from the fields raydit.runtime.options declares: OpenAI's
    (prompt, model, size, seconds) and raydit's own, which the openai client sends through
    `extra_body`. `input_reference` (an image upload) is handled apart from this. Left out:
    None, except `cache` (left out: the server's --cache; null, "none" or "off": every step
    computed) and `lora` (None: the base model, on a --fuse-lora server its LoRA; a name at
    scale 1.0 or {name: scale}; in a form the name or that object as JSON text);
    `guidance_options`: the model's further knobs {name: value}, in a form as JSON text.
    A number field refuses true / false."""
    fields = {}
    for name, spec in form_fields().items():
        spec = dict(spec)
        annotation = spec.pop("annotation")
        numeric = [kind for kind in (int, float) if kind is annotation or kind in get_args(annotation)]
        if numeric:
            annotation = Annotated[annotation, _not_a_bool(numeric[0])]
        fields[name] = (annotation, Field(**spec) if "default" in spec else Field(..., **spec))
    return create_model("VideoCreate", __config__=ConfigDict(extra="forbid"), **fields)


VideoCreate = _video_create()
# The form's fields that are no request field, and the request fields `resolve` makes of each.
FORM_INPUTS = {"model": (), "size": ("width", "height"), "seconds": ("num_frames",)}
# The form's request fields: form name -> GenerationRequest's field. Every field of the form is
# here or in FORM_INPUTS, so none is accepted and then dropped.
FORM_REQUEST = {o.form_name: o.request for o in OPTIONS if o.form is not None and o.request is not None}
_unread = set(VideoCreate.model_fields) - set(FORM_REQUEST) - set(FORM_INPUTS)
if _unread:
    raise RuntimeError(f"POST /v1/videos fields {sorted(_unread)} reach no request field: give their option a "
                       "`request` in raydit.runtime.options, or read them in raydit.serve.schema.resolve")
# raydit's own fields, sent by the openai client through `extra_body`.
RAYDIT_FIELDS = tuple(n for n in VideoCreate.model_fields if n not in ("prompt", "model", "size", "seconds"))


class LoraCreate(BaseModel):
    """POST /v1/loras: a LoRA under the server's --lora-dir, loaded on every rank."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096, description="relative to the server's --lora-dir")
    name: str | None = None  # default: the directory's (or file's) name
    target: str = "transformer"  # Wan 2.2 A14B: "transformer_2" or "both"


@dataclass(frozen=True)
class Limits:
    """What the server accepts: the geometry its plan was made for, steps, fps, the model."""

    model: str
    max_frames: int
    max_height: int
    max_width: int
    max_steps: int
    default_steps: int
    fps: int
    vae_temporal: int
    default_guidance: float = 6.0  # the server's is the model's pipeline's own (Engine.call_defaults)
    steps_limited_by: str = "--max-steps"
    guidance_options: tuple[str, ...] = ()  # the names of the guidance options the model takes
    cache: str | None = None  # the server's step-cache method (--cache); None: every step computed
    model_dir: str | None = None  # a request's scheduler is checked against this pipeline's own


def parse_body(data: dict[str, Any], model: type[BaseModel] = VideoCreate) -> Any:
    """Validate a body (form fields or JSON) as `model`. Every refused field is named in the
    message; `param` is the first of them."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        parts, first = [], None
        for err in exc.errors():
            loc = err.get("loc", ())
            # str | dict | None fields report the member type tried ("lora.str"): name the field.
            field = str(loc[0]) if loc else "body"
            first = first or field
            if err.get("type") == "extra_forbidden":
                known = ", ".join(model.model_fields) + (", input_reference" if model is VideoCreate else "")
                parts.append(f"{field}: unknown field; known fields: {known}")
            else:
                parts.append(f"{field}: {err.get('msg')} (got {err.get('input')!r})")
        raise RequestError("; ".join(parts), param=first) from None


_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")


def parse_size(size: str) -> tuple[int, int]:
    """'720x480' -> (width 720, height 480)."""
    m = _SIZE.match(size)
    if not m:
        raise RequestError(f"size {size!r} must be WIDTHxHEIGHT in pixels, e.g. 720x480", param="size")
    return int(m.group(1)), int(m.group(2))


def frames_for_seconds(seconds: float, fps: int, vae_temporal: int) -> int:
    """The fewest frames the VAE takes ((frames - 1) a multiple of `vae_temporal`) that
    last at least `seconds` at `fps`."""
    wanted = max(1, math.ceil(seconds * fps - 1e-9))
    k = max(0, math.ceil((wanted - 1) / vae_temporal))
    return 1 + k * vae_temporal


def format_seconds(frames: int, fps: int) -> str:
    return f"{frames / fps:g}"


def resolve(body: VideoCreate, limits: Limits, spec, loras=(), fused: dict | None = None) -> dict:
    """The generation parameters of a valid body, checked against `limits`, the model's
    geometry rules (`spec.geometry`, the planner's), the LoRAs the server holds (`loras`:
    names; `fused`: a --fuse-lora server's {name: scale}) and its step caching (`limits.cache`).
    Raises RequestError naming the field."""
    if body.model is not None and body.model != limits.model:
        raise RequestError(
            f"model {body.model!r} is not served here; this server runs {limits.model!r}", param="model"
        )
    if body.size is not None:
        width, height = parse_size(body.size)
    else:
        width, height = limits.max_width, limits.max_height
    if body.num_frames is not None and body.seconds is not None:
        # Both given: they must name one length (num_frames would silently win over seconds).
        wanted = frames_for_seconds(body.seconds, limits.fps, limits.vae_temporal)
        if wanted != body.num_frames:
            raise RequestError(
                f"seconds {body.seconds:g} and num_frames {body.num_frames} disagree: {body.seconds:g} s at "
                f"{limits.fps} fps is {wanted} frames; give one of them", param="seconds",
            )
    if body.num_frames is not None:
        frames, frames_param = body.num_frames, "num_frames"
    elif body.seconds is not None:
        frames, frames_param = frames_for_seconds(body.seconds, limits.fps, limits.vae_temporal), "seconds"
    else:
        frames, frames_param = limits.max_frames, "num_frames"
    schedule = schedule_choice(body, limits.model_dir)
    # A step list sets the count: the server's default steps never override it.
    steps = body.num_inference_steps
    if steps is None:
        listed = schedule.get("sigmas") or schedule.get("timesteps")
        steps = len(listed) if listed else limits.default_steps
    try:
        steps_of_list(steps, schedule.get("sigmas"), schedule.get("timesteps"), flag="num_inference_steps")
    except ValueError as exc:
        raise RequestError(str(exc), param="num_inference_steps") from None
    if steps > limits.max_steps:
        raise RequestError(
            f"num_inference_steps {steps} is more than this server's limit of {limits.max_steps} "
            f"({limits.steps_limited_by})",
            param="num_inference_steps",
        )
    if frames > limits.max_frames:
        raise RequestError(
            f"{frames} frames ({frames_param}) is more than the {limits.max_frames} frames this "
            f"server's plan holds (--frames); at {limits.fps} fps that is "
            f"{format_seconds(limits.max_frames, limits.fps)} s",
            param=frames_param,
        )
    if height > limits.max_height or width > limits.max_width:
        raise RequestError(
            f"size {width}x{height} is beyond the {limits.max_width}x{limits.max_height} this "
            "server's plan holds (--width / --height)",
            param="size",
        )
    try:
        spec.geometry(frames, height, width)
    except ValueError as exc:
        param = frames_param if str(exc).startswith("frames") else "size"
        raise RequestError(f"{param}: {exc}", param=param) from None
    # What the server works out from the body and its limits; every other request field of the
    # form goes to the engine as the body set it (left out where not set: the engine's default).
    params = {
        "negative_prompt": body.negative_prompt or "",
        "num_frames": frames,
        "height": height,
        "width": width,
        "num_inference_steps": steps,
        "guidance_scale": body.guidance_scale if body.guidance_scale is not None else limits.default_guidance,
        # No seed: a fresh one, reported back in the video object (same prompt, new video).
        "seed": body.seed if body.seed is not None else secrets.randbelow(2**31),
        **cache_choice(body, limits.cache),
        "lora": lora_choice(body.lora, loras, fused),
        "guidance_options": guidance_choice(body.guidance_options, limits),
        **schedule,
    }
    for name, request in FORM_REQUEST.items():
        if request not in params and name in body.model_fields_set:
            params[request] = getattr(body, name)
    return params


def schedule_choice(body: VideoCreate, model_dir: str | None = None) -> dict:
    """The body's scheduler fields, only those it sets, in GenerationRequest's normal form:
    `scheduler_options` a JSON object (text in a form), `sigmas` / `timesteps` a list (in a form,
    numbers separated by commas or a JSON list); checked against the pipeline's own scheduler
    in `model_dir` where given. RequestError naming the field otherwise."""
    import json

    from raydit.models.schedules import check_for_model, normalize_options, parse_steps

    given = body.model_fields_set
    out = {"scheduler": body.scheduler or None} if "scheduler" in given else {}
    options = body.scheduler_options
    if isinstance(options, str):
        try:
            options = json.loads(options) if options.strip() else None
        except ValueError:
            raise RequestError(f"scheduler_options: {options!r} is not valid JSON; give an object such as "
                               '{"shift": 5}', param="scheduler_options") from None
    for name, parse in (("scheduler_options", lambda: normalize_options(options)),
                        ("sigmas", lambda: parse_steps("sigmas", body.sigmas)),
                        ("timesteps", lambda: parse_steps("timesteps", body.timesteps))):
        try:
            value = parse()
        except ValueError as exc:
            raise RequestError(f"{name}: {exc}", param=name) from None
        if name in given:  # set, also to nothing: read here, never passed on as the body has it
            out[name] = [list(v) for v in value] if name == "scheduler_options" else value and list(value)
    if out.get("sigmas") and out.get("timesteps"):
        raise RequestError("timesteps: give sigmas or timesteps, not both: either list sets every step",
                           param="timesteps")
    if model_dir is not None:
        try:
            check_for_model(model_dir, out.get("scheduler"), out.get("scheduler_options", ()), out.get("sigmas"),
                            out.get("timesteps"))
        except ValueError as exc:
            message = str(exc)
            param = "scheduler_options" if "takes no option" in message else next(
                (n for n in ("sigmas", "timesteps") if f"takes no {n}" in message), "scheduler")
            raise RequestError(f"{param}: {exc}", param=param) from None
    return out


def guidance_choice(value, limits: Limits) -> dict[str, Any]:
    """The `guidance_options` field -> {name: value} (lists for block indices; {} when not
    given), in GenerationRequest's normal form, each name one the model takes. A form sends
    the object as JSON text. RequestError (param "guidance_options") otherwise; the values'
    ranges are the family's to check when the video starts (its error is the video's)."""
    import json

    from raydit.models.requests import normalize_options

    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except ValueError:
            raise RequestError(f"guidance_options: {value!r} is not valid JSON; give an object such as "
                               '{"stg_scale": 0}', param="guidance_options") from None
    try:
        options = normalize_options(value)
    except ValueError as exc:
        raise RequestError(f"guidance_options: {exc}", param="guidance_options") from None
    unknown = [name for name, _ in options if name not in limits.guidance_options]
    if unknown:
        takes = ", ".join(limits.guidance_options) or "none"
        raise RequestError(f"guidance_options: {', '.join(unknown)} not taken by {limits.model} (it takes: {takes})",
                           param="guidance_options")
    return {name: list(v) if isinstance(v, tuple) else v for name, v in options}


def lora_choice(value, loaded, fused: dict | None = None) -> dict[str, float] | None:
    """The `lora` field of POST /v1/videos -> {name: scale} (None: the base model), checked
    against the LoRAs the server holds (`loaded`: names) and its fused one (`fused`:
    {name: scale} or None, on a --fuse-lora server: then every request runs with exactly that).
    A form sends text: a name, or the object as JSON. RequestError (param "lora") otherwise."""
    import json

    from raydit.models.lora import normalize_choice

    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestError(f"lora: {value!r} is not valid JSON; give a name or {{\"name\": scale}}",
                               param="lora") from None
    if isinstance(value, str) and not value.strip():
        value = None
    try:
        choice = dict(normalize_choice(value))
    except ValueError as exc:
        raise RequestError(f"lora: {exc}", param="lora") from None
    if fused:
        if choice and choice != fused:
            (name, scale), = fused.items()
            raise RequestError(
                f"lora: this server serves LoRA {name!r} fused into its weights at scale {scale:g} "
                f"(--fuse-lora), so every video uses it; leave lora out (or give {{\"{name}\": {scale:g}}})",
                param="lora",
            )
        return dict(fused)
    for name in choice:
        if name not in loaded:
            raise RequestError(
                f"lora: {name!r} is not loaded; loaded: {', '.join(sorted(loaded)) or 'none'} "
                "(load it with POST /v1/loras)", param="lora",
            )
    return choice or None


def lora_path(lora_dir: str | None, path: str):
    """`path` of POST /v1/loras, relative to the server's --lora-dir -> the LoRA's .safetensors
    file. Refused (RequestError, param "path") when no --lora-dir was given, when the path is
    absolute, or when it or the file it selects resolves outside --lora-dir (`..`, symlinks)."""
    from pathlib import Path

    from raydit.models.lora import lora_file

    if not lora_dir:
        raise RequestError("this server loads no LoRAs over HTTP: start raydit serve with --lora-dir DIR",
                           param="path", status=403, code="loras_disabled")
    root = Path(lora_dir).resolve()
    given = Path(path)
    if given.is_absolute() or "\x00" in path:
        raise RequestError(f"path {path!r} must be relative to the server's --lora-dir", param="path")
    inside = (root / given).resolve()  # follows every symlink on the way
    if not inside.is_relative_to(root):
        raise RequestError(f"path {path!r} leads outside the server's --lora-dir (.. or a symlink); "
                           "give a path inside it", param="path")
    try:
        file = lora_file(inside)
    except ValueError as exc:
        raise RequestError(f"path {path!r}: {str(exc).replace(str(inside), path)}", param="path",
                           status=404 if not inside.exists() else 400,
                           code="not_found" if not inside.exists() else "invalid_value") from None
    if not file.resolve().is_relative_to(root):
        raise RequestError(f"path {path!r}: its .safetensors file is a symlink leading outside the server's "
                           "--lora-dir; give a path inside it", param="path")
    return file


def cache_choice(body: VideoCreate, server_cache: str | None) -> dict:
    """The body's step caching, only the fields it sets (the engine applies its own default for
    the rest); RequestError naming the field for an unknown method, and for a threshold alone
    on a server that runs no cache (`server_cache` None: nothing it could apply to)."""
    from raydit.models.cache_options import check_cache

    given = {k: getattr(body, k) for k in ("cache", "cache_threshold") if k in body.model_fields_set}
    if isinstance(given.get("cache"), str) and given["cache"].strip().lower() in ("", "none", "off"):
        given["cache"] = None
    if "cache" in given:
        try:
            check_cache(given["cache"], given.get("cache_threshold"))
        except ValueError as exc:
            param = "cache_threshold" if str(exc).startswith("cache_threshold") else "cache"
            raise RequestError(f"{param}: {exc}", param=param) from None
    elif given.get("cache_threshold") is not None and server_cache is None:
        raise RequestError(
            f"cache_threshold: {given['cache_threshold']!r} has no cache method to apply to: this server runs "
            "every step (started without --cache); send \"cache\": \"fbcache\" or \"teacache\" with it, "
            "or leave cache_threshold out", param="cache_threshold",
        )
    return given


def lora_error(exc: ValueError, lora_dir: str | None) -> RequestError:
    """The engine's one-line refusal of a LoRA (checked before anything is loaded, so the
    engine keeps the adapters it had) as a 4xx naming the field it is about."""
    message = str(exc)
    if "fused into this engine" in message:
        return RequestError(message, param="name", status=409, code="lora_fused")
    if "already loaded" in message:
        return RequestError(message, param="name", status=409, code="conflict")
    if message.startswith("LoRA name"):
        return RequestError(message, param="name")
    if message.startswith("LoRA target"):
        return RequestError(message, param="target")
    if lora_dir:  # the file: not a LoRA, another model's, unreadable; the server's paths not shown
        message = message.replace(os.path.realpath(lora_dir), "<lora-dir>")
    return RequestError(message, param="path")


def scheduler_step_limit(model_dir: str) -> int | None:
    """The scheduler's `num_train_timesteps` (more inference steps than that are refused by
    the scheduler), read from the pipeline's diffusers config; None when it does not say."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "scheduler" / "scheduler_config.json"
    try:
        value = json.loads(path.read_text()).get("num_train_timesteps")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None
