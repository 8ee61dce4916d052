"""Resolve what a user names as a model into a local diffusers pipeline and load it.

A model is either `tiny` (the built-in random-weight pipeline, written once to a cache
directory in diffusers' own format) or a local directory holding a diffusers pipeline
(`model_index.json` plus component folders, e.g. a downloaded THUDM/CogVideoX-2b).
The planner's other built-in names describe geometry only: they have no weights here.
"""

from __future__ import annotations

import json
from pathlib import Path

# Pipelines the runtime can serve end to end; checked before anything heavy is loaded.
# (The CogVideoX adapter also parallelizes the image-to-video transformer, but the runner
# has no image input yet.)
SUPPORTED_PIPELINES = ("CogVideoXPipeline",)


def resolve_model_dir(model: str) -> Path:
    """Return the pipeline directory for `model`, building `tiny` on first use.

    Raises ValueError with one actionable line for anything that is not loadable.
    """
    if model == "tiny":
        from raydit.models.tiny import tiny_pipeline_dir

        return Path(tiny_pipeline_dir())
    path = Path(model).expanduser()
    if path.is_dir():
        index = path / "model_index.json"
        if not index.is_file():
            raise ValueError(
                f"model directory {str(path)!r} is not a diffusers pipeline (no model_index.json); "
                "pass a directory saved with save_pretrained, or 'tiny'"
            )
        try:
            class_name = json.loads(index.read_text()).get("_class_name")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{index}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if class_name not in SUPPORTED_PIPELINES:
            raise ValueError(
                f"model directory {str(path)!r} holds a {class_name}; raydit runs "
                f"{', '.join(SUPPORTED_PIPELINES)}"
            )
        return path.resolve()
    if path.exists():
        raise ValueError(f"model {model!r} is a file, not a diffusers pipeline directory")
    from raydit.planner import model_spec

    try:
        model_spec(model)
    except ValueError:
        raise ValueError(
            f"unknown model {model!r}: give 'tiny' or a local diffusers pipeline directory"
        ) from None
    raise ValueError(
        f"model {model!r} is known to the planner but has no weights here; download its "
        "diffusers checkpoint and pass the local directory (e.g. --model ./CogVideoX-2b)"
    )


def load_pipeline(model: str | Path, device=None, dtype=None):
    """Load a supported pipeline through diffusers' ordinary `from_pretrained` path."""
    import diffusers
    import torch

    # Loading bars from every rank would drown the generation's own progress bar.
    diffusers.utils.logging.disable_progress_bar()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # The tokenizer warns that a prompt is longer than the model takes before the pipeline
    # truncates it; diffusers' own warning names the truncated words, which is what counts.
    transformers.utils.logging.set_verbosity_error()
    path = resolve_model_dir(str(model))
    class_name = json.loads((path / "model_index.json").read_text())["_class_name"]
    pipeline_cls = getattr(diffusers, class_name)
    pipe = pipeline_cls.from_pretrained(str(path), dtype=dtype or torch.float32)
    if device is not None:
        pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe
