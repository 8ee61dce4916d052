"""Wan's conformance cases: tiny transformers' forwards (T2V, I2V with CLIP tokens, TI2V's
timestep per token) and the tiny pipelines' steps, on every plan (tests/models/test_conformance.py
runs them)."""

from __future__ import annotations

from raydit.models.families.wan.tiny import TINY_IMAGE_DIM, TINY_TEXT_DIM, TINY_TEXT_TOKENS, tiny_transformer
from raydit.models.tiny import load_pipeline_dir

_BUILD_FORWARD = "raydit.models.families.wan.cases:wan_forward"


def wan_forward(kind: str, latent_frames: int, latent_height: int, latent_width: int, heads: int,
                head_dim: int, batch: int = 2, text_len: int = 13, seed: int = 31):
    """A tiny-weight WanTransformer3DModel and the kwargs of one forward call.

    kind "t2v": latents [batch, 4, F, H, W], text [batch, text_len, 32], one timestep per sample.
    kind "i2v": Wan 2.1 I2V: 12 input channels (noise, mask, image latents), 17 CLIP tokens
        in front of 512 text tokens (the model's processor assumes 512).
    kind "ti2v": a timestep per token ([batch, L], all different), so temb is [B, L, 6, C].
    """
    import torch

    overrides = dict(num_attention_heads=heads, attention_head_dim=head_dim, ffn_dim=2 * heads * head_dim)
    if kind == "i2v":
        overrides.update(in_channels=12, image_dim=TINY_IMAGE_DIM, added_kv_proj_dim=heads * head_dim)
        text_len = TINY_TEXT_TOKENS
    transformer = tiny_transformer(seed, **overrides)
    g = torch.Generator().manual_seed(7)
    channels = transformer.config.in_channels
    kwargs = dict(
        hidden_states=torch.randn(batch, channels, latent_frames, latent_height, latent_width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        timestep=torch.tensor([999.0, 421.0, 1.0, 700.0][:batch]),
    )
    if kind == "i2v":
        kwargs["encoder_hidden_states_image"] = torch.randn(batch, 17, TINY_IMAGE_DIM, generator=g)
    if kind == "ti2v":
        p_t, p_h, p_w = transformer.config.patch_size
        tokens = (latent_frames // p_t) * (latent_height // p_h) * (latent_width // p_w)
        kwargs["timestep"] = torch.rand(batch, tokens, generator=g) * 1000
    return transformer, kwargs


def forward_cases() -> list:
    """Transformer forward cases: heads and token counts chosen so that no world size 2..6
    divides the video, and 40 heads (Wan 14B) run ring / hybrid layouts on 3 and 6 ranks."""
    from raydit.models.conformance import ForwardCase

    return [
        # 2.1 T2V 1.3B-like: 12 heads; 7 latent frames x 1 x 7 = 49 tokens.
        ForwardCase("wan-t2v-h12", _BUILD_FORWARD, 12,
                    dict(kind="t2v", latent_frames=7, latent_height=2, latent_width=14, heads=12, head_dim=8)),
        # 2.1 I2V 14B-like: 40 heads, CLIP image tokens; 1 x 7 x 11 = 77 tokens.
        ForwardCase("wan-i2v-h40", _BUILD_FORWARD, 40,
                    dict(kind="i2v", latent_frames=1, latent_height=14, latent_width=22, heads=40, head_dim=6), worlds=(3, 4, 5)),
        # 2.2 TI2V-5B-like: 24 heads, per-token timestep; 7 x 1 x 13 = 91 tokens.
        ForwardCase("wan-ti2v-h24", _BUILD_FORWARD, 24,
                    dict(kind="ti2v", latent_frames=7, latent_height=2, latent_width=26, heads=24, head_dim=6), worlds=(2, 3, 4)),
        # 7 tokens: on 4..6 ranks the last ranks hold only padding.
        ForwardCase("wan-ti2v-7tokens", _BUILD_FORWARD, 6,
                    dict(kind="ti2v", latent_frames=7, latent_height=2, latent_width=2, heads=6, head_dim=12), worlds=(6, 8)),
    ]


_BUILD_PIPELINE = "raydit.models.families.wan.cases:wan_pipeline"


def wan_pipeline(base_dir: str):
    """A tiny Wan pipeline loaded from its directory (as a real checkpoint is)."""
    return load_pipeline_dir(base_dir)


def runner_cases(base_dirs) -> list:
    """Denoising cases on the tiny pipelines (6 heads: Ulysses 1, 2, 3, 6; 4, 5 and 8 ranks
    run ring / hybrid layouts). T2V runs on every world size of the suite, the variants on a
    few (the suite's one spawned group pays for every plan). Video token counts: 49 (7 x 1 x 7) and 45 (3 x 3 x 5): no
    world size 2..8 divides 49, and only 3 and 5 divide 45."""
    from raydit.models.conformance import RunnerCase

    def case(name, tiny, request, **kw):
        return RunnerCase(name, _BUILD_PIPELINE, 6, request, dict(base_dir=base_dirs[tiny]), **kw)

    a14b = dict(prompt="waves at dusk", negative_prompt="blur", num_frames=9, height=48, width=80,
                num_inference_steps=5, guidance_scale=5.0, guidance_scale_2=3.0, seed=5)
    return [
        # 2.1 T2V: UniPC (its multistep history travels in the checkpoint), two guidance calls.
        case("wan-t2v", "tiny-wan", dict(prompt="a red fox runs", num_frames=25, height=16, width=112,
                                         num_inference_steps=3, guidance_scale=5.0, seed=11)),
        # 2.2 A14B: timesteps 999, 923, 818, 667, 429 with the switch at 875: steps 0 and 1 run
        # `transformer`, steps 2.. `transformer_2` with guidance_scale_2. Resumed from a
        # checkpoint taken before the switch (after step 1) and after it (after step 2); the
        # resumed steps are not the schedule's last, whose update ignores UniPC's history.
        case("wan-a14b-resume-before-switch", "tiny-wan-a14b", a14b, steps=3, checkpoint_step=1, cfg=False, worlds=(3, 4)),
        case("wan-a14b-resume-after-switch", "tiny-wan-a14b", a14b, steps=4, checkpoint_step=3, worlds=(2, 4, 6)),
        # 2.2 TI2V-5B with an image: 16x VAE, a timestep per token (0 on the image's frame).
        case("wan-ti2v-image", "tiny-wan-ti2v", dict(prompt="a paper boat", num_frames=25, height=32, width=224,
                                                     num_inference_steps=3, guidance_scale=5.0, seed=2),
             image="checker", cfg=False, worlds=(2, 3)),
        # 2.1 I2V: CLIP image tokens in front of the text (cross-attention), image latents and
        # mask in the channels.
        case("wan-i2v", "tiny-wan-i2v", dict(prompt="a kite", num_frames=9, height=48, width=80,
                                             num_inference_steps=3, guidance_scale=5.0, seed=4),
             image="checker", cfg=False, worlds=(2, 5)),
    ]


def conformance_cases(base_dirs) -> dict:
    """Wan's cases for the shared suite (Family.conformance_cases)."""
    return {"forward": forward_cases(), "runner": runner_cases(base_dirs)}
