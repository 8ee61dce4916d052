"""The tiny SkyReels-V2 pipelines (TINY_VARIANTS: T2V, I2V, diffusion forcing), random
weights, written once in diffusers' format; Wan's tiny VAE and CLIP image encoder."""

from __future__ import annotations

import functools

from raydit.models.families.wan.tiny import (
    TINY_IMAGE_DIM,
    TINY_TEXT_DIM,
    TINY_TEXT_TOKENS,
    _tiny_image_encoder,
    _tiny_vae,
)
from raydit.models.tiny import WithDefaults

# Bump when anything below changes the saved files, so stale caches are not reused.
SKYREELS_TINY_VERSION = "1"

TINY_DEFAULTS = {"num_frames": 9, "height": 48, "width": 80}  # 3 x 3 x 5 = 45 video tokens

# name -> how the tiny pipeline differs from SkyReels-V2 T2V (`tiny-skyreels`).
TINY_VARIANTS: dict[str, dict] = {
    "tiny-skyreels": dict(),
    # I2V: CLIP image tokens by cross-attention, a mask and the image's latents in the channels.
    "tiny-skyreels-i2v": dict(image=True),
    # Diffusion forcing: a timestep per frame, the fps embedding.
    "tiny-skyreels-df": dict(forcing=True),
}


def tiny_transformer(seed: int, **overrides):
    """A SkyReelsV2Transformer3DModel of the tiny geometry (or `overrides`), every parameter
    drawn from `seed`."""
    import torch
    from diffusers import SkyReelsV2Transformer3DModel

    from raydit.models.tiny import randomize

    config = dict(patch_size=(1, 2, 2), num_attention_heads=6, attention_head_dim=12, in_channels=4,
                  out_channels=4, text_dim=TINY_TEXT_DIM, freq_dim=32, ffn_dim=96, num_layers=2,
                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    config.update(overrides)
    torch.manual_seed(seed)
    return randomize(SkyReelsV2Transformer3DModel(**config), seed)


def tiny_pipeline(name: str):
    """The tiny pipeline `name` (a key of TINY_VARIANTS), built in memory."""
    from diffusers import (
        SkyReelsV2DiffusionForcingPipeline,
        SkyReelsV2ImageToVideoPipeline,
        SkyReelsV2Pipeline,
        UniPCMultistepScheduler,
    )

    from raydit.models.tiny import SEED, t5_encoder, tokenizer

    if name not in TINY_VARIANTS:
        raise ValueError(f"no tiny SkyReels-V2 pipeline {name!r}; built-in: {', '.join(TINY_VARIANTS)}")
    v = TINY_VARIANTS[name]
    vae = _tiny_vae("wan2.1", SEED + 2)
    z = vae.config.z_dim
    transformer_kwargs = dict(in_channels=z, out_channels=z)
    if v.get("image"):
        transformer_kwargs.update(in_channels=z + 4 + z, image_dim=TINY_IMAGE_DIM, added_kv_proj_dim=6 * 12)
    if v.get("forcing"):
        transformer_kwargs.update(inject_sample_info=True)
    tok = tokenizer(TINY_TEXT_TOKENS)
    components = dict(
        tokenizer=tok,
        text_encoder=t5_encoder(len(tok), TINY_TEXT_DIM, umt5=True),
        vae=vae,
        # SkyReels-V2's scheduler: UniPC on flow-matching sigmas (shift 8 at 540P).
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0),
        transformer=tiny_transformer(SEED + 20, **transformer_kwargs),
    )
    if v.get("image"):
        image_encoder, image_processor = _tiny_image_encoder(SEED + 3)
        return SkyReelsV2ImageToVideoPipeline(image_encoder=image_encoder, image_processor=image_processor,
                                              **components)
    if v.get("forcing"):
        return SkyReelsV2DiffusionForcingPipeline(**components)
    return SkyReelsV2Pipeline(**components)


def tiny_pipeline_dir(name: str = "tiny-skyreels"):
    """The directory of the tiny pipeline `name`, written once to the cache."""
    from raydit.models.tiny import cache_root, write_pipeline

    if name not in TINY_VARIANTS:
        raise ValueError(f"no tiny SkyReels-V2 pipeline {name!r}; built-in: {', '.join(TINY_VARIANTS)}")
    return write_pipeline(cache_root() / f"{name}-{SKYREELS_TINY_VERSION}",
                          lambda: WithDefaults(tiny_pipeline(name), TINY_DEFAULTS))


TINY_PIPELINES = {name: functools.partial(tiny_pipeline_dir, name) for name in TINY_VARIANTS}  # Family.tiny
