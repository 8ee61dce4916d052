"""What one `generate` call returns (`GenerationResult`): the frames, the latents, the sound,
the plan, the timings and the request's events."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
