"""LTX-Video's conformance cases: the tiny transformer's forward and the tiny pipelines' steps,
on every plan (tests/models/test_conformance.py runs them)."""

from __future__ import annotations

from raydit.models.families.ltx.tiny import TINY_HEADS, TINY_LATENT_CHANNELS, TINY_TEXT_DIM, tiny_transformer
from raydit.models.tiny import load_pipeline_dir

_BUILD_FORWARD = "raydit.models.families.ltx.cases:ltx_forward"
_BUILD_PIPELINE = "raydit.models.families.ltx.cases:ltx_pipeline"


def ltx_forward(latent_frames: int, latent_height: int, latent_width: int, heads: int, head_dim: int,
                valid: tuple, text_len: int = 13, seed: int = 31):
    """A tiny-weight LTXVideoTransformer3DModel and the kwargs of one forward call (packed
    latents [B, F*H*W, C]); one sample per entry of `valid` (its unmasked text tokens)."""
    import torch

    transformer = tiny_transformer(seed, num_attention_heads=heads, attention_head_dim=head_dim)
    g = torch.Generator().manual_seed(7)
    batch = len(valid)
    tokens = latent_frames * latent_height * latent_width
    kwargs = dict(
        hidden_states=torch.randn(batch, tokens, TINY_LATENT_CHANNELS, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        timestep=torch.tensor([999.0, 421.0, 1.0, 700.0][:batch]),
        encoder_attention_mask=(torch.arange(text_len).unsqueeze(0) < torch.tensor(valid).unsqueeze(1)).long(),
        num_frames=latent_frames, height=latent_height, width=latent_width,
        rope_interpolation_scale=(8 / 25, 32, 32),
    )
    return transformer, kwargs


def ltx_pipeline(base_dir: str):
    """The tiny LTX pipeline loaded from its directory (as a real checkpoint is)."""
    return load_pipeline_dir(base_dir)


def forward_cases() -> list:
    from raydit.models.conformance import ForwardCase

    return [
        # 3 x 1 x 13 = 39 tokens (only 3 of 2..8 divides it), 6 heads, text masks that differ.
        ForwardCase("ltx-h6-39tokens", _BUILD_FORWARD, 6,
                    dict(latent_frames=3, latent_height=1, latent_width=13, heads=6, head_dim=12, valid=(4, 13))),
    ]


def runner_cases(base_dir: str, i2v_dir: str | None = None) -> list:
    """Denoising on the tiny pipelines: 17 frames at 32 x 416 -> 3 x 1 x 13 = 39 tokens."""
    from raydit.models.conformance import RunnerCase

    i2v = [] if i2v_dir is None else [
        # the image's 13 tokens at timestep 0, the other 26 at t: per-token timesteps split with the tokens
        RunnerCase("ltx-i2v", _BUILD_PIPELINE, TINY_HEADS,
                   dict(prompt="a kite climbs", negative_prompt="blur", num_frames=17, height=32, width=416,
                        num_inference_steps=3, guidance_scale=3.0, seed=12),
                   dict(base_dir=i2v_dir), image="checker", worlds=(2, 3)),
    ]
    return [
        RunnerCase("ltx-t2v", _BUILD_PIPELINE, TINY_HEADS,
                   dict(prompt="a red fox runs", negative_prompt="blur", num_frames=17, height=32, width=416,
                        num_inference_steps=3, guidance_scale=3.0, seed=11),
                   dict(base_dir=base_dir)),
    ] + i2v


def conformance_cases(base_dirs) -> dict:
    """LTX-Video's cases for the shared suite (Family.conformance_cases)."""
    return {"forward": forward_cases(), "runner": runner_cases(base_dirs["tiny-ltx"], base_dirs["tiny-ltx-i2v"])}
