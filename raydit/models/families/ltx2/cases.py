"""LTX-2's conformance cases: the tiny transformer's forward and the tiny pipelines' steps, on
every plan (tests/models/test_conformance.py runs them), and the tiny request they share."""

from __future__ import annotations

from raydit.models.families.ltx2.family import FRAME_RATE
from raydit.models.families.ltx2.tiny import TINY_HEADS, TINY_LATENT_CHANNELS, TINY_TEXT_DIM, tiny_transformer
from raydit.models.tiny import load_pipeline_dir


_BUILD_PIPELINE = "raydit.models.families.ltx2.cases:ltx2_pipeline"
_BUILD_FORWARD = "raydit.models.families.ltx2.cases:ltx2_forward"

# 17 frames at 32 x 416: 3 x 1 x 13 = 39 video tokens, 18 audio tokens; block 1 of 2 is STG's.
TINY_REQUEST = dict(prompt="a red fox barks", negative_prompt="blur", num_frames=17, height=32, width=416,
                    num_inference_steps=2, guidance_scale=3.0, seed=11, guidance_options={"stg_blocks": (1,)})
NO_STG_NO_MODALITY = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0}


def ltx2_pipeline(base_dir: str):
    """The tiny LTX-2 pipeline loaded from its directory (as a real checkpoint is)."""
    return load_pipeline_dir(base_dir)


def ltx2_forward(latent_frames: int, latent_height: int, latent_width: int, audio_frames: int, valid: tuple,
                 text_len: int = 11, seed: int = 31, **call):
    """A tiny-weight LTX2VideoTransformer3DModel and the kwargs of one forward call: packed video
    [B, F*H*W, 8] and audio [B, audio_frames, 4] latents, one sample per entry of `valid` (its
    unmasked prompt tokens), `call`: further forward arguments (STG blocks, isolate_modalities)."""
    import torch

    transformer = tiny_transformer(seed)
    g = torch.Generator().manual_seed(7)
    batch = len(valid)
    kwargs = dict(
        hidden_states=torch.randn(batch, latent_frames * latent_height * latent_width, TINY_LATENT_CHANNELS,
                                  generator=g),
        audio_hidden_states=torch.randn(batch, audio_frames, 4, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        audio_encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        timestep=torch.tensor([999.0, 421.0, 1.0][:batch]),
        encoder_attention_mask=(torch.arange(text_len).unsqueeze(0) >= text_len - torch.tensor(valid).unsqueeze(1)).long(),
        num_frames=latent_frames, height=latent_height, width=latent_width, fps=FRAME_RATE, audio_num_frames=audio_frames,
        use_cross_timestep=True,
    )
    kwargs["sigma"] = kwargs["timestep"]
    kwargs["audio_encoder_attention_mask"] = kwargs["encoder_attention_mask"]
    kwargs.update(call)
    return transformer, kwargs


def forward_cases() -> list:
    from raydit.models.conformance import ForwardCase

    return [
        # 3 x 1 x 13 = 39 video tokens (only 3 of 2..8 divides them), 18 audio tokens, 6 heads,
        # left-padded prompts of different lengths (Gemma's padding side)
        ForwardCase("ltx2-h6-39tokens", _BUILD_FORWARD, TINY_HEADS,
                    dict(latent_frames=3, latent_height=1, latent_width=13, audio_frames=18, valid=(4, 11))),
        # the guidance passes' switches: block 1's self-attention skipped (STG) and no audio<->video attention
        ForwardCase("ltx2-stg-isolated", _BUILD_FORWARD, TINY_HEADS,
                    dict(latent_frames=3, latent_height=1, latent_width=13, audio_frames=18, valid=(7,),
                         spatio_temporal_guidance_blocks=[1], isolate_modalities=True), worlds=(2,)),
        # the audio tokens split too (a plan's audio_split_tokens <= 18): 18 audio tokens make
        # uneven chunks on 4, 5 and 8 ranks; the same with block 1's self-attentions skipped (STG)
        ForwardCase("ltx2-audio-split", _BUILD_FORWARD, TINY_HEADS,
                    dict(latent_frames=3, latent_height=1, latent_width=13, audio_frames=18, valid=(4, 11)),
                    options={"audio_split_tokens": 18}),
        ForwardCase("ltx2-audio-split-stg", _BUILD_FORWARD, TINY_HEADS,
                    dict(latent_frames=3, latent_height=1, latent_width=13, audio_frames=18, valid=(7,),
                         spatio_temporal_guidance_blocks=[1]), worlds=(3,), options={"audio_split_tokens": 1}),
    ]


def runner_cases(base_dir: str, i2v_dir: str | None = None) -> list:
    """The main case on 2 and 4 ranks (the suite's time budget: its forward case runs every
    world): Ulysses, ring, hybrid, uneven chunks (39 tokens), cfg 2 (the [negative, positive]
    pass on one group, the STG and modality passes on the other) and cfg 4 (a pass per group);
    its variants on one world each."""
    from raydit.models.conformance import RunnerCase

    cases = [
        RunnerCase("ltx2-t2v", _BUILD_PIPELINE, TINY_HEADS, dict(TINY_REQUEST), dict(base_dir=base_dir),
                   worlds=(2, 4), branch_degrees=(2, 4)),
        # guidance without the perturbed passes: their slots are zeros
        RunnerCase("ltx2-t2v-cfg-only", _BUILD_PIPELINE, TINY_HEADS,
                   dict(TINY_REQUEST, seed=12, guidance_options=NO_STG_NO_MODALITY), dict(base_dir=base_dir),
                   cfg=False, worlds=(3,)),
        # the audio tokens split over the sp ranks as well (all four passes, cfg 2 and 4 on 4 ranks)
        RunnerCase("ltx2-t2v-audio-split", _BUILD_PIPELINE, TINY_HEADS, dict(TINY_REQUEST, seed=14),
                   dict(base_dir=base_dir), worlds=(4,), branch_degrees=(2, 4), options={"audio_split_tokens": 1}),
    ]
    if i2v_dir is not None:
        # the image's 13 tokens at timestep 0: per-token modulations split with the tokens
        cases.append(RunnerCase(
            "ltx2-i2v", _BUILD_PIPELINE, TINY_HEADS,
            dict(TINY_REQUEST, prompt="a kite climbs", seed=13, guidance_options={"stg_blocks": (0,), "image_crf": 0}),
            dict(base_dir=i2v_dir), image="checker", worlds=(2,)))
    return cases


def conformance_cases(base_dirs) -> dict:
    """LTX-2's cases for the shared suite (Family.conformance_cases)."""
    return {"forward": forward_cases(), "runner": runner_cases(base_dirs["tiny-ltx2"], base_dirs["tiny-ltx2-i2v"])}
