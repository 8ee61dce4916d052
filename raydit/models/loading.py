"""Resolve what a user names as a model into a local diffusers pipeline and load it.

A model is a built-in tiny pipeline of some family (`tiny`, `tiny-wan`, ...: random weights,
written once to a cache directory in diffusers' own format) or a local directory holding a
diffusers pipeline (`model_index.json` plus component folders, e.g. a downloaded
Wan-AI/Wan2.1-T2V-1.3B-Diffusers). The pipeline class in `model_index.json` picks the family
(raydit.models.registry); the planner's other built-in names describe geometry only.
"""

from __future__ import annotations

import json
from pathlib import Path


def pipeline_class(path: Path) -> str:
    """The pipeline class a diffusers directory names (model_index.json `_class_name`; "" for none)."""
    index = path / "model_index.json"
    try:
        return str(json.loads(index.read_text()).get("_class_name", ""))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{index}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def resolve_model_dir(model: str) -> Path:
    """Return the pipeline directory for `model`, building a tiny one on first use.

    Raises ValueError with one actionable line for anything that is not loadable.
    """
    from raydit.models.registry import family_for_class, tiny_models

    tiny = tiny_models()
    if model in tiny:
        return Path(tiny[model]())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise ValueError(
                f"model directory {str(path)!r} is not a diffusers pipeline (no model_index.json); "
                f"pass a directory saved with save_pretrained, or one of {', '.join(sorted(tiny))}"
            )
        class_name = pipeline_class(path)
        try:
            family_for_class(class_name)
        except ValueError as exc:
            raise ValueError(f"model directory {str(path)!r}: {exc}") from None
        return path.resolve()
    if path.exists():
        raise ValueError(f"model {model!r} is a file, not a diffusers pipeline directory")
    from raydit.planner import model_spec

    try:
        model_spec(model)
    except ValueError:
        raise ValueError(
            f"unknown model {model!r}: give {', '.join(sorted(tiny))} or a local diffusers pipeline directory"
        ) from None
    raise ValueError(
        f"model {model!r} is known to the planner but has no weights here; download its "
        "diffusers checkpoint and pass the local directory (e.g. --model ./Wan2.1-T2V-1.3B-Diffusers)"
    )


def takes_image(model_dir: str | Path) -> bool:
    """Whether the pipeline in `model_dir` is an image-to-video pipeline."""
    from raydit.models.registry import family_for_class

    class_name = pipeline_class(Path(model_dir))
    return class_name in family_for_class(class_name).image_pipelines


def load_pipeline(model: str | Path, device=None, dtype=None):
    """Load a supported pipeline through diffusers' ordinary `from_pretrained` path."""
    import diffusers
    import torch

    from raydit.models.registry import family_for_class
    from raydit.models.tiny import quiet_hub

    path = resolve_model_dir(str(model))
    pipeline_cls = getattr(diffusers, pipeline_class(path))
    components = family_for_class(pipeline_class(path)).load_components(path)
    # Loading bars from every rank would drown the generation's own progress bar; the
    # tokenizer's pre-truncation warning repeats what diffusers reports of the truncation.
    with quiet_hub():
        # A family's own components are not loaded (None) and are set once the pipeline is built
        # (diffusers checks a passed component against the saved class).
        pipe = pipeline_cls.from_pretrained(str(path), dtype=dtype or torch.float32, **dict.fromkeys(components))
    for name, component in components.items():
        setattr(pipe, name, component)
    # For the pipeline's life: the tokenizer warns that a prompt is longer than the model
    # takes before the pipeline truncates it, and diffusers' own warning names the truncated
    # words, which is what a user needs (once, not from every rank).
    import transformers

    transformers.utils.logging.set_verbosity_error()
    if device is not None:
        pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe
