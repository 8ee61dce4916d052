"""The tiny HunyuanVideo 1.5 pipelines (`tiny-hunyuan15`, `tiny-hunyuan15-i2v`), random weights,
written once in diffusers' format.

6 heads x 8 (Ulysses 1, 2, 3, 6; 4 and 5 ranks run ring or hybrid), two blocks, a small
Qwen2.5-VL text model with a tokenizer built in code whose chat template is 108 tokens before
the prompt (as Qwen's), a small T5 over ByT5's byte tokenizer, SigLIP for I2V, and the 1.5 VAE
(16x spatial, 4x temporal) with 8 channels; random weights.
"""

from __future__ import annotations

from raydit.models.tiny import tiny_dir

TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 6  # Ulysses 1, 2, 3, 6; 4 and 5 ranks run ring or hybrid layouts
TINY_HEAD_DIM = 8
TINY_ROPE_AXES = (2, 2, 4)  # frames, rows, columns: sums to the head dim
TINY_TEXT_DIM = 16  # Qwen hidden size == transformer text_embed_dim
TINY_BYT5_DIM = 24  # T5 d_model == transformer text_embed_2_dim
TINY_IMAGE_DIM = 12  # SigLIP hidden size == transformer image_embed_dim
TINY_LATENT_CHANNELS = 4
TINY_TARGET_SIZE = 64  # the 16:9 bucket (and a 48 x 80 image's) is 48 x 80
TINY_DEFAULTS = {"num_frames": 9, "height": 48, "width": 80}
TINY_SIGLIP_SIZE = 32  # SigLIP input; 8-pixel patches: 16 image tokens

# Qwen2.5-VL's chat template puts 108 tokens before the prompt, which the pipeline crops.
# This tokenizer keeps some of the system message's words whole and splits the others into
# characters, so that its template is 108 tokens too and the crop leaves exactly the prompt.
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WHOLE_WORDS = (
    "system user assistant you are a the video by detailing following aspects main content and "
    "theme of color shape size texture quantity text spatial relationships objects actions events behaviors "
    "temporal physical movement changes background environment light style atmosphere camera angles movements "
    "transitions used in"
).split()
TEMPLATE_TOKENS = 108


def qwen_tokenizer(max_length: int = 2048, whole_words: tuple = tuple(_WHOLE_WORDS)):
    """The tiny Qwen-like tokenizer (raydit.models.tiny.qwen_tokenizer) with the chat template."""
    from raydit.models.tiny import qwen_tokenizer as qwen_like

    tok = qwen_like(whole_words, max_length)
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def _template_tokenizer():
    """qwen_tokenizer, checked: its template is TEMPLATE_TOKENS tokens before the prompt
    ("helpful" and "describe" cost their characters: 95 + 6 + 7)."""
    tok = qwen_tokenizer()
    chat = [{"role": "system", "content": _system_message()}, {"role": "user", "content": "x"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    prefix = len(ids) - 4  # after the prompt "x": <|im_end|> <|im_start|> assistant
    if prefix != TEMPLATE_TOKENS:
        raise RuntimeError(f"the tiny Qwen template is {prefix} tokens, not {TEMPLATE_TOKENS}")
    return tok


def _system_message() -> str:
    """The system message HunyuanVideo15Pipeline puts in its template (the default of its
    prompt-embedding helper: the same text the pipeline passes)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def _qwen_encoder(vocab_size: int, seed: int):
    import torch
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(seed)
    config = Qwen2_5_VLTextConfig(
        vocab_size=vocab_size, hidden_size=TINY_TEXT_DIM, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, bos_token_id=0, eos_token_id=2,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}, rope_theta=1e6,
    )
    return Qwen2_5_VLTextModel(config).eval()


def _byt5_encoder(seed: int):
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(vocab_size=384, d_model=TINY_BYT5_DIM, d_kv=8, d_ff=32, num_layers=2, num_heads=3,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                      feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1)
    return T5EncoderModel(config).eval()


def _siglip(seed: int):
    import torch
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    config = SiglipVisionConfig(hidden_size=TINY_IMAGE_DIM, intermediate_size=16, num_hidden_layers=1,
                                num_attention_heads=2, image_size=TINY_SIGLIP_SIZE, patch_size=8)
    processor = SiglipImageProcessor(size={"height": TINY_SIGLIP_SIZE, "width": TINY_SIGLIP_SIZE})
    return SiglipVisionModel(config).eval(), processor


def tiny_transformer(seed: int, **overrides):
    """A HunyuanVideo15Transformer3DModel of the tiny geometry (or `overrides`), every
    parameter drawn from `seed` (zero-initialised gates would make parallel tests trivial)."""
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    from raydit.models.tiny import randomize

    config = dict(
        in_channels=2 * TINY_LATENT_CHANNELS + 1, out_channels=TINY_LATENT_CHANNELS, num_attention_heads=TINY_HEADS,
        attention_head_dim=TINY_HEAD_DIM, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1,
        patch_size_t=1, text_embed_dim=TINY_TEXT_DIM, text_embed_2_dim=TINY_BYT5_DIM, image_embed_dim=TINY_IMAGE_DIM,
        rope_axes_dim=TINY_ROPE_AXES, target_size=TINY_TARGET_SIZE, task_type="t2v",
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return randomize(HunyuanVideo15Transformer3DModel(**config), seed)


def _tiny_vae(seed: int):
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(seed)
    return AutoencoderKLHunyuanVideo15(
        latent_channels=TINY_LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
        spatial_compression_ratio=16, temporal_compression_ratio=4,
        downsample_match_channel=False, upsample_match_channel=False,
    ).eval()


def tiny_pipeline(image: bool = False):
    """The tiny HunyuanVideo15Pipeline (or, `image`, HunyuanVideo15ImageToVideoPipeline),
    built in memory."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Pipeline,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer

    from raydit.models.tiny import SEED

    tok = _template_tokenizer()
    parts = dict(
        text_encoder=_qwen_encoder(len(tok), SEED + 1),
        tokenizer=tok,
        transformer=tiny_transformer(SEED + 10, task_type="i2v" if image else "t2v"),
        vae=_tiny_vae(SEED + 2),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=_byt5_encoder(SEED + 3),
        tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    if not image:
        return HunyuanVideo15Pipeline(**parts)
    encoder, processor = _siglip(SEED + 4)
    return HunyuanVideo15ImageToVideoPipeline(**parts, image_encoder=encoder, feature_extractor=processor)


tiny_pipeline_dir = tiny_dir(f"tiny-hunyuan15-{TINY_VERSION}", tiny_pipeline, TINY_DEFAULTS)


tiny_i2v_pipeline_dir = tiny_dir(f"tiny-hunyuan15-i2v-{TINY_VERSION}", lambda: tiny_pipeline(image=True), TINY_DEFAULTS)

TINY_PIPELINES = {"tiny-hunyuan15": tiny_pipeline_dir, "tiny-hunyuan15-i2v": tiny_i2v_pipeline_dir}  # Family.tiny
