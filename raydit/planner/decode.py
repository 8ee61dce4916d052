"""The VAE decode and the text encoder in the planner: time and memory per rank (pure Python).

The decode runs on every rank of a replica (raydit.models.vae_parallel): the latent rows are
cut into `ranks` bands (the first rows % ranks get one more row), each rank decodes its band
and exchanges halo rows with its neighbours at every convolution; the frames are gathered once
to rank 0. Per video, with n = ranks, H x W output pixels, F output frames, e bytes per value:

    compute   t_c = F H W m / P_vae x ceil(rows / n) / rows      (the largest band paces)
              m = FLOP per output pixel and frame of the family's decoder (2 x MACs, counted
              on diffusers' decoders with real configs: each family's DecoderShape), P_vae = P x
              VAE_EFFICIENCY, x FLOAT32_CONV_SHARE where the decode runs in float32 (TF32 convolutions)
    memory    t_e = F H W v e_d / B_e x ceil(rows / n) / rows
              v = values per pixel-frame the decoder's other ops move (norms, activations, the
              causal caches' concatenations and pads, upsampling, residual adds: DecoderShape.
              elementwise_values, counted by bench/bench_decodecounts.py), e_d = the decode's
              bytes per value (the run's dtype: 2; 4 in float32), B_e = the device's measured
              elementwise bandwidth (its op table: raydit.planner.devicemodel). Convolutions and
              these ops are separate kernels in eager mode, so their times add. Launches are not
              priced: the decoder's ops work on whole frames (milliseconds each), so the host
              queues them faster than the GPU runs them (Wan 2.1's 720p decode: 7992 launches,
              0.08 s of host time; HunyuanVideo's tiled 77 x 480 x 848: 58869, 0.6 s, against
              their seconds of GPU time).
    halo      t_h = [n > 1] (x a + 2 F W h e / B)                 (both neighbours at once)
              x = halo exchanges (one per convolution taller than one row, per call of the
              decoder), h = halo values per output frame and output column (DecoderShape)
    norms     [n > 1] g a: one small all-gather per group norm (CogVideoX)
    gather    [n > 1] F H W 3 e (n - 1) / n / B + a                 (the bands to rank 0)

Peak memory per rank: the decoder's largest live activations at full resolution, for the
frames one decoder call produces, on the rank's band (plus its halo rows):

    M_dec = LIVE x C_top x f_call x (ceil(rows / n) s + 2) x W x e  + VAE weights

C_top: channels at full resolution, f_call: output frames per decoder call (CogVideoX: 8,
two latent frames; Wan: 4, one latent frame), s: output rows per latent row. Before issue 13
the decode ran replicated on every rank (n = 1) and was assumed tiled.

Text encoder: encoded once per request on one rank ("one-rank", raydit since issue 13:
raydit.models.text_encoding; the embeddings are broadcast), or kept on every rank
("every-rank", raydit before), or on the host ("cpu"). `rank_memory_gb` counts it on the ranks
that hold it; the planner's memory per rank (cost.memory_gb) is that of the largest rank,
the encoding rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from raydit.planner.model import DecoderShape, ModelSpec, VideoGeometry

GB = 1e9
# Fraction of the device's DiT rate (DeviceType.flops_per_second) a VAE decoder's convolutions
# reach: a fit on one published decode (bench/bench_costmodel.py, role "fit"): SGLang's
# HunyuanVideo 77 x 480 x 848 decode, 5.71 s on one H200 before its parallel decode (FIELD.md),
# decoded framewise and tiled in fp16 as SGLang's HunyuanVideo pipeline does (its HunyuanConfig's
# vae_precision): of the 5.71 s, the elementwise ops' 0.525 s (12792.4 values per decoded
# pixel-frame, 7.18e7 of them, 2 bytes each, at the H200 table's 3499 GB/s) leave 5.185 s to the
# convolutions' 1.235e15 FLOP: / (989e12 x 0.31, H200) = 0.777. (Fit before the elementwise
# term: 0.706.) Its check,
# TensorRT-LLM's Wan 2.2 720p decode (2.72 s on one B200), missed at 0.71 by -77% with the
# convolutions alone in bf16; its pipeline decodes in float32 (wan_t2v.py loads the VAE with
# torch_dtype=torch.float32): TF32 convolutions (FLOAT32_CONV_SHARE) and 4-byte elementwise
# traffic bring it to -15% (docs/benchmarks/costmodel.md).
VAE_EFFICIENCY = 0.78
# The share of a device's BF16 tensor rate its float32 convolutions reach: cuDNN runs them in
# TF32 (torch.backends.cudnn.allow_tf32 is on by default), whose published dense peak is half
# the BF16 / FP16 one on every datacenter part the planner knows (H100 SXM 494.7 / 989.4
# TFLOP/s, A100 156 / 312, HGX B200 18 / 36 PFLOPS with sparsity for 8 GPUs). Published, no fit.
FLOAT32_CONV_SHARE = 0.5
# The elementwise bandwidth a decode is priced at where the caller names no device with an op
# table: the H100's measured (bench_opsweep 2026-11-27: a DiT block's eager elementwise chain).
DEFAULT_ELEMENTWISE_GB_S = 2442.0
# Elementwise values per convolution FLOP for a decoder whose own are not counted
# (DecoderShape.elementwise_values 0): the counted HunyuanVideo decoder's 12792.4 values per
# decoded pixel-frame over its 1.716e7 FLOP (the lower of the two counted: Wan 2.1's is 22379.6
# over 8.48e6). A stated stand-in until bench_decodecounts counts the decoder.
STAND_IN_VALUES_PER_FLOP = 12792.4 / 1.716e7
# Live full-resolution activations at the decoder's peak (input, norm output, conv output, residual).
LIVE = 4
TEXT_ENCODER_PLACES = ("every-rank", "one-rank", "cpu")
# Width of the text embeddings broadcast (T5-XXL, umT5-XXL, HunyuanVideo's Llama: 4096).
TEXT_HIDDEN = 4096


# A model whose family declares no decoder (ModelSpec.decoder None: its VAE is not split and its
# decoder not counted, decoded replicated, on one rank's time): a Wan-2.1-like cost per pixel
# stands in for it.
UNCOUNTED = DecoderShape(2 * 4.24e6, 6320, 33.0, 0.0, 128, 4, parallel=False)


def decoder_shape(spec: ModelSpec) -> DecoderShape:
    """The decoder the family declared with the spec, or UNCOUNTED."""
    return spec.decoder if spec.decoder is not None else UNCOUNTED


@dataclass(frozen=True)
class DecodeCost:
    """One video's decode on `ranks` ranks: seconds (with parts) and peak GB per rank."""

    ranks: int
    compute: float  # the convolutions (and a mid-block attention)
    halo: float
    gather: float
    peak_gb: float
    elementwise: float = 0.0  # the other ops' memory traffic (module docstring: t_e)

    @property
    def seconds(self) -> float:
        return self.compute + self.elementwise + self.halo + self.gather

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "seconds": round(self.seconds, 4), "compute": round(self.compute, 4),
                "elementwise": round(self.elementwise, 4),
                "halo": round(self.halo, 4), "gather": round(self.gather, 4), "peak_gb": round(self.peak_gb, 2)}


def decode_ranks(spec: ModelSpec, geo: VideoGeometry, ranks: int) -> int:
    """Ranks the decode is split over: all of the replica's, where the family's VAE is split
    and every rank gets at least one latent row; else 1 (every rank decodes the whole video)."""
    if ranks < 1:
        raise ValueError(f"ranks {ranks} must be >= 1")
    if not decoder_shape(spec).parallel or geo.latent_height < ranks:
        return 1
    return ranks


def _spans(length: int, size: int, stride: int) -> list[int]:
    """Lengths of the slices [i, i + size) for i in range(0, length, stride) (diffusers' tiles)."""
    return [min(size, length - i) for i in range(0, length, stride)]


def _call_latent_frames(d: DecoderShape, latent_frames: int) -> list[int]:
    """Latent frames of each decoder call (diffusers' framewise decode, or one call)."""
    if d.call_frames and latent_frames > d.call_frames - 1:
        return _spans(latent_frames, d.call_frames, d.call_stride)
    return [latent_frames]


def decode_flops(spec: ModelSpec, geo: VideoGeometry, tiled: bool = False) -> float:
    """FLOP of one video's decode on one rank: flops_per_pixel per output pixel-frame the
    decoder calls produce (overlapping tiles and framewise calls counted as decoded), plus
    4 N^2 C per call where the decoder attends over a call's N latent tokens. `tiled`: the
    spatial tiling diffusers' enable_tiling() adds (families with a `tile`)."""
    pixels, attention = _decoded(spec, geo, tiled)
    return pixels * decoder_shape(spec).flops_per_pixel + attention


def decoded_pixel_frames(spec: ModelSpec, geo: VideoGeometry, tiled: bool = False) -> float:
    """Output pixel-frames the decoder calls produce for one video (overlapping tiles and
    framewise calls counted as decoded, frames the VAE drops included)."""
    return _decoded(spec, geo, tiled)[0]


def elementwise_values(spec: ModelSpec, geo: VideoGeometry, tiled: bool = False) -> float:
    """Values one video's decode moves outside its convolutions (DecoderShape.elementwise_values
    per decoded pixel-frame; uncounted: STAND_IN_VALUES_PER_FLOP x its FLOP per pixel-frame)."""
    d = decoder_shape(spec)
    per_pixel = d.elementwise_values or STAND_IN_VALUES_PER_FLOP * d.flops_per_pixel
    return decoded_pixel_frames(spec, geo, tiled) * per_pixel


def _decoded(spec: ModelSpec, geo: VideoGeometry, tiled: bool) -> tuple[float, float]:
    """(decoded pixel-frames, FLOP of the decoder's attention) of one video."""
    d = decoder_shape(spec)
    if not d.attention_channels and not d.call_frames and not (tiled and d.tile):
        return float((geo.frames + d.dropped_frames) * geo.height * geo.width), 0.0
    s, t = spec.vae_spatial, spec.vae_temporal
    lh, lw, lt = geo.latent_height, geo.latent_width, geo.latent_frames
    calls_t = _call_latent_frames(d, lt)
    if tiled and d.tile and (lh > d.tile or lw > d.tile):
        tiles = [(a, b) for a in _spans(lh, d.tile, d.tile_stride) for b in _spans(lw, d.tile, d.tile_stride)]
    else:
        tiles = [(lh, lw)]
    pixels = attention = 0.0
    for ft in calls_t:
        for th, tw in tiles:
            out_frames = 1 + t * (ft - 1)
            pixels += out_frames * th * s * tw * s
            attention += 4.0 * (ft * th * tw) ** 2 * d.attention_channels
    return pixels, attention


def decode_cost(spec: ModelSpec, geo: VideoGeometry, ranks: int, flops_per_s: float, link_gb_s: float,
                link_latency_us: float, *, tiled: bool = False, elementwise_gb_s: float = DEFAULT_ELEMENTWISE_GB_S,
                value_bytes: int | None = None) -> DecodeCost:
    """Predicted decode of one video on a replica of `ranks` ranks (module docstring);
    tiled: as diffusers' enable_tiling() decodes (decode_flops); `elementwise_gb_s`: the
    device's elementwise bandwidth (devicemodel.device_elementwise_gb_s); `value_bytes`: bytes per value the
    decode runs in (None: the run's, spec.bytes_per_param; 4: float32, TF32 convolutions)."""
    d = decoder_shape(spec)
    n = decode_ranks(spec, geo, ranks)
    e = spec.bytes_per_param
    e_dec = value_bytes if value_bytes is not None else e
    if e_dec not in (2, 4):
        raise ValueError(f"value_bytes {value_bytes!r} must be 2 (bf16 / fp16) or 4 (float32)")
    if not elementwise_gb_s > 0:
        raise ValueError(f"elementwise_gb_s {elementwise_gb_s!r} must be > 0")
    rows = geo.latent_height
    band = -(-rows // n)
    pixels = geo.frames * geo.height * geo.width
    conv_rate = flops_per_s * VAE_EFFICIENCY * (FLOAT32_CONV_SHARE if e_dec == 4 else 1.0)
    compute = decode_flops(spec, geo, tiled) / conv_rate * band / rows
    memory = elementwise_values(spec, geo, tiled) * e_dec / (elementwise_gb_s * GB) * band / rows
    a = link_latency_us * 1e-6
    bw = link_gb_s * GB
    halo = gather = 0.0
    if n > 1:
        calls = geo.latent_frames
        halo = (d.exchanges_per_latent_frame + d.norms_per_latent_frame) * calls * a \
            + 2 * geo.frames * geo.width * d.halo_values * e / bw
        # A mid-block attention gathers every band's keys and values (2 C per latent token of each call).
        halo += 2 * d.attention_channels * sum(_call_latent_frames(d, geo.latent_frames)) \
            * geo.latent_height * geo.latent_width * e * (n - 1) / n / bw
        gather = a + pixels * 3 * e * (n - 1) / n / bw
    return DecodeCost(n, compute, halo, gather, decode_peak_gb(spec, geo, ranks), memory)


def decode_activations_gb(spec: ModelSpec, geo: VideoGeometry, ranks: int) -> float:
    """The decoder's live activations at its peak on the largest band (M_dec without weights)."""
    d = decoder_shape(spec)
    n = decode_ranks(spec, geo, ranks)
    rows = geo.latent_height
    band = -(-rows // n)
    scale = geo.height // rows
    frames = d.frames_per_call or geo.frames
    return LIVE * d.top_channels * frames * (band * scale + 2) * geo.width * spec.bytes_per_param / GB


def decode_peak_gb(spec: ModelSpec, geo: VideoGeometry, ranks: int) -> float:
    """M_dec: activations on the largest band plus the VAE weights (module docstring)."""
    return decode_activations_gb(spec, geo, ranks) + spec.vae_params * spec.bytes_per_param / GB


def text_encoder_gb(spec: ModelSpec) -> float:
    return spec.text_encoder_params * spec.bytes_per_param / GB


def rank_memory_gb(spec: ModelSpec, denoise_gb: float, decode: DecodeCost | float, text_encoder: str,
                   holds_text_encoder: bool) -> float:
    """Peak GB of one rank: the denoising's (`denoise_gb`: every weight but the text encoder's,
    VAE included, plus the transformer's activations), or the decode's after it (the
    transformers' and adapters' weights plus M_dec; `decode` a DecodeCost or its peak_gb),
    whichever is larger, plus the text encoder where it lives (module docstring). The largest
    rank of a replica is the one holding the text encoder ("one-rank": its rank 0)."""
    if text_encoder not in TEXT_ENCODER_PLACES:
        raise ValueError(f"text_encoder {text_encoder!r} is not one of {', '.join(TEXT_ENCODER_PLACES)}")
    decode_gb = decode.peak_gb if isinstance(decode, DecodeCost) else float(decode)
    transformer_weights = (spec.params * spec.experts * spec.transformer_bytes_per_param + spec.adapter_bytes) / GB
    peak = max(denoise_gb, transformer_weights + decode_gb)
    here = text_encoder == "every-rank" or (text_encoder == "one-rank" and holds_text_encoder)
    return peak + (text_encoder_gb(spec) if here else 0.0)


def broadcast_seconds(spec: ModelSpec, prompts: int, ranks: int, link_gb_s: float, link_latency_us: float) -> float:
    """The embeddings of `prompts` prompts ([text_tokens, TEXT_HIDDEN] each) from the encoding
    rank to the replica's other `ranks - 1`: at most two hops (cfg group, then sp group), each
    a metadata message and the tensors."""
    if ranks <= 1:
        return 0.0
    nbytes = prompts * spec.text_tokens * TEXT_HIDDEN * spec.bytes_per_param
    return 2 * (2 * link_latency_us * 1e-6 + nbytes / (link_gb_s * GB))
