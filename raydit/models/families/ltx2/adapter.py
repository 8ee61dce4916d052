"""LTX-2's sequence parallelism: the plan (which inputs are split, which outputs gathered) and
the attention processors of its two streams.

Sequence parallelism. The video tokens are split over the sp ranks as for LTX-Video (before
the first block, gathered after the last). The audio tokens are split too, or stay whole on
every rank, by their length: the plan's `audio_split_tokens` (parallelize options; the
planner's cost model sets it, raydit.planner.cost.audio_split_tokens) is the length from which
splitting them pays; a forward with fewer audio tokens (or a plan without it) keeps them whole.
La is ~25 per second of sound, 1-2 % of the video's tokens at 512 x 768, so short clips keep
them whole; the collectives a split adds per block cost more than the work it saves there.
Per block:
  attn1 / audio_attn1 (self-attention)  Ulysses / ring over the stream's chunks (sp_attention)
                                     where the stream is split, its rotary table cut to this
                                     rank's chunk; the STG pass's perturbed blocks use the
                                     values alone (per token, local); a whole audio stream
                                     keeps diffusers' processor;
  attn2 / audio_attn2 (-> prompt)    local queries, the whole prompt: diffusers' processor;
  audio_to_video_attn               local video queries attend to every audio key: whole
                                     audio: diffusers' processor, the query rotary table cut;
                                     split audio: the audio keys (normed, rotated) and values of
                                     each chunk are all-gathered, pads dropped, then attended;
  video_to_audio_attn               every audio query (this rank's chunk, or all) must see
                                     every video token once: the video keys and values of each
                                     chunk are all-gathered, pads dropped (gather_sequence);
                                     a whole audio stream is the same on every rank.
Per-token timestep embeddings (image-to-video: temb and, without use_cross_timestep, the
cross-attention modulations are [B, Lv, k C]) are split with the tokens of their stream.
"""

from __future__ import annotations

from raydit.models.adapter import GatherOutput, ModelAdapter, SequenceParallelPlan, SplitInput, attend

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
