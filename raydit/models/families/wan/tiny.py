"""The tiny Wan pipelines (TINY_VARIANTS: Wan 2.1 T2V and I2V, Wan 2.2 A14B, A14B I2V and
TI2V-5B), random weights, written once in diffusers' format; the tiny VAE and CLIP image
encoder SkyReels-V2's tiny pipelines share."""

from __future__ import annotations

import functools

from raydit.models.tiny import WithDefaults

# Bump when anything below changes the saved files, so stale caches are not reused.
WAN_TINY_VERSION = "2"

TINY_TEXT_DIM = 32  # umT5 d_model == transformer text_dim
TINY_TEXT_TOKENS = 512  # Wan's max_sequence_length (2.1 I2V's processor assumes 512 text tokens)
TINY_IMAGE_DIM = 16  # CLIP hidden size == transformer image_dim
TINY_IMAGE_SIZE = 32  # CLIP input; patches of 8 -> 16 + 1 image tokens

TINY_DEFAULTS = {"num_frames": 9, "height": 48, "width": 80}  # 3 x 3 x 5 = 45 video tokens
TINY_TI2V_DEFAULTS = {"num_frames": 9, "height": 64, "width": 96}  # 16x VAE: 3 x 2 x 3 = 18

# name -> how the tiny pipeline differs from Wan 2.1 T2V (`tiny-wan`).
TINY_VARIANTS: dict[str, dict] = {
    # Wan 2.1 T2V: one transformer, 8x VAE, UniPC with flow_shift 3.
    "tiny-wan": dict(),
    # Wan 2.2 A14B: two experts, `transformer` for t >= 875, `transformer_2` below.
    "tiny-wan-a14b": dict(experts=2, boundary_ratio=0.875),
    # Wan 2.2 TI2V-5B: per-token timesteps, 16x VAE (residual, 2x2 pixel patches).
    "tiny-wan-ti2v": dict(vae="wan2.2", expand_timesteps=True, flow_shift=5.0),
    # Wan 2.1 I2V: CLIP image tokens by cross-attention, image latents + mask in the channels.
    "tiny-wan-i2v": dict(image=True, image_encoder=True),
    # Wan 2.2 I2V A14B: two experts, image latents + mask in the channels, no image encoder.
    "tiny-wan-a14b-i2v": dict(image=True, experts=2, boundary_ratio=0.9),
}


def tiny_transformer(seed: int, **overrides):
    """A WanTransformer3DModel of the tiny geometry (or `overrides`), every parameter drawn
    from `seed` (diffusers' zero-initialised gates would make parallel tests trivial)."""
    import torch
    from diffusers import WanTransformer3DModel

    from raydit.models.tiny import randomize

    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=6,  # Ulysses 1, 2, 3, 6: 4 and 5 ranks run ring / hybrid
        attention_head_dim=12,  # rotary: 4 channels each for frames, rows, columns
        in_channels=4,
        out_channels=4,
        text_dim=TINY_TEXT_DIM,
        freq_dim=32,
        ffn_dim=96,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return randomize(WanTransformer3DModel(**config), seed)


def _tiny_vae(kind: str, seed: int):
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    if kind == "wan2.1":  # 8x spatial, 4x temporal, like Wan 2.1's (16 latent channels there)
        z = 4
        extra = dict()
    else:  # Wan 2.2's 16x VAE: residual, 2x2 pixel patches in the channels (48 latent channels there)
        z = 8
        extra = dict(in_channels=12, out_channels=12, is_residual=True, patch_size=2, scale_factor_spatial=16)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=z,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[round(0.1 * i - 0.2, 3) for i in range(z)],
        latents_std=[round(0.5 + 0.25 * i, 3) for i in range(z)],
        scale_factor_temporal=4,
        **extra,
    ).eval()


def _tiny_image_encoder(seed: int):
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    try:  # transformers >= 5: the PIL backend by name (the plain name warns without torchvision)
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor

    torch.manual_seed(seed)
    config = CLIPVisionConfig(
        hidden_size=TINY_IMAGE_DIM,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TINY_IMAGE_SIZE,
        patch_size=8,
    )
    processor = CLIPImageProcessor(
        size={"shortest_edge": TINY_IMAGE_SIZE}, crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}
    )
    return CLIPVisionModel(config).eval(), processor


def tiny_pipeline(name: str):
    """The tiny pipeline `name` (a key of TINY_VARIANTS), built in memory."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline

    from raydit.models.tiny import SEED, t5_encoder, tokenizer

    if name not in TINY_VARIANTS:
        raise ValueError(f"no tiny Wan pipeline {name!r}; built-in: {', '.join(TINY_VARIANTS)}")
    v = TINY_VARIANTS[name]
    vae = _tiny_vae(v.get("vae", "wan2.1"), SEED + 2)
    z = vae.config.z_dim
    # I2V (not TI2V) joins a 4-frame mask and the image latents to the noise in the channels.
    in_channels = z + 4 + z if v.get("image") and not v.get("expand_timesteps") else z
    transformer_kwargs = dict(in_channels=in_channels, out_channels=z)
    if v.get("image_encoder"):
        inner = 6 * 12
        transformer_kwargs.update(image_dim=TINY_IMAGE_DIM, added_kv_proj_dim=inner)
    tok = tokenizer(TINY_TEXT_TOKENS)
    components = dict(
        tokenizer=tok,
        text_encoder=t5_encoder(len(tok), TINY_TEXT_DIM, umt5=True),
        vae=vae,
        # Wan's diffusers scheduler: UniPC on flow-matching sigmas.
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=v.get("flow_shift", 3.0)
        ),
        transformer=tiny_transformer(SEED + 10, **transformer_kwargs),
        transformer_2=tiny_transformer(SEED + 11, **transformer_kwargs) if v.get("experts", 1) == 2 else None,
        boundary_ratio=v.get("boundary_ratio"),
        expand_timesteps=v.get("expand_timesteps", False),
    )
    if not v.get("image"):
        return WanPipeline(**components)
    image_encoder = image_processor = None
    if v.get("image_encoder"):
        image_encoder, image_processor = _tiny_image_encoder(SEED + 3)
    return WanImageToVideoPipeline(image_encoder=image_encoder, image_processor=image_processor, **components)


def tiny_pipeline_dir(name: str = "tiny-wan"):
    """The directory of the tiny pipeline `name`, written once to the cache."""
    from raydit.models.tiny import cache_root, write_pipeline

    if name not in TINY_VARIANTS:
        raise ValueError(f"no tiny Wan pipeline {name!r}; built-in: {', '.join(TINY_VARIANTS)}")
    defaults = TINY_TI2V_DEFAULTS if TINY_VARIANTS[name].get("vae") == "wan2.2" else TINY_DEFAULTS
    return write_pipeline(cache_root() / f"{name}-{WAN_TINY_VERSION}",
                          lambda: WithDefaults(tiny_pipeline(name), defaults))


TINY_PIPELINES = {name: functools.partial(tiny_pipeline_dir, name) for name in TINY_VARIANTS}  # Family.tiny
