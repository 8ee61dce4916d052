"""What every family's built-in tiny pipeline shares: the cache, the atomic write, random
weights, a tokenizer and T5-style text encoder built in code (no download), and the components
more than one family's tiny pipeline holds (CLIP's text encoder, HunyuanVideo's VAE).

Each family's module builds its own tiny pipeline from these (CogVideoX's `tiny`, Wan's
`tiny-wan`, ...); the pipelines are written once in diffusers' own format and loaded with
`from_pretrained`, the path a real checkpoint takes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Callable

SEED = 20240601


def cache_root() -> Path:
    """`$RAYDIT_CACHE` if set, else `~/.cache/raydit`."""
    env = os.environ.get("RAYDIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "raydit"


@contextlib.contextmanager
def quiet_hub():
    """No progress bars or tokenizer warnings from diffusers / transformers: building or
    loading a tiny pipeline must print nothing a user did not ask for."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    level = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(level)


# A tiny pipeline directory's own request defaults (frames, height, width), beside its
# model_index.json; a family's spec_from_dir reads them.
DEFAULTS_FILE = "raydit_defaults.json"


class WithDefaults:
    """Saves `pipe` and, beside its model_index.json, the request `defaults` (DEFAULTS_FILE):
    what write_pipeline calls is save_pretrained."""

    def __init__(self, pipe, defaults: dict):
        self.pipe, self.defaults = pipe, defaults

    def save_pretrained(self, directory) -> None:
        self.pipe.save_pretrained(directory)
        (Path(directory) / DEFAULTS_FILE).write_text(json.dumps(self.defaults, indent=1) + "\n")


def request_defaults(path, pipeline_defaults) -> dict:
    """A spec reader's request defaults for a pipeline directory, as ModelSpec fields
    (default_frames, default_height, default_width): the pipeline's own (`pipeline_defaults`:
    num_frames, height, width) unless the directory carries its own in DEFAULTS_FILE (the tiny
    built-ins do)."""
    defaults = dict(pipeline_defaults)
    if (Path(path) / DEFAULTS_FILE).is_file():
        defaults.update(json.loads((Path(path) / DEFAULTS_FILE).read_text()))
    return dict(default_frames=int(defaults["num_frames"]), default_height=int(defaults["height"]),
                default_width=int(defaults["width"]))


def load_pipeline_dir(base_dir: str):
    """A tiny pipeline loaded from its directory with from_pretrained (as a real checkpoint
    is), quietly, its progress bar off."""
    from diffusers import DiffusionPipeline

    with quiet_hub():
        pipe = DiffusionPipeline.from_pretrained(base_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def randomize(model, seed: int, scale: float = 0.2):
    """Re-draw every parameter from `seed`. diffusers initialises some output layers to zero
    (adaptive-norm gates, final projections); those would make every parallel test pass
    trivially."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model.eval()


def write_pipeline(directory: str | os.PathLike, make_pipeline: Callable[[], object]) -> Path:
    """Write `make_pipeline()` with save_pretrained to `directory`, once.

    Built in a sibling temporary directory and renamed into place, so concurrent builders
    (several ranks, several tests) never expose a half-written pipeline; the first rename wins.
    """
    directory = Path(directory)
    if directory.exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with quiet_hub():
        pipe = make_pipeline()
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


def tiny_dir(name: str, make_pipeline: Callable[[], object], defaults: dict) -> Callable[[], Path]:
    """The builder of a built-in tiny pipeline's directory: it returns cache_root() / name,
    written once by `make_pipeline()` with its request defaults (`defaults`, in DEFAULTS_FILE)."""
    def build() -> Path:
        return write_pipeline(cache_root() / name, lambda: WithDefaults(make_pipeline(), defaults))

    build.__doc__ = f"The directory of `{name.rsplit('-', 1)[0]}`, written once to the cache."
    return build


def tokenizer(max_length: int):
    """A T5-like fast tokenizer: pad=0, eos=1, unk=2; words split into characters (so distinct
    prompts give distinct token ids)."""
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
        model_max_length=max_length,
    )


def qwen_tokenizer(whole_words, max_length: int = 2048):
    """A Qwen-like fast tokenizer built in code (the tiny stand-in for Qwen2.5-VL's): its chat
    markers <|im_start|>, <|im_end|>, <|endoftext|> and `whole_words` are single tokens, any other
    word is split into characters."""
    import string

    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    chars = string.ascii_lowercase + string.digits + string.punctuation
    vocab = {"<|endoftext|>": 0, "<unk>": 1}
    for word in (*special[:2], *whole_words, *chars, *("##" + c for c in chars)):
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", max_input_chars_per_word=100))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in special])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", unk_token="<unk>",
                                   eos_token="<|im_end|>", model_max_length=max_length)


def t5_encoder(vocab_size: int, d_model: int, seed: int = SEED + 1, umt5: bool = False):
    """A 2-layer T5 (or umT5, Wan's) encoder with `d_model` outputs, seeded weights."""
    import torch
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = config_cls(
        vocab_size=vocab_size,
        d_model=d_model,
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
    return model_cls(config).eval()


def clip_text_encoder(vocab_size: int, hidden: int, seed: int):
    """A 2-layer CLIP text encoder of width `hidden` (its pooled output: HunyuanVideo's and
    Kandinsky 5's second prompt), seeded weights. eos 1 is the shared tokenizer's </s>: the
    pooled output is the first eos position."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77, pad_token_id=0,
                            bos_token_id=0, eos_token_id=1)
    return CLIPTextModel(config).eval()


def hunyuan_video_vae(seed: int, latent_channels: int):
    """A tiny AutoencoderKLHunyuanVideo (8x spatial, 4x temporal, 8 channels), seeded weights: the
    VAE of HunyuanVideo's and Kandinsky 5's tiny pipelines."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(seed)
    return AutoencoderKLHunyuanVideo(
        latent_channels=latent_channels, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=8, temporal_compression_ratio=4,
    ).eval()


def resolve_builder(path: str):
    """"package.module:function" -> that function (how conformance cases name their builders)."""
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
