"""HunyuanVideo 1.5's conformance cases: the tiny transformer's forward and the tiny pipelines'
steps (T2V and I2V), on every plan (tests/models/test_conformance.py runs them)."""

from __future__ import annotations

from raydit.models.families.hunyuanvideo15.tiny import (TINY_BYT5_DIM, TINY_HEADS, TINY_IMAGE_DIM,
                                                        TINY_LATENT_CHANNELS, TINY_TEXT_DIM, tiny_transformer)
from raydit.models.tiny import load_pipeline_dir

_BUILD_FORWARD = "raydit.models.families.hunyuanvideo15.cases:hunyuan15_forward"
_BUILD_PIPELINE = "raydit.models.families.hunyuanvideo15.cases:hunyuan15_pipeline"


def hunyuan15_forward(latent_frames: int, latent_height: int, latent_width: int, heads: int, head_dim: int,
                      rope_axes: tuple, valid: tuple, valid_2: tuple, text_len: int = 11, text_len_2: int = 7,
                      image_tokens: int = 5, layers: int = 2, seed: int = 41):
    """A tiny-weight HunyuanVideo15Transformer3DModel and the kwargs of one forward call: one
    sample per entry of `valid` / `valid_2` (unmasked Qwen / ByT5 tokens); image tokens of
    zeros (text-to-video: the model masks them)."""
    import torch

    transformer = tiny_transformer(seed, num_attention_heads=heads, attention_head_dim=head_dim,
                                   rope_axes_dim=tuple(rope_axes), num_layers=layers)
    g = torch.Generator().manual_seed(7)
    batch = len(valid)

    def mask(counts, length):
        return (torch.arange(length).unsqueeze(0) < torch.tensor(counts).unsqueeze(1)).float()

    kwargs = dict(
        hidden_states=torch.randn(batch, 2 * TINY_LATENT_CHANNELS + 1, latent_frames, latent_height, latent_width,
                                  generator=g),
        timestep=torch.tensor([999.0, 421.0, 1.0, 700.0][:batch]),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        encoder_attention_mask=mask(valid, text_len),
        encoder_hidden_states_2=torch.randn(batch, text_len_2, TINY_BYT5_DIM, generator=g),
        encoder_attention_mask_2=mask(valid_2, text_len_2),
        image_embeds=torch.zeros(batch, image_tokens, TINY_IMAGE_DIM),
    )
    return transformer, kwargs


def hunyuan15_pipeline(base_dir: str):
    """A tiny HunyuanVideo 1.5 pipeline loaded from its directory (as a real checkpoint is)."""
    return load_pipeline_dir(base_dir)


def forward_cases() -> list:
    """Token counts no world size 2..6 divides, masks that differ per sample (Qwen and ByT5),
    6 and 5 heads (Ulysses 1, 2, 3, 6 / 1, 5; the rest ring or hybrid)."""
    from raydit.models.conformance import ForwardCase

    return [
        # 3 x 3 x 5 = 45 video tokens; two samples: 4 + 0 and 9 + 3 valid text tokens.
        ForwardCase("hunyuanvideo15-h6-masks", _BUILD_FORWARD, 6,
                    dict(latent_frames=3, latent_height=3, latent_width=5, heads=6, head_dim=8,
                         rope_axes=(2, 2, 4), valid=(4, 9), valid_2=(0, 3))),
        # 1 x 1 x 7 = 7 video tokens and 3 valid text tokens on 5 and 6 ranks.
        ForwardCase("hunyuanvideo15-h5-7tokens", _BUILD_FORWARD, 5,
                    dict(latent_frames=1, latent_height=1, latent_width=7, heads=5, head_dim=8,
                         rope_axes=(2, 2, 4), valid=(2,), valid_2=(1,), layers=1),
                    worlds=(5, 6)),
    ]


def runner_cases(base_dir: str, i2v_dir: str) -> list:
    """Denoising on the tiny pipelines: 3 x 3 x 5 = 45 video tokens (3 and 5 divide it, 2, 4, 6
    and 8 do not); classifier-free guidance (two calls; cfg = 2 runs one on each group), a
    quoted glyph text for the ByT5 encoder; image-to-video on 3 ranks. The text the
    blocks attend is ~2000 tokens (the pipeline's fixed 1000 + 256 + 729), so each case runs
    only the worlds it needs: one process is its own reference."""
    from raydit.models.conformance import RunnerCase

    request = dict(prompt='a red fox runs past a sign saying "stop"', negative_prompt="blur", num_frames=9,
                   height=48, width=80, num_inference_steps=2, guidance_scale=5.0, seed=11)
    return [
        # Every plan on 2..6 ranks (one rank is the reference itself), cfg 2 on 2 and 4.
        RunnerCase("hunyuanvideo15-t2v", _BUILD_PIPELINE, TINY_HEADS, request, dict(base_dir=base_dir),
                   worlds=(2, 3, 4, 5, 6)),
        # The image's channels split with the video tokens (3 ranks: Ulysses 3 and ring 3, the
        # 45 tokens divide; the t2v case covers the uneven splits and the cfg plans).
        RunnerCase("hunyuanvideo15-i2v", _BUILD_PIPELINE, TINY_HEADS, dict(request, seed=5),
                   dict(base_dir=i2v_dir), image="checker", worlds=(3,), cfg=False),
    ]


def conformance_cases(base_dirs) -> dict:
    """HunyuanVideo 1.5's cases for the shared suite (Family.conformance_cases)."""
    return {"forward": forward_cases(),
            "runner": runner_cases(base_dirs["tiny-hunyuan15"], base_dirs["tiny-hunyuan15-i2v"])}
