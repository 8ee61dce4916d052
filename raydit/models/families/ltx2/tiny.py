"""The tiny LTX-2 pipelines (`tiny-ltx2`, `tiny-ltx2-i2v`), random weights, written once in
diffusers' format.

`tiny-ltx2` / `tiny-ltx2-i2v`: video 6 heads x 8, audio 6 heads x 4, 2 blocks, split
rotary, perturbed attention (STG), a 2-layer Gemma 3 (16 wide), 1-layer connectors, the LTX-2
video VAE with 32x spatial / 8x temporal compression (8 channels), the audio VAE (2 channels,
8 mel bins) and a vocoder whose upsampling (160) is the mel hop: the sound lasts as the video.
"""

from __future__ import annotations

from raydit.models.tiny import tiny_dir

TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 6  # video and audio (the cross-attention rotary table has the video's head count)
TINY_HEAD_DIM = 8
TINY_AUDIO_HEAD_DIM = 4
TINY_TEXT_DIM = 16  # Gemma 3 hidden size == connectors' caption_channels == transformer's
TINY_TEXT_LAYERS = 2
TINY_LATENT_CHANNELS = 8
TINY_MAX_TEXT = 32  # the tiny tokenizer's model_max_length (the pipeline pads to its own 1024 regardless)
TINY_DEFAULTS = {"num_frames": 17, "height": 32, "width": 416}


def tiny_transformer(seed: int, **overrides):
    """An LTX2VideoTransformer3DModel of the tiny geometry (or `overrides`), parameters from `seed`."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    from raydit.models.tiny import randomize

    config = dict(in_channels=TINY_LATENT_CHANNELS, out_channels=TINY_LATENT_CHANNELS, num_attention_heads=TINY_HEADS,
                  attention_head_dim=TINY_HEAD_DIM, audio_in_channels=4, audio_out_channels=4,
                  audio_num_attention_heads=TINY_HEADS, audio_attention_head_dim=TINY_AUDIO_HEAD_DIM, num_layers=2,
                  caption_channels=TINY_TEXT_DIM, rope_type="split", perturbed_attn=True, rope_double_precision=False)
    config.update(overrides)
    config.setdefault("cross_attention_dim", config["num_attention_heads"] * config["attention_head_dim"])
    config.setdefault("audio_cross_attention_dim", config["audio_num_attention_heads"] * config["audio_attention_head_dim"])
    torch.manual_seed(seed)
    return randomize(LTX2VideoTransformer3DModel(**config), seed)


def _tiny_text_encoder(vocab_size: int, seed: int):
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=TINY_TEXT_DIM, intermediate_size=32,
                            num_hidden_layers=TINY_TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, max_position_embeddings=64, sliding_window=16, pad_token_id=0,
                            eos_token_id=1, bos_token_id=1)
    vision = SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    # image tokens beyond the vocabulary: text prompts never contain them
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          boi_token_index=vocab_size + 1, eoi_token_index=vocab_size + 2,
                          image_token_index=vocab_size + 3)
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config).eval()


def _tiny_connectors(seed: int):
    import torch
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    from raydit.models.tiny import randomize

    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(
        caption_channels=TINY_TEXT_DIM, text_proj_in_factor=TINY_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_type="split",
        rope_double_precision=False)
    return randomize(connectors, seed)


def _tiny_vaes(seed: int):
    import torch
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        latent_channels=TINY_LATENT_CHANNELS, block_out_channels=(8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False), downsample_type=("spatiotemporal",) * 3,
        upsample_type=("spatiotemporal",) * 3, upsample_residual=(False,) * 3, upsample_factor=(1,) * 3,
        timestep_conditioning=False, patch_size=4, decoder_spatial_padding_mode="zeros",
    ).eval()  # patch 4 x 2^3 = 32x spatial, 2^3 = 8x temporal
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    ).eval()
    # 8 x 5 x 4 = 160 samples per mel frame: the hop, so the waveform lasts as the video
    vocoder = LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[16, 10, 8],
                          upsample_factors=[8, 5, 4], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000).eval()
    return vae, audio_vae, vocoder


def tiny_pipeline():
    """The tiny LTX2Pipeline, built in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    from raydit.models.tiny import SEED, tokenizer

    tok = tokenizer(TINY_MAX_TEXT)
    vae, audio_vae, vocoder = _tiny_vaes(SEED + 2)
    # LTX-2's scheduler: dynamic shift by the video token count.
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=1024,
                                                max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
                                                shift_terminal=0.1)
    return LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae,
                        text_encoder=_tiny_text_encoder(len(tok), SEED + 1), tokenizer=tok,
                        connectors=_tiny_connectors(SEED + 3), transformer=tiny_transformer(SEED + 10), vocoder=vocoder)


def tiny_i2v_pipeline():
    """The tiny LTX2ImageToVideoPipeline: the text-to-video one's components."""
    from diffusers import LTX2ImageToVideoPipeline

    components = {k: v for k, v in tiny_pipeline().components.items() if v is not None}
    return LTX2ImageToVideoPipeline(**components)


tiny_pipeline_dir = tiny_dir(f"tiny-ltx2-{TINY_VERSION}", tiny_pipeline, TINY_DEFAULTS)


tiny_i2v_pipeline_dir = tiny_dir(f"tiny-ltx2-i2v-{TINY_VERSION}", tiny_i2v_pipeline, TINY_DEFAULTS)

TINY_PIPELINES = {"tiny-ltx2": tiny_pipeline_dir, "tiny-ltx2-i2v": tiny_i2v_pipeline_dir}  # Family.tiny
