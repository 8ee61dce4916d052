"""Model geometry: what the planner needs to know about a video diffusion transformer.

A `ModelSpec` comes from a built-in name (no download) or from a local diffusers pipeline
directory (`model_index.json` + `transformer/config.json`). `ModelSpec.geometry(frames,
height, width)` validates a request and gives the token grid:

    latent_frames = (frames - 1) / vae_temporal + 1, padded up to a multiple of patch_t
    latent_height = height / vae_spatial,  latent_width = width / vae_spatial
    token grid    = (latent_frames / patch_t) x (latent_height / patch) x (latent_width / patch)

CogVideoX-2b, 49 x 480 x 720: 13 x 30 x 45 = 17550 video tokens + 226 text = 17776.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

POSITIONAL_KINDS = ("sinusoidal", "rotary", "learned")

# T5 v1.1 XXL encoder (CogVideoX, LTX-Video, Mochi), umT5-XXL encoder (Wan), and
# HunyuanVideo's LLaVA-Llama-3-8B + CLIP-L: parameter counts.
_T5_XXL = 4.76e9
_UMT5_XXL = 5.68e9
_HUNYUAN_TEXT = 8.03e9 + 0.12e9


@dataclass(frozen=True)
class ModelSpec:
    """Geometry and size of one video DiT.

    heads, head_dim, layers: attention geometry (hidden = heads x head_dim).
    ffn_hidden: inner width of the feed-forward block.
    patch_size, patch_size_t: spatial and temporal patch (patch_size_t None: 1 frame).
    vae_spatial, vae_temporal: VAE compression (pixels per latent pixel, frames per latent).
    text_tokens: text sequence length; text_in_sequence: whether text tokens join the
        attention sequence (CogVideoX, HunyuanVideo, Mochi) or are only cross-attended
        (Wan, LTX-Video).
    positional: "sinusoidal", "rotary" or "learned".
    params: transformer parameter count; text_encoder_params, vae_params: the rest of the
        pipeline a rank keeps resident; bytes_per_param: 2 for bf16/fp16 weights.
    default_frames/height/width: the request used when the user gives none.
    """

    name: str
    family: str
    heads: int
    head_dim: int
    layers: int
    ffn_hidden: int
    patch_size: int
    patch_size_t: int | None
    text_tokens: int
    text_in_sequence: bool
    positional: str
    in_channels: int
    params: float
    text_encoder_params: float
    vae_params: float
    default_frames: int
    default_height: int
    default_width: int
    vae_spatial: int = 8
    vae_temporal: int = 4
    bytes_per_param: int = 2

    def __post_init__(self):
        for field_name in ("heads", "head_dim", "layers", "ffn_hidden", "patch_size", "in_channels",
                           "vae_spatial", "vae_temporal", "bytes_per_param"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {field_name} must be a positive integer, got {value!r}")
        if self.patch_size_t is not None and (not isinstance(self.patch_size_t, int) or self.patch_size_t < 1):
            raise ValueError(f"model {self.name!r}: patch_size_t must be None or a positive integer")
        if self.text_tokens < 0:
            raise ValueError(f"model {self.name!r}: text_tokens must be >= 0, got {self.text_tokens}")
        if self.positional not in POSITIONAL_KINDS:
            raise ValueError(
                f"model {self.name!r}: positional {self.positional!r} is not one of "
                f"{', '.join(POSITIONAL_KINDS)}"
            )
        # The defaults must themselves be a valid request.
        self.geometry(self.default_frames, self.default_height, self.default_width)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def pixel_multiple(self) -> int:
        """Height and width must be multiples of this (VAE scale x patch)."""
        return self.vae_spatial * self.patch_size

    @property
    def weight_bytes(self) -> float:
        """Bytes of every weight a rank keeps resident (transformer, text encoder, VAE)."""
        return (self.params + self.text_encoder_params + self.vae_params) * self.bytes_per_param

    def heads_divisors(self) -> list[int]:
        """The Ulysses degrees this model allows: divisors of the head count."""
        return [d for d in range(1, self.heads + 1) if self.heads % d == 0]

    def geometry(self, frames: int | None = None, height: int | None = None,
                 width: int | None = None) -> "VideoGeometry":
        """Validate a request (None: the model default) and return its token grid."""
        frames = self.default_frames if frames is None else frames
        height = self.default_height if height is None else height
        width = self.default_width if width is None else width
        for label, value in (("frames", frames), ("height", height), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        if (frames - 1) % self.vae_temporal:
            lower = frames - (frames - 1) % self.vae_temporal
            upper = lower + self.vae_temporal
            raise ValueError(
                f"frames {frames} cannot be taken by the VAE: (frames - 1) must be a multiple of "
                f"{self.vae_temporal}; nearest valid: {lower} or {upper}"
            )
        m = self.pixel_multiple
        for label, value in (("height", height), ("width", width)):
            if value % m:
                lower, upper = value - value % m, value - value % m + m
                nearest = f"{lower} or {upper}" if lower > 0 else f"{upper}"
                raise ValueError(
                    f"{label} {value} is not a multiple of {m} (VAE scale {self.vae_spatial} x "
                    f"patch {self.patch_size}); nearest valid: {nearest}"
                )
        latent_frames = (frames - 1) // self.vae_temporal + 1
        pt = self.patch_size_t or 1
        padded_latent_frames = -(-latent_frames // pt) * pt
        return VideoGeometry(
            frames=frames,
            height=height,
            width=width,
            latent_frames=latent_frames,
            padded_latent_frames=padded_latent_frames,
            latent_height=height // self.vae_spatial,
            latent_width=width // self.vae_spatial,
            token_frames=padded_latent_frames // pt,
            token_rows=height // m,
            token_cols=width // m,
            text_tokens=self.text_tokens if self.text_in_sequence else 0,
            cross_text_tokens=0 if self.text_in_sequence else self.text_tokens,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hidden"] = self.hidden
        return d


@dataclass(frozen=True)
class VideoGeometry:
    """The token grid of one request. Video tokens are flattened frame-major (t, h, w)."""

    frames: int
    height: int
    width: int
    latent_frames: int
    padded_latent_frames: int  # latent_frames padded up to the temporal patch
    latent_height: int
    latent_width: int
    token_frames: int
    token_rows: int
    token_cols: int
    text_tokens: int  # text tokens inside the attention sequence
    cross_text_tokens: int  # text tokens only cross-attended (not in the sequence)

    @property
    def video_tokens(self) -> int:
        return self.token_frames * self.token_rows * self.token_cols

    @property
    def sequence_tokens(self) -> int:
        return self.text_tokens + self.video_tokens

    def to_dict(self) -> dict:
        d = asdict(self)
        d["video_tokens"] = self.video_tokens
        d["sequence_tokens"] = self.sequence_tokens
        return d


def _tiny_spec() -> ModelSpec:
    """`tiny` mirrors raydit/models/tiny.py (read as text: importing it would import torch)."""
    consts = dict(TINY_HEADS=2, TINY_HEAD_DIM=16, TINY_LAYERS=2, TINY_TEXT_TOKENS=16,
                  TINY_LATENT_CHANNELS=4, TINY_PATCH_SIZE=2, TINY_VAE_SPATIAL=8,
                  TINY_VAE_TEMPORAL=4, TINY_FRAMES=9, TINY_HEIGHT=64, TINY_WIDTH=64)
    source = Path(__file__).resolve().parent.parent / "models" / "tiny.py"
    if source.is_file():
        for line in source.read_text().splitlines():
            name, _, rest = line.partition("=")
            name = name.strip()
            if name in consts:
                value = rest.split("#")[0].strip()
                if value.isdigit():
                    consts[name] = int(value)
    hidden = consts["TINY_HEADS"] * consts["TINY_HEAD_DIM"]
    return ModelSpec(
        name="tiny", family="cogvideox", heads=consts["TINY_HEADS"], head_dim=consts["TINY_HEAD_DIM"],
        layers=consts["TINY_LAYERS"], ffn_hidden=4 * hidden, patch_size=consts["TINY_PATCH_SIZE"],
        patch_size_t=None, text_tokens=consts["TINY_TEXT_TOKENS"], text_in_sequence=True,
        positional="sinusoidal", in_channels=consts["TINY_LATENT_CHANNELS"],
        params=_cogvideox_params(consts["TINY_LAYERS"], hidden, 4 * hidden),
        text_encoder_params=1e5, vae_params=1e5,
        default_frames=consts["TINY_FRAMES"], default_height=consts["TINY_HEIGHT"],
        default_width=consts["TINY_WIDTH"], vae_spatial=consts["TINY_VAE_SPATIAL"],
        vae_temporal=consts["TINY_VAE_TEMPORAL"],
    )


def _cogvideox_params(layers: int, hidden: int, ffn: int) -> float:
    """Transformer parameter estimate: attention 4h^2, FFN 2h*ffn, two adaptive norms ~4h^2."""
    return float(layers * (8 * hidden * hidden + 2 * hidden * ffn))


def _builtin_specs() -> dict[str, ModelSpec]:
    # name, family, heads, head_dim, layers, ffn, patch, patch_t, text tokens, text joins the
    # sequence, positional, latent channels, params, text-encoder params, VAE params,
    # default frames, height, width.
    specs = [
        ModelSpec("cogvideox-2b", "cogvideox", 30, 64, 30, 7680, 2, None, 226, True, "sinusoidal",
                  16, 1.69e9, _T5_XXL, 0.22e9, 49, 480, 720),
        ModelSpec("cogvideox-5b", "cogvideox", 48, 64, 42, 12288, 2, None, 226, True, "rotary",
                  16, 5.57e9, _T5_XXL, 0.22e9, 49, 480, 720),
        ModelSpec("cogvideox1.5-5b", "cogvideox", 48, 64, 42, 12288, 2, 2, 226, True, "rotary",
                  16, 5.57e9, _T5_XXL, 0.22e9, 81, 768, 1360),
        ModelSpec("wan2.1-t2v-1.3b", "wan", 12, 128, 30, 8960, 2, 1, 512, False, "rotary",
                  16, 1.42e9, _UMT5_XXL, 0.13e9, 81, 480, 832),
        ModelSpec("wan2.1-t2v-14b", "wan", 40, 128, 40, 13824, 2, 1, 512, False, "rotary",
                  16, 14.0e9, _UMT5_XXL, 0.13e9, 81, 720, 1280),
        # 20 dual-stream + 40 single-stream blocks, counted as 60 attention layers.
        ModelSpec("hunyuanvideo", "hunyuanvideo", 24, 128, 60, 12288, 2, 1, 256, True, "rotary",
                  16, 12.8e9, _HUNYUAN_TEXT, 0.25e9, 129, 720, 1280),
        # LTX-Video's VAE compresses 32x spatially and 8x in time; its patch is 1.
        ModelSpec("ltx-video", "ltx", 32, 64, 28, 8192, 1, 1, 128, False, "rotary",
                  128, 1.9e9, _T5_XXL, 0.4e9, 161, 512, 704, vae_spatial=32, vae_temporal=8),
        # Mochi's VAE compresses 6x in time; text joins the attention (asymmetric joint DiT).
        ModelSpec("mochi-1", "mochi", 24, 128, 48, 8192, 2, 1, 256, True, "rotary",
                  12, 10.0e9, _T5_XXL, 0.36e9, 163, 480, 848, vae_temporal=6),
    ]
    out = {s.name: s for s in specs}
    out["tiny"] = _tiny_spec()
    return out


BUILTIN_MODELS: Mapping[str, ModelSpec] = MappingProxyType(_builtin_specs())  # read-only


def model_spec(name_or_dir) -> ModelSpec:
    """A ModelSpec from a built-in name or a local diffusers pipeline directory."""
    if isinstance(name_or_dir, ModelSpec):
        return name_or_dir
    key = str(name_or_dir)
    for name, spec in BUILTIN_MODELS.items():
        if name.lower() == key.lower():
            return spec
    path = Path(key).expanduser()
    if path.is_dir():
        return _spec_from_dir(path)
    if path.exists():
        raise ValueError(f"model {key!r} is a file; give a built-in name or a diffusers pipeline directory")
    raise ValueError(
        f"unknown model {key!r}; built-in: {', '.join(BUILTIN_MODELS)}, or a local diffusers "
        "pipeline directory (with model_index.json and transformer/config.json)"
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _safetensors_bytes(folder: Path) -> float | None:
    """Total tensor bytes of a diffusers component folder, from safetensors headers only."""
    if not folder.is_dir():
        return None
    for index in folder.glob("*.safetensors.index.json"):
        total = _read_json(index).get("metadata", {}).get("total_size")
        if isinstance(total, (int, float)) and total > 0:
            return float(total)
    total = 0
    for f in folder.glob("*.safetensors"):
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for key, info in header.items():
            if key != "__metadata__":
                begin, end = info["data_offsets"]
                total += end - begin
    return float(total) if total else None


def _dtype_bytes(folder: Path) -> int:
    """Bytes per parameter of the stored weights (to turn stored bytes into a count)."""
    for f in folder.glob("*.safetensors"):
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            break
        for key, info in header.items():
            if key != "__metadata__":
                return {"F32": 4, "F16": 2, "BF16": 2}.get(info.get("dtype"), 2)
    return 2


def _param_count(folder: Path) -> float | None:
    stored = _safetensors_bytes(folder)
    return None if stored is None else stored / _dtype_bytes(folder)


def _t5_estimate(config: dict) -> float:
    d, ff, n = config.get("d_model", 4096), config.get("d_ff", 10240), config.get("num_layers", 24)
    vocab = config.get("vocab_size", 32128)
    return float(vocab * d + n * (4 * d * d + 3 * d * ff))


def _spec_from_dir(path: Path) -> ModelSpec:
    if (path / "transformer" / "config.json").is_file():
        transformer_dir = path / "transformer"
    elif (path / "config.json").is_file():
        transformer_dir = path
    else:
        raise ValueError(
            f"model directory {str(path)!r} has no transformer/config.json; give a diffusers "
            "pipeline directory (saved with save_pretrained) or a built-in name"
        )
    cfg = _read_json(transformer_dir / "config.json")
    if (path / "model_index.json").is_file():
        _read_json(path / "model_index.json")  # a broken index is an error worth one line
    cls = str(cfg.get("_class_name", ""))
    if not cls.startswith(("CogVideoX", "Wan")):
        raise ValueError(
            f"model directory {str(path)!r}: transformer class {cls or '(none)'!r} is not supported "
            "by the planner; supported: CogVideoXTransformer3DModel, WanTransformer3DModel"
        )

    def need(key):
        if key not in cfg:
            raise ValueError(f"{transformer_dir / 'config.json'}: missing {key!r}")
        return cfg[key]

    heads, head_dim, layers = need("num_attention_heads"), need("attention_head_dim"), need("num_layers")
    hidden = heads * head_dim
    te_dir = path / "text_encoder"
    te_params = _param_count(te_dir)
    if te_params is None:
        te_config = te_dir / "config.json"
        te_params = _t5_estimate(_read_json(te_config)) if te_config.is_file() else 0.0
    vae_params = _param_count(path / "vae") or 0.0
    vae_spatial, vae_temporal = 8, 4
    if (path / "vae" / "config.json").is_file():
        vae_cfg = _read_json(path / "vae" / "config.json")
        blocks = vae_cfg.get("block_out_channels")
        if isinstance(blocks, list) and blocks:
            vae_spatial = 2 ** (len(blocks) - 1)
        vae_temporal = int(vae_cfg.get("temporal_compression_ratio", vae_temporal))
        if cls.startswith("Wan"):  # Wan's VAE config has no block list of that meaning
            vae_spatial, vae_temporal = 8, 4
    if cls.startswith("CogVideoX"):
        vae_temporal = int(cfg.get("temporal_compression_ratio", vae_temporal))
        patch, patch_t = int(need("patch_size")), cfg.get("patch_size_t")
        ffn = 4 * hidden
        text_tokens, in_sequence = int(need("max_text_seq_length")), True
        if cfg.get("use_rotary_positional_embeddings"):
            positional = "rotary"
        elif cfg.get("use_learned_positional_embeddings"):
            positional = "learned"
        else:
            positional = "sinusoidal"
        frames = int(cfg.get("sample_frames", 49))
        height = int(cfg.get("sample_height", 60)) * vae_spatial
        width = int(cfg.get("sample_width", 90)) * vae_spatial
        family = "cogvideox"
    else:  # Wan
        p = need("patch_size")
        patch_t, patch = (int(p[0]), int(p[1])) if isinstance(p, list) else (1, int(p))
        ffn = int(cfg.get("ffn_dim", 4 * hidden))
        text_tokens, in_sequence, positional = 512, False, "rotary"
        frames, height, width = 81, 480, 832
        family = "wan"
    params = _param_count(transformer_dir) or _cogvideox_params(layers, hidden, ffn)
    return ModelSpec(
        name=str(path), family=family, heads=int(heads), head_dim=int(head_dim), layers=int(layers),
        ffn_hidden=int(ffn), patch_size=patch, patch_size_t=int(patch_t) if patch_t else None,
        text_tokens=text_tokens, text_in_sequence=in_sequence, positional=positional,
        in_channels=int(cfg.get("in_channels", 16)), params=params, text_encoder_params=te_params,
        vae_params=vae_params, default_frames=frames, default_height=height, default_width=width,
        vae_spatial=vae_spatial, vae_temporal=vae_temporal,
    )
