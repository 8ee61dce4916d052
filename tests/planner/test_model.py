"""Model geometry: built-in specs, specs read from diffusers directories, request validation."""

from __future__ import annotations

import json
import struct

import pytest

from raydit import model_spec  # the planner's, with the model families loaded (they read directories)
from raydit.planner import BUILTIN_MODELS, ModelSpec

# name, heads, head_dim, layers, patch_size_t, positional, text in sequence
BUILTINS = [
    ("cogvideox-2b", 30, 64, 30, None, "sinusoidal", True),
    ("cogvideox-5b", 48, 64, 42, None, "rotary", True),
    ("cogvideox1.5-5b", 48, 64, 42, 2, "rotary", True),
    ("wan2.1-t2v-1.3b", 12, 128, 30, 1, "rotary", False),
    ("wan2.1-t2v-14b", 40, 128, 40, 1, "rotary", False),
    ("wan2.1-i2v-14b-480p", 40, 128, 40, 1, "rotary", False),
    ("wan2.2-t2v-a14b", 40, 128, 40, 1, "rotary", False),
    ("wan2.2-ti2v-5b", 24, 128, 30, 1, "rotary", False),
    ("hunyuanvideo", 24, 128, 60, 1, "rotary", True),
    ("hunyuanvideo-i2v", 24, 128, 60, 1, "rotary", True),
    ("ltx-video", 32, 64, 28, 1, "rotary", False),
    ("ltx-video-2b", 32, 64, 28, 1, "rotary", False),
    ("ltx-video-13b", 32, 128, 48, 1, "rotary", False),
    ("ltx-2", 32, 128, 48, 1, "rotary", False),
    ("mochi-1", 24, 128, 48, 1, "rotary", True),
    ("tiny", 2, 16, 2, None, "sinusoidal", True),
    ("tiny-i2v", 2, 16, 2, None, "rotary", True),
    ("tiny-hunyuan", 6, 16, 2, 1, "rotary", True),
    ("tiny-hunyuan-i2v", 6, 16, 2, 1, "rotary", True),
    ("tiny-ltx", 6, 12, 2, 1, "rotary", False),
    ("tiny-mochi", 6, 16, 2, 1, "rotary", True),
    ("hunyuanvideo-1.5-480p", 16, 128, 54, 1, "rotary", True),
    ("hunyuanvideo-1.5-720p", 16, 128, 54, 1, "rotary", True),
    ("tiny-hunyuan15", 6, 8, 2, 1, "rotary", True),
    ("tiny-hunyuan15-i2v", 6, 8, 2, 1, "rotary", True),
    ("kandinsky5-t2v-lite", 28, 64, 32, 1, "rotary", False),
    ("kandinsky5-t2v-pro", 32, 128, 60, 1, "rotary", False),
    ("kandinsky5-i2v-pro", 32, 128, 60, 1, "rotary", False),
    ("tiny-kandinsky5", 6, 8, 2, 1, "rotary", False),
    ("tiny-kandinsky5-i2v", 6, 8, 2, 1, "rotary", False),
    ("skyreels-v2-t2v-14b-540p", 40, 128, 40, 1, "rotary", False),
    ("skyreels-v2-t2v-14b-720p", 40, 128, 40, 1, "rotary", False),
    ("skyreels-v2-i2v-1.3b-540p", 12, 128, 30, 1, "rotary", False),
    ("skyreels-v2-i2v-14b-540p", 40, 128, 40, 1, "rotary", False),
    ("skyreels-v2-i2v-14b-720p", 40, 128, 40, 1, "rotary", False),
    ("skyreels-v2-df-1.3b-540p", 12, 128, 30, 1, "rotary", False),
    ("skyreels-v2-df-14b-540p", 40, 128, 40, 1, "rotary", False),
    ("skyreels-v2-df-14b-720p", 40, 128, 40, 1, "rotary", False),
]


@pytest.mark.parametrize("name,heads,head_dim,layers,patch_t,positional,joined", BUILTINS)
def test_builtin_geometry(name, heads, head_dim, layers, patch_t, positional, joined):
    spec = model_spec(name)
    assert (spec.heads, spec.head_dim, spec.layers) == (heads, head_dim, layers)
    assert spec.patch_size_t == patch_t
    assert spec.positional == positional
    assert spec.text_in_sequence is joined
    geo = spec.geometry()  # the defaults are a valid request
    assert geo.video_tokens > 0
    assert geo.sequence_tokens == geo.video_tokens + (spec.text_tokens if joined else 0)


def test_every_builtin_is_listed():
    assert {b[0] for b in BUILTINS} == set(BUILTIN_MODELS)


# model, frames, height, width -> latent frames, padded latent frames, latent h, w, token grid, video, sequence
GEOMETRY = [
    ("cogvideox-2b", 49, 480, 720, 13, 13, 60, 90, (13, 30, 45), 17550, 17776),
    ("cogvideox-5b", 61, 480, 720, 16, 16, 60, 90, (16, 30, 45), 21600, 21826),
    ("cogvideox1.5-5b", 81, 768, 1360, 21, 22, 96, 170, (11, 48, 85), 44880, 45106),
    ("cogvideox1.5-5b", 85, 768, 1360, 22, 22, 96, 170, (11, 48, 85), 44880, 45106),
    ("wan2.1-t2v-1.3b", 81, 480, 832, 21, 21, 60, 104, (21, 30, 52), 32760, 32760),
    ("wan2.1-t2v-14b", 81, 720, 1280, 21, 21, 90, 160, (21, 45, 80), 75600, 75600),
    ("wan2.2-ti2v-5b", 121, 704, 1280, 31, 31, 44, 80, (31, 22, 40), 27280, 27280),
    ("ltx-video", 161, 512, 704, 21, 21, 16, 22, (21, 16, 22), 7392, 7392),
    ("hunyuanvideo-1.5-720p", 121, 720, 1280, 31, 31, 45, 80, (31, 45, 80), 111600, 112856),
    ("hunyuanvideo-i2v", 129, 720, 1280, 33, 33, 90, 160, (33, 45, 80), 118800, 119196),  # 144 image + 252 text
    ("hunyuanvideo-1.5-480p", 121, 480, 848, 31, 31, 30, 53, (31, 30, 53), 49290, 50546),
    ("tiny", 9, 64, 64, 3, 3, 8, 8, (3, 4, 4), 48, 64),
    ("mochi-1", 163, 480, 848, 28, 28, 60, 106, (28, 30, 53), 44520, 44776),  # genmo's 163-frame videos
    ("tiny", 1, 16, 16, 1, 1, 2, 2, (1, 1, 1), 1, 17),
]


@pytest.mark.parametrize("name,f,h,w,lf,plf,lh,lw,grid,video,seq", GEOMETRY)
def test_request_geometry(name, f, h, w, lf, plf, lh, lw, grid, video, seq):
    g = model_spec(name).geometry(f, h, w)
    assert (g.latent_frames, g.padded_latent_frames, g.latent_height, g.latent_width) == (lf, plf, lh, lw)
    assert (g.token_frames, g.token_rows, g.token_cols) == grid
    assert (g.video_tokens, g.sequence_tokens) == (video, seq)


BAD_REQUESTS = [
    ("cogvideox-2b", 50, 480, 720, "frames 50 cannot be taken by the VAE: (frames - 1) must be a multiple of 4; nearest valid: 49 or 53"),
    ("cogvideox-2b", 49, 481, 720, "height 481 is not a multiple of 16 (VAE scale 8 x patch 2); nearest valid: 480 or 496"),
    ("cogvideox-2b", 49, 480, 730, "width 730 is not a multiple of 16 (VAE scale 8 x patch 2); nearest valid: 720 or 736"),
    ("cogvideox-2b", 49, 8, 720, "height 8 is not a multiple of 16 (VAE scale 8 x patch 2); nearest valid: 16"),
    ("cogvideox-2b", 0, 480, 720, "frames must be a positive integer, got 0"),
    ("cogvideox-2b", -3, 480, 720, "frames must be a positive integer, got -3"),
    ("cogvideox-2b", 49, 0, 720, "height must be a positive integer, got 0"),
    ("cogvideox-2b", 49, 480, -16, "width must be a positive integer, got -16"),
    ("cogvideox-2b", 49.0, 480, 720, "frames must be a positive integer, got 49.0"),
    ("ltx-video", 160, 512, 704, "(frames - 1) must be a multiple of 8; nearest valid: 153 or 161"),
    ("ltx-video", 161, 500, 704, "height 500 is not a multiple of 32 (VAE scale 32 x patch 1)"),
    ("mochi-1", 164, 480, 848, "(frames - 1) must be a multiple of 6"),
]


@pytest.mark.parametrize("name,f,h,w,message", BAD_REQUESTS)
def test_bad_request_names_value_and_rule(name, f, h, w, message):
    with pytest.raises(ValueError) as info:
        model_spec(name).geometry(f, h, w)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_model_lists_builtins(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'cogvideox-3b'; built-in: cogvideox-2b"):
        model_spec("cogvideox-3b")
    f = tmp_path / "file.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match="is a file"):
        model_spec(str(f))


def test_spec_validation():
    base = model_spec("tiny")
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    with pytest.raises(ValueError, match="heads must be a positive integer, got 0"):
        ModelSpec(**{**fields, "heads": 0})
    with pytest.raises(ValueError, match="positional 'alibi' is not one of"):
        ModelSpec(**{**fields, "positional": "alibi"})
    with pytest.raises(ValueError, match="frames 10 cannot be taken by the VAE"):
        ModelSpec(**{**fields, "default_frames": 10})


# -- specs from diffusers directories ------------------------------------------------------

COGVIDEOX_2B_CONFIG = {
    "_class_name": "CogVideoXTransformer3DModel",
    "num_attention_heads": 30, "attention_head_dim": 64, "num_layers": 30, "in_channels": 16,
    "patch_size": 2, "patch_size_t": None, "max_text_seq_length": 226, "sample_frames": 49,
    "sample_height": 60, "sample_width": 90, "temporal_compression_ratio": 4,
    "use_rotary_positional_embeddings": False, "use_learned_positional_embeddings": False,
}


def _write_safetensors(path, tensors: dict[str, tuple[str, list[int]]]):
    """A valid safetensors file: 8-byte header length, JSON header, zero-filled data."""
    sizes = {"BF16": 2, "F32": 4}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def _pipeline_dir(tmp_path, config, class_name="CogVideoXPipeline"):
    root = tmp_path / "pipe"
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    (root / "transformer" / "config.json").write_text(json.dumps(config))
    return root


def test_spec_from_cogvideox_dir(tmp_path):
    root = _pipeline_dir(tmp_path, COGVIDEOX_2B_CONFIG)
    _write_safetensors(root / "transformer" / "diffusion_pytorch_model.safetensors",
                       {"a": ("BF16", [10, 20]), "b": ("BF16", [7])})
    spec = model_spec(str(root))
    builtin = model_spec("cogvideox-2b")
    for key in ("heads", "head_dim", "layers", "patch_size", "patch_size_t", "text_tokens",
                "positional", "in_channels", "default_frames", "default_height", "default_width"):
        assert getattr(spec, key) == getattr(builtin, key), key
    assert spec.params == 207  # read from the safetensors header: 10*20 + 7 bf16 values
    g = spec.geometry()
    assert (g.video_tokens, g.sequence_tokens) == (17550, 17776)


def test_spec_from_cogvideox15_dir_reads_patch_t_and_rotary(tmp_path):
    cfg = {**COGVIDEOX_2B_CONFIG, "num_attention_heads": 48, "num_layers": 42, "patch_size_t": 2,
           "use_rotary_positional_embeddings": True, "sample_frames": 81, "sample_height": 96,
           "sample_width": 170}
    spec = model_spec(str(_pipeline_dir(tmp_path, cfg)))
    assert (spec.heads, spec.patch_size_t, spec.positional) == (48, 2, "rotary")
    assert spec.geometry().token_frames == 11


def test_spec_from_wan_dir(tmp_path):
    cfg = {"_class_name": "WanTransformer3DModel", "num_attention_heads": 12, "attention_head_dim": 128,
           "num_layers": 30, "patch_size": [1, 2, 2], "ffn_dim": 8960, "in_channels": 16}
    spec = model_spec(str(_pipeline_dir(tmp_path, cfg, "WanPipeline")))
    assert (spec.heads, spec.patch_size, spec.patch_size_t, spec.ffn_hidden) == (12, 2, 1, 8960)
    assert spec.text_in_sequence is False


@pytest.mark.parametrize("mutate,message", [
    (lambda root: (root / "transformer" / "config.json").unlink(), "has no transformer/config.json"),
    (lambda root: (root / "transformer" / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda root: (root / "transformer" / "config.json").write_text(
        json.dumps({**COGVIDEOX_2B_CONFIG, "_class_name": "FluxTransformer2DModel"})),
     "transformer class 'FluxTransformer2DModel' is not supported by a CogVideoX pipeline"),
    (lambda root: (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"})),
     "holds a FluxPipeline; raydit plans CogVideoXImageToVideoPipeline, CogVideoXPipeline"),
    (lambda root: (root / "model_index.json").unlink(), "is not a diffusers pipeline (no model_index.json)"),
    (lambda root: (root / "transformer" / "config.json").write_text(
        json.dumps({k: v for k, v in COGVIDEOX_2B_CONFIG.items() if k != "max_text_seq_length"})),
     "missing 'max_text_seq_length'"),
])
def test_bad_model_dir(tmp_path, mutate, message):
    root = _pipeline_dir(tmp_path, COGVIDEOX_2B_CONFIG)
    mutate(root)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_spec(str(root))


def test_tiny_matches_the_tiny_pipeline(tmp_path):
    """The planner's `tiny` has the geometry of the CogVideoX family's tiny pipeline."""
    tiny = pytest.importorskip("raydit.models.families.cogvideox.tiny")
    spec = model_spec("tiny")
    assert (spec.heads, spec.head_dim, spec.layers) == (tiny.TINY_HEADS, tiny.TINY_HEAD_DIM, tiny.TINY_LAYERS)
    assert (spec.text_tokens, spec.in_channels, spec.patch_size) == (
        tiny.TINY_TEXT_TOKENS, tiny.TINY_LATENT_CHANNELS, tiny.TINY_PATCH_SIZE)
    assert (spec.default_frames, spec.default_height, spec.default_width) == (
        tiny.TINY_FRAMES, tiny.TINY_HEIGHT, tiny.TINY_WIDTH)
    # And the transformer config it writes reads back to the same geometry.
    from_dir = model_spec(str(_pipeline_dir(tmp_path, {
        "_class_name": "CogVideoXTransformer3DModel", **tiny._transformer_config()})))
    assert from_dir.geometry() == spec.geometry()
    assert from_dir.positional == spec.positional == "sinusoidal"


# Transformer configs as diffusers writes them for the published checkpoints (the values its
# conversion scripts use: scripts/convert_ltx_to_diffusers.py, versions 0.9.1 / 0.9.7, and
# scripts/convert_hunyuan_video_to_diffusers.py, HYVideo-T/2-cfgdistill and HYVideo-T/2-I2V-16ch;
# nothing can be downloaded here). Each built-in's shape and parameter count must be what
# diffusers builds from them (on the meta device: no memory, no weights).
_LTX_COMMON = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, activation_fn="gelu-approximate",
                   qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
                   caption_channels=4096, attention_bias=True, attention_out_bias=True)
_HUNYUAN_COMMON = dict(out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                       num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                       qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                       rope_theta=256.0, rope_axes_dim=(16, 56, 56))
_SKYREELS_COMMON = dict(attention_head_dim=128, cross_attn_norm=True, eps=1e-6, freq_dim=256, out_channels=16,
                        patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads", text_dim=4096)
_SKYREELS_1_3B = dict(num_attention_heads=12, num_layers=30, ffn_dim=8960)
_SKYREELS_14B = dict(num_attention_heads=40, num_layers=40, ffn_dim=13824)
_WAN_COMMON = dict(attention_head_dim=128, patch_size=(1, 2, 2), text_dim=4096, out_channels=16)
_WAN_14B = dict(_WAN_COMMON, num_attention_heads=40, num_layers=40, ffn_dim=13824)
PUBLISHED_CONFIGS = [
    # Wan 2.1 / 2.2 (scripts/convert_wan_to_diffusers.py: 1.3B, 14B, I2V 14B with the image's
    # k / v, TI2V-5B with 48 channels; each A14B expert is the 14B T2V transformer)
    ("wan2.1-t2v-1.3b", "WanTransformer3DModel",
     dict(_WAN_COMMON, num_attention_heads=12, num_layers=30, ffn_dim=8960, in_channels=16)),
    ("wan2.1-t2v-14b", "WanTransformer3DModel", dict(_WAN_14B, in_channels=16)),
    ("wan2.1-i2v-14b-480p", "WanTransformer3DModel",
     dict(_WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)),
    ("wan2.2-t2v-a14b", "WanTransformer3DModel", dict(_WAN_14B, in_channels=16)),
    ("wan2.2-ti2v-5b", "WanTransformer3DModel",
     dict(_WAN_COMMON, num_attention_heads=24, num_layers=30, ffn_dim=14336, in_channels=48, out_channels=48)),
    ("ltx-video-2b", "LTXVideoTransformer3DModel",
     dict(_LTX_COMMON, num_attention_heads=32, attention_head_dim=64, cross_attention_dim=2048, num_layers=28)),
    ("ltx-video-13b", "LTXVideoTransformer3DModel",
     dict(_LTX_COMMON, num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096, num_layers=48)),
    # LTX-2: diffusers' LTX2VideoTransformer3DModel defaults are the LTX-2 (19B) config
    ("ltx-2", "LTX2VideoTransformer3DModel",
     dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
          attention_head_dim=128, cross_attention_dim=4096, audio_in_channels=128, audio_num_attention_heads=32,
          audio_attention_head_dim=64, audio_cross_attention_dim=2048, num_layers=48, caption_channels=3840,
          rope_type="split")),
    ("hunyuanvideo", "HunyuanVideoTransformer3DModel", dict(_HUNYUAN_COMMON, in_channels=16)),
    # SkyReels-V2 (scripts/convert_skyreelsv2_to_diffusers.py: DF-1.3B with the fps embedding,
    # DF-14B without; T2V and I2V as Wan 2.1's 14B and I2V configs)
    *((name, "SkyReelsV2Transformer3DModel", dict(_SKYREELS_COMMON, **config)) for name, config in (
        ("skyreels-v2-df-1.3b-540p", dict(_SKYREELS_1_3B, in_channels=16, inject_sample_info=True)),
        ("skyreels-v2-df-14b-540p", dict(_SKYREELS_14B, in_channels=16)),
        ("skyreels-v2-df-14b-720p", dict(_SKYREELS_14B, in_channels=16)),
        ("skyreels-v2-t2v-14b-540p", dict(_SKYREELS_14B, in_channels=16)),
        ("skyreels-v2-t2v-14b-720p", dict(_SKYREELS_14B, in_channels=16)),
        ("skyreels-v2-i2v-1.3b-540p", dict(_SKYREELS_1_3B, in_channels=36, image_dim=1280, added_kv_proj_dim=1536)),
        ("skyreels-v2-i2v-14b-540p", dict(_SKYREELS_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)),
        ("skyreels-v2-i2v-14b-720p", dict(_SKYREELS_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)),
    )),
    ("hunyuanvideo-i2v", "HunyuanVideoTransformer3DModel",
     dict(_HUNYUAN_COMMON, in_channels=16, image_condition_type="token_replace")),
]


@pytest.mark.parametrize("name,cls,config", PUBLISHED_CONFIGS, ids=[c[0] for c in PUBLISHED_CONFIGS])
def test_builtin_matches_the_published_transformer_config(name, cls, config):
    import diffusers
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = getattr(diffusers, cls)(**config)
    params = sum(p.numel() for p in model.parameters())
    blocks = config["num_layers"] + config.get("num_single_layers", 0)
    spec = model_spec(name)
    assert (spec.heads, spec.head_dim, spec.layers) == (config["num_attention_heads"], config["attention_head_dim"], blocks)
    assert spec.in_channels == config["in_channels"]
    patch = config["patch_size"]  # SkyReels-V2's: one (t, h, w) tuple
    patch = (patch[1], patch[0]) if isinstance(patch, tuple) else (patch, config["patch_size_t"])
    assert (spec.patch_size, spec.patch_size_t) == patch
    # Every block's feed-forward (4 x hidden in LTX and HunyuanVideo; SkyReels-V2's `ffn`).
    ff = next(m for n, m in model.named_modules()
              if n.startswith(("transformer_blocks.0.", "blocks.0.")) and n.endswith(("ff.net.0.proj", "ffn.net.0.proj")))
    assert spec.ffn_hidden == ff.out_features
    assert spec.params == pytest.approx(params, rel=0.01), f"{name}: diffusers builds {params:.4e} parameters"
    # LTX-2's audio stream: the heads and FFN of its blocks' audio attention and audio FFN.
    block = (model.transformer_blocks if hasattr(model, "transformer_blocks") else model.blocks)[0]
    if hasattr(block, "audio_attn1"):
        assert (spec.audio_heads, spec.audio_head_dim) == (block.audio_attn1.heads, block.audio_attn1.head_dim)
        for attn in (block.audio_attn2, block.audio_to_video_attn, block.video_to_audio_attn):
            assert attn.inner_dim == spec.audio_hidden
        assert spec.audio_ffn_hidden == block.audio_ff.net[0].proj.out_features
    else:
        assert spec.audio_hidden == 0


# -- LTX-2's audio stream -------------------------------------------------------------------------


def test_ltx2_audio_tokens_follow_the_duration():
    """La = round(frames / 24 x 25), as LTX2Pipeline sizes its audio latents; no other model has any."""
    spec = model_spec("ltx-2")
    assert (spec.audio_heads, spec.audio_head_dim, spec.audio_hidden, spec.audio_ffn_hidden) == (32, 64, 2048, 8192)
    assert {f: spec.geometry(f, 512, 768).audio_tokens for f in (9, 121, 161, 241)} == {
        9: 9, 121: 126, 161: 168, 241: 251}
    assert spec.geometry().to_dict()["audio_tokens"] == 126
    assert all(BUILTIN_MODELS[n].geometry().audio_tokens == 0 for n in BUILTIN_MODELS if n != "ltx-2")


def test_ltx2_audio_rate_is_the_pipelines():
    """25 tokens a second: AutoencoderKLLTX2Audio's defaults (16000 Hz, mel hop 160) over its
    fixed 4x temporal compression; 24 fps: LTX2Pipeline's frame_rate."""
    import inspect

    from diffusers import AutoencoderKLLTX2Audio, LTX2Pipeline
    from diffusers.models.autoencoders import autoencoder_kl_ltx2_audio

    from raydit.models.families.ltx2 import family as ltx2

    vae = inspect.signature(AutoencoderKLLTX2Audio.__init__).parameters
    assert autoencoder_kl_ltx2_audio.LATENT_DOWNSAMPLE_FACTOR == ltx2.AUDIO_VAE_TEMPORAL_COMPRESSION
    spec = model_spec("ltx-2")
    assert spec.audio_tokens_per_second == (vae["sample_rate"].default / vae["mel_hop_length"].default
                                            / ltx2.AUDIO_VAE_TEMPORAL_COMPRESSION)
    assert spec.frame_rate == inspect.signature(LTX2Pipeline.__call__).parameters["frame_rate"].default == ltx2.FRAME_RATE


def test_spec_from_ltx2_dir_reads_the_audio_stream(tmp_path):
    """The tiny LTX-2 pipeline's directory: its audio stream (6 heads x 4, FFN 4 x) at the audio
    rate of the built-in (its audio VAE has LTX-2's 16000 Hz and hop 160); 17 frames give the 18
    audio tokens its conformance request runs. A directory whose audio VAE hops 320 samples has
    half the tokens."""
    from raydit.models.families.ltx2 import tiny as ltx2

    spec = model_spec(str(ltx2.tiny_pipeline_dir()))
    builtin = model_spec("ltx-2")
    assert (spec.audio_heads, spec.audio_head_dim) == (ltx2.TINY_HEADS, ltx2.TINY_AUDIO_HEAD_DIM)
    assert spec.audio_ffn_hidden == 4 * spec.audio_hidden and builtin.audio_ffn_hidden == 4 * builtin.audio_hidden
    assert (spec.audio_tokens_per_second, spec.frame_rate) == (builtin.audio_tokens_per_second, builtin.frame_rate)
    assert spec.geometry().audio_tokens == 18 == builtin.geometry(17, 512, 768).audio_tokens
    assert spec.calibration_key.endswith(f":a{spec.audio_hidden}:affn{spec.audio_ffn_hidden}")

    root = _pipeline_dir(tmp_path, {"_class_name": "LTX2VideoTransformer3DModel", "num_attention_heads": 32,
                                    "attention_head_dim": 128, "audio_num_attention_heads": 16,
                                    "audio_attention_head_dim": 128}, "LTX2Pipeline")
    for folder, config in (("vae", {"spatial_compression_ratio": 32, "temporal_compression_ratio": 8}),
                           ("audio_vae", {"sample_rate": 16000, "mel_hop_length": 320})):
        (root / folder).mkdir()
        (root / folder / "config.json").write_text(json.dumps(config))
    spec = model_spec(str(root))
    assert (spec.audio_hidden, spec.audio_ffn_hidden, spec.audio_tokens_per_second) == (2048, 8192, 12.5)
    assert spec.geometry(121, 512, 768).audio_tokens == 63  # round(121 / 24 x 12.5)


def test_audio_fields_come_together():
    base = model_spec("ltx-2")
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    with pytest.raises(ValueError, match="an audio stream needs audio_heads, audio_head_dim, audio_ffn_hidden, "
                                         "audio_tokens_per_second and frame_rate all > 0"):
        ModelSpec(**{**fields, "audio_tokens_per_second": 0.0})
    with pytest.raises(ValueError, match="audio_head_dim must be an integer >= 0, got -1"):
        ModelSpec(**{**fields, "audio_head_dim": -1})
    silent = ModelSpec(**{**fields, "audio_heads": 0, "audio_head_dim": 0, "audio_ffn_hidden": 0,
                          "audio_tokens_per_second": 0, "frame_rate": 0})
    assert silent.geometry().audio_tokens == 0 and ":a" not in silent.calibration_key


# -- Mochi 1 ----------------------------------------------------------------------------------------


def test_mochi_builtin_matches_the_published_config():
    """genmo/mochi-1-preview as diffusers' scripts/convert_mochi_to_diffusers.py writes it:
    MochiTransformer3DModel() with its defaults and AutoencoderKLMochi(latent_channels=12,
    out_channels=3), built on the meta device. The feed-forward is SwiGLU: ffn_hidden is its
    inner width (the down projection's input; the up projection is twice as wide, gate and value)."""
    import diffusers
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = diffusers.MochiTransformer3DModel()
        vae = diffusers.AutoencoderKLMochi(latent_channels=12, out_channels=3)
    config, spec = model.config, model_spec("mochi-1")
    assert (spec.heads, spec.head_dim, spec.layers) == (config.num_attention_heads, config.attention_head_dim,
                                                        config.num_layers)
    assert (spec.in_channels, spec.patch_size, spec.patch_size_t) == (config.in_channels, config.patch_size, 1)
    assert spec.text_tokens == config.max_sequence_length and spec.text_in_sequence
    assert spec.ffn_hidden == model.transformer_blocks[0].ff.net[2].in_features
    assert spec.params == pytest.approx(sum(p.numel() for p in model.parameters()), rel=0.01)
    assert spec.vae_params == pytest.approx(sum(p.numel() for p in vae.parameters()), rel=0.01)
    assert (spec.vae_temporal, spec.vae_spatial) == (vae.temporal_compression_ratio, vae.spatial_compression_ratio)
    # MochiPipeline.__call__'s defaults
    assert (spec.default_frames, spec.default_height, spec.default_width) == (19, 480, 848)


# -- the planner names no family (issue 41) --------------------------------------------------------
def test_the_planner_looks_models_up_without_anyone_loading_the_families_first(tmp_path):
    """A fresh process asks the planner itself (not raydit.model_spec) for a built-in and for a
    pipeline directory: the lookups load the families' models and readers on their own, with
    the decoder each family declares, and still import neither torch nor diffusers."""
    import subprocess
    import sys

    cfg = {"_class_name": "WanTransformer3DModel", "num_attention_heads": 12, "attention_head_dim": 128,
           "num_layers": 30, "patch_size": [1, 2, 2], "ffn_dim": 8960, "in_channels": 16}
    root = _pipeline_dir(tmp_path, cfg, "WanPipeline")
    code = ("import sys; from raydit.planner.registry import model_spec; "
            "mochi = model_spec('mochi-1'); wan = model_spec(sys.argv[1]); "
            "assert mochi.family == 'mochi' and mochi.decoder is not None and mochi.decoder.dropped_frames == 5; "
            "assert wan.family == 'wan' and wan.decoder == model_spec('wan2.1-t2v-1.3b').decoder; "
            "bad = [m for m in ('torch', 'diffusers', 'ray') if m in sys.modules]; assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_planners_code_names_no_family():
    """No string in the planner's code (comments and docstrings aside) is a family's name: the
    built-in models and the decoders are the families' data."""
    import ast
    from pathlib import Path

    import raydit.planner
    from raydit.models.registry import families

    names = set(families())
    assert {"cogvideox", "wan", "mochi"} <= names
    for path in Path(raydit.planner.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and id(n) not in docstrings and n.value in names}
        assert not named, f"{path.name} names the families {sorted(named)}"
