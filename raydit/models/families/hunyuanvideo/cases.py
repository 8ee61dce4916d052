"""HunyuanVideo's conformance cases: the tiny transformer's forward (T2V, token_replace,
latent_concat) and the tiny pipelines' steps, on every plan (tests/models/test_conformance.py
runs them)."""

from __future__ import annotations

from raydit.models.families.hunyuanvideo.tiny import (TINY_HEADS, TINY_LATENT_CHANNELS, TINY_POOLED_DIM, TINY_TEXT_DIM,
                                                      tiny_transformer)
from raydit.models.tiny import load_pipeline_dir

_BUILD_FORWARD = "raydit.models.families.hunyuanvideo.cases:hunyuan_forward"
_BUILD_PIPELINE = "raydit.models.families.hunyuanvideo.cases:hunyuan_pipeline"


def hunyuan_forward(latent_frames: int, latent_height: int, latent_width: int, heads: int, head_dim: int,
                    rope_axes: tuple, valid: tuple, text_len: int = 13, layers: int = 1, single_layers: int = 1,
                    seed: int = 31, image_condition_type: str | None = None):
    """A tiny-weight HunyuanVideoTransformer3DModel and the kwargs of one forward call: one
    sample per entry of `valid` (its count of unmasked text tokens out of `text_len`)."""
    import torch

    # latent_concat: [noise ; image latents ; mask] channels in, noise channels out
    channels = 2 * TINY_LATENT_CHANNELS + 1 if image_condition_type == "latent_concat" else TINY_LATENT_CHANNELS
    transformer = tiny_transformer(seed, num_attention_heads=heads, attention_head_dim=head_dim,
                                   rope_axes_dim=tuple(rope_axes), num_layers=layers, num_single_layers=single_layers,
                                   image_condition_type=image_condition_type, in_channels=channels)
    g = torch.Generator().manual_seed(7)
    batch = len(valid)
    mask = (torch.arange(text_len).unsqueeze(0) < torch.tensor(valid).unsqueeze(1)).float()
    kwargs = dict(
        hidden_states=torch.randn(batch, channels, latent_frames, latent_height, latent_width, generator=g),
        timestep=torch.tensor([999.0, 421.0, 1.0, 700.0][:batch]),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(batch, TINY_POOLED_DIM, generator=g),
        guidance=torch.tensor([6000.0, 3500.0, 1000.0, 8000.0][:batch]),
    )
    return transformer, kwargs


def hunyuan_pipeline(base_dir: str):
    """The tiny HunyuanVideo pipeline loaded from its directory (as a real checkpoint is)."""
    return load_pipeline_dir(base_dir)


def forward_cases() -> list:
    """Token counts no world size 2..6 divides, masks that differ per sample, fewer valid text
    tokens than ranks, and 6 and 5 heads (Ulysses 1, 2, 3, 6 / 1, 5; the rest ring or hybrid)."""
    from raydit.models.conformance import ForwardCase

    return [
        # 3 x 3 x 5 = 45 video tokens; two samples with 5 and 11 valid of 13 text tokens.
        ForwardCase("hunyuanvideo-h6-masks", _BUILD_FORWARD, 6,
                    dict(latent_frames=3, latent_height=6, latent_width=10, heads=6, head_dim=16,
                         rope_axes=(4, 6, 6), valid=(5, 11))),
        # 1 x 1 x 7 = 7 video tokens, 2 valid text tokens of 9: on 3..8 ranks some ranks hold
        # no valid text and, from 4 ranks, only padding of the video.
        ForwardCase("hunyuanvideo-h5-7tokens", _BUILD_FORWARD, 5,
                    dict(latent_frames=1, latent_height=2, latent_width=14, heads=5, head_dim=8,
                         rope_axes=(2, 2, 4), valid=(2,), text_len=9, layers=2, single_layers=1),
                    worlds=(5, 6, 8)),  # more ranks than video tokens: the last hold only padding
        # token_replace (HunyuanVideo-I2V's blocks): the first frame's 15 of 45 tokens get their
        # own modulation; on 2 ranks rank 0 holds them all, on 3 exactly them, on 4, 5 and 6
        # they span ranks 0 and 1, on 8 ranks 0..2 (chunks of 6).
        ForwardCase("hunyuanvideo-token-replace", _BUILD_FORWARD, 6,
                    dict(latent_frames=3, latent_height=6, latent_width=10, heads=6, head_dim=16,
                         rope_axes=(4, 6, 6), valid=(5, 11), image_condition_type="token_replace")),
        # latent_concat (HunyuanVideo-I2V-33ch): 2 x 4 + 1 input channels, then T2V's blocks.
        ForwardCase("hunyuanvideo-latent-concat", _BUILD_FORWARD, 6,
                    dict(latent_frames=3, latent_height=6, latent_width=10, heads=6, head_dim=16,
                         rope_axes=(4, 6, 6), valid=(7,), image_condition_type="latent_concat"),
                    worlds=(2, 3)),
    ]


def runner_cases(base_dir: str, i2v_dir: str) -> list:
    """Denoising on the tiny pipeline: 3 x 3 x 5 = 45 video tokens (3 and 5 divide it, 2, 4, 6
    and 8 do not); embedded guidance (one call per step, cfg plans run it on both groups) and
    true classifier-free guidance (two calls; cfg = 2 runs one on each group)."""
    from raydit.models.conformance import RunnerCase

    request = dict(prompt="a red fox runs", num_frames=9, height=48, width=80, num_inference_steps=2,
                   guidance_scale=6.0, seed=11)
    return [
        RunnerCase("hunyuanvideo-embedded", _BUILD_PIPELINE, TINY_HEADS, request, dict(base_dir=base_dir), cfg=False),
        RunnerCase("hunyuanvideo-true-cfg", _BUILD_PIPELINE, TINY_HEADS,
                   dict(request, negative_prompt="blur", true_cfg_scale=3.0, seed=5), dict(base_dir=base_dir),
                   worlds=(2, 3, 4)),  # the embedded case covers every world; cfg 2 runs on 2 and 4
        # Image-to-video (token_replace) with true CFG: the branches' texts differ in length
        # (396 / 540 tokens); Ulysses 2 and 3, ring 2 and 3, hybrid and cfg 2 on 2..4 ranks.
        RunnerCase("hunyuanvideo-i2v", _BUILD_PIPELINE, TINY_HEADS,
                   dict(request, negative_prompt="blur", true_cfg_scale=3.0, seed=7), dict(base_dir=i2v_dir),
                   image="checker", worlds=(2, 3, 4)),
    ]


def conformance_cases(base_dirs) -> dict:
    """HunyuanVideo's cases for the shared suite (Family.conformance_cases)."""
    return {"forward": forward_cases(),
            "runner": runner_cases(base_dirs["tiny-hunyuan"], base_dirs["tiny-hunyuan-i2v"])}
