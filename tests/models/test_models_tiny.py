"""The built-in tiny pipeline: cached, deterministic, loadable like a real checkpoint, fast."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest
import torch

from raydit.models import tiny as shared
from raydit.models.registry import tiny_models
from raydit.planner import BUILTIN_MODELS
from raydit.models.families.cogvideox import tiny


def _digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*.safetensors"))
    }


def test_tiny_dir_is_cached_under_raydit_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYDIT_CACHE", str(tmp_path))
    directory = tiny.tiny_pipeline_dir()
    assert directory == tmp_path / f"tiny-{tiny.TINY_VERSION}"
    for part in ("model_index.json", "tokenizer", "text_encoder", "vae", "transformer", "scheduler"):
        assert (directory / part).exists(), part
    stamp = (directory / "model_index.json").stat().st_mtime_ns
    assert tiny.tiny_pipeline_dir() == directory
    assert (directory / "model_index.json").stat().st_mtime_ns == stamp  # not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_weights_are_deterministic(tmp_path):
    a = tiny.build_tiny_pipeline(tmp_path / "a")
    b = tiny.build_tiny_pipeline(tmp_path / "b")
    assert _digest(a) == _digest(b) and len(_digest(a)) == 3


def test_loaded_pipeline_matches_the_constants():
    pipe = tiny.load_tiny_pipeline()
    config = pipe.transformer.config
    assert type(pipe).__name__ == "CogVideoXPipeline"
    assert (config.num_attention_heads, config.attention_head_dim, config.num_layers) == (
        tiny.TINY_HEADS, tiny.TINY_HEAD_DIM, tiny.TINY_LAYERS)
    assert config.max_text_seq_length == tiny.TINY_TEXT_TOKENS
    assert config.text_embed_dim == pipe.text_encoder.config.d_model == tiny.TINY_TEXT_EMBED_DIM
    assert config.in_channels == pipe.vae.config.latent_channels == tiny.TINY_LATENT_CHANNELS
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (tiny.TINY_VAE_SPATIAL, tiny.TINY_VAE_TEMPORAL)
    assert config.patch_size == tiny.TINY_PATCH_SIZE and not config.use_rotary_positional_embeddings
    assert type(pipe.scheduler).__name__ == "CogVideoXDDIMScheduler"


# A line Ray streams to the driver from its processes ("(raylet) ...", "(RankWorker pid=12) ...",
# colored): a module before this one in the same pytest worker leaves its Ray up (conftest's
# ray_local), and what its actors print arrives on this process's fd 2 whenever it arrives.
_RAY_STREAMED = re.compile(r"^(\x1b\[[0-9;]*m)?\((raylet|autoscaler[^)]*|[\w.:-]+ pid=\d+[^)]*)\)")


def test_building_prints_nothing(tmp_path, capfd):
    """A user's first run (and a bad-input error after it) shows no download-style progress bars."""
    tiny.build_tiny_pipeline(tmp_path / "quiet")
    tiny.load_tiny_pipeline()
    out, err = capfd.readouterr()
    err = "".join(line for line in err.splitlines(keepends=True) if not _RAY_STREAMED.match(line))
    assert (out, err) == ("", "")


def test_tokenizer_tells_prompts_apart():
    tokenizer = tiny.load_tiny_pipeline().tokenizer
    ids = lambda text: tokenizer(text, padding="max_length", max_length=tiny.TINY_TEXT_TOKENS,  # noqa: E731
                                 truncation=True, return_tensors="pt").input_ids
    assert ids("a cat").shape == (1, tiny.TINY_TEXT_TOKENS)
    assert not torch.equal(ids("a cat"), ids("a dog"))
    assert ids("a cat")[0, 4].item() == 1 and ids("a cat")[0, 5:].eq(0).all()  # </s>, then padding


def test_the_diffusers_pipeline_runs_end_to_end():
    pipe = tiny.load_tiny_pipeline()
    out = pipe("a cat", num_frames=tiny.TINY_FRAMES, height=tiny.TINY_HEIGHT, width=tiny.TINY_WIDTH,
               num_inference_steps=2, max_sequence_length=tiny.TINY_TEXT_TOKENS,
               generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert out.shape == (1, tiny.TINY_FRAMES, tiny.TINY_HEIGHT, tiny.TINY_WIDTH, 3)


def test_a_concurrent_builder_that_renames_first_wins(tmp_path, monkeypatch):
    """Two processes building the same directory: the loser's rename fails, it keeps the winner's."""
    target = tmp_path / "shared"
    real_replace = os.replace
    raced = []

    def replace_after_a_rival(src, dst):
        if not raced:
            raced.append(dst)
            tiny.build_tiny_pipeline(target)  # the rival finishes first
        return real_replace(src, dst)

    monkeypatch.setattr(shared.os, "replace", replace_after_a_rival)
    assert tiny.build_tiny_pipeline(target) == target
    assert raced
    monkeypatch.undo()
    assert _digest(target) == _digest(tiny.build_tiny_pipeline(tmp_path / "reference"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference", "shared"]  # no temp dir left


GEOMETRY_FIELDS = ("family", "heads", "head_dim", "layers", "patch_size", "patch_size_t", "text_tokens",
                   "text_in_sequence", "positional", "in_channels", "default_frames", "default_height",
                   "default_width", "vae_spatial", "vae_temporal", "experts")


@pytest.mark.parametrize("name", sorted(n for n in tiny_models() if n in BUILTIN_MODELS))
def test_every_tiny_builtin_matches_what_its_family_writes(name):
    """The planner's entry for each family's tiny pipeline equals the spec read back from the
    directory the family writes (its config files, through the family's spec_from_dir). Tiny
    variants the table does not list are read from their directory (raydit.model_spec)."""
    import raydit

    built = raydit.model_spec(str(tiny_models()[name]()))
    listed = raydit.model_spec(name)
    for field in GEOMETRY_FIELDS:
        assert getattr(built, field) == getattr(listed, field), field
