"""Kandinsky 5's conformance cases: the tiny transformer's forward and the tiny pipelines' steps,
on every plan (tests/models/test_conformance.py runs them)."""

from __future__ import annotations

from raydit.models.families.kandinsky5.tiny import (TINY_HEADS, TINY_I2V_DEFAULTS, TINY_LATENT_CHANNELS,
                                                    TINY_POOLED_DIM, TINY_TEXT_DIM, tiny_transformer)
from raydit.models.tiny import load_pipeline_dir

_BUILD_FORWARD = "raydit.models.families.kandinsky5.cases:kandinsky5_forward"
_BUILD_PIPELINE = "raydit.models.families.kandinsky5.cases:kandinsky5_pipeline"
_CAST = "raydit.models.families.kandinsky5.cases:cast_transformer"


def kandinsky5_forward(latent_frames: int, latent_height: int, latent_width: int, heads: int, axes: tuple,
                       text_len: int = 11, batch: int = 2, visual_blocks: int = 2, seed: int = 41):
    """A tiny-weight Kandinsky5Transformer3DModel and the kwargs of one forward call (patch
    (1, 2, 2): latent height and width are twice the token rows and columns)."""
    import torch

    transformer = tiny_transformer(seed, model_dim=heads * sum(axes), axes_dims=tuple(axes),
                                   num_visual_blocks=visual_blocks)
    g = torch.Generator().manual_seed(7)
    channels = 2 * TINY_LATENT_CHANNELS + 1
    kwargs = dict(
        hidden_states=torch.randn(batch, latent_frames, latent_height, latent_width, channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        timestep=torch.tensor([999.0, 421.0, 1.0, 700.0][:batch]),
        pooled_projections=torch.randn(batch, TINY_POOLED_DIM, generator=g),
        visual_rope_pos=[torch.arange(latent_frames), torch.arange(latent_height // 2), torch.arange(latent_width // 2)],
        text_rope_pos=torch.arange(text_len),
        scale_factor=(1.0, 2.0, 2.0),
    )
    return transformer, kwargs


def cast_transformer(transformer, dtype):
    """The transformer in `dtype` as from_pretrained(dtype=...) loads it: in half precision its
    `_keep_in_fp32_modules` (time embedding, modulations) stay float32; in float64 everything
    but the time embedding, whose input is float32 by construction (the model casts it)."""
    import torch

    transformer.to(dtype)
    keep = transformer._keep_in_fp32_modules if dtype in (torch.float16, torch.bfloat16) else ["time_embeddings"]
    for name, module in transformer.named_modules():
        if name and any(k in name.split(".") for k in keep):
            module.to(torch.float32)
    return transformer


def kandinsky5_pipeline(base_dir: str, dtype=None):
    """A tiny Kandinsky 5 pipeline loaded from its directory (as a real checkpoint is); in
    `dtype` as from_pretrained(dtype=...) loads it: the transformer's time embedding and
    modulations stay float32 (`_keep_in_fp32_modules`; the model breaks when they are cast)."""
    if dtype is None:
        return load_pipeline_dir(base_dir)
    from diffusers import DiffusionPipeline

    from raydit.models.tiny import quiet_hub

    with quiet_hub():
        pipe = DiffusionPipeline.from_pretrained(base_dir, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def forward_cases() -> list:
    """Token counts no world size 2..6 divides; 6 and 5 heads (Ulysses 1, 2, 3, 6 / 1, 5; the
    rest ring or hybrid)."""
    from raydit.models.conformance import ForwardCase

    return [
        # 3 x 3 x 5 = 45 video tokens (latents 3 x 6 x 10, patch 2), a batch of two samples.
        ForwardCase("kandinsky5-h6", _BUILD_FORWARD, 6,
                    dict(latent_frames=3, latent_height=6, latent_width=10, heads=6, axes=(2, 2, 4)), cast=_CAST),
        # 1 x 1 x 7 = 7 video tokens on 5 and 6 ranks (pad rows on most of them), one block.
        ForwardCase("kandinsky5-h5-7tokens", _BUILD_FORWARD, 5,
                    dict(latent_frames=1, latent_height=2, latent_width=14, heads=5, axes=(2, 2, 4), batch=1,
                         visual_blocks=1),
                    worlds=(5, 6), cast=_CAST),
    ]


def runner_cases(base_dir: str, i2v_dir: str) -> list:
    """Denoising on the tiny pipelines: 3 x 3 x 5 = 45 video tokens (3 and 5 divide it, 2, 4,
    6 and 8 do not), classifier-free guidance (cfg = 2 runs one branch on each group);
    image-to-video (17 frames: the pipeline needs 5 latent frames) on 3 and 4 ranks."""
    from raydit.models.conformance import RunnerCase

    request = dict(prompt="a red fox runs through snow", negative_prompt="blur", num_frames=9, height=48, width=80,
                   num_inference_steps=2, guidance_scale=5.0, seed=11)
    return [
        # Every plan on 2..4 ranks (one rank is the reference itself), cfg 2 on 2 and 4 (the
        # suite's time); the forward cases cover 5, 6 and 8 ranks.
        RunnerCase("kandinsky5-t2v", _BUILD_PIPELINE, TINY_HEADS, request, dict(base_dir=base_dir),
                   worlds=(2, 3, 4)),
        # 5 x 2 x 3 = 30 video tokens (4 ranks pad); an empty negative prompt: the pipeline's default.
        RunnerCase("kandinsky5-i2v", _BUILD_PIPELINE, TINY_HEADS,
                   dict(request, seed=5, negative_prompt="", **TINY_I2V_DEFAULTS),
                   dict(base_dir=i2v_dir), image="checker", worlds=(3, 4), cfg=False),
    ]


def conformance_cases(base_dirs) -> dict:
    """Kandinsky 5's cases for the shared suite (Family.conformance_cases)."""
    return {"forward": forward_cases(),
            "runner": runner_cases(base_dirs["tiny-kandinsky5"], base_dirs["tiny-kandinsky5-i2v"])}
