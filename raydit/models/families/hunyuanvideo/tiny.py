"""The tiny HunyuanVideo pipelines (`tiny-hunyuan`, `tiny-hunyuan-i2v`), random weights, written
once in diffusers' format.

`tiny-hunyuan`: 6 heads x 16, one dual- and one single-stream block, a small Llama and CLIP
text encoder with tokenizers built in code (the Llama one takes the pipeline's default prompt
template: 95 tokens before the prompt, which the pipeline crops), the HunyuanVideo VAE (8x
spatial, 4x temporal) with 8 channels; random weights. `tiny-hunyuan-i2v`: the same
transformer with token_replace blocks, a Llava of the tiny Llama and a 2-layer CLIP vision
tower (48 x 48 images in 2-pixel patches: 576 features, as CLIP-L/336's) and a tokenizer whose
I2V template is 103 tokens with `<image>` 6th, as Llama-3's (the pipeline's crop positions are
fixed numbers).
"""

from __future__ import annotations

from raydit.models.families.hunyuanvideo.family import _IMAGE_EMB_LEN
from raydit.models.tiny import clip_text_encoder, hunyuan_video_vae, tiny_dir

TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 6  # Ulysses 1, 2, 3, 6; 4 and 5 ranks run ring or hybrid layouts
TINY_HEAD_DIM = 16
TINY_ROPE_AXES = (4, 6, 6)  # frames, rows, columns: sums to the head dim
TINY_TEXT_DIM = 32  # Llama hidden size == transformer text_embed_dim
TINY_POOLED_DIM = 16  # CLIP hidden size == transformer pooled_projection_dim
TINY_LATENT_CHANNELS = 4
TINY_DEFAULTS = {"num_frames": 9, "height": 64, "width": 64}

# The pipeline's default prompt template puts 95 Llama-3 tokens before the prompt and crops
# them; this tokenizer keeps the template's words whole (and "of" in characters) so that its
# template is 95 tokens too and the crop leaves exactly the prompt.
_SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_TEMPLATE_WORDS = (
    "actions and angles aspects atmosphere background behaviors by camera changes color content describe detailing "
    "environment events following in light main movement movements objects physical quantity relationships shape "
    "size spatial style system temporal text texture the theme transitions used user video"
).split()


def _llama3_like_tokenizer(special: tuple, words, max_length: int):
    """A Llama-3-like fast tokenizer (BOS first; `special` and `words` single tokens) built in
    code: any other word is split into characters."""
    import string

    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_lowercase + string.digits + string.punctuation
    vocab = {"<pad>": 0, "<unk>": 1}
    for word in (*special, *words, *chars, *("##" + c for c in chars)):
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", max_input_chars_per_word=100))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in special])
    core.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", vocab["<|begin_of_text|>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<|begin_of_text|>", model_max_length=max_length)


def llama_tokenizer(max_length: int = 512):
    """A Llama-3-like fast tokenizer (BOS first, header tokens) built in code: the template's
    words are single tokens, any other word is split into characters."""
    return _llama3_like_tokenizer(_SPECIAL, _TEMPLATE_WORDS, max_length)


def _llama_encoder(vocab_size: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=TINY_TEXT_DIM, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                         bos_token_id=2)
    return LlamaModel(config).eval()


def tiny_transformer(seed: int, **overrides):
    """A HunyuanVideoTransformer3DModel of the tiny geometry (or `overrides`), every parameter
    drawn from `seed` (zero-initialised gates would make parallel tests trivial)."""
    import torch
    from diffusers import HunyuanVideoTransformer3DModel

    from raydit.models.tiny import randomize

    config = dict(
        in_channels=TINY_LATENT_CHANNELS, out_channels=TINY_LATENT_CHANNELS, num_attention_heads=TINY_HEADS,
        attention_head_dim=TINY_HEAD_DIM, num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
        patch_size=2, patch_size_t=1, text_embed_dim=TINY_TEXT_DIM, pooled_projection_dim=TINY_POOLED_DIM,
        rope_axes_dim=TINY_ROPE_AXES, guidance_embeds=True,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return randomize(HunyuanVideoTransformer3DModel(**config), seed)


def tiny_pipeline():
    """The tiny HunyuanVideoPipeline, built in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    from raydit.models.tiny import SEED, tokenizer

    tok, tok_2 = llama_tokenizer(), tokenizer(77)
    return HunyuanVideoPipeline(
        text_encoder=_llama_encoder(len(tok), SEED + 1),
        tokenizer=tok,
        transformer=tiny_transformer(SEED + 10),
        vae=hunyuan_video_vae(SEED + 2, TINY_LATENT_CHANNELS),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),  # HunyuanVideo's
        text_encoder_2=clip_text_encoder(len(tok_2), TINY_POOLED_DIM, SEED + 3),
        tokenizer_2=tok_2,
    )


tiny_pipeline_dir = tiny_dir(f"tiny-hunyuan-{TINY_VERSION}", tiny_pipeline, TINY_DEFAULTS)


# -- the tiny image-to-video pipeline -----------------------------------------------------------
TINY_I2V_VERSION = "1"
TINY_VISION_SIZE = 48  # CLIP vision input; 2-pixel patches: 24 x 24 = 576 features, as CLIP-L/336's
_IMAGE_TOKEN = "<image>"
_NEWLINES = "\n\n"  # a token, as in Llama-3: it puts <image> 6th, where the pipeline expects it

# The I2V template's words, each one token except "to" and "by" (in characters): with the
# special tokens, the template before the prompt is 103 tokens, the pipeline's crop_start.
_I2V_TEMPLATE_WORDS = (
    "according actions and angles aspects assistant atmosphere background behaviors camera changes color content "
    "describe detailing environment events following image in light main movement movements objects of physical "
    "quantity reference relationships shape size spatial style system temporal text texture the theme transitions "
    "used user video"
).split()


def llava_tokenizer(max_length: int = 1024):
    """A Llama-3-like tokenizer for the I2V template (BOS first; header, <image> and blank-line
    tokens) built in code: its template is 103 tokens with <image> at position 5 and the
    assistant header 4 tokens, the numbers the pipeline's crop is written for."""
    return _llama3_like_tokenizer((*_SPECIAL, _IMAGE_TOKEN, _NEWLINES), _I2V_TEMPLATE_WORDS, max_length)


def _llava_encoder(tok, seed: int):
    """LlavaForConditionalGeneration: the tiny Llama and a 2-layer CLIP vision tower (the
    feature layer is the second to last, CLS dropped: 576 features), random weights."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=TINY_TEXT_DIM, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0,
                       bos_token_id=tok.bos_token_id)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=TINY_VISION_SIZE, patch_size=2, projection_dim=16)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids(_IMAGE_TOKEN),
                         pad_token_id=0, image_seq_length=_IMAGE_EMB_LEN)
    return LlavaForConditionalGeneration(config).eval()


def tiny_i2v_pipeline():
    """The tiny HunyuanVideoImageToVideoPipeline (token_replace, as HunyuanVideo-I2V), in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoImageToVideoPipeline
    from transformers import CLIPImageProcessor

    from raydit.models.tiny import SEED, tokenizer, quiet_hub

    tok, tok_2 = llava_tokenizer(), tokenizer(77)
    with quiet_hub():  # CLIPImageProcessor warns that it falls back to PIL without torchvision
        processor = CLIPImageProcessor(size={"shortest_edge": TINY_VISION_SIZE},
                                       crop_size={"height": TINY_VISION_SIZE, "width": TINY_VISION_SIZE})
    return HunyuanVideoImageToVideoPipeline(
        text_encoder=_llava_encoder(tok, SEED + 4),
        tokenizer=tok,
        transformer=tiny_transformer(SEED + 11, image_condition_type="token_replace"),
        vae=hunyuan_video_vae(SEED + 2, TINY_LATENT_CHANNELS),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=clip_text_encoder(len(tok_2), TINY_POOLED_DIM, SEED + 3),
        tokenizer_2=tok_2,
        image_processor=processor,
    )


tiny_i2v_pipeline_dir = tiny_dir(f"tiny-hunyuan-i2v-{TINY_I2V_VERSION}", tiny_i2v_pipeline, TINY_DEFAULTS)

TINY_PIPELINES = {"tiny-hunyuan": tiny_pipeline_dir, "tiny-hunyuan-i2v": tiny_i2v_pipeline_dir}  # Family.tiny
