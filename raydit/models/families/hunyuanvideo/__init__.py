"""HunyuanVideo (text- and image-to-video).

What differs: dual-stream then single-stream blocks over [video ; text]; only the video is split
and the valid (unmasked) text joins attention as a second part, one token per rank
(raydit.models.joint_text); guidance embedded in the model, true CFG (two calls) only with a
negative prompt and `true_cfg_scale`; image-to-video through a Llava text encoder and
token_replace / latent_concat conditioning; its VAE decoder is shared with Kandinsky 5
(raydit.models.decoders).

Where: `family` (the adapter and the Family), `tiny` (the tiny pipelines), `cases` (the
conformance cases)."""

from raydit.models.families.hunyuanvideo.family import FAMILY

__all__ = ["FAMILY"]
