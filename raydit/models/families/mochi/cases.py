"""Mochi's conformance cases: the tiny transformer's forward and the tiny pipeline's steps, on
every plan (tests/models/test_conformance.py runs them)."""

from __future__ import annotations

from raydit.models.families.mochi.tiny import TINY_HEADS, TINY_LATENT_CHANNELS, TINY_TEXT_DIM, tiny_transformer
from raydit.models.tiny import load_pipeline_dir

_BUILD_FORWARD = "raydit.models.families.mochi.cases:mochi_forward"
_BUILD_PIPELINE = "raydit.models.families.mochi.cases:mochi_pipeline"


def mochi_forward(latent_frames: int, latent_height: int, latent_width: int, heads: int, head_dim: int,
                  valid: tuple, text_len: int = 13, layers: int = 2, seed: int = 31):
    """A tiny-weight MochiTransformer3DModel and the kwargs of one forward call: one sample
    per entry of `valid` (its count of valid text tokens out of `text_len`), bool masks as the
    pipeline gives them."""
    import torch

    transformer = tiny_transformer(seed, num_attention_heads=heads, attention_head_dim=head_dim, num_layers=layers,
                                   max_sequence_length=text_len)
    g = torch.Generator().manual_seed(7)
    batch = len(valid)
    kwargs = dict(
        hidden_states=torch.randn(batch, TINY_LATENT_CHANNELS, latent_frames, 2 * latent_height, 2 * latent_width,
                                  generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        timestep=torch.tensor([999.0, 421.0, 1.0, 700.0][:batch]),
        encoder_attention_mask=torch.arange(text_len).unsqueeze(0) < torch.tensor(valid).unsqueeze(1),
    )
    return transformer, kwargs


def mochi_pipeline(base_dir: str):
    """The tiny Mochi pipeline loaded from its directory (as a real checkpoint is)."""
    return load_pipeline_dir(base_dir)


def forward_cases() -> list:
    """Token counts no world size 2..6 divides, masks that differ per sample, fewer valid text
    tokens than ranks, a sample with no valid text (force_zeros_for_empty_prompt), 6 and 5
    heads (Ulysses 1, 2, 3, 6 / 1, 5; the rest ring or hybrid)."""
    from raydit.models.conformance import ForwardCase

    return [
        # 3 x 3 x 5 = 45 video tokens (latent 6 x 10, patch 2); two samples with 5 and 11 of 13
        # text tokens valid.
        ForwardCase("mochi-h6-masks", _BUILD_FORWARD, 6,
                    dict(latent_frames=3, latent_height=3, latent_width=5, heads=6, head_dim=16, valid=(5, 11))),
        # 1 x 1 x 7 = 7 video tokens, 2 and 0 valid text tokens of 9: on 3..8 ranks some ranks
        # hold no valid text and, from 4 ranks, only padding of the video; the second sample
        # attends to the video alone.
        ForwardCase("mochi-h5-7tokens", _BUILD_FORWARD, 5,
                    dict(latent_frames=1, latent_height=1, latent_width=7, heads=5, head_dim=8, valid=(2, 0),
                         text_len=9, layers=3),
                    worlds=(5, 8)),
    ]


def runner_cases(base_dir: str) -> list:
    """Denoising on the tiny pipeline: 13 frames at 48 x 80 -> 3 x 3 x 5 = 45 video tokens
    (3 and 5 divide it, 2, 4, 6 and 8 do not), the branches batched, cfg plans on 2 groups."""
    from raydit.models.conformance import RunnerCase

    return [
        RunnerCase("mochi-t2v", _BUILD_PIPELINE, TINY_HEADS,
                   dict(prompt="a red fox runs", negative_prompt="blur", num_frames=13, height=48, width=80,
                        num_inference_steps=3, guidance_scale=4.5, seed=11),
                   dict(base_dir=base_dir), worlds=(2, 3, 4, 8)),  # the suite's time; the forward cases run every world
    ]


def conformance_cases(base_dirs) -> dict:
    """Mochi's cases for the shared suite (Family.conformance_cases)."""
    return {"forward": forward_cases(), "runner": runner_cases(base_dirs["tiny-mochi"])}
