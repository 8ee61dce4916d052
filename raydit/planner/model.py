"""Model geometry: what the planner needs to know about a video diffusion transformer.

A `ModelSpec` comes from a built-in name (no download) or from a local diffusers pipeline
directory (`model_index.json` + `transformer/config.json`). `ModelSpec.geometry(frames,
height, width)` validates a request and gives the token grid:

    latent_frames = (frames - 1) / vae_temporal + 1, padded up to a multiple of patch_t
    latent_height = height / vae_spatial,  latent_width = width / vae_spatial
    token grid    = (latent_frames / patch_t) x (latent_height / patch) x (latent_width / patch)

CogVideoX-2b, 49 x 480 x 720: 13 x 30 x 45 = 17550 video tokens + 226 text = 17776.

A model with an audio stream (LTX-2) also carries the sound's tokens, as its pipeline makes them:

    audio_tokens  = round(frames / frame_rate x audio_tokens_per_second)

LTX-2, 121 frames at 24 fps, 25 audio tokens a second: round(126.04) = 126.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, replace
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

POSITIONAL_KINDS = ("sinusoidal", "rotary", "learned")

# T5 v1.1 XXL encoder (CogVideoX, LTX-Video, Mochi), umT5-XXL encoder (Wan), and
# HunyuanVideo's LLaVA-Llama-3-8B + CLIP-L: parameter counts.
_T5_XXL = 4.76e9
_UMT5_XXL = 5.68e9
_HUNYUAN_TEXT = 8.03e9 + 0.12e9
# HunyuanVideo-I2V's LLaVA-Llama-3-8B with its CLIP ViT-L/14-336 vision tower (0.30e9) and
# projector (0.02e9), + CLIP-L text.
_HUNYUAN_I2V_TEXT = 8.03e9 + 0.30e9 + 0.02e9 + 0.12e9
_CLIP_VIT_H = 0.63e9
_HUNYUAN15_TEXT = 7.07e9 + 0.22e9  # Qwen2.5-VL-7B text model + ByT5-small encoder
# LTX-2: Gemma 3 12B (11.77e9 text with tied embeddings + 0.42e9 SigLIP) and the pipeline's text
# connectors (1.43e9: Linear 49 x 3840 -> 3840 and two 2-layer 30 x 128 transformers, LTX2TextConnectors'
# defaults, which are LTX-2's).
_LTX2_TEXT = 12.19e9 + 1.43e9
# Kandinsky 5: Qwen2.5-VL-7B (the whole Qwen2_5_VLForConditionalGeneration the pipelines load,
# 8.29e9) + CLIP ViT-L/14's text model (0.12e9).
_KANDINSKY5_TEXT = 8.29e9 + 0.12e9


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
    params: transformer parameter count (of one expert); text_encoder_params, vae_params: the
        rest of the pipeline a rank keeps resident; bytes_per_param: 2 for bf16/fp16 weights.
    cfg_branches: transformer passes per step with guidance on: 2 for classifier-free
        guidance (cond + uncond), 1 where guidance is embedded (HunyuanVideo).
    experts: transformers the pipeline holds (Wan 2.2 A14B: 2, switched at a boundary
        timestep; each step runs one), all counted in the weights.
    default_frames/height/width: the request used when the user gives none.
    adapter_bytes: LoRA adapters every rank holds beside the weights (unfused; each counted
        once per transformer it loads into), as the runtime measured them; 0 for none.
    audio_heads, audio_head_dim, audio_ffn_hidden: an audio stream run in the same blocks as the
        video (audio_hidden = heads x head_dim; the family's spec reader sets them); 0 for none.
    audio_tokens_per_second: audio tokens per second of sound (sample rate / mel hop / the audio
        VAE's temporal compression); frame_rate: frames per second a request's video is read at
        to give the sound's length. Both 0 without an audio stream.
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
    experts: int = 1  # transformers of `params` each held (Wan 2.2 A14B: 2, one per step)
    cfg_branches: int = 2  # transformer passes per step with guidance on (HunyuanVideo: 1, embedded; LTX-2: 4)
    adapter_bytes: float = 0.0  # LoRA adapters resident on every rank (raydit.models.lora.adapter_bytes)
    audio_heads: int = 0  # LTX-2's audio stream; 0: none
    audio_head_dim: int = 0
    audio_ffn_hidden: int = 0
    audio_tokens_per_second: float = 0.0
    frame_rate: float = 0.0
    # Bytes per token and channel one layer's non-GEMM, non-attention ops (norms, modulation,
    # rotary, residuals, activations) move in eager mode, counted on the family's diffusers block;
    # 0: not counted (raydit.planner.devicemodel.DEFAULT_ELEMENTWISE_BYTES stands in).
    elementwise_bytes: float = 0.0

    def __post_init__(self):
        for field_name in ("heads", "head_dim", "layers", "ffn_hidden", "patch_size", "in_channels",
                           "vae_spatial", "vae_temporal", "bytes_per_param", "experts", "cfg_branches"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {field_name} must be a positive integer, got {value!r}")
        if self.patch_size_t is not None and (not isinstance(self.patch_size_t, int) or self.patch_size_t < 1):
            raise ValueError(f"model {self.name!r}: patch_size_t must be None or a positive integer")
        if isinstance(self.adapter_bytes, bool) or not isinstance(self.adapter_bytes, (int, float)) \
                or not self.adapter_bytes >= 0:
            raise ValueError(f"model {self.name!r}: adapter_bytes must be a number >= 0, got {self.adapter_bytes!r}")
        for field_name in ("audio_heads", "audio_head_dim", "audio_ffn_hidden"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model {self.name!r}: {field_name} must be an integer >= 0, got {value!r}")
        for field_name in ("audio_tokens_per_second", "frame_rate", "elementwise_bytes"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"model {self.name!r}: {field_name} must be a number >= 0, got {value!r}")
        audio = (self.audio_heads, self.audio_head_dim, self.audio_ffn_hidden, self.audio_tokens_per_second,
                 self.frame_rate)
        if any(audio) and not all(audio):
            raise ValueError(
                f"model {self.name!r}: an audio stream needs audio_heads, audio_head_dim, audio_ffn_hidden, "
                f"audio_tokens_per_second and frame_rate all > 0 (none: all 0), got {', '.join(map(str, audio))}")
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
    def audio_hidden(self) -> int:
        """Width of the audio stream (0: none)."""
        return self.audio_heads * self.audio_head_dim

    @property
    def calibration_key(self) -> str:
        """What a model calibration of this transformer is filed under on a device type: its
        family and the shape that sets its cost (a built-in spec and a saved pipeline of the
        same shape share it; weights and the name do not matter)."""
        pt = self.patch_size_t or 1
        text = f"{self.text_tokens}{'s' if self.text_in_sequence else 'x'}"
        audio = f":a{self.audio_hidden}:affn{self.audio_ffn_hidden}" if self.audio_hidden else ""
        return (f"{self.family}:{self.heads}x{self.head_dim}:L{self.layers}:ffn{self.ffn_hidden}:"
                f"p{self.patch_size}x{pt}:c{self.in_channels}:t{text}:b{self.cfg_branches}{audio}")

    @property
    def pixel_multiple(self) -> int:
        """Height and width must be multiples of this (VAE scale x patch)."""
        return self.vae_spatial * self.patch_size

    @property
    def weight_bytes(self) -> float:
        """Bytes of every weight a rank keeps resident (every transformer, text encoder, VAE, and
        the LoRA adapters loaded beside them)."""
        return (self.params * self.experts + self.text_encoder_params + self.vae_params) * self.bytes_per_param \
            + self.adapter_bytes

    @property
    def idle_weight_bytes(self) -> float:
        """Bytes that need not stay on the device during denoising: the experts not running
        this step and the text encoder once the prompt is encoded."""
        return (self.params * (self.experts - 1) + self.text_encoder_params) * self.bytes_per_param

    def audio_tokens(self, frames: int) -> int:
        """Audio tokens of a request of `frames` frames: the sound lasts as the video,
        round(frames / frame_rate x tokens per second); 0 without an audio stream."""
        if not self.audio_hidden:
            return 0
        return round(frames / self.frame_rate * self.audio_tokens_per_second)

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
            audio_tokens=self.audio_tokens(frames),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hidden"] = self.hidden
        d["audio_hidden"] = self.audio_hidden
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
    audio_tokens: int = 0  # LTX-2's audio stream: whole on every rank, not in the split sequence

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
        # I2V: 16 noise + 4 mask + 16 image-latent channels; 257 CLIP image tokens join the
        # text in cross-attention (the CLIP ViT-H image encoder counts with the text encoder).
        ModelSpec("wan2.1-i2v-14b-480p", "wan", 40, 128, 40, 13824, 2, 1, 512, False, "rotary",
                  36, 14.0e9, _UMT5_XXL + _CLIP_VIT_H, 0.13e9, 81, 480, 832),
        # Two 14B experts: `transformer` above the boundary timestep, `transformer_2` below.
        ModelSpec("wan2.2-t2v-a14b", "wan", 40, 128, 40, 13824, 2, 1, 512, False, "rotary",
                  16, 14.0e9, _UMT5_XXL, 0.13e9, 81, 720, 1280, experts=2),
        # TI2V-5B: 48 latent channels, the 16x spatial VAE; 121 frames at 704 x 1280.
        ModelSpec("wan2.2-ti2v-5b", "wan", 24, 128, 30, 14336, 2, 1, 512, False, "rotary",
                  48, 5.0e9, _UMT5_XXL, 0.7e9, 121, 704, 1280, vae_spatial=16),
        # SkyReels-V2 (Skywork/SkyReels-V2-*-Diffusers): Wan 2.1's transformer layout (1.3B: 12
        # heads x 128, 30 layers; 14B: 40 x 128, 40 layers) as diffusers' conversion script
        # configures it; parameters counted on the meta device (1.3B DF 1.436e9 with its fps
        # embedding, I2V 1.3B 1.564e9, 14B 14.29e9, I2V 14B 16.39e9). Defaults: 540P 97 x 544 x
        # 960 (the pipelines'), 720P 121 x 720 x 1280 (base_num_frames 121 for diffusion forcing).
        # DF: a timestep per latent frame, long videos in windows of base_num_frames.
        ModelSpec("skyreels-v2-t2v-14b-540p", "skyreels", 40, 128, 40, 13824, 2, 1, 512, False, "rotary",
                  16, 14.29e9, _UMT5_XXL, 0.13e9, 97, 544, 960),
        ModelSpec("skyreels-v2-t2v-14b-720p", "skyreels", 40, 128, 40, 13824, 2, 1, 512, False, "rotary",
                  16, 14.29e9, _UMT5_XXL, 0.13e9, 121, 720, 1280),
        ModelSpec("skyreels-v2-i2v-1.3b-540p", "skyreels", 12, 128, 30, 8960, 2, 1, 512, False, "rotary",
                  36, 1.564e9, _UMT5_XXL + _CLIP_VIT_H, 0.13e9, 97, 544, 960),
        ModelSpec("skyreels-v2-i2v-14b-540p", "skyreels", 40, 128, 40, 13824, 2, 1, 512, False, "rotary",
                  36, 16.39e9, _UMT5_XXL + _CLIP_VIT_H, 0.13e9, 97, 544, 960),
        ModelSpec("skyreels-v2-i2v-14b-720p", "skyreels", 40, 128, 40, 13824, 2, 1, 512, False, "rotary",
                  36, 16.39e9, _UMT5_XXL + _CLIP_VIT_H, 0.13e9, 121, 720, 1280),
        ModelSpec("skyreels-v2-df-1.3b-540p", "skyreels", 12, 128, 30, 8960, 2, 1, 512, False, "rotary",
                  16, 1.436e9, _UMT5_XXL, 0.13e9, 97, 544, 960),
        ModelSpec("skyreels-v2-df-14b-540p", "skyreels", 40, 128, 40, 13824, 2, 1, 512, False, "rotary",
                  16, 14.29e9, _UMT5_XXL, 0.13e9, 97, 544, 960),
        ModelSpec("skyreels-v2-df-14b-720p", "skyreels", 40, 128, 40, 13824, 2, 1, 512, False, "rotary",
                  16, 14.29e9, _UMT5_XXL, 0.13e9, 121, 720, 1280),
        # 20 dual-stream + 40 single-stream blocks, counted as 60 attention layers.
        # Guidance is embedded (a guidance-scale input): one transformer pass per step.
        ModelSpec("hunyuanvideo", "hunyuanvideo", 24, 128, 60, 12288, 2, 1, 256, True, "rotary",
                  16, 12.8e9, _HUNYUAN_TEXT, 0.25e9, 129, 720, 1280, cfg_branches=1),
        # HunyuanVideo-I2V (hunyuanvideo-community/HunyuanVideo-I2V): the same transformer with
        # token_replace blocks (16 channels; the image's latents replace the first latent frame).
        # Text: 576 image features of the LLaVA kept 1 in 4 (144) + 252 prompt tokens = 396;
        # HunyuanVideoImageToVideoPipeline's defaults 129 x 720 x 1280.
        ModelSpec("hunyuanvideo-i2v", "hunyuanvideo", 24, 128, 60, 12288, 2, 1, 396, True, "rotary",
                  16, 12.8e9, _HUNYUAN_I2V_TEXT, 0.25e9, 129, 720, 1280, cfg_branches=1),
        # HunyuanVideo 1.5 (HunyuanVideo15Transformer3DModel's defaults: 16 heads x 128, 54
        # dual-stream blocks, patch 1, 65 = 32 noise + 32 image + 1 mask channels, 8.33e9 params
        # counted on the meta device; AutoencoderKLHunyuanVideo15: 16x / 4x, 32 channels, 1.26e9).
        # Text joins the attention: 1000 Qwen2.5-VL + 256 ByT5 tokens (padded); encoders: the
        # Qwen2.5-VL-7B text model 7.07e9 + ByT5-small's encoder 0.22e9. Defaults: 121 frames at
        # the 16:9 bucket of the transformer's target_size (640: 480 x 848; 960: 720 x 1280).
        ModelSpec("hunyuanvideo-1.5-480p", "hunyuanvideo15", 16, 128, 54, 8192, 1, 1, 1256, True, "rotary",
                  65, 8.33e9, _HUNYUAN15_TEXT, 1.26e9, 121, 480, 848, vae_spatial=16),
        ModelSpec("hunyuanvideo-1.5-720p", "hunyuanvideo15", 16, 128, 54, 8192, 1, 1, 1256, True, "rotary",
                  65, 8.33e9, _HUNYUAN15_TEXT, 1.26e9, 121, 720, 1280, vae_spatial=16),
        # LTX-Video's VAE compresses 32x spatially and 8x in time; its patch is 1.
        ModelSpec("ltx-video", "ltx", 32, 64, 28, 8192, 1, 1, 128, False, "rotary",
                  128, 1.92e9, _T5_XXL, 0.4e9, 161, 512, 704, vae_spatial=32, vae_temporal=8),
        # The same 2B model under its sized name; LTX-Video 13B (0.9.7): 32 heads x 128, 48 layers,
        # 4096-wide cross-attention; both with LTXPipeline's defaults (161 x 512 x 704). Shapes and
        # parameter counts (1.923e9, 13.04e9) are what diffusers builds from the configs its
        # conversion script writes for those checkpoints (tests/test_planner_model.py).
        ModelSpec("ltx-video-2b", "ltx", 32, 64, 28, 8192, 1, 1, 128, False, "rotary",
                  128, 1.92e9, _T5_XXL, 0.4e9, 161, 512, 704, vae_spatial=32, vae_temporal=8),
        ModelSpec("ltx-video-13b", "ltx", 32, 128, 48, 16384, 1, 1, 128, False, "rotary",
                  128, 13.04e9, _T5_XXL, 0.4e9, 161, 512, 704, vae_spatial=32, vae_temporal=8),
        # LTX-2 (Lightricks/LTX-2, LTX2Pipeline): the 19B audio-video transformer, diffusers'
        # LTX2VideoTransformer3DModel defaults (its LTX-2 config): video 32 heads x 128, 48
        # blocks, 128 latent channels, patch 1; the audio stream (32 x 64 = 2048 wide, FFN 4 x) runs
        # in the same blocks and is counted in the parameters (1.888e10 on the meta device), not in
        # the split sequence: its tokens (AutoencoderKLLTX2Audio's defaults: 16000 Hz / hop 160 /
        # 4x temporal compression = 25 a second, read at the pipeline's 24 fps) stay whole on every
        # rank, costed apart (raydit.planner.cost). Gemma 3 text reaches both streams by
        # cross-attention, 1024 tokens (max_sequence_length). VAEs: video 32x / 8x (the pipeline's),
        # 1.22e9 + audio VAE 0.05e9 + vocoder 0.06e9. LTX2Pipeline's defaults: 121 x 512 x 768.
        # Guidance: four branches per step (the negative and positive passes, STG, modality), shared
        # out over cfg 1, 2 or 4 groups.
        ModelSpec("ltx-2", "ltx2", 32, 128, 48, 16384, 1, 1, 1024, False, "rotary",
                  128, 18.88e9, _LTX2_TEXT, 1.33e9, 121, 512, 768, vae_spatial=32, vae_temporal=8,
                  cfg_branches=4, audio_heads=32, audio_head_dim=64, audio_ffn_hidden=4 * 32 * 64,
                  audio_tokens_per_second=25.0, frame_rate=24.0),
        # Kandinsky 5 (kandinskylab/Kandinsky-5.0-*-Diffusers, Kandinsky5T2VPipeline / I2V),
        # Kandinsky5Transformer3DModel as its configs set it: Lite 2B (model_dim 1792 = 28 heads x
        # 64, 32 visual + 2 text blocks, FFN 7168, time_dim 512) and Pro 19B (4096 = 32 x 128,
        # 60 + 4 blocks, FFN 16384, time_dim 1024); patch (1, 2, 2), 33 = 16 noise + 16
        # conditioning + 1 mask channels; 2.008e9 / 1.931e10 parameters on the meta device
        # (tests/models/test_family_kandinsky5.py). Layers count the visual blocks (the text
        # blocks run on the text alone, whole on every rank); the text is cross-attended, at most
        # 512 Qwen2.5-VL tokens. The HunyuanVideo VAE (8x / 4x, 0.25e9); the pipelines' defaults
        # 121 x 512 x 768. The 10 s Lite checkpoints use NABLA sparse attention: one process per
        # replica only (sequence parallelism refuses it).
        ModelSpec("kandinsky5-t2v-lite", "kandinsky5", 28, 64, 32, 7168, 2, 1, 512, False, "rotary",
                  33, 2.008e9, _KANDINSKY5_TEXT, 0.25e9, 121, 512, 768),
        ModelSpec("kandinsky5-t2v-pro", "kandinsky5", 32, 128, 60, 16384, 2, 1, 512, False, "rotary",
                  33, 19.31e9, _KANDINSKY5_TEXT, 0.25e9, 121, 512, 768),
        ModelSpec("kandinsky5-i2v-pro", "kandinsky5", 32, 128, 60, 16384, 2, 1, 512, False, "rotary",
                  33, 19.31e9, _KANDINSKY5_TEXT, 0.25e9, 121, 512, 768),
        # Mochi 1 (genmo/mochi-1-preview): MochiTransformer3DModel's defaults, which its conversion
        # script builds (24 heads x 128, 48 asymmetric dual-stream blocks, a 1536-wide text
        # stream, SwiGLU of inner width 8192, patch 2, 12 latent channels: 1.0028e10 parameters
        # on the meta device); the T5 text (256 tokens, padded) joins the attention.
        # AutoencoderKLMochi(latent_channels=12): 6x in time, 8x in space, 4.6e8 parameters.
        # MochiPipeline's defaults: 19 frames at 480 x 848.
        ModelSpec("mochi-1", "mochi", 24, 128, 48, 8192, 2, 1, 256, True, "rotary",
                  12, 10.03e9, _T5_XXL, 0.46e9, 19, 480, 848, vae_temporal=6),
    ]
    # Built-in tiny pipelines (random weights, written by their family's module; a test
    # checks each against the spec read back from the directory it writes).
    tiny_hidden = 2 * 16
    specs.append(ModelSpec("tiny", "cogvideox", 2, 16, 2, 4 * tiny_hidden, 2, None, 16, True, "sinusoidal",
                           4, _cogvideox_params(2, tiny_hidden, 4 * tiny_hidden), 1e5, 1e5, 9, 64, 64))
    specs.append(ModelSpec("tiny-i2v", "cogvideox", 2, 16, 2, 4 * tiny_hidden, 2, None, 16, True, "rotary",
                           8, _cogvideox_params(2, tiny_hidden, 4 * tiny_hidden), 1e5, 1e5, 9, 64, 64))
    # tiny-hunyuan: HunyuanVideo's layout (one dual- and one single-stream block) at 6 heads.
    specs.append(ModelSpec("tiny-hunyuan", "hunyuanvideo", 6, 16, 2, 192, 2, 1, 256, True, "rotary",
                           4, 6.4e5, 4.2e4, 7.1e4, 9, 64, 64, cfg_branches=1))
    # tiny-hunyuan-i2v: the same with token_replace blocks; a tiny Llava: 144 image + 252 text tokens.
    specs.append(ModelSpec("tiny-hunyuan-i2v", "hunyuanvideo", 6, 16, 2, 192, 2, 1, 396, True, "rotary",
                           4, 6.4e5, 6.3e4, 7.1e4, 9, 64, 64, cfg_branches=1))
    # tiny-hunyuan15 / -i2v: HunyuanVideo 1.5's layout (patch 1, 16x VAE, joint text) at 6 heads x 8.
    # (4.6e6 parameters: the ByT5 projection's 2048-wide hidden layer is fixed by diffusers.)
    for name, encoders in (("tiny-hunyuan15", 2.9e4), ("tiny-hunyuan15-i2v", 3.4e4)):
        specs.append(ModelSpec(name, "hunyuanvideo15", 6, 8, 2, 96, 1, 1, 1256, True, "rotary",
                               9, 4.6e6, encoders, 1.1e5, 9, 48, 80, vae_spatial=16))
    # tiny-mochi: Mochi's layout (asymmetric dual-stream blocks, 6x / 8x VAE, joint T5 text) at 6 heads.
    specs.append(ModelSpec("tiny-mochi", "mochi", 6, 16, 2, 256, 2, 1, 256, True, "rotary",
                           12, 4.2e5, 2.5e4, 6.1e5, 7, 32, 48, vae_temporal=6))
    # tiny-ltx: LTX-Video's layout (patch 1, 32x / 8x VAE, T5 cross-attention) at 6 heads.
    specs.append(ModelSpec("tiny-ltx", "ltx", 6, 12, 2, 288, 1, 1, 128, False, "rotary",
                           8, 2.3e5, 2.5e4, 1.1e5, 9, 64, 96, vae_spatial=32, vae_temporal=8))
    # tiny-kandinsky5 / -i2v: Kandinsky 5's layout (patch (1, 2, 2), HunyuanVideo VAE, Qwen text
    # cross-attended) at 6 heads x 8; I2V at 17 frames (its pipeline needs 5 latent frames).
    for name, frames, height, width in (("tiny-kandinsky5", 9, 48, 80), ("tiny-kandinsky5-i2v", 17, 32, 48)):
        specs.append(ModelSpec(name, "kandinsky5", 6, 8, 2, 64, 2, 1, 512, False, "rotary",
                               9, 9.2e4, 2.2e4, 7.1e4, frames, height, width))
    return {s.name: _with_elementwise(s) for s in specs}


# Bytes per token and channel a layer's non-GEMM, non-attention ops move in eager bf16, counted
# on diffusers 0.42.1's blocks at real widths on the meta device: a TorchDispatchMode summing the
# bytes of every op's inputs and outputs (views, GEMMs and the attention kernel excluded), one block
# of 1024 video tokens with the family's text (bench/bench_opsweep.py --count-blocks repeats it):
# WanTransformerBlock (1536 wide; modulation, norms and rotary in float32) 658.8 MB over 1024 x 1536
# -> 419; CogVideoXBlock (1920, 1024 + 226 tokens) 202.3 MB -> 84; HunyuanVideo's dual-stream
# block (3072, 1024 + 256) 912.9 MB -> 232 and single-stream 936.3 MB -> 238 (238 taken).
# SkyReels-V2 runs Wan's block. Families not counted: 0 (the device model's default).
ELEMENTWISE_BYTES = {"wan": 419.0, "skyreels": 419.0, "cogvideox": 84.0, "hunyuanvideo": 238.0}


def _with_elementwise(spec: ModelSpec) -> ModelSpec:
    counted = ELEMENTWISE_BYTES.get(spec.family, 0.0)
    return replace(spec, elementwise_bytes=counted) if counted and not spec.elementwise_bytes else spec


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


# Pipeline class (model_index.json `_class_name`) -> reader(path, configs) -> ModelSpec.
# Filled by raydit.models.registry from the model families; the planner names none.
_SPEC_READERS: dict[str, Callable] = {}

# Component folders whose config a reader may need; `configs[""]` is model_index.json.
_COMPONENT_CONFIGS = {
    "transformer": "config.json", "transformer_2": "config.json", "vae": "config.json",
    "text_encoder": "config.json", "image_encoder": "config.json", "audio_vae": "config.json",
    "tokenizer": "tokenizer_config.json", "scheduler": "scheduler_config.json",
}


def register_spec_reader(pipelines, reader: Callable) -> None:
    """Read directories holding any of `pipelines` with `reader(path, configs)`."""
    for name in pipelines:
        _SPEC_READERS[name] = reader


def read_pipeline_configs(path: Path) -> dict[str, dict]:
    """{component: parsed config} of a diffusers pipeline directory ("" = model_index.json)."""
    configs = {"": _read_json(path / "model_index.json")}
    for component, filename in _COMPONENT_CONFIGS.items():
        f = path / component / filename
        if f.is_file():
            configs[component] = _read_json(f)
    return configs


def component_params(folder: Path) -> float | None:
    """Parameter count of a component folder from its safetensors headers (no weights read)."""
    return _param_count(folder)


def t5_params(config: dict) -> float:
    """Parameter estimate of a T5-style encoder from its config (when no weights are there)."""
    return _t5_estimate(config)


def _spec_from_dir(path: Path) -> ModelSpec:
    if not (path / "model_index.json").is_file():
        raise ValueError(
            f"model directory {str(path)!r} is not a diffusers pipeline (no model_index.json); give a "
            "directory saved with save_pretrained, or a built-in name"
        )
    configs = read_pipeline_configs(path)
    class_name = str(configs[""].get("_class_name", ""))
    reader = _SPEC_READERS.get(class_name)
    if reader is None:
        if not _SPEC_READERS:
            raise ValueError(
                "pipeline directories are read through raydit's model families: call "
                "raydit.model_spec / raydit.plan (or raydit.models.registry.load_families() first)"
            )
        raise ValueError(
            f"model directory {str(path)!r} holds a {class_name or '(no _class_name)'}; raydit plans "
            f"{', '.join(sorted(_SPEC_READERS))}"
        )
    if "transformer" not in configs:
        raise ValueError(
            f"model directory {str(path)!r} has no transformer/config.json; give a diffusers "
            "pipeline directory (saved with save_pretrained) or a built-in name"
        )
    return _with_elementwise(reader(path, configs))


def require(config: dict, key: str, where: str):
    """config[key], or a one-line ValueError naming the file and the key."""
    if key not in config:
        raise ValueError(f"{where}: missing {key!r}")
    return config[key]
