"""LTX-Video (text- and image-to-video).

What differs: latents packed as tokens (patch 1) between steps; only the video in
self-attention, the T5 text by cross-attention (whole on every rank, diffusers' processor);
image-to-video gives every token its own timestep (the first frame at 0), split with the
tokens; both guidance branches as one batch; sigmas shifted by the token count.

Where: `family` (the adapter and the Family), `tiny` (the tiny pipelines), `cases` (the
conformance cases)."""

from raydit.models.families.ltx.family import FAMILY

__all__ = ["FAMILY"]
