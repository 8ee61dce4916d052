"""The LTX-2 family: video with sound, text-to-video (`LTX2Pipeline`) and image-to-video
(`LTX2ImageToVideoPipeline`).

Model. LTX2VideoTransformer3DModel denoises two token streams in one list of blocks: the video
(packed latents [B, Lv, Cv], patch 1) and the audio (packed mel latents [B, La, Ca]). Each block
runs, per stream, self-attention (rotary), cross-attention to the prompt (the Gemma 3 text
through the pipeline's connectors, one text per stream), then audio-to-video cross-attention
(video queries, audio keys) and video-to-audio (audio queries, video keys), then the FFNs.

Steps. As `LTX2Pipeline.__call__` with its defaults: up to four transformer calls per step,
  1. [negative, positive] as one batch of 2 (classifier-free guidance, video guidance_scale and
     audio_guidance_scale), when either scale is > 1;
  2. positive, self-attention skipped in the blocks `stg_blocks` (spatio-temporal guidance),
     when stg_scale or audio_stg_scale is > 0;
  3. positive, audio<->video cross-attention off (modality guidance), when modality_scale or
     audio_modality_scale is > 1;
each prediction turned into x0 (latents - v sigma), combined as x0_pos + (g - 1)(x0_pos - x0_neg)
+ s_stg (x0_pos - x0_stg) + (m - 1)(x0_pos - x0_mod), rescaled towards the positive prediction's
std (guidance_rescale, per stream) and turned back into a velocity for FlowMatchEuler. The
knobs beyond `guidance_scale` travel in GenerationRequest.guidance_options (OPTION_DEFAULTS:
the pipeline's defaults, with its `audio_x or x` fallbacks).

Branches. A guided step has four guidance branches (`max_branches` 4), in this order: negative,
positive, STG, modality. A branch whose pass is off (its scales at their neutral values) is a
slot that predicts zeros without a transformer call, so every guided request has four and any
branch degree (cfg 1, 2 or 4) shares them out evenly: cfg 2 gives one group the [negative,
positive] pass (a batch of 2, as the pipeline runs it) and the other the STG and modality
passes; cfg 4 gives each group one pass. Each branch predicts x0 as one row [1, N] and
`combine_guidance` (the runner's hook, after the gather on a cfg mesh) puts them together as
above. A request with the positive pass alone (every guidance scale neutral) has one branch,
whose prediction is the velocity itself, run on every group. Each pass keeps the pipeline's
batching (negative and positive as one batch where one group runs both) and input layout, which
bf16 needs to be bit-equal to diffusers.

Step caching (raydit.models.cache): each pass is a guidance branch with its own residuals,
for both output streams (the audio's cut per rank where it is split); the decision is made at
the first call of a one-process step (the [negative, positive] pass, or the positive alone).

State. The runner's latents are one tensor [1, Lv*Cv + La*Ca] (float32): the packed video then
the packed audio latents, flattened. FlowMatchEuler's step is elementwise, so one scheduler
stepping both streams gives the numbers of the pipeline's two (its audio scheduler is a copy with
the same sigmas and step index). `output_latents` unpacks and denormalizes both, as
output_type="latent" returns them, flattened the same way.

Image-to-video: the first latent frame holds the image's latents (conditioning mask 1), its
tokens get timestep 0 (per-token video timestep, so temb is [B, Lv, 6C]) and keep their values
through the steps. The pipeline re-compresses the image as H.264 at CRF 33 (Gemma 3
checkpoints) with PyAV before encoding it; guidance option image_crf=0 skips that.

Tiny. `tiny-ltx2` / `tiny-ltx2-i2v`: video 6 heads x 8, audio 6 heads x 4, 2 blocks, split
rotary, perturbed attention (STG), a 2-layer Gemma 3 (16 wide), 1-layer connectors, the LTX-2
video VAE with 32x spatial / 8x temporal compression (8 channels), the audio VAE (2 channels,
8 mel bins) and a vocoder whose upsampling (160) is the mel hop: the sound lasts as the video.

Legend: B batch, Lv / La video / audio tokens, Cv / Ca their latent channels.
"""

from __future__ import annotations

import json

from raydit.models.adapter import GatherOutput, ModelAdapter, SequenceParallelPlan, SplitInput, attend
from raydit.models.family import Audio, Family, Prepared
from raydit.models.requests import check_frames, check_size, reference_call
from raydit.models.tiny import DEFAULTS_FILE, load_pipeline_dir, tiny_dir
from raydit.planner.model import DecoderShape

PIPELINE_DEFAULTS = {"num_frames": 121, "height": 512, "width": 768}  # LTX2Pipeline.__call__'s
MAX_SEQUENCE_LENGTH = 1024  # the pipeline's default (a tokenizer with a smaller limit: its own)
FRAME_RATE = 24.0  # the pipeline's default (audio length, rotary positions in time)
STG_BLOCK = 28  # the pipeline's default spatio_temporal_guidance_blocks = [28]
# AutoencoderKLLTX2Audio.temporal_compression_ratio: mel frames per audio latent frame, a constant
# of diffusers' class (LATENT_DOWNSAMPLE_FACTOR), not in its config.
AUDIO_VAE_TEMPORAL_COMPRESSION = 4

# GenerationRequest.guidance_options this family takes, with LTX2Pipeline's defaults. None: the
# pipeline's fallback (audio_x or x; stg_blocks: [28], or the last block of a transformer with
# fewer, where [28] would name none; image_crf: 33 for Gemma 3 checkpoints, 18 for Gemma 4).
OPTION_DEFAULTS = {
    "stg_scale": 1.0,
    "modality_scale": 3.0,
    "guidance_rescale": 0.7,
    "audio_guidance_scale": 7.0,
    "audio_stg_scale": 1.0,
    "audio_modality_scale": 3.0,
    "audio_guidance_rescale": 0.7,
    "stg_blocks": None,
    "use_cross_timestep": True,
    "image_crf": None,
}


def max_sequence_length(pipe) -> int:
    """The prompt length the pipeline pads to: its default, or the tokenizer's limit if smaller."""
    limit = getattr(getattr(pipe, "tokenizer", None), "model_max_length", MAX_SEQUENCE_LENGTH)
    return min(MAX_SEQUENCE_LENGTH, int(limit))


def _default_crf(pipe) -> int:
    """The image CRF LTX2ImageToVideoPipeline uses for this checkpoint (by its text encoder)."""
    from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

    encoder = getattr(pipe, "text_encoder", None)
    if encoder is None:  # dropped on a rank that does not encode: its class says the generation
        from types import SimpleNamespace

        from raydit.models.text_encoding import _DROPPED

        cls = getattr(pipe, _DROPPED, {}).get("text_encoder", (type(None), None))[0]
        encoder = SimpleNamespace(config=SimpleNamespace(model_type="gemma4" if "Gemma4" in cls.__name__ else "gemma3"))
    return int(resolve_default_image_crf(encoder))


def guidance(pipe, request) -> dict:
    """Every guidance knob of `request` for this pipeline, resolved as LTX2Pipeline does."""
    o = {name: request.option(name, default) for name, default in OPTION_DEFAULTS.items()}
    g = dict(o, guidance_scale=request.guidance_scale)
    # The pipeline's own fallbacks: `audio_x = audio_x or x`.
    g["audio_guidance_scale"] = o["audio_guidance_scale"] or request.guidance_scale
    g["audio_stg_scale"] = o["audio_stg_scale"] or o["stg_scale"]
    g["audio_modality_scale"] = o["audio_modality_scale"] or o["modality_scale"]
    g["audio_guidance_rescale"] = o["audio_guidance_rescale"] or o["guidance_rescale"]
    layers = len(pipe.transformer.transformer_blocks)
    if o["stg_blocks"] is None:
        g["stg_blocks"] = (STG_BLOCK,) if layers > STG_BLOCK else (layers - 1,)
    g["cfg"] = g["guidance_scale"] > 1.0 or g["audio_guidance_scale"] > 1.0
    g["stg"] = g["stg_scale"] > 0.0 or g["audio_stg_scale"] > 0.0
    g["modality"] = g["modality_scale"] > 1.0 or g["audio_modality_scale"] > 1.0
    return g


# -- adapter -----------------------------------------------------------------------------------
# Sequence parallelism. The video tokens are split over the sp ranks as for LTX-Video (before
# the first block, gathered after the last). The audio tokens are split too, or stay whole on
# every rank, by their length: the plan's `audio_split_tokens` (parallelize options; the
# planner's cost model sets it, raydit.planner.cost.audio_split_tokens) is the length from which
# splitting them pays; a forward with fewer audio tokens (or a plan without it) keeps them whole.
# La is ~25 per second of sound, 1-2 % of the video's tokens at 512 x 768, so short clips keep
# them whole; the collectives a split adds per block cost more than the work it saves there.
# Per block:
#   attn1 / audio_attn1 (self-attention)  Ulysses / ring over the stream's chunks (sp_attention)
#                                      where the stream is split, its rotary table cut to this
#                                      rank's chunk; the STG pass's perturbed blocks use the
#                                      values alone (per token, local); a whole audio stream
#                                      keeps diffusers' processor;
#   attn2 / audio_attn2 (-> prompt)    local queries, the whole prompt: diffusers' processor;
#   audio_to_video_attn               local video queries attend to every audio key: whole
#                                      audio: diffusers' processor, the query rotary table cut;
#                                      split audio: the audio keys (normed, rotated) and values of
#                                      each chunk are all-gathered, pads dropped, then attended;
#   video_to_audio_attn               every audio query (this rank's chunk, or all) must see
#                                      every video token once: the video keys and values of each
#                                      chunk are all-gathered, pads dropped (gather_sequence);
#                                      a whole audio stream is the same on every rank.
# Per-token timestep embeddings (image-to-video: temb and, without use_cross_timestep, the
# cross-attention modulations are [B, Lv, k C]) are split with the tokens of their stream.
VIDEO, AUDIO = 0, 1  # the layout's parts: the video, and the audio where it is split
AUDIO_SPLIT = "audio_split"  # ForwardContext.flags: this forward splits the audio tokens


def stream_layout(layout, part: int):
    """The layout of one stream alone (each stream attends to itself apart)."""
    from raydit.parallel.sharding import SeqLayout

    return SeqLayout((layout.part_lengths[part],), layout.sp)


def shard_stream_rotary(rotary_emb, layout, sp_index: int, part: int = VIDEO):
    """A stream's rotary table cut to this rank's chunk: interleaved tables are [B, L, C], split
    ones [B, H, L, r] (raydit.parallel.sharding.shard_rotary)."""
    from raydit.parallel.sharding import shard_rotary

    dim = 1 if rotary_emb[0].ndim == 3 else 2
    return shard_rotary(rotary_emb, layout, sp_index, part, dim, name=("video", "audio")[part])


def _rotate(attn, x, rotary_emb):
    from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb

    if rotary_emb is None:
        return x
    rotate = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
    return rotate(x, rotary_emb)


def _output(attn, out_BLC, gate_logits):
    """The per-head gates (LTX-2.3's gated attention) and the output projection."""
    if gate_logits is not None:
        gates = 2.0 * gate_logits.sigmoid()  # [B, L, H]: logits 0 give gates 1
        out_BLC = (out_BLC.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
    return attn.to_out[1](attn.to_out[0](out_BLC))  # linear, dropout


def _split(context, part: int) -> bool:
    """Whether `part`'s tokens are split over the ranks in this forward."""
    return part == VIDEO or bool(context.flags.get(AUDIO_SPLIT))


class LTX2SelfAttnProcessor:
    """attn1 (video) or audio_attn1 of a block, sequence parallel: projections, the QK RMS norms
    (across heads) and rotary are per token and run on the local chunk; the attention runs over
    all chunks of the stream. A forward that keeps the audio whole runs `original` on it."""

    def __init__(self, context, part: int = VIDEO, original=None):
        self.context, self.part, self.original = context, part, original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, perturbation_mask=None, all_perturbed=None):
        import torch

        if not _split(self.context, self.part):
            kwargs = {} if perturbation_mask is None and all_perturbed is None else dict(
                perturbation_mask=perturbation_mask, all_perturbed=all_perturbed)
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                                 key_rotary_emb, **kwargs)
        if encoder_hidden_states is not None:
            raise ValueError("LTX2SelfAttnProcessor serves self-attention (attn1, audio_attn1) only")
        if attention_mask is not None:
            raise ValueError("a self-attention mask is not supported under sequence parallelism "
                             "(LTX-2's text- and image-to-video pipelines pass none)")
        mesh, layout = self.context.mesh, self.context.layout
        assert layout is not None, "split hook did not run before attention"
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        value = attn.to_v(hidden_states)  # [B, L, C]
        if all_perturbed is None:
            all_perturbed = (perturbation_mask == 0).all() if perturbation_mask is not None else False
        # A compiled block cannot branch on a tensor: it computes the attention and selects.
        traced = torch.compiler.is_compiling() and isinstance(all_perturbed, torch.Tensor)
        if not traced and all_perturbed:  # spatio-temporal guidance: this block's self-attention is skipped
            return _output(attn, value, gate_logits)
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(hidden_states))
        if query_rotary_emb is not None:
            freqs = shard_stream_rotary(query_rotary_emb, layout, mesh.sp_index, self.part)
            query, key = _rotate(attn, query, freqs), _rotate(attn, key, freqs)

        out_BLC = attend(*(x.unflatten(2, (attn.heads, -1)) for x in (query, key, value)), mesh,
                         stream_layout(layout, self.part))
        if perturbation_mask is not None:  # a batch mixing perturbed and plain samples
            out_BLC = value.lerp(out_BLC, perturbation_mask.to(out_BLC.dtype))
        if traced:
            out_BLC = torch.where(all_perturbed, value, out_BLC)
        return _output(attn, out_BLC, gate_logits)


class _GatheredKeysAttention:
    """Cross-attention whose keys and values are split over the ranks (part `keys_part`): each
    rank makes them from its chunk (normed, rotated), they are all-gathered and unpadded, and
    this rank's queries attend to all of them, each key once."""

    def __init__(self, context, keys_part: int):
        from raydit.parallel.opaque import register_call

        self.context, self.keys_part = context, keys_part
        # The gather is a collective torch.compile cannot keep in a block's graph: a compiled
        # block calls it (and the attention after it) as one opaque op (raydit.parallel.opaque),
        # whose output is like the queries. One name per mesh: every block shares one graph.
        self._key = register_call(self._attend, like=(0,), name=(type(self).__qualname__, keys_part, context.mesh.key))

    def _attend(self, tensors, ints):
        """q [B, H, Lq, D], k and v [B, chunk, C] (this rank's keys) -> [B, H, Lq, D]."""
        import torch.nn.functional as F

        from raydit.parallel.mesh import gather_sequence

        q_BHLD, k_BLC, v_BLC = tensors
        mesh, layout = self.context.mesh, self.context.layout
        part = self.keys_part
        heads = q_BHLD.shape[1]
        # [B, chunk, C] -> [B, L, C]: the same on every rank, bit for bit
        k_BLC, v_BLC = gather_sequence(k_BLC, mesh, layout, part), gather_sequence(v_BLC, mesh, layout, part)
        k_BHLD = k_BLC.unflatten(2, (heads, -1)).transpose(1, 2)
        v_BHLD = v_BLC.unflatten(2, (heads, -1)).transpose(1, 2)
        return [F.scaled_dot_product_attention(q_BHLD, k_BHLD, v_BHLD)]

    def attend(self, attn, hidden_states, encoder_hidden_states, query_rotary_emb, key_rotary_emb, query_part):
        """diffusers' LTX2AudioVideoAttnProcessor with this rank's queries (their rotary cut to
        the chunk where `query_part` is split) and the keys' chunks gathered."""
        from raydit.parallel.opaque import opaque_call

        mesh, layout = self.context.mesh, self.context.layout
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(encoder_hidden_states))  # [B, chunk, C]: this rank's keys
        value = attn.to_v(encoder_hidden_states)
        if query_rotary_emb is not None:  # as diffusers: the keys take the queries' table where they have none
            key_rotary_emb = key_rotary_emb if key_rotary_emb is not None else query_rotary_emb
            if _split(self.context, query_part):
                query_rotary_emb = shard_stream_rotary(query_rotary_emb, layout, mesh.sp_index, query_part)
            query = _rotate(attn, query, query_rotary_emb)
            key = _rotate(attn, key, shard_stream_rotary(key_rotary_emb, layout, mesh.sp_index, self.keys_part))
        q_BHLD = query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        (out_BHLD,) = opaque_call(self._key, [q_BHLD, key, value], [])
        return _output(attn, out_BHLD.transpose(1, 2).flatten(2, 3).to(query.dtype), gate_logits)


class LTX2AudioToVideoAttnProcessor(_GatheredKeysAttention):
    """audio_to_video_attn: this rank's video queries attend to every audio key. Whole audio:
    diffusers' own processor with the video (query) rotary table cut to the local chunk; split
    audio: the audio keys' chunks gathered."""

    def __init__(self, context, original):
        super().__init__(context, AUDIO)
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("an audio-to-video attention mask is not supported under sequence parallelism")
        if _split(self.context, AUDIO):
            return self.attend(attn, hidden_states, encoder_hidden_states, query_rotary_emb, key_rotary_emb, VIDEO)
        if query_rotary_emb is not None:
            query_rotary_emb = shard_stream_rotary(query_rotary_emb, self.context.layout, self.context.mesh.sp_index)
        return self.original(attn, hidden_states, encoder_hidden_states, None, query_rotary_emb, key_rotary_emb)


class LTX2VideoToAudioAttnProcessor(_GatheredKeysAttention):
    """video_to_audio_attn: every audio query (this rank's chunk where the audio is split, else
    all of them) attends to every video token once: the video keys' chunks gathered."""

    def __init__(self, context):
        super().__init__(context, VIDEO)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("a video-to-audio attention mask is not supported under sequence parallelism")
        return self.attend(attn, hidden_states, encoder_hidden_states, query_rotary_emb, key_rotary_emb, AUDIO)


class LTX2Adapter(ModelAdapter):
    name = "ltx2"
    transformer_classes = ("LTX2VideoTransformer3DModel",)
    # audio_split_tokens: split the audio stream in forwards with at least this many audio tokens
    options = ("audio_split_tokens",)
    plan = SequenceParallelPlan(
        blocks="transformer_blocks",
        # LTX2VideoTransformerBlock.forward(hidden_states, audio_hidden_states, ..., temb, temb_audio,
        # temb_ca_scale_shift, temb_ca_audio_scale_shift, temb_ca_gate, temb_ca_audio_gate, ...): the
        # modulations are per sample ([B, 1, k C]) or, per-token timestep, [B, L, k C].
        split_inputs=(SplitInput("hidden_states", VIDEO),
                      SplitInput("temb", VIDEO, every_block=True, min_len=2),
                      SplitInput("temb_ca_scale_shift", VIDEO, every_block=True, min_len=2),
                      SplitInput("temb_ca_gate", VIDEO, every_block=True, min_len=2),
                      SplitInput("audio_hidden_states", AUDIO, when=AUDIO_SPLIT),
                      SplitInput("temb_audio", AUDIO, every_block=True, min_len=2, when=AUDIO_SPLIT),
                      SplitInput("temb_ca_audio_scale_shift", AUDIO, every_block=True, min_len=2, when=AUDIO_SPLIT),
                      SplitInput("temb_ca_audio_gate", AUDIO, every_block=True, min_len=2, when=AUDIO_SPLIT)),
        gather_outputs=(GatherOutput(0, VIDEO), GatherOutput(1, AUDIO, when=AUDIO_SPLIT)),  # (video, audio)
        attention="attn1",
    )

    def make_processor(self, context):
        return LTX2SelfAttnProcessor(context, VIDEO)

    def parallelize(self, transformer, mesh, options=None):
        threshold = (options or {}).get("audio_split_tokens")
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
                raise ValueError(f"audio_split_tokens {threshold!r} must be an integer >= 1 (None: never split)")
            heads = transformer.config.audio_num_attention_heads
            if heads % mesh.ulysses:
                raise ValueError(f"ulysses_degree {mesh.ulysses} does not divide the {heads} audio attention heads: "
                                 "the audio tokens cannot be split on this plan; drop audio_split_tokens")
        handle = super().parallelize(transformer, mesh, options)
        context = handle.context
        try:
            for block in self.plan.block_list(transformer):
                for name in ("audio_attn1", "audio_to_video_attn", "video_to_audio_attn"):
                    attn = getattr(block, name)
                    handle._processors.append((attn, attn.processor))
                    attn.set_processor(LTX2SelfAttnProcessor(context, AUDIO, attn.processor) if name == "audio_attn1"
                                       else LTX2AudioToVideoAttnProcessor(context, attn.processor)
                                       if name == "audio_to_video_attn" else LTX2VideoToAudioAttnProcessor(context))

            def decide(module, args, kwargs):
                """Split the audio tokens in this forward when they are at least the threshold."""
                audio = kwargs.get("audio_hidden_states", args[1] if len(args) > 1 else None)
                context.flags[AUDIO_SPLIT] = bool(
                    threshold is not None and mesh.sp > 1 and audio is not None and audio.shape[1] >= threshold)
                return None

            handle._hooks.append(transformer.register_forward_pre_hook(decide, with_kwargs=True))
        except BaseException:
            handle.remove()
            raise
        return handle


# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
# Gemma 3 12B (11.77e9 text with tied embeddings + 0.42e9 SigLIP) and the pipeline's text connectors
# (1.43e9: Linear 49 x 3840 -> 3840 and two 2-layer 30 x 128 transformers, LTX2TextConnectors'
# defaults, which are LTX-2's).
TEXT_ENCODER_PARAMS = 12.19e9 + 1.43e9

def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import ModelSpec

    common = dict(family="ltx2")
    return [
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
        ModelSpec(name="ltx-2", heads=32, head_dim=128, layers=48, ffn_hidden=16384, patch_size=1,
                  patch_size_t=1, text_tokens=1024, text_in_sequence=False, positional="rotary",
                  in_channels=128, params=18.88e9, text_encoder_params=TEXT_ENCODER_PARAMS, vae_params=1.33e9,
                  default_frames=121, default_height=512, default_width=768, vae_spatial=32, vae_temporal=8,
                  cfg_branches=4, audio_heads=32, audio_head_dim=64, audio_ffn_hidden=4 * 32 * 64,
                  audio_tokens_per_second=25.0, frame_rate=24.0, **common),
    ]


class LTX2Family(Family):
    """LTX2Pipeline's and LTX2ImageToVideoPipeline's steps."""

    name = "ltx2"
    pipelines = ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
    image_pipelines = ("LTX2ImageToVideoPipeline",)
    adapter = LTX2Adapter
    batch_branches = False  # different passes, not one batch (group_calls batches the cfg pair alone)
    max_branches = 4  # negative, positive, STG, modality (module docstring)
    # LTX-2's video VAE (AutoencoderKLLTX2Video, diffusers' default config = LTX-2's), counted with
    # torch.utils.flop_counter on the meta device, 3 x 8 x 8 latents (17 x 256 x 256 out): 1.5030e12
    # FLOP, 1.349e6 per output pixel-frame. raydit runs it whole on one rank (this family does not
    # split it), so it is priced whole; the halo and memory figures are the uncounted stand-in's.
    decoder = DecoderShape(1.349e6, 6320, 33.0, 0.0, 128, 4, parallel=False)
    option_names = tuple(OPTION_DEFAULTS)

    models = staticmethod(builtin_models)

    def tiny(self):
        return {"tiny-ltx2": tiny_pipeline_dir, "tiny-ltx2-i2v": tiny_i2v_pipeline_dir}

    def spec_from_dir(self, path, configs):
        """Geometry from transformer/, vae/, audio_vae/ and tokenizer/ configs; parameters from the
        weights' headers. The planner sees the video stream as the split sequence, the prompt as
        cross-attended text (max_sequence_length tokens) and the audio stream apart, whole on every
        rank: its heads and width (transformer/ audio_*; FFN 4 x, diffusers' FeedForward) and its
        tokens per second as `init` makes them (audio_vae/ sample_rate / mel_hop_length /
        AUDIO_VAE_TEMPORAL_COMPRESSION, read at FRAME_RATE; without audio_vae/, the pipeline's
        16000 / 160). The vocoder turns mel frames into samples and sets no token count."""
        from raydit.planner.model import ModelSpec, attention_shape, component_params, transformer_config

        cfg, where = transformer_config(path, configs, "LTX2VideoTransformer3DModel", "an LTX-2 pipeline")
        heads, head_dim = attention_shape(cfg, where)
        layers = int(cfg.get("num_layers", 48))
        hidden = heads * head_dim
        # diffusers' defaults where the config leaves them out (LTX-2's: 32 x 64)
        audio_heads = int(cfg.get("audio_num_attention_heads", 32))
        audio_head_dim = int(cfg.get("audio_attention_head_dim", 64))
        audio_hidden = audio_heads * audio_head_dim
        audio_vae = configs.get("audio_vae", {})
        audio_per_second = (float(audio_vae.get("sample_rate", 16000)) / float(audio_vae.get("mel_hop_length", 160))
                            / AUDIO_VAE_TEMPORAL_COMPRESSION)
        vae = configs.get("vae", {})
        scaling = vae.get("spatio_temporal_scaling", [True] * 4)
        scaling = [scaling] * 4 if isinstance(scaling, bool) else scaling
        steps = 2 ** sum(map(bool, scaling))
        vae_spatial = vae.get("spatial_compression_ratio") or int(vae.get("patch_size", 4)) * steps
        vae_temporal = vae.get("temporal_compression_ratio") or int(vae.get("patch_size_t", 1)) * steps
        defaults = dict(PIPELINE_DEFAULTS)
        if (path / DEFAULTS_FILE).is_file():
            defaults.update(json.loads((path / DEFAULTS_FILE).read_text()))
        text = int(configs.get("tokenizer", {}).get("model_max_length", MAX_SEQUENCE_LENGTH))

        def params(*folders):
            counts = [component_params(path / f) for f in folders if (path / f).is_dir()]
            return float(sum(c for c in counts if c is not None))

        # per block: video self/text/a2v attention 12 h^2 + FFN 8 h^2; audio the same at its width
        estimate = float(layers * (20 * hidden * hidden + 20 * audio_hidden * audio_hidden))
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=layers, ffn_hidden=4 * hidden,
            patch_size=int(cfg.get("patch_size", 1)), patch_size_t=int(cfg.get("patch_size_t", 1)),
            text_tokens=min(text, MAX_SEQUENCE_LENGTH), text_in_sequence=False, positional="rotary",
            in_channels=int(cfg.get("in_channels", 128)),
            params=component_params(path / "transformer") or estimate,
            text_encoder_params=params("text_encoder", "connectors"),
            vae_params=params("vae", "audio_vae", "vocoder"),
            default_frames=int(defaults["num_frames"]), default_height=int(defaults["height"]),
            default_width=int(defaults["width"]), vae_spatial=int(vae_spatial), vae_temporal=int(vae_temporal),
            cfg_branches=self.max_branches, audio_heads=audio_heads, audio_head_dim=audio_head_dim,
            audio_ffn_hidden=4 * audio_hidden, audio_tokens_per_second=audio_per_second, frame_rate=FRAME_RATE,
        )

    def conformance_cases(self, base_dirs):
        return {"forward": forward_cases(), "runner": runner_cases(base_dirs["tiny-ltx2"], base_dirs["tiny-ltx2-i2v"])}

    def encoders(self, pipe) -> list:
        # The connectors only turn the text encoder's states into the two streams' prompts.
        return [m for m in (getattr(pipe, "text_encoder", None), getattr(pipe, "connectors", None)) if m is not None]

    def do_cfg(self, pipe, request) -> bool:
        """Whether the step runs more than the positive pass (module docstring: then four branches)."""
        g = guidance(pipe, request)
        return g["cfg"] or g["stg"] or g["modality"]

    # -- checks ----------------------------------------------------------------------------
    def check_request(self, pipe, request) -> None:
        super().check_request(pipe, request)
        if request.guidance_scale_2 is not None:
            raise ValueError("guidance_scale_2 is for two-expert pipelines (Wan 2.2 A14B); LTX-2 has one: drop it")
        for name in ("stg_scale", "modality_scale", "guidance_rescale", "audio_guidance_scale", "audio_stg_scale",
                     "audio_modality_scale", "audio_guidance_rescale"):
            value = request.option(name)
            if value is not None and (isinstance(value, (bool, tuple)) or value < 0):
                raise ValueError(f"guidance option {name}={value!r} must be a number >= 0")
        for name in ("guidance_rescale", "audio_guidance_rescale"):
            value = request.option(name)
            if value is not None and value > 1:
                raise ValueError(f"guidance option {name}={value!r} must be in [0, 1] (0 turns rescaling off)")
        cross = request.option("use_cross_timestep")
        if cross is not None and not isinstance(cross, bool):
            raise ValueError(f"guidance option use_cross_timestep={cross!r} must be true or false")
        crf = request.option("image_crf")
        if crf is not None:
            if request.image is None:
                raise ValueError("guidance option image_crf is for image-to-video requests; drop it")
            if isinstance(crf, (bool, tuple, float)) or not 0 <= crf <= 51:
                raise ValueError(f"guidance option image_crf={crf!r} must be an integer in 0..51 (0: no re-compression)")
        layers = len(pipe.transformer.transformer_blocks)
        blocks = request.option("stg_blocks")
        if blocks is not None:
            if not isinstance(blocks, tuple) or not blocks or any(not 0 <= b < layers for b in blocks):
                raise ValueError(f"guidance option stg_blocks={blocks!r} must list block indices in 0..{layers - 1}")
            if not pipe.transformer.config.perturbed_attn:
                raise ValueError("guidance option stg_blocks needs a transformer with perturbed_attn (LTX-2.3); "
                                 "this one has none: set stg_scale=0 and audio_stg_scale=0")
        temporal = pipe.vae_temporal_compression_ratio
        check_frames(request.num_frames, temporal)
        check_size(request, 32)  # the pipeline's check_inputs

    # -- prepare ---------------------------------------------------------------------------
    def encode(self, pipe, request, device, dtype):
        import torch

        g = guidance(pipe, request)
        embeds, mask, negative, negative_mask = pipe.encode_prompt(
            prompt=request.prompt, negative_prompt=request.negative_prompt, do_classifier_free_guidance=g["cfg"],
            max_sequence_length=max_sequence_length(pipe), device=device)
        if g["cfg"]:  # the pipeline's batch order
            embeds, mask = torch.cat([negative, embeds]), torch.cat([negative_mask, mask])
        side = getattr(pipe.tokenizer, "padding_side", "left")
        # The connectors run on the pipeline's batch; their rows are the two prompts' inputs.
        video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side=side)
        rows = [{"video_embeds": v, "audio_embeds": a, "mask": m}
                for v, a, m in zip(video.split(1), audio.split(1), connector_mask.split(1))]
        return rows[-1], (rows[0] if g["cfg"] else None)

    def guidance_branches(self, pipe, request, positive, negative):
        """[negative, positive, STG, modality] with guidance (a pass that is off: a slot of
        zeros), the positive pass alone without (module docstring)."""
        g = guidance(pipe, request)
        if not self.do_cfg(pipe, request):
            return [{**positive, "pass": "alone"}]
        off = {"pass": None}
        return [{**negative, "pass": "neg"} if g["cfg"] else off, {**positive, "pass": "pos"},
                {**positive, "pass": "stg"} if g["stg"] else off, {**positive, "pass": "mod"} if g["modality"] else off]

    def group_calls(self, branches):
        """One call per pass; the negative and positive passes as one batch where both are here."""
        from raydit.models.family import cat_branches

        calls = []
        for branch in branches:
            if branch["pass"] == "pos" and calls and calls[-1]["pass"] == "neg":
                calls[-1] = {**cat_branches([calls[-1], branch]), "pass": "cfg"}
            else:
                calls.append(branch)
        return calls

    def call_branch_counts(self, calls, branches):
        return [2 if call["pass"] == "cfg" else 1 for call in calls]

    def call_runs_model(self, call):
        return call["pass"] is not None  # an off slot predicts zeros without the transformer

    def init(self, pipe, request, generator, device, dtype):
        import numpy as np
        import torch
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        g = guidance(pipe, request)
        context = {"guidance": g}
        channels = pipe.transformer.config.in_channels
        if request.image is None:
            video = pipe.prepare_latents(1, channels, request.height, request.width, request.num_frames, 0.0,
                                         torch.float32, device, generator)  # [1, Lv, Cv]
        else:
            from PIL import Image

            from raydit.models.requests import png_to_image

            image = png_to_image(request.image)
            crf = _default_crf(pipe) if g["image_crf"] is None else g["image_crf"]
            if crf:
                try:
                    import av  # noqa: F401  (diffusers re-compresses with PyAV)
                except ImportError:
                    raise ValueError(
                        f"image-to-video re-compresses the image at H.264 CRF {crf} as LTX-2 was trained, which "
                        "needs PyAV (pip install av); or set guidance option image_crf=0 to skip it") from None
                from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

                image = Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
            image = pipe.video_processor.preprocess(image, height=request.height, width=request.width)
            image = image.to(device=device, dtype=dtype)
            # [1, Lv, Cv], the first latent frame the image's; mask [1, Lv], 1 on those tokens
            video, context["conditioning_mask"] = pipe.prepare_latents(
                image, 1, channels, request.height, request.width, request.num_frames, 0.0, torch.float32, device,
                generator)
        frames = (request.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        height = request.height // pipe.vae_spatial_compression_ratio
        width = request.width // pipe.vae_spatial_compression_ratio
        # The sound lasts as the video: its latent frames per second from the audio VAE's hop.
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        audio_frames = round(request.num_frames / FRAME_RATE * per_second)
        mel_bins = pipe.audio_vae.config.mel_bins
        audio = pipe.prepare_audio_latents(1, num_channels_latents=pipe.audio_vae.config.latent_channels,
                                           audio_latent_length=audio_frames, num_mel_bins=mel_bins, noise_scale=0.0,
                                           dtype=torch.float32, device=device, generator=generator)  # [1, La, Ca]
        n = request.num_inference_steps
        config = pipe.scheduler.config
        mu = calculate_shift(video.shape[1], config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        timesteps, _ = retrieve_timesteps(pipe.scheduler, n, device, None, sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
        if request.image is None:
            pipe.scheduler.set_begin_index(0)  # the text-to-video pipeline does, the image one does not
        fps = conditioning_frame_rate(FRAME_RATE, 1.0)  # motion_speed 1
        video_coords = pipe.transformer.rope.prepare_video_coords(1, frames, height, width, device, fps=fps)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(1, audio_frames, device)
        context.update({
            "video_shape": tuple(video.shape[1:]), "audio_shape": tuple(audio.shape[1:]),
            "latent_frames": frames, "latent_height": height, "latent_width": width, "fps": fps,
            "audio_frames": audio_frames, "latent_mel_bins": mel_bins // pipe.audio_vae_mel_compression_ratio,
            "video_coords": video_coords, "audio_coords": audio_coords,
        })
        latents = torch.cat([video.flatten(1), audio.flatten(1)], dim=1)
        return Prepared(latents=latents, timesteps=timesteps, context=context)

    # -- a step ----------------------------------------------------------------------------
    @staticmethod
    def split(state, latents=None):
        """The runner's latents [1, Lv*Cv + La*Ca] -> video [1, Lv, Cv], audio [1, La, Ca] (views)."""
        latents = state.latents if latents is None else latents
        (lv, cv), (la, ca) = state.context["video_shape"], state.context["audio_shape"]
        return latents[:, :lv * cv].view(1, lv, cv), latents[:, lv * cv:].view(1, la, ca)

    def predict(self, pipe, state, t, branch):
        """One call's x0 predictions as rows [k, N] (N = Lv Cv + La Ca): "cfg" the negative and
        positive rows, one batch; "neg", "pos", "stg", "mod" one row; an off slot a row of zeros.
        The positive pass "alone" (no guidance): the velocity [1, N] itself."""
        import torch

        kind = branch["pass"]
        if kind is None:
            return state.latents.new_zeros(1, state.latents.shape[1])
        video, audio = self._call(pipe, state, t, branch)
        if kind == "alone":
            return self._guide(pipe, state, {"pos": (video, audio)})
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def combine_guidance(self, pipe, state, t, *predictions):
        """The four branches' x0 rows (negative, positive, STG, modality) -> the guided velocity,
        as the pipeline combines them."""
        g = state.context["guidance"]

        def streams(flat):
            video, audio = self.split(state, flat)
            return video.transpose(1, 2).contiguous().transpose(1, 2), audio  # the pipeline's layout

        neg, pos, stg, mod = predictions
        x0 = {"pos": streams(pos)}
        for name, row, on in (("neg", neg, g["cfg"]), ("stg", stg, g["stg"]), ("mod", mod, g["modality"])):
            if on:
                x0[name] = streams(row)
        return self._guide(pipe, state, x0)

    def _call(self, pipe, state, t, branch) -> tuple:
        """One transformer call of the step, as the pipeline makes it -> x0 predictions, video
        [b, Lv, Cv] and audio [b, La, Ca]: "cfg" the [negative, positive] batch, "stg" with
        self-attention skipped in the STG blocks, "mod" with audio<->video attention off, the
        others plain, each on its branch's prompt."""
        import torch

        c, g, i = state.context, state.context["guidance"], state.step_index
        video, audio = self.split(state)
        # The pipeline's packed video latents are channel-major ([1, Lv, Cv] with strides
        # (Lv Cv, 1, Lv): _pack_latents permutes, and every step's arithmetic keeps the layout);
        # a bf16 GEMM over them differs from one over row-major tokens, so they are laid out so.
        video = video.transpose(1, 2).contiguous().transpose(1, 2)
        embeds, audio_embeds, mask = branch["video_embeds"], branch["audio_embeds"], branch["mask"]
        dtype = embeds.dtype
        reps = embeds.shape[0]  # 2 for the [negative, positive] batch
        timestep = t.expand(reps)
        video_timestep = timestep
        if "conditioning_mask" in c:  # image-to-video: [reps, Lv], 0 on the image's tokens
            video_timestep = timestep.unsqueeze(-1) * (1 - torch.cat([c["conditioning_mask"]] * reps))
        vc = c["video_coords"].repeat((reps,) + (1,) * (c["video_coords"].ndim - 1)) if reps > 1 else c["video_coords"]
        ac = c["audio_coords"].repeat((reps,) + (1,) * (c["audio_coords"].ndim - 1)) if reps > 1 else c["audio_coords"]
        x = torch.cat([video] * reps) if reps > 1 else video
        a = torch.cat([audio] * reps) if reps > 1 else audio
        v_out, a_out = pipe.transformer(
            hidden_states=x.to(dtype), audio_hidden_states=a.to(dtype), encoder_hidden_states=embeds,
            audio_encoder_hidden_states=audio_embeds, timestep=video_timestep,
            audio_timestep=timestep if "conditioning_mask" in c else None, sigma=timestep,
            encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=c["latent_frames"],
            height=c["latent_height"], width=c["latent_width"], fps=c["fps"], audio_num_frames=c["audio_frames"],
            video_coords=vc, audio_coords=ac, perturbation_mask=None, use_cross_timestep=g["use_cross_timestep"],
            isolate_modalities=branch["pass"] == "mod",
            spatio_temporal_guidance_blocks=list(g["stg_blocks"]) if branch["pass"] == "stg" else None,
            return_dict=False)
        # x0 = latents - v sigma (the pipeline's convert_velocity_to_x0)
        return (pipe.convert_velocity_to_x0(video, v_out.float(), i, pipe.scheduler),
                pipe.convert_velocity_to_x0(audio, a_out.float(), i, pipe.scheduler))

    def _guide(self, pipe, state, x0: dict):
        """x0 predictions -> the guided velocity [1, N]: x0_pos plus the guidance deltas, rescaled
        per stream, turned back into a velocity (v = (latents - x0) / sigma)."""
        import torch
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        g, i = state.context["guidance"], state.step_index
        video, audio = self.split(state)
        video = video.transpose(1, 2).contiguous().transpose(1, 2)  # the pipeline's layout (see _passes)
        (v_pos, a_pos) = x0["pos"]
        v_cfg = a_cfg = v_stg = a_stg = v_mod = a_mod = 0
        if "neg" in x0:
            v_cfg = (g["guidance_scale"] - 1) * (v_pos - x0["neg"][0])
            a_cfg = (g["audio_guidance_scale"] - 1) * (a_pos - x0["neg"][1])
        if "stg" in x0:
            v_stg = g["stg_scale"] * (v_pos - x0["stg"][0])
            a_stg = g["audio_stg_scale"] * (a_pos - x0["stg"][1])
        if "mod" in x0:
            v_mod = (g["modality_scale"] - 1) * (v_pos - x0["mod"][0])
            a_mod = (g["audio_modality_scale"] - 1) * (a_pos - x0["mod"][1])
        v_guided = v_pos + v_cfg + v_stg + v_mod
        a_guided = a_pos + a_cfg + a_stg + a_mod
        if g["guidance_rescale"] > 0:
            v_guided = rescale_noise_cfg(v_guided, v_pos, guidance_rescale=g["guidance_rescale"])
        if g["audio_guidance_rescale"] > 0:
            a_guided = rescale_noise_cfg(a_guided, a_pos, guidance_rescale=g["audio_guidance_rescale"])
        v_velocity = pipe.convert_x0_to_velocity(video, v_guided, i, pipe.scheduler)
        a_velocity = pipe.convert_x0_to_velocity(audio, a_guided, i, pipe.scheduler)
        return torch.cat([v_velocity.flatten(1), a_velocity.flatten(1)], dim=1)

    def scheduler_step(self, pipe, state, noise, t, generator):
        latents, carry = super().scheduler_step(pipe, state, noise, t, generator)
        mask = state.context.get("conditioning_mask")
        if mask is not None:  # the image's latent frame (the first Lv tokens of mask 1) is kept
            _, cv = state.context["video_shape"]
            kept = int(mask[0].sum()) * cv
            assert bool(mask[0, : int(mask[0].sum())].all()), "the image's tokens lead the video"
            latents = latents.clone()
            latents[:, :kept] = state.latents[:, :kept].to(latents.dtype)
        return latents, carry

    # -- outputs ---------------------------------------------------------------------------
    def _streams(self, pipe, state, latents=None):
        """Video [1, C, F, H, W] and audio [1, C, L, M] latents, denormalized as the pipeline's
        output_type="latent" returns them."""
        c = state.context
        video, audio = self.split(state, latents)
        video = pipe._unpack_latents(video, c["latent_frames"], c["latent_height"], c["latent_width"],
                                     pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, c["audio_frames"], num_mel_bins=c["latent_mel_bins"])
        return video, audio

    def output_latents(self, pipe, state, latents=None):
        import torch

        video, audio = self._streams(pipe, state, latents)
        vae = pipe.vae
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def reference_latents(self, pipe, request):
        import torch

        from raydit.models.requests import png_to_image

        g = guidance(pipe, request)
        pipe.set_progress_bar_config(disable=True)
        image = {}
        if request.image is not None:
            crf = _default_crf(pipe) if g["image_crf"] is None else g["image_crf"]
            image = {"image": png_to_image(request.image), "image_crf": crf}
        out = pipe(**reference_call(
            request, **image, stg_scale=g["stg_scale"], modality_scale=g["modality_scale"],
            guidance_rescale=g["guidance_rescale"], audio_guidance_scale=g["audio_guidance_scale"],
            audio_stg_scale=g["audio_stg_scale"], audio_modality_scale=g["audio_modality_scale"],
            audio_guidance_rescale=g["audio_guidance_rescale"], spatio_temporal_guidance_blocks=list(g["stg_blocks"]),
            use_cross_timestep=g["use_cross_timestep"], max_sequence_length=max_sequence_length(pipe)))
        return torch.cat([out.frames.flatten(1), out.audio.flatten(1)], dim=1)

    def decode_video(self, pipe, state, latents):
        import torch

        video, _ = self._streams(pipe, state, latents)
        vae = pipe.vae
        dtype = pipe.transformer.dtype  # the pipeline casts to the prompt embeddings' dtype first
        video = video.to(dtype)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = video.to(vae.dtype)
        # The pipeline's defaults: decode_timestep 0 and noise scale 0 (the latents as they are).
        timestep = torch.zeros(1, device=video.device, dtype=video.dtype) if vae.config.timestep_conditioning else None
        return vae.decode(video, timestep, return_dict=False)[0]

    def decode_audio(self, pipe, state, latents=None):
        _, audio = self._streams(pipe, state, latents)
        mel = pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0]
        waveform = pipe.vocoder(mel)[0]  # [channels, samples]
        rate = getattr(pipe.vocoder.config, "output_sampling_rate", None) or pipe.audio_sampling_rate
        return Audio(waveform=waveform.float().clamp(-1, 1).cpu().numpy(), sample_rate=int(rate), frame_rate=FRAME_RATE)


FAMILY = LTX2Family()


# -- the tiny pipelines ------------------------------------------------------------------------
TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 6  # video and audio (the cross-attention rotary table has the video's head count)
TINY_HEAD_DIM = 8
TINY_AUDIO_HEAD_DIM = 4
TINY_TEXT_DIM = 16  # Gemma 3 hidden size == connectors' caption_channels == transformer's
TINY_TEXT_LAYERS = 2
TINY_LATENT_CHANNELS = 8
TINY_MAX_TEXT = 32  # the tiny tokenizer's limit: the prompt length the pipeline pads to
TINY_DEFAULTS = {"num_frames": 17, "height": 32, "width": 416}


def tiny_transformer(seed: int, **overrides):
    """An LTX2VideoTransformer3DModel of the tiny geometry (or `overrides`), parameters from `seed`."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    from raydit.models.tiny import randomize

    config = dict(in_channels=TINY_LATENT_CHANNELS, out_channels=TINY_LATENT_CHANNELS, num_attention_heads=TINY_HEADS,
                  attention_head_dim=TINY_HEAD_DIM, audio_in_channels=4, audio_out_channels=4,
                  audio_num_attention_heads=TINY_HEADS, audio_attention_head_dim=TINY_AUDIO_HEAD_DIM, num_layers=2,
                  caption_channels=TINY_TEXT_DIM, rope_type="split", perturbed_attn=True, rope_double_precision=False)
    config.update(overrides)
    config.setdefault("cross_attention_dim", config["num_attention_heads"] * config["attention_head_dim"])
    config.setdefault("audio_cross_attention_dim", config["audio_num_attention_heads"] * config["audio_attention_head_dim"])
    torch.manual_seed(seed)
    return randomize(LTX2VideoTransformer3DModel(**config), seed)


def _tiny_text_encoder(vocab_size: int, seed: int):
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=TINY_TEXT_DIM, intermediate_size=32,
                            num_hidden_layers=TINY_TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, max_position_embeddings=64, sliding_window=16, pad_token_id=0,
                            eos_token_id=1, bos_token_id=1)
    vision = SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    # image tokens beyond the vocabulary: text prompts never contain them
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          boi_token_index=vocab_size + 1, eoi_token_index=vocab_size + 2,
                          image_token_index=vocab_size + 3)
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config).eval()


def _tiny_connectors(seed: int):
    import torch
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    from raydit.models.tiny import randomize

    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(
        caption_channels=TINY_TEXT_DIM, text_proj_in_factor=TINY_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_type="split",
        rope_double_precision=False)
    return randomize(connectors, seed)


def _tiny_vaes(seed: int):
    import torch
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        latent_channels=TINY_LATENT_CHANNELS, block_out_channels=(8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False), downsample_type=("spatiotemporal",) * 3,
        upsample_type=("spatiotemporal",) * 3, upsample_residual=(False,) * 3, upsample_factor=(1,) * 3,
        timestep_conditioning=False, patch_size=4, decoder_spatial_padding_mode="zeros",
    ).eval()  # patch 4 x 2^3 = 32x spatial, 2^3 = 8x temporal
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    ).eval()
    # 8 x 5 x 4 = 160 samples per mel frame: the hop, so the waveform lasts as the video
    vocoder = LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[16, 10, 8],
                          upsample_factors=[8, 5, 4], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000).eval()
    return vae, audio_vae, vocoder


def tiny_pipeline():
    """The tiny LTX2Pipeline, built in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    from raydit.models.tiny import SEED, tokenizer

    tok = tokenizer(TINY_MAX_TEXT)
    vae, audio_vae, vocoder = _tiny_vaes(SEED + 2)
    # LTX-2's scheduler: dynamic shift by the video token count.
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=1024,
                                                max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
                                                shift_terminal=0.1)
    return LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae,
                        text_encoder=_tiny_text_encoder(len(tok), SEED + 1), tokenizer=tok,
                        connectors=_tiny_connectors(SEED + 3), transformer=tiny_transformer(SEED + 10), vocoder=vocoder)


def tiny_i2v_pipeline():
    """The tiny LTX2ImageToVideoPipeline: the text-to-video one's components."""
    from diffusers import LTX2ImageToVideoPipeline

    components = {k: v for k, v in tiny_pipeline().components.items() if v is not None}
    return LTX2ImageToVideoPipeline(**components)


tiny_pipeline_dir = tiny_dir(f"tiny-ltx2-{TINY_VERSION}", tiny_pipeline, TINY_DEFAULTS)


tiny_i2v_pipeline_dir = tiny_dir(f"tiny-ltx2-i2v-{TINY_VERSION}", tiny_i2v_pipeline, TINY_DEFAULTS)


def ltx2_pipeline(base_dir: str):
    """The tiny LTX-2 pipeline loaded from its directory (as a real checkpoint is)."""
    return load_pipeline_dir(base_dir)


# -- conformance -------------------------------------------------------------------------------
_BUILD_PIPELINE = "raydit.models.families.ltx2:ltx2_pipeline"

# 17 frames at 32 x 416: 3 x 1 x 13 = 39 video tokens, 18 audio tokens; block 1 of 2 is STG's.
TINY_REQUEST = dict(prompt="a red fox barks", negative_prompt="blur", num_frames=17, height=32, width=416,
                    num_inference_steps=2, guidance_scale=3.0, seed=11, guidance_options={"stg_blocks": (1,)})
NO_STG_NO_MODALITY = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0}


_BUILD_FORWARD = "raydit.models.families.ltx2:ltx2_forward"


def ltx2_forward(latent_frames: int, latent_height: int, latent_width: int, audio_frames: int, valid: tuple,
                 text_len: int = 11, seed: int = 31, **call):
    """A tiny-weight LTX2VideoTransformer3DModel and the kwargs of one forward call: packed video
    [B, F*H*W, 8] and audio [B, audio_frames, 4] latents, one sample per entry of `valid` (its
    unmasked prompt tokens), `call`: further forward arguments (STG blocks, isolate_modalities)."""
    import torch

    transformer = tiny_transformer(seed)
    g = torch.Generator().manual_seed(7)
    batch = len(valid)
    kwargs = dict(
        hidden_states=torch.randn(batch, latent_frames * latent_height * latent_width, TINY_LATENT_CHANNELS,
                                  generator=g),
        audio_hidden_states=torch.randn(batch, audio_frames, 4, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        audio_encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_DIM, generator=g),
        timestep=torch.tensor([999.0, 421.0, 1.0][:batch]),
        encoder_attention_mask=(torch.arange(text_len).unsqueeze(0) >= text_len - torch.tensor(valid).unsqueeze(1)).long(),
        num_frames=latent_frames, height=latent_height, width=latent_width, fps=FRAME_RATE, audio_num_frames=audio_frames,
        use_cross_timestep=True,
    )
    kwargs["sigma"] = kwargs["timestep"]
    kwargs["audio_encoder_attention_mask"] = kwargs["encoder_attention_mask"]
    kwargs.update(call)
    return transformer, kwargs


def forward_cases() -> list:
    from raydit.models.conformance import ForwardCase

    return [
        # 3 x 1 x 13 = 39 video tokens (only 3 of 2..8 divides them), 18 audio tokens, 6 heads,
        # left-padded prompts of different lengths (Gemma's padding side)
        ForwardCase("ltx2-h6-39tokens", _BUILD_FORWARD, TINY_HEADS,
                    dict(latent_frames=3, latent_height=1, latent_width=13, audio_frames=18, valid=(4, 11))),
        # the guidance passes' switches: block 1's self-attention skipped (STG) and no audio<->video attention
        ForwardCase("ltx2-stg-isolated", _BUILD_FORWARD, TINY_HEADS,
                    dict(latent_frames=3, latent_height=1, latent_width=13, audio_frames=18, valid=(7,),
                         spatio_temporal_guidance_blocks=[1], isolate_modalities=True), worlds=(2,)),
        # the audio tokens split too (a plan's audio_split_tokens <= 18): 18 audio tokens make
        # uneven chunks on 4, 5 and 8 ranks; the same with block 1's self-attentions skipped (STG)
        ForwardCase("ltx2-audio-split", _BUILD_FORWARD, TINY_HEADS,
                    dict(latent_frames=3, latent_height=1, latent_width=13, audio_frames=18, valid=(4, 11)),
                    options={"audio_split_tokens": 18}),
        ForwardCase("ltx2-audio-split-stg", _BUILD_FORWARD, TINY_HEADS,
                    dict(latent_frames=3, latent_height=1, latent_width=13, audio_frames=18, valid=(7,),
                         spatio_temporal_guidance_blocks=[1]), worlds=(3,), options={"audio_split_tokens": 1}),
    ]


def runner_cases(base_dir: str, i2v_dir: str | None = None) -> list:
    """The main case on 2 and 4 ranks (the suite's time budget: its forward case runs every
    world): Ulysses, ring, hybrid, uneven chunks (39 tokens), cfg 2 (the [negative, positive]
    pass on one group, the STG and modality passes on the other) and cfg 4 (a pass per group);
    its variants on one world each."""
    from raydit.models.conformance import RunnerCase

    cases = [
        RunnerCase("ltx2-t2v", _BUILD_PIPELINE, TINY_HEADS, dict(TINY_REQUEST), dict(base_dir=base_dir),
                   worlds=(2, 4), branch_degrees=(2, 4)),
        # guidance without the perturbed passes: their slots are zeros
        RunnerCase("ltx2-t2v-cfg-only", _BUILD_PIPELINE, TINY_HEADS,
                   dict(TINY_REQUEST, seed=12, guidance_options=NO_STG_NO_MODALITY), dict(base_dir=base_dir),
                   cfg=False, worlds=(3,)),
        # the audio tokens split over the sp ranks as well (all four passes, cfg 2 and 4 on 4 ranks)
        RunnerCase("ltx2-t2v-audio-split", _BUILD_PIPELINE, TINY_HEADS, dict(TINY_REQUEST, seed=14),
                   dict(base_dir=base_dir), worlds=(4,), branch_degrees=(2, 4), options={"audio_split_tokens": 1}),
    ]
    if i2v_dir is not None:
        # the image's 13 tokens at timestep 0: per-token modulations split with the tokens
        cases.append(RunnerCase(
            "ltx2-i2v", _BUILD_PIPELINE, TINY_HEADS,
            dict(TINY_REQUEST, prompt="a kite climbs", seed=13, guidance_options={"stg_blocks": (0,), "image_crf": 0}),
            dict(base_dir=i2v_dir), image="checker", worlds=(2,)))
    return cases

