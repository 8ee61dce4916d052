"""Model geometry: what the planner needs to know about a video diffusion transformer.

A `ModelSpec` comes from a built-in name (no download) or from a local diffusers pipeline
directory (`model_index.json` + `transformer/config.json`), both found by `registry.model_spec`
(the directory read by `pipeline_dir`). `ModelSpec.geometry(frames, height, width)` validates a
request and gives the token grid:

    latent_frames = (frames - 1) / vae_temporal + 1, padded up to a multiple of patch_t
    latent_height = height / vae_spatial,  latent_width = width / vae_spatial
    token grid    = (latent_frames / patch_t) x (latent_height / patch) x (latent_width / patch)

CogVideoX-2b, 49 x 480 x 720: 13 x 30 x 45 = 17550 video tokens + 226 text = 17776.

A model with an audio stream (LTX-2) also carries the sound's tokens, as its pipeline makes them:

    audio_tokens  = round(frames / frame_rate x audio_tokens_per_second)

LTX-2, 121 frames at 24 fps, 25 audio tokens a second: round(126.04) = 126.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

POSITIONAL_KINDS = ("sinusoidal", "rotary", "learned")

# Parameter counts of text and image encoders several families' pipelines load (a family's own
# encoders are counted in its module): T5 v1.1 XXL's encoder, umT5-XXL's encoder, CLIP ViT-H/14's
# vision tower (an image-to-video pipeline's image encoder).
T5_XXL_PARAMS = 4.76e9
UMT5_XXL_PARAMS = 5.68e9
CLIP_VIT_H_PARAMS = 0.63e9


@dataclass(frozen=True)
class DecoderShape:
    """What the cost model needs of one family's VAE decoder (counted by forward hooks on
    diffusers' decoder with the real config: MACs and halo values per output pixel). A family
    declares its own (raydit.planner.decode prices it); a ModelSpec carries it as `decoder`."""

    flops_per_pixel: float  # FLOP per output pixel and frame (2 x MACs)
    halo_values: float  # halo values sent per output frame and output column (all convs)
    exchanges_per_latent_frame: float
    norms_per_latent_frame: float
    top_channels: int  # channels of the decoder's full-resolution activations (per output pixel)
    frames_per_call: int  # output frames one decoder call produces (0: the whole video)
    parallel: bool = True  # raydit decodes this family's VAE by rows
    # Channels of a self-attention over one decoder call's latent tokens (HunyuanVideo's mid
    # block: 4 N^2 C FLOP for N tokens); 0: none (its cost is then in flops_per_pixel).
    attention_channels: int = 0
    # Latent frames per decoder call and the stride between calls (diffusers' framewise
    # decode: each call also takes the frame before its stride, its first output frame
    # dropped), and, for `tiled` decodes, the latent tile side and stride (diffusers' defaults).
    call_frames: int = 0  # 0: the whole video in one call (or the cost is per pixel only)
    call_stride: int = 0
    tile: int = 0
    tile_stride: int = 0
    # Output frames the decoder makes beyond the video's and the VAE then drops (Mochi's decoder
    # makes t x T frames for T latent frames and drops the first t - 1): decoded, so counted.
    dropped_frames: int = 0
    # Values (input and output elements) the decoder's ops other than its convolutions and GEMMs
    # move per decoded pixel-frame (norms, activations, the causal caches' concatenations and
    # pads, upsampling, residual adds, the growing output's concatenation), counted on diffusers'
    # decode by bench/bench_decodecounts.py; priced at the decode's bytes per value and the
    # device's elementwise bandwidth (raydit.planner.decode). 0: not counted (a stand-in, there).
    elementwise_values: float = 0.0


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
    decoder: the VAE decoder's shape (DecoderShape), declared by the family; None: uncounted.
    fp8_params: weight elements of one expert that quantize "fp8" keeps in one byte each (the
        blocks' linear layers raydit.models.quantize selects), declared by the family; 0: not
        counted (FP8 weights are then priced at bytes_per_param, too high, never too low).
    fp8_weights: the run keeps those weights in FP8 (plan(mode=Mode(quantize="fp8")) sets it).
        Their row-wise float32 scales (one per output row: under 0.2% of the FP8 bytes at the
        built-ins' widths) are not counted.
    keeps_bf16: the run also keeps those weights at bytes_per_param beside their quantized form
        (full-precision steps: plan(mode=Mode(keep_bf16=True)) sets it).
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
    # Kernels one layer's non-GEMM, non-attention ops launch per transformer call in eager mode,
    # counted with elementwise_bytes; 0: not counted (devicemodel.ELEMENTWISE_LAUNCHES stands in).
    elementwise_launches: int = 0
    # True: the guidance branches run as one batch, one transformer call a step (CogVideoX);
    # False: one call per branch (the launches of a step count once per call).
    batched_branches: bool = False
    # True: the FFN's input projection is 2 x ffn_hidden wide, value and gate (Mochi's SwiGLU).
    gated_ffn: bool = False
    # True: every self-attention call carries a boolean mask (HunyuanVideo's text padding), priced at
    # the device table's masked-attention rate (devicemodel.DeviceTable.attention, kernel "bf16-masked").
    masked_attention: bool = False
    # The family's VAE decoder as the cost model prices it; None: not counted, decoded on one
    # rank (raydit.planner.decode prices a Wan-2.1-like decoder per pixel for it).
    decoder: DecoderShape | None = None
    fp8_params: float = 0.0
    fp8_weights: bool = False
    keeps_bf16: bool = False

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
        if isinstance(self.fp8_params, bool) or not isinstance(self.fp8_params, (int, float)) \
                or not 0 <= self.fp8_params <= self.params:
            raise ValueError(f"model {self.name!r}: fp8_params must be a number in 0..params ({self.params:g}), "
                             f"got {self.fp8_params!r}")
        if self.fp8_weights not in (True, False):
            raise ValueError(f"model {self.name!r}: fp8_weights must be True or False, got {self.fp8_weights!r}")
        if isinstance(self.elementwise_launches, bool) or not isinstance(self.elementwise_launches, int) \
                or self.elementwise_launches < 0:
            raise ValueError(f"model {self.name!r}: elementwise_launches must be an integer >= 0, "
                             f"got {self.elementwise_launches!r}")
        for flag in ("gated_ffn", "masked_attention"):
            if getattr(self, flag) not in (True, False):
                raise ValueError(f"model {self.name!r}: {flag} must be True or False, got {getattr(self, flag)!r}")
        if self.batched_branches not in (True, False):
            raise ValueError(f"model {self.name!r}: batched_branches must be True or False, got {self.batched_branches!r}")
        if self.keeps_bf16 not in (True, False):
            raise ValueError(f"model {self.name!r}: keeps_bf16 must be True or False, got {self.keeps_bf16!r}")
        if self.decoder is not None and not isinstance(self.decoder, DecoderShape):
            raise ValueError(f"model {self.name!r}: decoder must be a DecoderShape or None, got {self.decoder!r}")
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
    def transformer_bytes_per_param(self) -> float:
        """Bytes per transformer parameter as the run keeps them: bytes_per_param, less one byte
        less for each of the fp8_params where fp8_weights, plus bytes_per_param more for each of
        them where keeps_bf16."""
        per = float(self.bytes_per_param)
        if self.fp8_weights:
            per -= (self.bytes_per_param - 1) * self.fp8_params / self.params
        if self.keeps_bf16:
            per += self.bytes_per_param * self.fp8_params / self.params
        return per

    @property
    def weight_bytes(self) -> float:
        """Bytes of every weight a rank keeps resident (every transformer, text encoder, VAE, and
        the LoRA adapters loaded beside them)."""
        return self.params * self.experts * self.transformer_bytes_per_param \
            + (self.text_encoder_params + self.vae_params) * self.bytes_per_param + self.adapter_bytes

    @property
    def idle_weight_bytes(self) -> float:
        """Bytes that need not stay on the device during denoising: the experts not running
        this step and the text encoder once the prompt is encoded."""
        return self.params * (self.experts - 1) * self.transformer_bytes_per_param \
            + self.text_encoder_params * self.bytes_per_param

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
