"""Mochi 1 (text-to-video).

What differs: asymmetric dual-stream blocks (video and T5 text of different widths, their own
weights) meeting in one joint attention; the valid text joins attention as a second part
(raydit.models.joint_text); a gated (SwiGLU) feed-forward; guidance and the scheduler step in
float32 on the pipeline's linear-quadratic sigmas.

Where: `family` (the adapter and the Family), `tiny` (the tiny pipeline), `cases` (the
conformance cases)."""

from raydit.models.families.mochi.family import FAMILY

__all__ = ["FAMILY"]
