"""SkyReels-V2 (text-, image-to-video and diffusion forcing for long videos).

What differs: Wan 2.1's transformer, so it builds on the Wan family (its processor, rotary,
encoding, decode and geometry, imported, not copied) and adds a block-causal attention mask, a
timestep per latent frame split with the video, and diffusion forcing's windowed loop (one
runner step per iteration of every window).

Where: `family` (the adapter and the Family, on Wan's), `tiny` (the tiny pipelines), `cases`
(the conformance cases)."""

from raydit.models.families.skyreels.family import FAMILY

__all__ = ["FAMILY"]
