"""Wan 2.1 / 2.2 (text- and image-to-video; one or two experts, TI2V-5B).

What differs: only the video in self-attention, the text (and Wan 2.1 I2V's CLIP image tokens)
by cross-attention, whole on every rank; Wan 2.2's two experts (the step's transformer chosen by
the timestep, `guidance_scale_2` below the boundary) and TI2V's timestep per token, split with
the video; one transformer call per guidance branch.

Where: `family` (the adapter and the Family), `tiny` (the tiny pipelines), `cases` (the
conformance cases)."""

from raydit.models.families.wan.family import FAMILY

__all__ = ["FAMILY"]
