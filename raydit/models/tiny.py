"""The built-in `tiny` pipeline: a real CogVideoX pipeline, small enough for CPU tests.

It has the CogVideoX-2b architecture (sinusoidal positional embedding, DDIM scheduler) with
deterministic random weights. It is written once, in ordinary diffusers format, to a cache
directory and loaded from there through `CogVideoXPipeline.from_pretrained`, the same path a
real checkpoint takes. No network access is needed: the tokenizer is built in code with the
`tokenizers` library (a character-level WordPiece vocabulary, so distinct prompts give
distinct token ids).

The geometry constants below are read by the planner's `tiny` ModelSpec; keep them in sync
with `_transformer_config`.
"""

from __future__ import annotations

import os
import shutil
import string
import tempfile
from pathlib import Path

import torch

# Bump when anything below changes the saved files, so stale caches are not reused.
TINY_VERSION = "1"

TINY_HEADS = 2
TINY_HEAD_DIM = 16
TINY_LAYERS = 2
TINY_TEXT_TOKENS = 16  # transformer max_text_seq_length == pipeline max_sequence_length
TINY_TEXT_EMBED_DIM = 32  # T5 d_model == transformer text_embed_dim
TINY_TIME_EMBED_DIM = 16
TINY_LATENT_CHANNELS = 4
TINY_PATCH_SIZE = 2
TINY_VAE_SPATIAL = 8  # pixels per latent pixel (4 VAE blocks: 2**3)
TINY_VAE_TEMPORAL = 4  # latent frames = (frames - 1) // 4 + 1
TINY_FRAMES = 9
TINY_HEIGHT = 64
TINY_WIDTH = 64

_SEED = 20240601


def _transformer_config(**overrides) -> dict:
    config = dict(
        num_attention_heads=TINY_HEADS,
        attention_head_dim=TINY_HEAD_DIM,
        in_channels=TINY_LATENT_CHANNELS,
        out_channels=TINY_LATENT_CHANNELS,
        time_embed_dim=TINY_TIME_EMBED_DIM,
        text_embed_dim=TINY_TEXT_EMBED_DIM,
        num_layers=TINY_LAYERS,
        sample_width=TINY_WIDTH // TINY_VAE_SPATIAL,
        sample_height=TINY_HEIGHT // TINY_VAE_SPATIAL,
        sample_frames=TINY_FRAMES,
        patch_size=TINY_PATCH_SIZE,
        temporal_compression_ratio=TINY_VAE_TEMPORAL,
        max_text_seq_length=TINY_TEXT_TOKENS,
        use_rotary_positional_embeddings=False,
    )
    config.update(overrides)
    return config


def tiny_transformer(seed: int = _SEED, **overrides):
    """A CogVideoXTransformer3DModel with the tiny geometry (or `overrides`), seeded weights.

    diffusers initialises some output layers to zero (AdaLayerNormZero-style gates); those
    would make every test trivially pass, so all parameters are re-drawn from the seed.
    """
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(**_transformer_config(**overrides))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def _tokenizer():
    """A T5-like fast tokenizer: pad=0, eos=1, unk=2; words split into characters."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_lowercase + string.digits + string.punctuation
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab["##" + c] = len(vocab)
    core = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", max_input_chars_per_word=100))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=TINY_TEXT_TOKENS,
    )


def _text_encoder(vocab_size: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(_SEED + 1)
    config = T5Config(
        vocab_size=vocab_size,
        d_model=TINY_TEXT_EMBED_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config).eval()


def _vae():
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(_SEED + 2)
    return AutoencoderKLCogVideoX(
        block_out_channels=(8, 8, 8, 8),
        latent_channels=TINY_LATENT_CHANNELS,
        layers_per_block=1,
        norm_num_groups=4,
        temporal_compression_ratio=TINY_VAE_TEMPORAL,
        sample_height=TINY_HEIGHT,
        sample_width=TINY_WIDTH,
    ).eval()


def build_tiny_pipeline(directory: str | os.PathLike, **transformer_overrides) -> Path:
    """Write the tiny pipeline (optionally with a variant transformer) to `directory`.

    The directory is built in a sibling temporary directory and renamed into place, so
    concurrent builders never expose a half-written pipeline; the first rename wins.
    """
    from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler, CogVideoXPipeline

    directory = Path(directory)
    if directory.exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    scheduler_cls = CogVideoXDDIMScheduler
    if transformer_overrides.pop("scheduler", "ddim") == "dpm":
        scheduler_cls = CogVideoXDPMScheduler
    tokenizer = _tokenizer()
    pipe = CogVideoXPipeline(
        tokenizer=tokenizer,
        text_encoder=_text_encoder(len(tokenizer)),
        vae=_vae(),
        transformer=tiny_transformer(**transformer_overrides),
        scheduler=scheduler_cls(),
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any other
    try:
        pipe.save_pretrained(tmp)
        try:
            os.replace(tmp, directory)
        except OSError:
            # Another process renamed its copy into place first (target not empty).
            if not directory.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def cache_root() -> Path:
    """`$RAYDIT_CACHE` if set, else `~/.cache/raydit`."""
    env = os.environ.get("RAYDIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "raydit"


def tiny_pipeline_dir() -> Path:
    """The directory of the built-in tiny pipeline, building it on first use."""
    return build_tiny_pipeline(cache_root() / f"tiny-{TINY_VERSION}")


def load_tiny_pipeline(dtype: torch.dtype = torch.float32):
    """`CogVideoXPipeline.from_pretrained(tiny_pipeline_dir())`."""
    from diffusers import CogVideoXPipeline

    return CogVideoXPipeline.from_pretrained(tiny_pipeline_dir(), dtype=dtype)
