"""The VAE decode and the text encoder in the planner: time and memory per rank (pure Python).

The decode runs on every rank of a replica (raydit.models.vae_parallel): the latent rows are
cut into `ranks` bands (the first rows % ranks get one more row), each rank decodes its band
and exchanges halo rows with its neighbours at every convolution; the frames are gathered once
to rank 0. Per video, with n = ranks, H x W output pixels, F output frames, e bytes per value:

    compute   t_c = F H W m / P_vae x ceil(rows / n) / rows      (the largest band paces)
              m = FLOP per output pixel and frame of the family's decoder (2 x MACs, counted
              on diffusers' decoders with real configs: DECODERS below), P_vae = P x VAE_EFFICIENCY
    halo      t_h = [n > 1] (x a + 2 F W h e / B)                 (both neighbours at once)
              x = halo exchanges (one per convolution taller than one row, per call of the
              decoder), h = halo values per output frame and output column (DECODERS)
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

from raydit.planner.model import ModelSpec, VideoGeometry

GB = 1e9
# Fraction of the device's DiT rate (DeviceType.flops_per_second) a VAE decoder reaches: a
# fit on one published decode (bench/bench_costmodel.py, role "fit"): SGLang's HunyuanVideo
# 77 x 480 x 848 decode, 5.71 s on one H200 before its parallel decode (FIELD.md), decoded
# framewise and tiled as SGLang's video pipelines do: decode_flops = 1.235e15 FLOP, / 5.71 s
# / (989e12 x 0.31, H200) = 0.706. Its check, TensorRT-LLM's Wan 2.2 720p decode (2.72 s on
# one B200), misses at this value: -77% (docs/benchmarks/costmodel.json). Not the decoders'
# shapes: on one CPU thread (fp32, random weights, diffusers' default configs, 3 x 8 x 8
# latents -> 9 x 64 x 64, FLOP by torch.utils.flop_counter, 2 rounds, load ~4) Wan 2.1's
# decoder reached 61-62 GFLOP/s against HunyuanVideo's 75-76 (0.81x), far from the 0.23x the
# check implies. The B200 rate it is predicted at is fit on TensorRT-LLM's own denoising time
# (0.63 of the BF16 peak against H100's 0.285): if that run used FP8 kernels the rate is
# overstated about 2x; that, B200's conv kernels, or what the published decode time includes
# is the miss, and none of them is measurable here.
VAE_EFFICIENCY = 0.71
# Live full-resolution activations at the decoder's peak (input, norm output, conv output, residual).
LIVE = 4
TEXT_ENCODER_PLACES = ("every-rank", "one-rank", "cpu")
# Width of the text embeddings broadcast (T5-XXL, umT5-XXL, HunyuanVideo's Llama: 4096).
TEXT_HIDDEN = 4096


@dataclass(frozen=True)
class DecoderShape:
    """What the cost model needs of one family's VAE decoder (counted by forward hooks on
    diffusers' decoder with the real config: MACs and halo values per output pixel)."""

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


# CogVideoX (AutoencoderKLCogVideoX, 13 latent frames -> 49): 9.30e6 MAC per output pixel-frame,
# 8291 halo values per output frame and column, 18.9 exchanges and 17.1 group norms per latent frame.
# Wan 2.1 (AutoencoderKLWan, base 96, 21 -> 81 frames): 4.24e6 MAC, 6320 halo values, 33 exchanges,
# no group norm (RMS norm over channels).
DECODERS = {
    "cogvideox": DecoderShape(2 * 9.30e6, 8291, 18.9, 17.1, 128, 8),
    "wan": DecoderShape(2 * 4.24e6, 6320, 33.0, 0.0, 96, 4),
}
DECODERS["skyreels"] = DECODERS["wan"]  # SkyReels-V2 decodes with Wan 2.1's VAE (AutoencoderKLWan)
# Wan 2.2's 16x VAE (TI2V-5B: decoder base 256 at half resolution, patch 2; 5 -> 17 frames):
# 9.33e6 MAC per output pixel-frame, 8934 halo values, 33 exchanges per latent frame; its 256
# channels at half resolution hold as much as 64 at full resolution.
WAN_16X = DecoderShape(2 * 9.33e6, 8934, 33.0, 0.0, 64, 4)
# HunyuanVideo (AutoencoderKLHunyuanVideo, diffusers' default config = HunyuanVideo's: blocks
# 128/256/512/512, 2 layers each, mid-block attention), counted with torch.utils.flop_counter
# on the decoder built on the meta device (a throwaway script: `FlopCounterMode` around
# `vae.decoder(torch.randn(1, 16, T, h, w, device="meta"))`, T x h x w = 3x8x8, 5x32x32,
# 9x32x32 latents): 9x32x32 (33 x 256 x 256 out) 3.711e13 FLOP in convolutions + 1.9e10 in
# linear layers, 1.716e7 FLOP per output pixel-frame (5x32x32: 1.754e7 incl. attention;
# 3x8x8: 1.808e7, edges weigh more), plus the mid block's one-head attention over the call's
# latent tokens, 4 N^2 x 512 FLOP (1.74e11 at N = 9216: the bmm count). diffusers decodes it
# framewise (5 latent frames a call, stride 3) and, with enable_tiling() (the official
# repository, xDiT and SGLang tile), in 32 x 32 latent tiles at stride 24. raydit splits it by
# rows (issue 18). Halo counts by forward pre-hooks on the same meta-device decoder (5 x 32 x 32
# latents, one call of 17 frames: 35 convolutions with a 1-row halo, 30 group norms; 2342 halo
# values per output frame and column): per latent frame of the framewise decode (stride 3,
# each output frame decoded 17/12 times) 3318 values, 11.7 exchanges, 10 norms.
HUNYUAN = DecoderShape(1.716e7, 3318, 11.7, 10.0, 128, 17, attention_channels=512,
                       call_frames=5, call_stride=3, tile=32, tile_stride=24)
DECODERS["hunyuanvideo"] = HUNYUAN
# HunyuanVideo 1.5 (AutoencoderKLHunyuanVideo15, default config: 16x, blocks 128 ... 1024, RMS
# norms), counted the same way on 5 x 16 x 16 latents (17 x 256 x 256 out): 2.535e7 FLOP per
# output pixel-frame in convolutions, plus its mid block's one-head attention over every latent
# token of the video at 1024 channels (6.7e9 = 4 N^2 C, N = 1280); 3370 halo values per output
# frame and column, 8 exchanges per latent frame, no group norm. diffusers decodes the whole
# video in one call (no framewise decode).
HUNYUAN15 = DecoderShape(2.535e7, 3370, 8.0, 0.0, 128, 0, attention_channels=1024)
DECODERS["hunyuanvideo15"] = HUNYUAN15
# LTX-Video (AutoencoderKLLTXVideo, default config = 0.9.0's: decoder 512 ... 128 channels,
# patch 4), 5 x 16 x 16 latents (33 x 512 x 512 out): 8.92e5 FLOP per output pixel-frame
# (3 x 8 x 8: 9.17e5), 590 halo values per output frame and column, 8.6 exchanges per latent
# frame, RMS norms only; its 128 channels at a quarter of the resolution hold as much as 8 at
# full resolution; the whole video in one call.
LTX = DecoderShape(2 * 4.46e5, 590, 8.6, 0.0, 8, 0)
DECODERS["ltx"] = LTX
# Mochi 1 (AutoencoderKLMochi(), diffusers' default config = its conversion script's: decoder 768
# ... 128 channels, replicate-padded causal convolutions, per-frame group norms, no attention),
# counted the same way on the meta device: 1.5805e7 FLOP per decoded output pixel-frame (4 x 16 x
# 16 and 8 x 16 x 16 latents alike); the decoder makes 6 T frames for T latent frames, of which
# the VAE drops the first 5 (`dropped_frames`); 4670 halo values per decoded frame and column (5 x
# 16 x 16); 38 convolutions with a 1-row halo per call (9.5 per latent frame at the pipeline's 19
# frames: 4 latent frames) and 16.4 group-norm calls per latent frame (each norm runs per 8
# frames); the whole video in one call at 128 channels at full resolution. raydit splits it by
# rows (issue 34).
DECODERS["mochi"] = DecoderShape(1.5805e7, 4670, 9.5, 16.4, 128, 0, dropped_frames=5)
# Kandinsky 5 decodes with HunyuanVideo's VAE (AutoencoderKLHunyuanVideo), split by rows as
# HunyuanVideo's is (its family decodes by rows): priced as that decoder, split.
DECODERS["kandinsky5"] = HUNYUAN
# LTX-2's video VAE (AutoencoderKLLTX2Video, diffusers' default config = LTX-2's), counted with
# torch.utils.flop_counter on the meta device, 3 x 8 x 8 latents (17 x 256 x 256 out): 1.5030e12
# FLOP, 1.349e6 per output pixel-frame (LTX-Video's decoder, the same way: 9.17e5). raydit runs it
# whole on one rank (the family does not split it), so it is priced whole, not split; the other
# figures (halo, memory) stay the stand-in's (_OTHER below): not counted for LTX-2.
DECODERS["ltx2"] = DecoderShape(1.349e6, 6320, 33.0, 0.0, 128, 4, parallel=False)
# Families whose VAE raydit does not split and whose decoder is not counted (decoded
# replicated, on one rank's time): a Wan-2.1-like cost per pixel stands in for their decoder.
_OTHER = DecoderShape(2 * 4.24e6, 6320, 33.0, 0.0, 128, 4, parallel=False)


def decoder_shape(spec: ModelSpec) -> DecoderShape:
    if spec.family == "wan" and spec.vae_spatial == 16:
        return WAN_16X
    return DECODERS.get(spec.family, _OTHER)


@dataclass(frozen=True)
class DecodeCost:
    """One video's decode on `ranks` ranks: seconds (with parts) and peak GB per rank."""

    ranks: int
    compute: float
    halo: float
    gather: float
    peak_gb: float

    @property
    def seconds(self) -> float:
        return self.compute + self.halo + self.gather

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "seconds": round(self.seconds, 4), "compute": round(self.compute, 4),
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
    d = decoder_shape(spec)
    if not d.attention_channels and not d.call_frames and not (tiled and d.tile):
        return (geo.frames + d.dropped_frames) * geo.height * geo.width * d.flops_per_pixel
    s, t = spec.vae_spatial, spec.vae_temporal
    lh, lw, lt = geo.latent_height, geo.latent_width, geo.latent_frames
    calls_t = _call_latent_frames(d, lt)
    if tiled and d.tile and (lh > d.tile or lw > d.tile):
        tiles = [(a, b) for a in _spans(lh, d.tile, d.tile_stride) for b in _spans(lw, d.tile, d.tile_stride)]
    else:
        tiles = [(lh, lw)]
    total = 0.0
    for ft in calls_t:
        for th, tw in tiles:
            out_frames = 1 + t * (ft - 1)
            total += out_frames * th * s * tw * s * d.flops_per_pixel
            total += 4.0 * (ft * th * tw) ** 2 * d.attention_channels
    return total


def decode_cost(spec: ModelSpec, geo: VideoGeometry, ranks: int, flops_per_s: float, link_gb_s: float,
                link_latency_us: float, *, tiled: bool = False) -> DecodeCost:
    """Predicted decode of one video on a replica of `ranks` ranks (module docstring);
    tiled: as diffusers' enable_tiling() decodes (decode_flops)."""
    d = decoder_shape(spec)
    n = decode_ranks(spec, geo, ranks)
    e = spec.bytes_per_param
    rows = geo.latent_height
    band = -(-rows // n)
    pixels = geo.frames * geo.height * geo.width
    compute = decode_flops(spec, geo, tiled) / (flops_per_s * VAE_EFFICIENCY) * band / rows
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
    return DecodeCost(n, compute, halo, gather, decode_peak_gb(spec, geo, ranks))


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
    transformer_weights = (spec.params * spec.experts * spec.bytes_per_param + spec.adapter_bytes) / GB
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
