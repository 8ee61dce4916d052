"""CogVideoX (2b, 5b, 1.5; text- and image-to-video), the family the others are read against.

What differs: the text is IN the attention sequence (text chunk and video chunk on every rank,
both split); positions sinusoidal (2b) or rotary (5b), a temporal patch of 2 (1.5, padded with
prepended frames); image-to-video by channels; both guidance branches as one batch; DDIM or
CogVideoX's DPM scheduler, whose previous x0 is carried between steps.

Where: `family` (the adapter and the Family), `tiny` (the tiny pipelines), `cases` (the
conformance cases)."""

from raydit.models.families.cogvideox.family import FAMILY

__all__ = ["FAMILY"]
