"""SkyReels-V2's conformance cases: tiny transformers' forwards (a timestep per sample or per
frame, the block-causal mask) and the tiny pipelines' steps (T2V, diffusion forcing in causal
blocks and in windows, I2V), on every plan (tests/models/test_conformance.py runs them)."""

from __future__ import annotations

from raydit.models.families.skyreels.tiny import tiny_transformer
from raydit.models.families.wan.tiny import TINY_TEXT_DIM
from raydit.models.tiny import load_pipeline_dir

_BUILD_FORWARD = "raydit.models.families.skyreels.cases:skyreels_forward"


def skyreels_forward(kind: str, latent_frames: int, latent_height: int, latent_width: int, heads: int,
                     head_dim: int, batch: int = 2, text_len: int = 13, block: int = 1, seed: int = 37):
    """A tiny-weight SkyReelsV2Transformer3DModel and the kwargs of one forward call.

    kind "t2v": one timestep per sample. kind "df": diffusion forcing, a timestep per latent
    frame (all different) and the fps embedding; `block` > 1: the block-causal mask over
    groups of `block` frames.
    """
    import torch

    overrides = dict(num_attention_heads=heads, attention_head_dim=head_dim, ffn_dim=2 * heads * head_dim,
                     inject_sample_info=kind == "df", num_frame_per_block=block)
    transformer = tiny_transformer(seed, **overrides)
    g = torch.Generator().manual_seed(11)
    kwargs = dict(
        hidden_states=torch.randn(batch, 4, latent_frames, latent_height, latent_width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        timestep=torch.tensor([999.0, 421.0, 1.0, 700.0][:batch]),
    )
    if kind == "df":
        # Batch 1, as the pipeline calls it (its fps embedding broadcasts over one sample only).
        kwargs = {k: v[:1] for k, v in kwargs.items()}
        kwargs.update(timestep=(torch.rand(1, latent_frames, generator=g) * 1000).long(),
                      enable_diffusion_forcing=True, fps=[1])
    return transformer, kwargs


def forward_cases() -> list:
    """Token counts no world size 2..6 divides; 12 heads (1.3B-like: 4 and 5 ranks run ring
    or hybrid layouts)."""
    from raydit.models.conformance import ForwardCase

    return [
        # DF 1.3B-like: a timestep per frame (temb [B, 6, L, C] split with the video); 7 x 1 x 7 = 49 tokens.
        ForwardCase("skyreels-df-h12", _BUILD_FORWARD, 12,
                    dict(kind="df", latent_frames=7, latent_height=2, latent_width=14, heads=12, head_dim=8)),
        # T2V: one timestep per sample; 5 x 1 x 11 = 55 tokens.
        ForwardCase("skyreels-t2v-h12", _BUILD_FORWARD, 12,
                    dict(kind="t2v", latent_frames=5, latent_height=2, latent_width=22, heads=12, head_dim=8),
                    worlds=(3,)),
        # Block-causal attention (causal_block_size 2): 6 x 1 x 7 = 42 tokens, mask rows split.
        ForwardCase("skyreels-df-causal", _BUILD_FORWARD, 6,
                    dict(kind="df", latent_frames=6, latent_height=2, latent_width=14, heads=6, head_dim=12,
                         block=2), worlds=(2, 5)),
    ]


_BUILD_PIPELINE = "raydit.models.families.skyreels.cases:skyreels_pipeline"


def skyreels_pipeline(base_dir: str):
    """A tiny SkyReels-V2 pipeline loaded from its directory (as a real checkpoint is)."""
    return load_pipeline_dir(base_dir)


def runner_cases(base_dirs) -> list:
    """Denoising cases on the tiny pipelines (6 heads: Ulysses 1, 2, 3, 6; 4, 5 and 8 ranks
    run ring / hybrid layouts); 45 video tokens (3 x 3 x 5), or 18 (3 x 2 x 3) in the long
    video's windows and I2V."""
    from raydit.models.conformance import RunnerCase

    def case(name, tiny, request, **kw):
        return RunnerCase(name, _BUILD_PIPELINE, 6, request, dict(base_dir=base_dirs[tiny]), **kw)

    return [
        # T2V: UniPC's history travels in the checkpoint; two guidance calls.
        case("skyreels-t2v", "tiny-skyreels", dict(prompt="a red fox runs", num_frames=9, height=48, width=80,
                                                   num_inference_steps=3, guidance_scale=5.0, seed=11),
             worlds=(2, 3, 4)),
        # Diffusion forcing, asynchronous: 13 frames = 4 latent frames in 2 causal blocks
        # (block-causal attention), the second a step behind the first (4 steps); 60 tokens.
        case("skyreels-df-causal", "tiny-skyreels-df",
             dict(prompt="a lighthouse", num_frames=13, height=48, width=80, num_inference_steps=3,
                  guidance_scale=5.0, seed=5, guidance_options=dict(ar_step=1, causal_block_size=2)),
             steps=3, checkpoint_step=1, worlds=(2, 4)),
        # A long video: 13 frames (4 latent) in two windows of 9 (3 latent) overlapping by 5 (2),
        # the overlap re-noised (4 steps; 18 tokens a window); resumed from a checkpoint in the
        # first window, run into the second.
        case("skyreels-df-long", "tiny-skyreels-df",
             dict(prompt="a river", num_frames=13, height=32, width=48, num_inference_steps=2,
                  guidance_scale=5.0, seed=8,
                  guidance_options=dict(base_num_frames=9, overlap_history=5, addnoise_condition=20)),
             steps=3, checkpoint_step=1, cfg=False, worlds=(3,)),
        # I2V: CLIP image tokens in front of the text, image latents and mask in the channels.
        case("skyreels-i2v", "tiny-skyreels-i2v", dict(prompt="a kite", num_frames=9, height=32, width=48,
                                                       num_inference_steps=3, guidance_scale=5.0, seed=4),
             image="checker", cfg=False, worlds=(2,)),
    ]


def conformance_cases(base_dirs) -> dict:
    """SkyReels-V2's cases for the shared suite (Family.conformance_cases)."""
    return {"forward": forward_cases(), "runner": runner_cases(base_dirs)}
