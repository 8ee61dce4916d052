"""The tiny Mochi pipeline (`tiny-mochi`), random weights, written once in diffusers' format.

`tiny-mochi`: 6 heads x 16 (96-wide video), a 48-wide text stream, 2 blocks (the
second context_pre_only), 12 latent channels, a 2-layer T5 and a small AutoencoderKLMochi
with the released compression (6x temporal, 8x spatial); random weights; the released
checkpoint's scheduler (invert_sigmas=True).
"""

from __future__ import annotations

from raydit.models.families.mochi.family import MAX_SEQUENCE_LENGTH
from raydit.models.tiny import tiny_dir

TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 6  # Ulysses 1, 2, 3, 6; 4 and 5 ranks run ring or hybrid layouts
TINY_HEAD_DIM = 16  # the video stream is 96 wide
TINY_TEXT_WIDTH = 48  # the text stream (pooled_projection_dim), narrower than the video's, as Mochi's
TINY_TEXT_DIM = 32  # T5 d_model == transformer text_embed_dim (8 pooling heads divide it)
TINY_LATENT_CHANNELS = 12  # the pipeline's decode reshapes latents_mean to 12 channels
TINY_DEFAULTS = {"num_frames": 7, "height": 32, "width": 48}


def tiny_transformer(seed: int, **overrides):
    """A MochiTransformer3DModel of the tiny geometry (or `overrides`), every parameter drawn
    from `seed` (zero-initialised gates would make parallel tests trivial)."""
    import torch
    from diffusers import MochiTransformer3DModel

    from raydit.models.tiny import randomize

    config = dict(patch_size=2, num_attention_heads=TINY_HEADS, attention_head_dim=TINY_HEAD_DIM, num_layers=2,
                  pooled_projection_dim=TINY_TEXT_WIDTH, in_channels=TINY_LATENT_CHANNELS, text_embed_dim=TINY_TEXT_DIM,
                  time_embed_dim=32, max_sequence_length=MAX_SEQUENCE_LENGTH)
    config.update(overrides)
    torch.manual_seed(seed)
    return randomize(MochiTransformer3DModel(**config), seed)


def _tiny_vae(seed: int):
    """AutoencoderKLMochi with the released compression (temporal 1 x 2 x 3, spatial 2 x 2 x 2)
    at 32 channels (its group norms take 32 groups), one layer per block, no attention; seeded weights (its default init, which decodes to a
    varied video)."""
    import torch
    from diffusers import AutoencoderKLMochi

    torch.manual_seed(seed)
    return AutoencoderKLMochi(
        in_channels=15, out_channels=3, latent_channels=TINY_LATENT_CHANNELS,
        encoder_block_out_channels=(32, 32, 32, 32), decoder_block_out_channels=(32, 32, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1), add_attention_block=(False, False, False, False, False),
    ).eval()


def tiny_pipeline():
    """The tiny MochiPipeline, built in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, MochiPipeline

    from raydit.models.tiny import SEED, t5_encoder, tokenizer

    tok = tokenizer(MAX_SEQUENCE_LENGTH)
    return MochiPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True),  # genmo/mochi-1-preview's
        vae=_tiny_vae(SEED + 2),
        text_encoder=t5_encoder(len(tok), TINY_TEXT_DIM),
        tokenizer=tok,
        transformer=tiny_transformer(SEED + 10),
    )


tiny_pipeline_dir = tiny_dir(f"tiny-mochi-{TINY_VERSION}", tiny_pipeline, TINY_DEFAULTS)

TINY_PIPELINES = {"tiny-mochi": tiny_pipeline_dir}  # what the family declares (Family.tiny)
