r"""Cost and memory model of one denoising step for one sequence-parallel layout.

Notation (all per denoising step, per rank):

    T, V   text tokens in the attention sequence, video tokens
    X      text tokens only cross-attended (Wan, LTX); 0 for CogVideoX
    U, R   ulysses degree, ring degree;  sp = U * R
    T' = ceil(T / sp) * sp,  V' = ceil(V / sp) * sp,  S' = T' + V'   (docs/design.md padding)
    s  = S' / sp                        local tokens on each rank
    b  = samples one group carries: the step's guidance branches / C (C: the cfg degree, the
         branch degree: 2 classifier-free branches on cfg 1 make b 2; LTX-2's 4 on cfg 2: 2)
    h  = heads * head_dim,  f = FFN width,  L = layers,  e = bytes per activation sent
         (2: bf16 on GPUs; 4: float32 on CPU slots)
    P  = achievable FLOP/s of the slowest device in the group (peak x efficiency); P_a: the
         same for the attention kernel where calibration measured it apart (`raydit doctor
         --calibrate`: the linear part of a DiT block and the attention kernel, timed
         separately), else P_a = P
    B, a   link bandwidth (bytes/s, one direction) and latency of the link a collective uses
    La     audio tokens (LTX-2: round(frames / 24 fps x 25 a second); 0 for every other family),
           not in S': whole on every rank, or split over the sp ranks where that is cheaper
           (below);  La' = ceil(La / sp) sp,  a = La' / sp where split (La where whole);
           H_a, h_a = H_a x audio head_dim, f_a: the audio stream's heads, width and FFN width;
           V: the video tokens, unpadded

Compute (padding included: pad queries are computed and dropped, pad keys are masked but
still go through the kernel):

    linear   F_lin = 2 b s L (4 h^2 + 2 h f)  [+ 2 b s L 2h^2 + 2 b X L 2h^2 with cross-attention]
    attention: after the Ulysses all-to-all a rank holds h/U of the channels of S'/R queries
             and meets the S' keys in R ring steps of S'/R keys each:
             F_blk = 4 b (S'/R)^2 (h/U)     per ring step and layer (QK^T and PV, 2 FLOP/MAC),
             at P_a
    cross    F_x   = 4 b s X h L
    audio    LTX-2's audio stream runs in every block beside the video (the text reaches it at
             width h_a), at the linear rate:
             F_aud = 2 b La L (10 h_a^2 + 2 h_a f_a) + 2 b X L 2 h_a^2 + 4 b La (La + X + V) h_a L
                     whole on every rank, the same at any sp: audio self-attention q k v out,
                     prompt q out, audio->video k v and video->audio q out (10 GEMMs h_a x h_a),
                     the FFN; the prompt's audio K/V; attention of the La audio queries over the
                     La audio, X text and all V video keys (video->audio, after the gather below)
             F_av  = 2 b s L 4 h h_a + 4 b s La h_a L
                     the video side, split with the video: audio->video q (h -> h_a) and out
                     (h_a -> h), video->audio k and v (h -> h_a) of the s local tokens; their
                     audio->video attention over the La audio keys
             Split audio: F_aud's per-token terms run on the rank's a tokens (La -> a in the
             GEMMs, a queries over La' + X + V keys); the prompt's audio K/V stays whole.

Kernel efficiency at small shards: a GEMM or attention kernel with m rows reaches
m / (m + m0) of its large-size rate (m0 = SMALL_SHARD_ROWS on GPUs, 0 for CPU slots);
m = b s for the linear layers, m = b (S'/R) (h/U) / head_dim (rows x heads) for attention.
Wave quantization (GPUs; CPU slots: none): a kernel launches its output tiles as thread
blocks, at most one wave of W = WAVE_SLOTS at a time (one per SM: 132 on H100/H200 SXM), and
its last wave runs as long as a full one, so n tiles reach n / (ceil(n / W) W) of the rate:

    attention  n = ceil((S'/R) / 128) x heads / U x b   (FlashAttention-2/3's forward: one
               block of 128 query rows per head and batch; the keys are looped inside it)
    linear     n = ceil(b s / 128) x ceil(N / 256)     per GEMM of output width N (q, k, v
               and the out projection: h each, the FFN: f and h), a 128 x 256 tile (cuBLAS /
               CUTLASS's large bf16 tile on Hopper)

Sharding shrinks n: HunyuanVideo at 720p on 8 ranks (Ulysses 8: 3 heads, 14.9k rows) loses
4% of its attention rate to the tail wave against 0.5% on one GPU.
The audio terms take the same rules: GEMMs of F_av and the prompt's audio K/V as the linear
layers (m = b s, b X); the audio kernels as attention (H_a heads, ceil(rows / 128) x H_a x b
tiles; rows La for F_aud, s for F_av). The GEMMs of the La audio rows take the shard efficiency
alone (m = b La): a GEMM of one or a few row tiles splits its K loop over the idle SMs (cuBLAS's
split-K / stream-K), which the 128 x 256 tail-wave rule does not describe: it would give LTX-2's
126 x 2048 x 2048 q projection 8 tiles for 132 SMs, 93 us on an H100, where reading its 8 MB of
weights takes 2.5 us.

Communication:

    Ulysses: q, k, v in and the output back, per attention layer. Each moves the rank's
             b s h e bytes, of which (U-1)/U leave the rank, to U-1 peers:
             t_x = (U-1) a_intra + b s h e (U-1)/U / B_intra      one tensor's exchange
             The exchange is pipelined in n = min(ULYSSES_HEAD_CHUNKS, heads / U) head
             chunks (raydit.parallel.attention): the first chunk's q, k, v and the last
             chunk's output are exposed, the rest hides behind the attention of the other
             chunks where the link overlaps compute:
             t_a2a = 4 t_x / n + max(0, 4 t_x (n-1)/n - t_att) + (k-1) min(t_att, 4 t_x (n-1)/n)
             (t_att = t_ring below: one layer's attention, ring included; k as for the ring)
             A CPU slot's link (shm) does not overlap: gloo copies on the rank's own core,
             so there t_a2a = 4 t_x.
    PCIe:    GPUs of a PCIe node share the host's lanes: when `active` devices of the
             replica communicate at once, each gets B x min(1, PCIE_FULL_RATE_GPUS / active).
    Ring:    R-1 exchanges of one K and one V block, 2 b (S'/R) (h/U) e bytes, overlapped with
             the block in flight:  t_kv = a_ring + 2 b (S'/R)(h/U) e / B_ring
             t_ring = t_blk + (R-1) (max(k t_blk, t_kv) + o),   t_blk = F_blk / P
             k = RING_OVERLAP_SLOWDOWN (1.1): the send/recv kernels take SMs from the
             attention kernel while they overlap; o = RING_STEP_OVERHEAD_S, a fixed cost
             per ring step (kernel launches, log-sum-exp merge of the partial output).
             Together they are why Ulysses wins inside a fast node when the all-to-all
             is cheap, and ring wins where links are slow.
             B_ring is the network when the ring group spans nodes, else the node's link.
             On a CPU slot's link (shm) nothing overlaps: each step costs t_blk + t_kv + o.
    Audio:   video->audio attention needs every video key: per layer the rank's K and V chunks
             (b V'/sp tokens x h_a each) are all-gathered over the sp group, then attended; nothing
             overlaps it:  t_av = 2 ((sp-1) a + b V' h_a e (sp-1)/sp / B)   (sp > 1; B, a: the ring
             link where R > 1, else the node's)
             Split audio adds, per layer, its self-attention's exchanges (Ulysses: q, k, v and
             the output, 4 (U-1) a_intra + 4 b a h_a e (U-1)/U / B_intra; ring: R-1 K/V blocks of
             2 b (La'/R)(h_a/U) e bytes and o each, nothing hidden: the audio kernels are tiny)
             and audio->video attention's all-gather of the audio K and V (as t_av with La' for
             V'); and once a step the gather of the audio stream after the last block. The plan
             splits the audio where this total is below the whole stream's; `audio_split_tokens`
             is the length from which it is, for the plan's layout and video (the runtime
             splits a request's audio from that length on).
    Edges:   once per step the split/gather of the transformer input/output across sp
             (b V' c e bytes, c = latent channels x patch volume) and, with cfg C > 1, the
             all-gather of the predictions over the C groups (each rank receives C - 1 of
             that size).

Step time of one replica:

    t_step = L (F_lin/L + F_x/L) / P + (F_aud + F_av) / P + L (t_a2a + t_ring + t_av) + t_edges

A video end to end (the steps, the text encoding and the VAE decode around them) is priced
in raydit.planner.endtoend.

A replica (cfg groups of sp ranks) finishes one step of one request in t_step: cfg C divides
b by C, so each group does 1/C of the work, at the price of the edge exchange. Replicas
serve separate requests: throughput = sum over replicas of 1 / t_step; latency is not
changed by them.

Memory of a replica's largest rank, its rank 0 (no weight sharding under sequence
parallelism: every rank holds the transformers and the VAE; the text encoder lives on rank 0
alone, which encodes the prompts and broadcasts the embeddings):

    M = max(W + A, W_t + M_dec) + W_text + reserve
    A = e b s (10 h + f) + [R > 1] 4 b (S'/R) (h/U) e + e b La (10 h_a + f_a) + [La > 0] 2 e b V' h_a
        W: transformer(s), adapters and VAE weights; W_t: W without the VAE; A: 10 h:
        residual, norm output, q, k, v, attention output, two all-to-all buffers and slack;
        f: the FFN intermediate; the ring term: current and next K/V block. M_dec: the VAE
        weights and the decoder's peak activations on the rank's band of latent rows, the
        decode split over the replica's C x U x R ranks (raydit.planner.decode). The audio
        terms: the whole audio stream's activations, counted as the video's, and the gathered
        video K and V of video->audio attention. W_text: the text encoder. reserve: CUDA
        context, workspaces, fragmentation (1.5 GB on GPUs, 0.5 GB for a CPU slot).
        Flash-style attention: no S x S matrix.

A model's own rates (`fit_model_rates`, from `raydit doctor --calibrate --model`): one
measured step on one device (U = R = 1) is split into L x the self-attention kernel timed at
the model's shape, and the rest; P_lin = F_lin-work / rest and P_a = F_blk-work / kernel
time (`step_work`: the FLOP over the shard and wave efficiencies above), so the formulas give
that step back and carry it to other requests and layouts. The rest holds what the generic
figures leave out: norms, modulation and rotary embeddings in the model's own dtypes,
embeddings, the scheduler. Measured on one H200 (bench_gpu): Wan-1.3B-shaped, timed at
41x480x832, predicted the 81x480x832 step within 2%; the device's generic figures, -17%.

Which published figures set constants (fits) and which only check them:
bench/bench_costmodel.py lists each anchor with its role. The efficiencies in hardware.py
are fits on one-GPU CogVideoX figures (A100, H100, L40); PCIE_FULL_RATE_GPUS is a fit on
xDiT's CogVideoX1.5 8 x L40 speedup; decode.VAE_EFFICIENCY is a fit on SGLang's one-H200
HunyuanVideo decode. WAVE_SLOTS and the tiles are hardware facts, not fits; so is the
head-dim-128 attention rate on Hopper (hardware.HOPPER_HEAD_DIM_128_SPEEDUP: FlashAttention-2's
published 370 / 299 TFLOP/s at head dim 128 / 64 on an H100). Everything else
(HunyuanVideo and Open-Sora 2.0 on 1-8 H100, Wan 2.1 I2V on 1 and 8 H100, TensorRT-LLM's
Wan 2.2 decode) checks. The model ranks layouts; absolute times are as good as those checks
show.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from raydit.planner.decode import decode_peak_gb, rank_memory_gb
from raydit.planner.model import ModelSpec, VideoGeometry

ACT_BYTES = 2
GB = 1e9
RING_STEP_OVERHEAD_S = 20e-6
RING_OVERLAP_SLOWDOWN = 1.1
# raydit.parallel.attention.DEFAULT_HEAD_CHUNKS (the planner imports no torch).
ULYSSES_HEAD_CHUNKS = 4
# Rows at which a GPU kernel reaches half its large-size rate (a few tiles per SM).
SMALL_SHARD_ROWS = 64
# Devices of a PCIe node that communicate at the full link rate at once (two per switch).
PCIE_FULL_RATE_GPUS = 2
# Thread blocks a GPU runs at once in one wave of a large kernel (one per SM: H100/H200 SXM
# 132; A100 108 and L40 142 are near it) and the tiles the waves are made of.
WAVE_SLOTS = 132
ATTENTION_TILE_ROWS = 128
GEMM_TILE = (128, 256)


def ceil_to(n: int, k: int) -> int:
    """Smallest multiple of k that is >= n."""
    return -(-n // k) * k


def padded_parts(geo: VideoGeometry, sp: int) -> tuple[int, int]:
    """(T', V'): text and video token counts, each padded to a multiple of sp."""
    return ceil_to(geo.text_tokens, sp), ceil_to(geo.video_tokens, sp)


def pad_tokens(geo: VideoGeometry, sp: int) -> int:
    text, video = padded_parts(geo, sp)
    return text + video - geo.sequence_tokens


def split_kind(geo: VideoGeometry, sp: int) -> str:
    """How the video part is cut: whole latent frames, whole latent rows, or bare tokens."""
    if geo.token_frames % sp == 0:
        return "frames"
    if (geo.token_frames * geo.token_rows) % sp == 0:
        return "rows"
    return "tokens"


SPLIT_ORDER = {"frames": 0, "rows": 1, "tokens": 2}


def batch_per_group(branches: int, cfg: int) -> int:
    """Samples one sequence-parallel group carries through the transformer per step: its share
    of the step's `branches` guidance branches (1: guidance off) over `cfg` groups."""
    if branches < 1 or cfg < 1 or (branches > 1 and branches % cfg):
        raise ValueError(f"cfg {cfg} does not share {branches} guidance branches evenly")
    return max(1, branches // cfg)


def memory_gb(spec: ModelSpec, geo: VideoGeometry, ulysses: int, ring: int, batch: int,
              reserve_gb: float, decode_ranks: int | None = None) -> float:
    """Peak memory of the replica's largest rank in GB (formula in the module docstring);
    decode_ranks: the ranks the VAE decode is split over (default ulysses x ring; x cfg)."""
    sp = ulysses * ring
    text, video = padded_parts(geo, sp)
    seq = text + video
    s = seq // sp
    h, f = spec.hidden, spec.ffn_hidden
    act = ACT_BYTES * batch * s * (10 * h + f)
    if ring > 1:
        act += 4 * batch * (seq // ring) * (h // ulysses) * ACT_BYTES
    if spec.audio_hidden and geo.audio_tokens:
        # The whole audio stream, and video->audio attention's gathered video K and V.
        h_a = spec.audio_hidden
        act += ACT_BYTES * batch * geo.audio_tokens * (10 * h_a + spec.audio_ffn_hidden)
        act += 2 * ACT_BYTES * batch * video * h_a
    denoise_gb = (spec.weight_bytes - spec.text_encoder_params * spec.bytes_per_param + act) / GB
    ranks = sp if decode_ranks is None else decode_ranks
    return rank_memory_gb(spec, denoise_gb, decode_peak_gb(spec, geo, ranks), "one-rank",
                          holds_text_encoder=True) + reserve_gb


@dataclass(frozen=True)
class Link:
    """Bandwidth in GB/s (one direction), latency in microseconds, and the kind: "nvlink",
    "pcie" (shared host lanes), "shm" (CPU slots: copies on the rank's own core, no overlap)
    or "network". `via`: the node link a network link's traffic also crosses on its way to the
    NIC (a PCIe node's shared lanes, shared by at most `via_sharers` of the devices; `through`)."""

    gb_s: float
    latency_us: float
    kind: str = "nvlink"
    via: "Link | None" = None
    via_sharers: int = 0

    def seconds(self, nbytes: float, hops: int = 1) -> float:
        return hops * self.latency_us * 1e-6 + nbytes / (self.gb_s * GB)

    @property
    def overlaps(self) -> bool:
        """Whether a transfer on this link runs beside compute (False: it takes the core)."""
        return self.kind != "shm"

    def shared_by(self, active: int) -> "Link":
        """The link as each of `active` devices communicating at once sees it: a PCIe link's
        lanes are shared; traffic leaving through a PCIe node (`via`) gets no more than them."""
        if self.via is not None:
            lanes = self.via.shared_by(min(active, self.via_sharers))
            return Link(min(self.gb_s, lanes.gb_s), self.latency_us, self.kind)
        if self.kind == "pcie" and active > PCIE_FULL_RATE_GPUS:
            return Link(self.gb_s * PCIE_FULL_RATE_GPUS / active, self.latency_us, self.kind)
        return self

    def through(self, node: "Link", sharers: int) -> "Link":
        """This (network) link as seen from a node whose GPUs reach the NIC over `node`, `sharers`
        of them at once: a PCIe node's lanes carry the traffic too (an NVLink node's GPUs have
        their own NIC paths)."""
        return replace(self, via=node, via_sharers=max(1, sharers)) if node.kind == "pcie" else self


@dataclass(frozen=True)
class StepCost:
    """One replica's predicted step, seconds, with its parts."""

    compute: float  # linear layers + cross-attention + attention blocks not hidden by comm
    all_to_all: float
    ring_exposed: float  # ring K/V transfer time not hidden behind compute
    edges: float  # split/gather and the CFG exchange
    total: float
    audio_compute: float = 0.0  # of `compute`: LTX-2's audio stream, (F_aud + F_av) / P
    audio_whole: float = 0.0  # of `audio_compute`: F_aud / P, the part every rank repeats at any sp
    audio_gather: float = 0.0  # video->audio attention's all-gather of the video K/V, L t_av
    audio_split: bool = False  # the audio tokens are split over the sp ranks (else whole on each)
    audio_exchange: float = 0.0  # what splitting them adds: their attention's exchanges and gathers

    def to_dict(self) -> dict:
        return {k: round(v, 6) for k, v in self.__dict__.items()}


def shard_efficiency(rows: float, small_rows: float) -> float:
    """Fraction of its large-size rate a kernel with `rows` rows reaches (module docstring)."""
    return rows / (rows + small_rows) if small_rows > 0 else 1.0


def wave_efficiency(tiles: float, slots: int) -> float:
    """Fraction of its rate a kernel of `tiles` thread blocks reaches on `slots` at once: the
    last, partial wave takes as long as a full one (module docstring). slots 0: 1.0."""
    if slots <= 0 or tiles <= 0:
        return 1.0
    return tiles / (-(-tiles // slots) * slots)


def _gemm_tiles(rows: float, width: float) -> float:
    return -(-rows // GEMM_TILE[0]) * -(-width // GEMM_TILE[1])


def audio_work(spec: ModelSpec, geo: VideoGeometry, ulysses: int, ring: int, batch: int,
               small_rows: float = SMALL_SHARD_ROWS, wave_slots: int = WAVE_SLOTS,
               audio_split: bool = False) -> tuple[float, float]:
    """(whole, split) work of the audio stream in one step on one rank, FLOP divided by the
    shard and wave efficiencies (module docstring): whole, F_aud, is the same on every rank at
    any sp (the audio tokens are not split); split, F_av, the video side of the audio<->video
    attention, shrinks with the rank's video tokens. audio_split: the audio tokens are split
    too; then whole is the prompt's audio K/V alone and F_aud's per-token terms join split.
    (0, 0) without an audio stream."""
    h_a, La = spec.audio_hidden, geo.audio_tokens
    if not (h_a and La):
        return 0.0, 0.0
    sp = ulysses * ring
    keys = La
    if audio_split and sp > 1:
        keys = -(-La // sp) * sp  # La': padded; pad keys go through the kernel
        La = keys // sp  # this rank's audio queries
    text, video = padded_parts(geo, sp)
    s = (text + video) // sp
    h, f_a, H_a, L = spec.hidden, spec.audio_ffn_hidden, spec.audio_heads, spec.layers
    X, V, b = geo.cross_text_tokens, geo.video_tokens, batch

    def kernel_eff(rows: int) -> float:  # an attention kernel of `rows` queries per head
        tiles = -(-rows // ATTENTION_TILE_ROWS) * H_a * b
        return shard_efficiency(b * rows * H_a, small_rows) * wave_efficiency(tiles, wave_slots)

    def gemm_eff(rows: int, width: int) -> float:  # the linear layers' rule
        return shard_efficiency(rows, small_rows) * wave_efficiency(_gemm_tiles(rows, width), wave_slots)

    m_a = b * La
    gemms = 2 * m_a * L * (10 * h_a * h_a + 2 * h_a * f_a) / shard_efficiency(m_a, small_rows)
    prompt = 2 * b * X * L * 2 * h_a * h_a / gemm_eff(b * X, h_a) if X else 0.0
    attention = 4 * m_a * (keys + X + V) * h_a * L / kernel_eff(La)

    m = b * s
    split = 2 * m * L * (3 * h * h_a / gemm_eff(m, h_a) + h_a * h / gemm_eff(m, h))
    split += 4 * m * keys * h_a * L / kernel_eff(s)
    if audio_split and sp > 1:
        return prompt, split + gemms + attention
    return gemms + prompt + attention, split


def step_work(spec: ModelSpec, geo: VideoGeometry, ulysses: int, ring: int, batch: int,
              small_rows: float = SMALL_SHARD_ROWS, wave_slots: int = WAVE_SLOTS,
              audio_split: bool = False) -> tuple[float, float]:
    """(linear, attention block) work of one step on one rank, in FLOP divided by the shard
    and wave efficiencies (module docstring): seconds = work / FLOP/s of the part's rate.
    linear: every layer's GEMMs and cross-attention, and the audio stream (`audio_work`);
    attention block: one layer's one ring step, F_blk, at the kernel's rate."""
    sp = ulysses * ring
    text, video = padded_parts(geo, sp)
    seq = text + video
    s = seq // sp
    h, f, L, X, b = spec.hidden, spec.ffn_hidden, spec.layers, geo.cross_text_tokens, batch

    m = b * s
    # Each GEMM's FLOP over its wave efficiency (q, k, v, out: width h; FFN: f, then h).
    wave = lambda width: wave_efficiency(_gemm_tiles(m, width), wave_slots)  # noqa: E731
    lin_time_flops = 2 * m * L * (4 * h * h / wave(h) + h * f / wave(f) + h * f / wave(h))
    if X:
        lin_time_flops += (2 * m * L * 2 * h * h + 4 * m * X * h * L) / wave(h)
        lin_time_flops += 2 * b * X * L * 2 * h * h / wave_efficiency(_gemm_tiles(b * X, h), wave_slots)
    linear = lin_time_flops / shard_efficiency(m, small_rows) + sum(
        audio_work(spec, geo, ulysses, ring, batch, small_rows, wave_slots, audio_split))

    block = seq // ring
    heads_here = spec.heads / ulysses
    attn_tiles = -(-block // ATTENTION_TILE_ROWS) * max(1, spec.heads // ulysses) * b
    attn_eff = shard_efficiency(b * block * heads_here, small_rows) * wave_efficiency(attn_tiles, wave_slots)
    return linear, 4 * b * block * block * (h / ulysses) / attn_eff


# The longest audio stream `audio_split_tokens` looks at: 20 minutes of LTX-2's sound.
AUDIO_SPLIT_SEARCH_TOKENS = 1 << 15


def can_split_audio(spec: ModelSpec, geo: VideoGeometry, ulysses: int, ring: int) -> bool:
    """Whether a layout could split the audio tokens: an audio stream, sp > 1, and a Ulysses
    degree that divides the audio heads too."""
    return bool(spec.audio_hidden and geo.audio_tokens and ulysses * ring > 1 and spec.audio_heads % ulysses == 0)


def step_cost(spec: ModelSpec, geo: VideoGeometry, ulysses: int, ring: int, cfg: int, batch: int,
              flops_per_s: float, intra: Link, ring_link: Link, edge_link: Link,
              small_rows: float = SMALL_SHARD_ROWS, head_chunks: int = ULYSSES_HEAD_CHUNKS,
              wave_slots: int = WAVE_SLOTS, attn_flops_per_s: float | None = None,
              act_bytes: int = ACT_BYTES, audio_split: bool | None = None) -> StepCost:
    """Predicted time of one denoising step on one replica (formula in the module docstring).

    attn_flops_per_s: the attention kernel's rate where it was measured apart from the rest
    (DeviceType.attention_flops_per_second); default `flops_per_s`. act_bytes: bytes per
    activation element on the links (DeviceType.activation_bytes).
    head_chunks: the Ulysses pipeline depth (1: no overlap, as in systems whose all-to-all
    is synchronous). wave_slots: thread blocks per wave (0: no wave quantization, CPU slots).
    audio_split: split the audio tokens (True), keep them whole (False), or the cheaper (None).
    """
    args = (spec, geo, ulysses, ring, cfg, batch, flops_per_s, intra, ring_link, edge_link, small_rows, head_chunks,
            wave_slots, attn_flops_per_s, act_bytes)
    if not can_split_audio(spec, geo, ulysses, ring):
        return _step_cost(*args, False)
    if audio_split is not None:
        return _step_cost(*args, audio_split)
    whole, split = _step_cost(*args, False), _step_cost(*args, True)
    return split if split.total < whole.total else whole


def audio_split_tokens(spec: ModelSpec, geo: VideoGeometry, ulysses: int, ring: int, cfg: int, batch: int,
                       flops_per_s: float, intra: Link, ring_link: Link, edge_link: Link, **rates) -> int | None:
    """The fewest audio tokens from which splitting them over the sp ranks makes `step_cost`'s
    step shorter than keeping them whole, for this layout and the geometry's video; None where
    no length up to AUDIO_SPLIT_SEARCH_TOKENS does (or the layout cannot split them). Splitting
    saves work in proportion to the audio and adds exchanges whose latency it does not shrink, so
    it pays from a length on: found by bisection between a length where it does not pay and one
    where it does. Near the crossover the two predictions are jagged (the kernels' wave
    quantization) and a few longer lengths may prefer whole by a hair: the rule "split from
    this length on" stays within 1% of choosing per length (tests/planner/test_search.py)."""
    if not can_split_audio(spec, geo, ulysses, ring):
        return None

    def pays(tokens: int) -> bool:
        g = replace(geo, audio_tokens=tokens)
        args = (spec, g, ulysses, ring, cfg, batch, flops_per_s, intra, ring_link, edge_link)
        return step_cost(*args, audio_split=True, **rates).total < step_cost(*args, audio_split=False, **rates).total

    low, high = 1, AUDIO_SPLIT_SEARCH_TOKENS
    if not pays(high):
        return None
    if pays(low):
        return low
    while high - low > 1:  # pays(high), not pays(low)
        mid = (low + high) // 2
        low, high = (low, mid) if pays(mid) else (mid, high)
    return high


def _step_cost(spec: ModelSpec, geo: VideoGeometry, ulysses: int, ring: int, cfg: int, batch: int,
               flops_per_s: float, intra: Link, ring_link: Link, edge_link: Link, small_rows: float,
               head_chunks: int, wave_slots: int, attn_flops_per_s: float | None, act_bytes: int,
               audio_split: bool) -> StepCost:
    sp = ulysses * ring
    active = sp * cfg
    intra, ring_link, edge_link = (lk.shared_by(active) for lk in (intra, ring_link, edge_link))
    text, video = padded_parts(geo, sp)
    seq = text + video
    s = seq // sp
    h, L, b = spec.hidden, spec.layers, batch
    e = act_bytes

    linear_work, block_work = step_work(spec, geo, ulysses, ring, batch, small_rows, wave_slots, audio_split)
    t_lin = linear_work / flops_per_s
    block = seq // ring
    t_blk = block_work / (attn_flops_per_s or flops_per_s)
    if ring > 1:
        t_kv = ring_link.seconds(2 * b * block * (h / ulysses) * e)
        # A CPU slot's link (shm) copies on the rank's own core: the transfer adds to the block.
        step_kv = max(RING_OVERLAP_SLOWDOWN * t_blk, t_kv) if ring_link.overlaps else t_blk + t_kv
        t_ring = t_blk + (ring - 1) * (step_kv + RING_STEP_OVERHEAD_S)
    else:
        t_ring = t_blk
    t_attn_compute = ring * t_blk
    ring_exposed = max(0.0, t_ring - t_attn_compute)

    t_a2a = 0.0
    if ulysses > 1:
        # One tensor's exchange; q, k, v in and the output back make 4.
        t_x4 = 4 * intra.seconds(b * s * h * e * (ulysses - 1) / ulysses, hops=ulysses - 1)
        n = min(head_chunks, spec.heads // ulysses)
        if intra.overlaps and n > 1:
            hideable = t_x4 * (n - 1) / n
            t_a2a = (t_x4 / n + max(0.0, hideable - t_ring)
                     + (RING_OVERLAP_SLOWDOWN - 1) * min(t_ring, hideable))
        else:
            t_a2a = t_x4

    channels = spec.in_channels * spec.patch_size ** 2 * (spec.patch_size_t or 1)
    out_bytes = b * video * channels * e
    edges = 0.0
    if sp > 1:
        edges += 2 * edge_link.seconds(out_bytes * (sp - 1) / sp)
    if cfg > 1:
        edges += edge_link.seconds(out_bytes * (cfg - 1))

    audio_whole, audio_shrinks = (w / flops_per_s for w in audio_work(spec, geo, ulysses, ring, batch, small_rows,
                                                                        wave_slots, audio_split))
    audio_gather = audio_exchange = 0.0
    if sp > 1 and spec.audio_hidden and geo.audio_tokens:
        h_a = spec.audio_hidden
        # The K and V chunks of every rank to every rank, each layer, before video->audio attention.
        gather_link = ring_link if ring > 1 else intra
        audio_gather = L * 2 * gather_link.seconds(b * video * h_a * e * (sp - 1) / sp, hops=sp - 1)
        if audio_split:
            padded = -(-geo.audio_tokens // sp) * sp
            layer = 2 * gather_link.seconds(b * padded * h_a * e * (sp - 1) / sp, hops=sp - 1)  # audio->video K/V
            if ulysses > 1:  # audio self-attention's q, k, v in and output back
                layer += 4 * intra.seconds(b * padded // sp * h_a * e * (ulysses - 1) / ulysses, hops=ulysses - 1)
            if ring > 1:
                layer += (ring - 1) * (ring_link.seconds(2 * b * padded / ring * h_a / ulysses * e)
                                       + RING_STEP_OVERHEAD_S)
            audio_exchange = L * layer + edge_link.seconds(b * padded * h_a * e * (sp - 1) / sp, hops=sp - 1)

    compute = t_lin + L * t_attn_compute
    total = compute + L * (t_a2a + ring_exposed) + edges + audio_gather + audio_exchange
    return StepCost(compute, L * t_a2a, L * ring_exposed, edges, total, audio_whole + audio_shrinks, audio_whole,
                    audio_gather, bool(audio_split and sp > 1 and spec.audio_hidden and geo.audio_tokens),
                    audio_exchange)


@dataclass(frozen=True)
class ModelRates:
    """A model's own rates on one device type, FLOP/s, fit by `fit_model_rates` from a
    measured one-device step: its linear part (everything of the step that is not the
    self-attention kernel) and its attention kernels at its own shape."""

    linear: float
    lse_attention: float
    plain_attention: float


def fit_model_rates(spec: ModelSpec, geo: VideoGeometry, batch: int, step_seconds: float,
                    plain_attention_seconds: float, lse_attention_seconds: float | None = None, *,
                    small_rows: float = SMALL_SHARD_ROWS, wave_slots: int = WAVE_SLOTS) -> ModelRates:
    """The rates with which `step_cost` gives back a step measured on one device (ulysses,
    ring and cfg 1, `batch` samples): the self-attention kernel took `plain_attention_seconds`
    per layer at the model's shape (torch's SDPA, the kernel of ring 1) and
    `lse_attention_seconds` (the LSE kernel a ring runs; default: the same), and the rest of
    the step is the linear part. A model runs more than its GEMMs: norms, modulation, rotary
    embeddings and residuals in the dtype its code chooses (Wan keeps them in float32), the
    embeddings and the scheduler; a generic calibration block cannot know them, the model's
    own step does. The rates then carry to other requests and layouts through the module's
    formulas. ValueError when the attention alone took the step (inconsistent figures)."""
    for label, value in (("step_seconds", step_seconds), ("plain_attention_seconds", plain_attention_seconds)):
        if not value > 0:
            raise ValueError(f"{label} must be > 0, got {value!r}")
    linear_work, block_work = step_work(spec, geo, 1, 1, batch, small_rows, wave_slots)
    linear_seconds = step_seconds - spec.layers * plain_attention_seconds
    if not linear_seconds > 0:
        raise ValueError(f"a step of {step_seconds:.4g} s cannot hold {spec.layers} layers of "
                         f"{plain_attention_seconds:.4g} s attention each; measure both on the same device")
    lse = lse_attention_seconds if lse_attention_seconds else plain_attention_seconds
    return ModelRates(linear_work / linear_seconds, block_work / lse, block_work / plain_attention_seconds)
