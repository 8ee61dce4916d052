"""The tiny Kandinsky 5 pipelines (`tiny-kandinsky5`, `tiny-kandinsky5-i2v`), random weights,
written once in diffusers' format.

6 heads x 8 (Ulysses 1, 2, 3, 6; 4 and 5 ranks run ring or hybrid), one text block and two
visual blocks, patch (1, 2, 2), a small Qwen2.5-VL with a tokenizer built in code whose chat
template is 128 tokens before the prompt (as the pipeline crops), a small CLIP text model, and
HunyuanVideo's VAE (8x spatial, 4x temporal) with 4 channels; random weights.
"""

from __future__ import annotations

from raydit.models.tiny import clip_text_encoder, hunyuan_video_vae, tiny_dir

TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 6  # Ulysses 1, 2, 3, 6; 4 and 5 ranks run ring or hybrid layouts
TINY_AXES = (2, 2, 4)  # frames, rows, columns: the head dim is their sum, 8
TINY_TEXT_DIM = 16  # Qwen hidden size == transformer in_text_dim
TINY_POOLED_DIM = 16  # CLIP hidden size == transformer in_text_dim2
TINY_LATENT_CHANNELS = 4
TINY_DEFAULTS = {"num_frames": 9, "height": 48, "width": 80}  # 3 x 3 x 5 = 45 video tokens
TINY_I2V_DEFAULTS = {"num_frames": 17, "height": 32, "width": 48}  # 5 x 2 x 3 = 30 video tokens
TEMPLATE_TOKENS = 128  # the pipelines' prompt_template_encode_start_idx

# The words of the pipelines' system message kept whole; "scren" and "pay" are spelled out in
# characters so that the template is exactly TEMPLATE_TOKENS tokens before the prompt.
_WHOLE_WORDS = (
    "a action actions and angle animation are attention camera characters content describe detail dynamism effects "
    "engineer follows footage game generated how if in is it key kind location main moves name objects of or order "
    "postprocessing presented professional prompt scene shakes shown some style system the their they to "
    "transitions user video view visual whether you zoom"
).split()


def qwen_tokenizer(max_length: int = 2048):
    """The tiny Qwen-like tokenizer (text only): the template's words are single tokens."""
    from raydit.models.tiny import qwen_tokenizer as qwen_like

    return qwen_like(_WHOLE_WORDS, max_length)


def _template_prefix(pipe_template: str, tok) -> int:
    """How many tokens `tok` gives the pipeline's template before the prompt."""
    with_prompt = tok(pipe_template.format("x"))["input_ids"]
    return len(with_prompt) - 2  # after the prompt "x": <|im_end|>


def _qwen_encoder(vocab_size: int, seed: int):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=TINY_TEXT_DIM, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         rope_theta=1e6, pad_token_id=0, bos_token_id=0, eos_token_id=2),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TINY_TEXT_DIM,
                           patch_size=2, spatial_merge_size=1, temporal_patch_size=1, fullatt_block_indexes=[0],
                           window_size=4),
        image_token_id=vocab_size + 1, video_token_id=vocab_size + 2, vision_start_token_id=vocab_size + 3,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_transformer(seed: int, **overrides):
    """A Kandinsky5Transformer3DModel of the tiny geometry (or `overrides`), every parameter
    drawn from `seed` (diffusers zero-initialises the modulations: the blocks would be identities)."""
    import torch
    from diffusers import Kandinsky5Transformer3DModel

    from raydit.models.tiny import randomize

    config = dict(
        in_visual_dim=TINY_LATENT_CHANNELS, out_visual_dim=TINY_LATENT_CHANNELS, in_text_dim=TINY_TEXT_DIM,
        in_text_dim2=TINY_POOLED_DIM, time_dim=16, patch_size=(1, 2, 2), model_dim=TINY_HEADS * sum(TINY_AXES),
        ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=TINY_AXES, visual_cond=True,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return randomize(Kandinsky5Transformer3DModel(**config), seed)


def tiny_pipeline(image: bool = False):
    """The tiny Kandinsky5T2VPipeline (or, `image`, Kandinsky5I2VPipeline), built in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5I2VPipeline, Kandinsky5T2VPipeline

    from raydit.models.tiny import SEED, tokenizer

    tok, tok_2 = qwen_tokenizer(), tokenizer(77)
    cls = Kandinsky5I2VPipeline if image else Kandinsky5T2VPipeline
    pipe = cls(
        transformer=tiny_transformer(SEED + 10),
        vae=hunyuan_video_vae(SEED + 2, TINY_LATENT_CHANNELS),
        text_encoder=_qwen_encoder(len(tok), SEED + 1),
        tokenizer=tok,
        text_encoder_2=clip_text_encoder(len(tok_2), TINY_POOLED_DIM, SEED + 3),
        tokenizer_2=tok_2,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
    )
    prefix = _template_prefix(pipe.prompt_template, tok)
    if prefix != pipe.prompt_template_encode_start_idx or prefix != TEMPLATE_TOKENS:
        raise RuntimeError(f"the tiny Qwen template is {prefix} tokens; the pipeline crops "
                           f"{pipe.prompt_template_encode_start_idx}")
    return pipe


tiny_pipeline_dir = tiny_dir(f"tiny-kandinsky5-{TINY_VERSION}", tiny_pipeline, TINY_DEFAULTS)
tiny_i2v_pipeline_dir = tiny_dir(f"tiny-kandinsky5-i2v-{TINY_VERSION}", lambda: tiny_pipeline(image=True), TINY_I2V_DEFAULTS)

TINY_PIPELINES = {"tiny-kandinsky5": tiny_pipeline_dir, "tiny-kandinsky5-i2v": tiny_i2v_pipeline_dir}  # Family.tiny
