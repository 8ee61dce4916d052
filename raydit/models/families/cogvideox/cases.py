"""CogVideoX's conformance cases: the tiny transformer's forward and the tiny pipeline's steps
(2b, 5b, 1.5 and I2V variants), on every plan (tests/models/test_conformance.py runs them)."""

from __future__ import annotations

from types import SimpleNamespace

from raydit.models.families.cogvideox.tiny import TINY_TEXT_EMBED_DIM, i2v_overrides, tiny_transformer
from raydit.models.tiny import quiet_hub

# Builders are module-level so spawned ranks rebuild identical models: weights from
# tiny_transformer's fixed seed, inputs from a fixed generator. The geometry hits the hard
# cases: 30 heads at 30 patch rows (the 480p height, where xDiT refuses 4 and 8 ranks), a
# 13-token text that no world size > 1 divides, rotary tables cut per rank (5b), a temporal
# patch of 2 (1.5), image latents in the channels (I2V, learned positions or the ofs embedding).
TEXT_LEN = 13  # divides no world size in 2..6
_BUILD_FORWARD = "raydit.models.families.cogvideox.cases:cogvideox_forward"
_BUILD_PIPELINE = "raydit.models.families.cogvideox.cases:cogvideox_pipeline"


def rotary_table(transformer, latent_frames: int, latent_height: int, latent_width: int, vae_scale: int = 1):
    """The rotary table diffusers' pipeline builds, from its own helper (no copy of its logic)."""
    import torch
    from diffusers import CogVideoXPipeline

    fake_pipe = SimpleNamespace(vae_scale_factor_spatial=vae_scale, transformer=transformer)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(
        fake_pipe, latent_height * vae_scale, latent_width * vae_scale, latent_frames, torch.device("cpu")
    )


def cogvideox_forward(latent_frames: int, latent_height: int, latent_width: int, text_len: int = TEXT_LEN,
                      batch: int = 2, **overrides):
    """A tiny-weight CogVideoXTransformer3DModel and the kwargs of one forward call.

    hidden_states [batch, F, C_in, H, W], encoder_hidden_states [batch, text_len, text_dim].
    """
    import torch

    config = dict(
        sample_frames=(latent_frames - 1) * 4 + 1,
        sample_height=latent_height,
        sample_width=latent_width,
        max_text_seq_length=text_len,
    )
    config.update(overrides)
    transformer = tiny_transformer(**config)
    g = torch.Generator().manual_seed(7)
    kwargs = dict(
        hidden_states=torch.randn(batch, latent_frames, transformer.config.in_channels, latent_height, latent_width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_EMBED_DIM, generator=g),
        timestep=torch.tensor([999, 421][:batch] + [1] * max(0, batch - 2)),
        image_rotary_emb=None,
    )
    if transformer.config.use_rotary_positional_embeddings:
        kwargs["image_rotary_emb"] = rotary_table(transformer, latent_frames, latent_height, latent_width)
    if transformer.config.ofs_embed_dim:
        kwargs["ofs"] = torch.full((batch,), 2.0)
    return transformer, kwargs


def cogvideox_pipeline(base_dir: str, scheduler: str = "ddim", image: bool = False, **overrides):
    """The tiny pipeline (from disk, as a real checkpoint) with a variant transformer and
    scheduler; `image=True` makes it the image-to-video pipeline (channels doubled)."""
    from diffusers import (CogVideoXDDIMScheduler, CogVideoXDPMScheduler, CogVideoXImageToVideoPipeline,
                           CogVideoXPipeline)

    with quiet_hub():
        pipe = CogVideoXPipeline.from_pretrained(base_dir)
    scheduler_cls = {"ddim": CogVideoXDDIMScheduler, "dpm": CogVideoXDPMScheduler}[scheduler]
    if image:
        i2v_overrides(overrides)
    pipeline_cls = CogVideoXImageToVideoPipeline if image else CogVideoXPipeline
    return pipeline_cls(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        transformer=tiny_transformer(**overrides),
        scheduler=scheduler_cls.from_config(pipe.scheduler.config),
    )


def forward_cases() -> list:
    from raydit.models.conformance import ForwardCase

    # The 2b case runs on every world size; the variants on a few (the suite's time).
    rotary = dict(use_rotary_positional_embeddings=True)
    return [
        # 2b style: sinusoidal positions; 30 heads, 30 patch rows (480p), 13 text tokens.
        ForwardCase("cogvideox-2b-h30-rows30", _BUILD_FORWARD, 30,
                    dict(latent_frames=2, latent_height=60, latent_width=4,
                         num_attention_heads=30, attention_head_dim=8)),
        # 5b style: rotary on video tokens only; 27 video tokens (odd).
        ForwardCase("cogvideox-5b-rotary", _BUILD_FORWARD, 6,
                    dict(latent_frames=3, latent_height=6, latent_width=6,
                         num_attention_heads=6, attention_head_dim=16, **rotary), worlds=(2, 3, 4)),
        # 1.5 style: temporal patch 2 (4 latent frames -> 2 patch frames), rotary "slice" grid.
        ForwardCase("cogvideox-1.5-patch_t2", _BUILD_FORWARD, 4,
                    dict(latent_frames=4, latent_height=6, latent_width=8, patch_size_t=2,
                         num_attention_heads=4, attention_head_dim=16, **rotary), worlds=(2, 4)),
        # 5b-I2V style: image latents joined in the channels, learned + rotary positions.
        ForwardCase("cogvideox-5b-i2v", _BUILD_FORWARD, 2,
                    dict(latent_frames=3, latent_height=4, latent_width=6, in_channels=8,
                         use_learned_positional_embeddings=True, **rotary), worlds=(2, 3)),
        # 1.5-I2V style: channels doubled, temporal patch 2, ofs embedding.
        ForwardCase("cogvideox-1.5-i2v-ofs", _BUILD_FORWARD, 2,
                    dict(latent_frames=2, latent_height=4, latent_width=4, in_channels=8, patch_size_t=2,
                         ofs_embed_dim=16, **rotary), worlds=(2, 4)),
    ]


def runner_cases(base_dir: str) -> list:
    from raydit.models.conformance import RunnerCase

    rotary = dict(use_rotary_positional_embeddings=True)
    return [
        # 2b: DDIM; 480 x 16 pixels -> 60 x 2 latents -> 30 patch rows; 30 heads.
        RunnerCase("cogvideox-2b-h30-rows30", _BUILD_PIPELINE, 30,
                   dict(prompt="a red fox runs", num_frames=5, height=480, width=16, num_inference_steps=3, seed=11),
                   dict(base_dir=base_dir, num_attention_heads=30, attention_head_dim=8, max_text_seq_length=TEXT_LEN,
                        sample_height=60, sample_width=2, sample_frames=5)),
        # 5b: rotary, DPM (stochastic: the generator state travels in the checkpoint).
        RunnerCase("cogvideox-5b-rotary-dpm", _BUILD_PIPELINE, 6,
                   dict(prompt="waves at dusk", num_frames=9, height=48, width=48, num_inference_steps=3, seed=5),
                   dict(base_dir=base_dir, scheduler="dpm", num_attention_heads=6, attention_head_dim=16,
                        max_text_seq_length=TEXT_LEN, sample_height=6, sample_width=6, **rotary), worlds=(2, 3, 5)),
        # 1.5: temporal patch 2; 3 latent frames padded to 4 as the pipeline does.
        RunnerCase("cogvideox-1.5-patch_t2-dpm", _BUILD_PIPELINE, 4,
                   dict(prompt="a paper boat", num_frames=9, height=48, width=64, num_inference_steps=3, seed=2),
                   dict(base_dir=base_dir, scheduler="dpm", patch_size_t=2, num_attention_heads=4,
                        attention_head_dim=16, max_text_seq_length=TEXT_LEN, sample_height=6, sample_width=8,
                        **rotary), worlds=(2, 4)),
        # I2V: image latents joined in the channels, learned positions; an image in the request.
        RunnerCase("cogvideox-i2v", _BUILD_PIPELINE, 2,
                   dict(prompt="a kite", num_frames=5, height=32, width=48, num_inference_steps=3, seed=4),
                   dict(base_dir=base_dir, image=True, max_text_seq_length=TEXT_LEN, sample_height=4,
                        sample_width=6, sample_frames=5),
                   image="checker", worlds=(2, 3)),
    ]


def conformance_cases(base_dirs) -> dict:
    """CogVideoX's cases for the shared suite (Family.conformance_cases)."""
    return {"forward": forward_cases(), "runner": runner_cases(base_dirs["tiny"])}
