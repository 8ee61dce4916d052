"""The tiny LTX-Video pipelines (`tiny-ltx`, `tiny-ltx-i2v`), random weights, written once in
diffusers' format.

`tiny-ltx`: 6 heads x 12, 2 blocks, 8 latent channels, a 2-layer T5 and the LTX VAE with 32x
spatial and 8x temporal compression (8 channels); `tiny-ltx-i2v`: the same components in
LTXImageToVideoPipeline.
"""

from __future__ import annotations

from raydit.models.families.ltx.family import MAX_SEQUENCE_LENGTH
from raydit.models.tiny import tiny_dir

TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 6  # Ulysses 1, 2, 3, 6; 4 and 5 ranks run ring or hybrid layouts
TINY_HEAD_DIM = 12  # rotary: the hidden size (72) is 3 axes x 12 frequencies x (cos, sin)
TINY_TEXT_DIM = 32  # T5 d_model == transformer caption_channels
TINY_LATENT_CHANNELS = 8
TINY_DEFAULTS = {"num_frames": 9, "height": 64, "width": 96}


def tiny_transformer(seed: int, **overrides):
    """An LTXVideoTransformer3DModel of the tiny geometry (or `overrides`), every parameter
    drawn from `seed`."""
    import torch
    from diffusers import LTXVideoTransformer3DModel

    from raydit.models.tiny import randomize

    config = dict(in_channels=TINY_LATENT_CHANNELS, out_channels=TINY_LATENT_CHANNELS, num_attention_heads=TINY_HEADS,
                  attention_head_dim=TINY_HEAD_DIM, num_layers=2, caption_channels=TINY_TEXT_DIM)
    config.update(overrides)
    config.setdefault("cross_attention_dim", config["num_attention_heads"] * config["attention_head_dim"])
    torch.manual_seed(seed)
    return randomize(LTXVideoTransformer3DModel(**config), seed)


def _tiny_vae(seed: int):
    import torch
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(seed)
    return AutoencoderKLLTXVideo(
        latent_channels=TINY_LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
    ).eval()  # patch 4 x 2^3 = 32x spatial, 2^3 = 8x temporal


def tiny_pipeline():
    """The tiny LTXPipeline, built in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline

    from raydit.models.tiny import SEED, t5_encoder, tokenizer

    tok = tokenizer(MAX_SEQUENCE_LENGTH)
    # LTX-Video's scheduler: dynamic shift by the token count.
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=1024,
                                                max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
                                                shift_terminal=0.1)
    return LTXPipeline(scheduler=scheduler, vae=_tiny_vae(SEED + 2), text_encoder=t5_encoder(len(tok), TINY_TEXT_DIM),
                       tokenizer=tok, transformer=tiny_transformer(SEED + 10))


def tiny_i2v_pipeline():
    """The tiny LTXImageToVideoPipeline: the text-to-video one's components."""
    from diffusers import LTXImageToVideoPipeline

    return LTXImageToVideoPipeline(**tiny_pipeline().components)


tiny_pipeline_dir = tiny_dir(f"tiny-ltx-{TINY_VERSION}", tiny_pipeline, TINY_DEFAULTS)


tiny_i2v_pipeline_dir = tiny_dir(f"tiny-ltx-i2v-{TINY_VERSION}", tiny_i2v_pipeline, TINY_DEFAULTS)

TINY_PIPELINES = {"tiny-ltx": tiny_pipeline_dir, "tiny-ltx-i2v": tiny_i2v_pipeline_dir}  # Family.tiny
