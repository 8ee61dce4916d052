"""HunyuanVideo 1.5 (text- and image-to-video).

What differs: one kind of dual-stream block over [video ; text], the text built by the model from
three encoders (Qwen2.5-VL, ByT5 glyphs, SigLIP for image-to-video) with the valid tokens first;
the valid text joins attention as a second part (raydit.models.joint_text); guidance lives in the
pipeline's guider (one call per branch); image-to-video by channels.

Where: `family` (the adapter and the Family), `tiny` (the tiny pipelines), `cases` (the
conformance cases)."""

from raydit.models.families.hunyuanvideo15.family import FAMILY

__all__ = ["FAMILY"]
