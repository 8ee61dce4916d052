"""What an Engine checks before Ray starts: the model's frame rule, its scheduler's steps,
its family (looked up once from the pipeline directory)."""

from __future__ import annotations

import json
import logging
from pathlib import Path


def family_of(model_dir: str):
    """The Family of the pipeline in `model_dir` (raydit.models.registry)."""
    from raydit.models.loading import pipeline_class
    from raydit.models.registry import family_for_class

    return family_for_class(pipeline_class(Path(model_dir)))


def check_steps(limit: int | str | None, steps: int) -> None:
    """Refuse more inference steps than the scheduler has training timesteps (diffusers
    would raise it on every rank). `limit`: the figure, or a pipeline directory."""
    if isinstance(limit, str):
        limit = num_train_timesteps(limit)
    if limit is not None and steps > limit:
        raise ValueError(
            f"num_inference_steps {steps} is more than the {limit} timesteps the model's scheduler "
            f"was trained with; use {limit} steps or fewer"
        )


def round_frames(model_dir: str, vae_temporal: int, frames):
    """A frame count the VAE cannot take as it is ((frames - 1) not a multiple of its temporal
    factor) -> the count the model's diffusers pipeline runs instead (its family's rule, e.g.
    Wan rounds 12 to 13, CogVideoX 10 to 9), said in one logged line; others unchanged."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % vae_temporal == 0:
        return frames
    from raydit.models.loading import pipeline_class

    pipeline = pipeline_class(Path(model_dir))
    rounded = family_of(model_dir).round_frames(frames, vae_temporal)
    logging.getLogger("raydit").warning(
        "raydit: frames %d -> %d: the VAE takes %d k + 1 frames; rounded as diffusers' %s does",
        frames, rounded, vae_temporal, pipeline)
    return rounded


def note_frames(model_dir: str, vae_temporal: int, asked: int, got: int) -> None:
    """Say in one logged line when the video has another frame count than the request asked for
    (as the model's diffusers pipeline gives it: CogVideoX's VAE decodes an even number of latent
    frames into 4 per latent frame, so 5 frames come back as 8)."""
    if asked == got:
        return
    from raydit.models.loading import pipeline_class

    latent = (asked - 1) // vae_temporal + 1
    logging.getLogger("raydit").warning(
        "raydit: num_frames %d gave %d frames, as diffusers' %s does (its VAE decodes the %d latent frames "
        "into %d)", asked, got, pipeline_class(Path(model_dir)), latent, got)


def num_train_timesteps(model_dir: str) -> int | None:
    """The scheduler's training timesteps (the most inference steps it can take), read
    from the pipeline's scheduler config without loading anything."""
    config = Path(model_dir) / "scheduler" / "scheduler_config.json"
    try:
        value = json.loads(config.read_text()).get("num_train_timesteps")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None
