"""Joint attention of sharded video tokens and a masked text that stays whole on every rank.

HunyuanVideo, HunyuanVideo 1.5 and Mochi attend over [video | valid text]: the text is padded
to a fixed length, and how many of its tokens are valid varies per sample. Each rank holds its
chunk of the video and the whole text; the valid text joins the sequence as a second part
of the layout (each rank takes its share of it), so every valid text token is attended
exactly once across the ranks. Samples with the same valid length run together.

`JointTextProcessor` is the sequence-parallel processor those families share: the mask read
once per forward, the joint attention behind one opaque call (so a compiled block keeps one
graph), the outputs in the model's shapes. A family says only what differs: what its mask
covers (`valid_counts`), how the outputs leave the attention (`finish`) and, where its
blocks differ from the common projections, `text_projections` or `rotate`.

Legend: B batch, S this rank's video tokens, Lt text tokens (padded), H heads, D head dim,
C width.
"""

from __future__ import annotations

from raydit.models.adapter import GatherOutput, SequenceParallelPlan, SplitInput

TEXT = 1  # the valid text tokens: the second part of the joint layout
_COUNTS_CACHE = "__joint_text_valid__"  # ForwardContext.split_cache: (the mask, its counts)


def valid_text_counts(mask, text_len: int, batch: int, video_len: int = 0, name: str = "attention_mask",
                      how: str = "") -> list[int]:
    """Per sample, how many text tokens are valid, from a mask that is a prefix.

    mask: [B, video_len + Lt] (bool or 0/1; any shape that flattens to it per sample), True
    for a key to attend, or None (all valid); B may be 1 for the whole batch. With
    `video_len` the mask covers the joint sequence [video | text] and must keep every video
    token. Only a prefix of the text can be laid out exactly: any other mask is refused, with
    `how` (the model's own way of building it) in the one-line error.
    """
    import torch

    if mask is None:
        return [text_len] * batch
    mask = mask.reshape(mask.shape[0], -1).bool()
    if mask.shape[1] != video_len + text_len:
        covers = f"the joint sequence has {video_len} video + {text_len} text tokens" if video_len \
            else f"the text has {text_len}"
        raise ValueError(f"{name} covers {mask.shape[1]} tokens; {covers}")
    text = mask[:, video_len:]
    counts = text.sum(dim=1)
    prefix = torch.arange(text_len, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
    if not bool(mask[:, :video_len].all()) or not torch.equal(text, prefix):
        keep = "keep every video token and a prefix of the text tokens" if video_len \
            else "mark a prefix of the text tokens as valid"
        raise ValueError(f"{name} must {keep}{f' ({how})' if how else ''}")
    counts = [int(c) for c in counts.tolist()]
    return counts * batch if len(counts) == 1 and batch > 1 else counts


def joint_video_text_attention(q, k, v, tq, tk, tv, counts: list[int], mesh, video_len: int):
    """q, k, v [B, S, H, D] (this rank's video chunk), tq, tk, tv [B, Lt, H, D] (the whole
    text), counts: valid text tokens per sample, video_len: the whole video's tokens.
    -> (video [B, S, H, D], text [B, Lt, H, D] with masked rows zero), as one device gives."""
    import torch

    from raydit.parallel.attention import sp_attention
    from raydit.parallel.mesh import gather_sequence
    from raydit.parallel.sharding import SeqLayout

    S = q.shape[1]
    video_out = q.new_empty(q.shape)
    text_out = tq.new_zeros(tq.shape)
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(counts):
        groups.setdefault(n, []).append(b)
    for n, samples in groups.items():
        rows = slice(samples[0], samples[-1] + 1) if samples == list(range(samples[0], samples[-1] + 1)) else samples
        joint = SeqLayout((video_len, n), mesh.sp)  # the video chunks are the blocks' own

        def local(video_BSHD, text_BLHD):
            # [B, S + chunk_n, H, D] -> [B, H, S + chunk_n, D]: my video chunk, my share of the valid text
            mine = joint.shard(text_BLHD[rows, :n], TEXT, mesh.sp_index, dim=1)
            return torch.cat([video_BSHD[rows], mine], dim=1).transpose(1, 2)

        out = sp_attention(local(q, tq), local(k, tk), local(v, tv), mesh, joint).transpose(1, 2)
        video_out[rows] = out[:, :S]
        # Every rank's share of the valid text rows -> the whole valid text on every rank.
        text_out[rows, :n] = gather_sequence(out[:, S:], mesh, joint, TEXT, dim=1)
    return [video_out, text_out]


def joint_text_plan(blocks, attention: str = "attn", video_part: int = 0) -> SequenceParallelPlan:
    """The plan of blocks that take (hidden_states, encoder_hidden_states, ...) and return
    (video, text): only the video is split (before the first block) and gathered (after the
    last); the text stays whole on every rank, the processor joins its valid tokens."""
    return SequenceParallelPlan(blocks=blocks, split_inputs=(SplitInput("hidden_states", video_part),),
                                gather_outputs=(GatherOutput(0, video_part),), attention=attention)


def split_heads(attn, x_BLC):
    """[B, L, C] -> [B, L, H, D] with the attention module's head count."""
    return x_BLC.unflatten(2, (attn.heads, -1))


def norm(module, x):
    """A block's optional norm (None: x as it is)."""
    return x if module is None else module(x)


class JointTextProcessor:
    """Sequence-parallel processor of a block attending [this rank's video | the whole text].

    hidden_states: [B, S, C], this rank's video chunk; encoder_hidden_states: [B, Lt, Ct], the
    whole text; attention_mask: the model's mask (`valid_counts` reads it). Returns (video
    [B, S, C], text [B, Lt, Ct]) as the model's processor does.
    """

    video_part = 0  # the video's part in the blocks' layout

    def __init__(self, context):
        from raydit.parallel.opaque import register_call

        self.context = context
        # The joint attention reads the mask's values (how many text tokens are valid) to lay
        # the sequence out: data-dependent Python that torch.compile cannot keep in a graph,
        # so a compiled block calls it as one opaque op (raydit.parallel.opaque). Outputs:
        # video like q, text like tq. Every processor of a mesh registers under one name, so
        # every block runs one compiled graph (they share everything _joint reads).
        self._joint_key = register_call(self._joint, like=(0, 3), name=(type(self).__qualname__, context.mesh.key))

    # -- what a family says ----------------------------------------------------------------------
    def valid_counts(self, mask, video_len: int, text_len: int, batch: int) -> list[int]:
        """Valid text tokens per sample from the model's mask (valid_text_counts with the
        family's layout of it)."""
        raise NotImplementedError

    def project(self, attn, video, text, rotary):
        """-> q, k, v [B, S, H, D] of this rank's video (rotated by its share of `rotary`) and
        tq, tk, tv [B, Lt, H, D] of the whole text, as the model's processor computes them: the
        block's projections and (optional) norms of each stream, the video rotated."""
        q, k, v = (split_heads(attn, proj(video)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = norm(attn.norm_q, q), norm(attn.norm_k, k)
        if rotary is not None:
            q, k = self.rotate(q, k, rotary)
        projections, (norm_q, norm_k) = self.text_projections(attn)
        tq, tk, tv = (split_heads(attn, proj(text)) for proj in projections)
        return q, k, v, norm(norm_q, tq), norm(norm_k, tk), tv

    def text_projections(self, attn):
        """((q, k, v projections), (q, k norms)) of the text: the block's add_* ones."""
        return (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), (attn.norm_added_q, attn.norm_added_k)

    def rotate(self, q, k, rotary):
        """q, k [B, S, H, D] rotated by this rank's rows of the table of all video tokens
        (cos, sin [Lv, D]), with diffusers' apply_rotary_emb."""
        from diffusers.models.embeddings import apply_rotary_emb

        from raydit.parallel.sharding import shard_rotary

        freqs = shard_rotary(rotary, self.context.layout, self.context.mesh.sp_index, self.video_part, dim=0)
        return apply_rotary_emb(q, freqs, sequence_dim=1), apply_rotary_emb(k, freqs, sequence_dim=1)

    def finish(self, attn, video_BSC, text_BLC):
        """The attention's outputs [B, S, C] and [B, Lt, C] -> what the processor returns."""
        raise NotImplementedError

    # -- the shared skeleton ---------------------------------------------------------------------
    def _counts(self, mask, video_len: int, text_len: int, batch: int) -> list[int]:
        # The same mask tensor goes to every block of a forward: read it once (one host sync).
        cache = self.context.split_cache
        cached = cache.get(_COUNTS_CACHE)
        if cached is not None and cached[0] is mask:
            return cached[1]
        counts = self.valid_counts(mask, video_len, text_len, batch)
        cache[_COUNTS_CACHE] = (mask, counts)
        return counts

    def _joint(self, tensors, ints):
        """What opaque_call runs: tensors q, k, v, tq, tk, tv and the mask if any, ints
        [video_len] -> [video, text] of joint_video_text_attention."""
        q, k, v, tq, tk, tv = tensors[:6]
        mask = tensors[6] if len(tensors) > 6 else None
        (video_len,) = ints
        counts = self._counts(mask, video_len, tq.shape[1], q.shape[0])
        return joint_video_text_attention(q, k, v, tq, tk, tv, counts, self.context.mesh, video_len)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from raydit.parallel.opaque import opaque_call

        if encoder_hidden_states is None:
            raise ValueError(f"{type(self).__name__} needs the text tokens (encoder_hidden_states)")
        layout = self.context.layout
        if layout is None:
            raise RuntimeError("the split hook did not run before attention")
        assert hidden_states.shape[1] == layout.local_len, (hidden_states.shape, layout.local_len)
        q, k, v, tq, tk, tv = self.project(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        joint = [q, k, v, tq, tk, tv] + ([] if attention_mask is None else [attention_mask])
        video_out, text_out = opaque_call(self._joint_key, joint, [layout.part_lengths[self.video_part]])
        return self.finish(attn, video_out.flatten(2, 3).type_as(q), text_out.flatten(2, 3).type_as(q))
