"""Kandinsky 5 (text- and image-to-video).

What differs: text blocks run whole on every rank before the visual blocks, which alone are
split (the rotary table cut once per forward); cross-attention to the text keeps diffusers'
processor; channels-last latents with visual-conditioning channels; NABLA sparse attention runs
on one process only (refused under sequence parallelism); its VAE decoder is HunyuanVideo's
(raydit.models.decoders).

Where: `family` (the adapter and the Family), `tiny` (the tiny pipelines), `cases` (the
conformance cases)."""

from raydit.models.families.kandinsky5.family import FAMILY

__all__ = ["FAMILY"]
