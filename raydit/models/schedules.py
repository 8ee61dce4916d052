"""A request's own scheduler: the class it names, its options and its explicit step list.

A request may name a diffusers scheduler class (`scheduler`), override its config
(`scheduler_options`) and give the steps as an explicit list (`sigmas` or `timesteps`), in
diffusers' terms:

- the scheduler is built from the pipeline's own scheduler config (`from_config`) with the
  options on top, so everything the request does not set is the checkpoint's;
- a pipeline whose scheduler names its shift otherwise keeps it (Wan's UniPC `flow_shift`
  becomes FlowMatch's `shift`), unless the request sets one; one logged line says so;
- the list goes to the scheduler's `set_timesteps` with diffusers' semantics: a flow-matching
  scheduler applies its `shift` to the sigmas it is given (shift 5 turns 1, 0.75, 0.5, 0.25
  into 1, 0.9375, 0.8333, 0.625), LTX's its `mu`. The family's own `set_timesteps` call
  (its device, its `mu`) is kept; only its step count and spacing are replaced by the list
  (`own_scheduler` binds the list to the scheduler object). That is also how a diffusers
  pipeline that takes no list (WanPipeline) is given one: the reference runs are built with
  `own_scheduler` too.

Every request gets its own scheduler object (`own_scheduler`), also when it sets nothing
(a copy of the pipeline's): requests served together never share one.

A scheduler that draws fresh noise at every step (FlowMatchLCMScheduler, ancestral and SDE
schedulers) is given the request's generator (`step`): the same on every rank, checkpointed
with the request, so the same seed gives the same video on any plan.

Imports stay light (no torch, no diffusers at the top): GenerationRequest checks its fields here.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math

log = logging.getLogger(__name__)

# Config names the same shift goes by in diffusers' schedulers (UniPC / DPM-Solver with flow
# sigmas: flow_shift; the FlowMatch schedulers: shift).
SHIFT_NAMES = ("shift", "flow_shift")


def normalize_options(options) -> tuple[tuple[str, object], ...]:
    """A dict or (name, value) pairs -> sorted pairs (hashable, equal to a checkpoint's JSON
    form); a value is a number, a bool, a string or None."""
    if options is None:
        return ()
    pairs = list(options.items()) if isinstance(options, dict) else [tuple(p) for p in options]
    out = {}
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str) or not pair[0]:
            raise ValueError(f"scheduler option {pair!r} must be a (name, value) pair, e.g. ('shift', 5.0)")
        name, value = pair
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"scheduler option {name}={value!r} must be finite")
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"scheduler option {name}={value!r} must be a number, a bool or a string")
        if name in out:
            raise ValueError(f"scheduler option {name} is given twice; give it once")
        out[name] = value
    return tuple(sorted(out.items()))


def normalize_steps(name: str, values) -> tuple[float, ...] | None:
    """An explicit step list (sigmas or timesteps) -> a tuple of floats, checked: not empty,
    finite, strictly decreasing, sigmas in (0, 1], timesteps > 0. None stays None."""
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} {values!r} must be a list of numbers, e.g. 1,0.75,0.5,0.25")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} entry {v!r} must be a finite number")
        out.append(float(v))
    if not out:
        raise ValueError(f"{name} is an empty list; give one value per step, e.g. 1,0.75,0.5,0.25, or drop it")
    for a, b in zip(out, out[1:]):
        if not b < a:
            raise ValueError(f"{name} {out} must fall step by step (each below the one before): {b:g} follows {a:g}")
    if name == "sigmas":
        bad = [v for v in out if not 0.0 < v <= 1.0]
        if bad:
            raise ValueError(f"sigma {bad[0]:g} is outside (0, 1]: a sigma list runs from at most 1 (pure noise) "
                             "down to above 0 (the scheduler's last step goes to 0)")
    elif out[-1] <= 0:
        raise ValueError(f"timestep {out[-1]:g} must be > 0 (the scheduler's last step goes to 0)")
    return tuple(out)


def parse_option_value(text: str):
    """A scheduler option's value as text (the command line's NAME=VALUE) -> true / false, an
    int, a float, "none" -> None, else the word itself."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(items, flag: str = "--scheduler-option") -> tuple[tuple[str, object], ...]:
    """NAME=VALUE strings (repeatable flag) -> normalized scheduler options."""
    out = []
    for item in items or ():
        name, sep, text = str(item).partition("=")
        if not sep or not name.strip() or not text.strip():
            raise ValueError(f"{flag} {item!r} must be NAME=VALUE, e.g. shift=5")
        out.append((name.strip(), parse_option_value(text)))
    return normalize_options(out)


def parse_steps(name: str, value) -> tuple[float, ...] | None:
    """A step list as the command line or a form gives it ("1,0.75,0.5,0.25", a JSON list as
    text, or a list) -> normalized floats (normalize_steps' checks)."""
    if isinstance(value, str):
        text = value.strip().removeprefix("[").removesuffix("]")
        value = [v.strip() for v in text.split(",")] if text.strip() else []
    if isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value):
        try:
            value = [float(v) for v in value]
        except ValueError:
            raise ValueError(f"{name} {','.join(map(str, value))!r} must be numbers separated by commas, "
                             "e.g. 1,0.75,0.5,0.25") from None
    return normalize_steps(name, value)


def steps_of_list(steps, sigmas, timesteps, flag: str = "--steps") -> int | None:
    """The step count of a request with an explicit list: the list's length; `steps` given and
    different is refused. None when no list is given (the caller's default applies)."""
    given = sigmas if sigmas is not None else timesteps
    if given is None:
        return steps
    if steps is not None and steps != len(given):
        which = "sigmas" if sigmas is not None else "timesteps"
        raise ValueError(f"{flag} {steps} disagrees with the {len(given)} {which} given; the list sets the step "
                         f"count: give {len(given)} or drop {flag}")
    return len(given)


@functools.lru_cache(maxsize=16)
def _model_scheduler(model_dir: str):
    import json
    from pathlib import Path

    path = Path(model_dir) / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    cls = _schedulers_cached().get(config.get("_class_name"))
    return None if cls is None else cls.from_config(config)


def check_for_model(model_dir: str, name=None, options=(), sigmas=None, timesteps=None) -> None:
    """The request's scheduler fields against the model directory's own scheduler, on the
    driver before any worker loads the model: an unknown or unfitting class (the fitting ones
    listed), an option the class does not take, a list its set_timesteps cannot use."""
    if name is None and not options and sigmas is None and timesteps is None:
        return
    base = _model_scheduler(str(model_dir))
    if base is None:
        return  # no scheduler config to check against: the workers' load refuses it
    own_scheduler(base, name=name, options=normalize_options(options), sigmas=sigmas, timesteps=timesteps)


def check_request_schedule(request) -> None:
    """The schedule fields of a request, checked together (one line each)."""
    if request.scheduler is not None and (not isinstance(request.scheduler, str) or not request.scheduler):
        raise ValueError(f"scheduler {request.scheduler!r} must be a diffusers scheduler class name, "
                         "e.g. FlowMatchEulerDiscreteScheduler")
    if request.sigmas is not None and request.timesteps is not None:
        raise ValueError("give sigmas or timesteps, not both: either list sets every step")
    steps = request.sigmas if request.sigmas is not None else request.timesteps
    if steps is not None and len(steps) != request.num_inference_steps:
        which = "sigmas" if request.sigmas is not None else "timesteps"
        raise ValueError(f"num_inference_steps {request.num_inference_steps} disagrees with the {len(steps)} "
                         f"{which} given; the list sets the step count: use {len(steps)} or drop the steps")


def _diffusers_scheduler_classes() -> dict:
    import diffusers
    from diffusers import SchedulerMixin

    out = {}
    for name in dir(diffusers):
        if name.endswith("Scheduler") and not name.startswith("_"):
            try:
                cls = getattr(diffusers, name)
                # A placeholder for a missing optional backend (torchsde) raises here.
                if isinstance(cls, type) and issubclass(cls, SchedulerMixin) and hasattr(cls, "set_timesteps"):
                    out[name] = cls
            except Exception:
                continue
    return out


def _is_flow(scheduler) -> bool:
    config = scheduler.config
    return (type(scheduler).__name__.startswith("FlowMatch") or bool(config.get("use_flow_sigmas"))
            or config.get("prediction_type") == "flow_prediction")


def fitting_schedulers(base) -> list[str]:
    """The scheduler class names that fit a pipeline whose own scheduler is `base`: diffusers'
    `compatibles` of it, and for a flow-matching pipeline every FlowMatch scheduler (diffusers
    lists UniPC's Karras family as compatible with Wan's UniPC, not FlowMatch's)."""
    names = {type(base).__name__} | {c.__name__ for c in base.compatibles}
    if _is_flow(base):
        names |= {n for n in _schedulers_cached() if n.startswith("FlowMatch")}
    return sorted(names)


def _init_names(cls) -> set[str]:
    return {n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "kwargs")}


def build_scheduler(base, name: str | None = None, options=(), *, label: str = "request"):
    """A new scheduler object: class `name` (default: `base`'s) from `base`'s config with
    `options` on top; the shift carried over where the two classes name it otherwise."""
    options = dict(options)
    if name is None and not options:
        import copy

        return copy.deepcopy(base)
    fits = fitting_schedulers(base)
    cls_name = name or type(base).__name__
    if cls_name not in fits:
        raise ValueError(f"scheduler {cls_name!r} does not fit this pipeline ({type(base).__name__}); "
                         f"use one of: {', '.join(fits)}")
    cls = _schedulers_cached().get(cls_name)
    if cls is None:  # listed as compatible, but diffusers could not import it (a missing backend)
        usable = ", ".join(n for n in fits if n in _schedulers_cached())
        raise ValueError(f"scheduler {cls_name!r} is not importable from this diffusers (a package it needs, e.g. "
                         f"torchsde, is missing): install that package or use one of: {usable}")
    takes = _init_names(cls)
    unknown = sorted(k for k in options if k not in takes)
    if unknown:
        raise ValueError(f"{cls_name} takes no option {', '.join(unknown)}; its options: {', '.join(sorted(takes))}")
    config = dict(base.config)
    if not any(n in options for n in SHIFT_NAMES):
        own = [n for n in SHIFT_NAMES if n in config and n in takes]
        theirs = [n for n in SHIFT_NAMES if n in config and n not in takes]
        wanted = [n for n in SHIFT_NAMES if n in takes and n not in config]
        if theirs and wanted and not own:
            options[wanted[0]] = config[theirs[0]]
            log.info("%s: %s gets the pipeline's %s %s=%g as %s (set %s to choose another)", label, cls_name,
                     type(base).__name__, theirs[0], config[theirs[0]], wanted[0], wanted[0])
    # Only the keys the class takes: from_config logs the others as unexpected.
    config = {k: v for k, v in config.items() if k in takes}
    try:
        return cls.from_config(config, **options)
    except Exception as e:  # noqa: BLE001 - a class that cannot start from this config raises anything
        raise ValueError(f"{cls_name} cannot be built from {type(base).__name__}'s config ({type(e).__name__}: "
                         f"{_first_line(e)}); set its options with scheduler_options or choose another scheduler") from None


def _first_line(e: BaseException) -> str:
    """An exception diffusers raised, as one line for a refusal."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _set_timesteps_from_list(scheduler, which: str, values: tuple[float, ...]) -> None:
    """Bind `values` to `scheduler.set_timesteps`: whoever sets its timesteps (a family's
    init, a diffusers pipeline) gets the list's steps, with its own device and `mu`."""
    original = scheduler.set_timesteps
    takes = inspect.signature(original).parameters
    if which not in takes:
        raise ValueError(f"{type(scheduler).__name__}.set_timesteps takes no {which} list; use a scheduler "
                         "that does (FlowMatchEulerDiscreteScheduler, FlowMatchLCMScheduler) or drop the list")

    @functools.wraps(original)
    def set_timesteps(num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None, **kwargs):
        if mu is not None:
            kwargs["mu"] = mu
        import numpy as np

        # An array, as diffusers' pipelines pass their own lists (UniPC's flow shift multiplies it).
        original(num_inference_steps=len(values), device=device, **{which: np.array(values, dtype=np.float64)},
                 **kwargs)

    # An instance attribute, not data: live_scheduler_state leaves it out.
    scheduler.set_timesteps = set_timesteps


def own_scheduler(base, request=None, *, name=None, options=(), sigmas=None, timesteps=None):
    """The scheduler object one request runs on: from `request`'s fields (or the keywords, for
    a reference run), built from the pipeline's scheduler `base`. With a step list, its
    `set_timesteps` uses the list (diffusers' semantics)."""
    if request is not None:
        name, options = request.scheduler, request.scheduler_options
        sigmas, timesteps = request.sigmas, request.timesteps
    scheduler = build_scheduler(base, name, options)
    if sigmas is not None and timesteps is not None:
        raise ValueError("give sigmas or timesteps, not both: either list sets every step")
    if sigmas is not None:
        _set_timesteps_from_list(scheduler, "sigmas", normalize_steps("sigmas", sigmas))
    elif timesteps is not None:
        _set_timesteps_from_list(scheduler, "timesteps", normalize_steps("timesteps", timesteps))
    if (sigmas is not None or timesteps is not None) and not scheduler.config.get("use_dynamic_shifting"):
        # Set the list once now (a scheduler shifted by the family's `mu` waits for it): a list
        # the class cannot run is one line here, on the driver's check too, not an error deep
        # in a worker's prepare. The family's own call sets it again on its device.
        try:
            scheduler.set_timesteps(device="cpu")
        except Exception as e:  # noqa: BLE001 - diffusers raises several kinds here
            raise ValueError(f"{type(scheduler).__name__} cannot run the {'sigmas' if sigmas is not None else 'timesteps'}"
                             f" list given ({_first_line(e)}); use FlowMatchEulerDiscreteScheduler or drop the list") from None
    return scheduler


@functools.lru_cache(maxsize=None)
def _schedulers_cached() -> dict:
    return _diffusers_scheduler_classes()


@functools.lru_cache(maxsize=None)
def _takes_generator(cls) -> bool:
    return "generator" in inspect.signature(cls.step).parameters


def step(scheduler, noise, t, sample, generator, **kwargs):
    """`scheduler.step(...)`'s new sample, with the request's `generator` where the step takes
    one (a scheduler that draws noise draws it from the request's seed, the same on every rank)."""
    if generator is not None and _takes_generator(type(scheduler)):
        kwargs["generator"] = generator
    return scheduler.step(noise, t, sample, return_dict=False, **kwargs)[0]
