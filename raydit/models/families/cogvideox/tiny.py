"""The tiny CogVideoX pipelines (`tiny`, `tiny-i2v`), seeded random weights, written once in
diffusers' format.

`tiny` is the CogVideoX-2b architecture (sinusoidal positions, DDIM) at 2 heads x 16, 2
layers; `tiny-i2v` is CogVideoXImageToVideoPipeline with CogVideoX-5b-I2V's layout (image
latents joined in the channels, learned + rotary positions); both 9 frames at 64 x 64.
"""

from __future__ import annotations

from pathlib import Path

from raydit.models.tiny import SEED, cache_root, quiet_hub, randomize, t5_encoder, tokenizer, write_pipeline

# The tiny pipelines' geometry: the planner's `tiny` entry (family.builtin_models) repeats it;
# tests/planner/test_model.py checks the two against each other.
TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 2
TINY_HEAD_DIM = 16
TINY_LAYERS = 2
TINY_TEXT_TOKENS = 16  # transformer max_text_seq_length == pipeline max_sequence_length
TINY_TEXT_EMBED_DIM = 32  # T5 d_model == transformer text_embed_dim
TINY_TIME_EMBED_DIM = 16
TINY_LATENT_CHANNELS = 4
TINY_PATCH_SIZE = 2
TINY_VAE_SPATIAL = 8  # pixels per latent pixel (4 VAE blocks: 2**3)
TINY_VAE_TEMPORAL = 4  # latent frames = (frames - 1) // 4 + 1
TINY_FRAMES = 9
TINY_HEIGHT = 64
TINY_WIDTH = 64


def _transformer_config(**overrides) -> dict:
    config = dict(
        num_attention_heads=TINY_HEADS,
        attention_head_dim=TINY_HEAD_DIM,
        in_channels=TINY_LATENT_CHANNELS,
        out_channels=TINY_LATENT_CHANNELS,
        time_embed_dim=TINY_TIME_EMBED_DIM,
        text_embed_dim=TINY_TEXT_EMBED_DIM,
        num_layers=TINY_LAYERS,
        sample_width=TINY_WIDTH // TINY_VAE_SPATIAL,
        sample_height=TINY_HEIGHT // TINY_VAE_SPATIAL,
        sample_frames=TINY_FRAMES,
        patch_size=TINY_PATCH_SIZE,
        temporal_compression_ratio=TINY_VAE_TEMPORAL,
        max_text_seq_length=TINY_TEXT_TOKENS,
        use_rotary_positional_embeddings=False,
    )
    config.update(overrides)
    return config


def tiny_transformer(seed: int = SEED, **overrides):
    """A CogVideoXTransformer3DModel with the tiny geometry (or `overrides`), seeded weights."""
    import torch
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    return randomize(CogVideoXTransformer3DModel(**_transformer_config(**overrides)), seed)


def tiny_vae():
    import torch
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(SEED + 2)
    return AutoencoderKLCogVideoX(
        block_out_channels=(8, 8, 8, 8),
        latent_channels=TINY_LATENT_CHANNELS,
        layers_per_block=1,
        norm_num_groups=4,
        temporal_compression_ratio=TINY_VAE_TEMPORAL,
        sample_height=TINY_HEIGHT,
        sample_width=TINY_WIDTH,
    ).eval()


def i2v_overrides(overrides: dict) -> dict:
    """The transformer `overrides` of an image-to-video variant, completed in place with
    CogVideoX-5b-I2V's layout where they leave it open: doubled input channels (the image
    latents joined in the channels), learned + rotary positions."""
    overrides.setdefault("in_channels", 2 * TINY_LATENT_CHANNELS)
    overrides.setdefault("use_learned_positional_embeddings", True)
    overrides.setdefault("use_rotary_positional_embeddings", True)
    return overrides


def build_tiny_pipeline(directory, scheduler: str = "ddim", image: bool = False, **transformer_overrides) -> Path:
    """Write the tiny pipeline (optionally with a variant transformer / the DPM scheduler;
    `image=True`: the image-to-video pipeline, image latents joined in the channels)."""

    def make():
        from diffusers import (CogVideoXDDIMScheduler, CogVideoXDPMScheduler, CogVideoXImageToVideoPipeline,
                               CogVideoXPipeline)

        scheduler_cls = CogVideoXDPMScheduler if scheduler == "dpm" else CogVideoXDDIMScheduler
        tok = tokenizer(TINY_TEXT_TOKENS)
        if image:
            i2v_overrides(transformer_overrides)
        pipeline_cls = CogVideoXImageToVideoPipeline if image else CogVideoXPipeline
        return pipeline_cls(
            tokenizer=tok,
            text_encoder=t5_encoder(len(tok), TINY_TEXT_EMBED_DIM),
            vae=tiny_vae(),
            transformer=tiny_transformer(**transformer_overrides),
            scheduler=scheduler_cls(),
        )

    return write_pipeline(directory, make)


def tiny_pipeline_dir() -> Path:
    """The directory of the built-in `tiny` pipeline, building it on first use."""
    return build_tiny_pipeline(cache_root() / f"tiny-{TINY_VERSION}")


def tiny_i2v_pipeline_dir() -> Path:
    """The built-in `tiny-i2v` (CogVideoXImageToVideoPipeline, 64 x 64, 9 frames)."""
    return build_tiny_pipeline(cache_root() / f"tiny-i2v-{TINY_VERSION}", image=True)


def load_tiny_pipeline(dtype=None):
    """`CogVideoXPipeline.from_pretrained(tiny_pipeline_dir())`."""
    import torch
    from diffusers import CogVideoXPipeline

    with quiet_hub():
        return CogVideoXPipeline.from_pretrained(tiny_pipeline_dir(), dtype=dtype or torch.float32)


TINY_PIPELINES = {"tiny": tiny_pipeline_dir, "tiny-i2v": tiny_i2v_pipeline_dir}  # what the family declares (Family.tiny)
