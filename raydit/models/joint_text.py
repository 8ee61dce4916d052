"""Joint attention of sharded video tokens and a masked text that stays whole on every rank.

HunyuanVideo and HunyuanVideo 1.5 attend over [video | valid text]: the text is padded to a
fixed length, and how many of its tokens are valid varies per sample. Each rank holds its
chunk of the video and the whole text; the valid text joins the sequence as a second part
of the layout (each rank takes its share of it), so every valid text token is attended
exactly once across the ranks. Samples with the same valid length run together.

Legend: B batch, S this rank's video tokens, Lt text tokens (padded), H heads, D head dim.
"""

from __future__ import annotations

TEXT = 1  # the valid text tokens: the second part of the joint layout


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


def joint_call(tensors, ints, mesh, counts_of):
    """The form a processor registers with raydit.parallel.opaque: tensors q, k, v, tq, tk, tv
    and the joint mask if any, ints [video_len]; `counts_of(mask, video_len, text_len, batch)`
    gives the valid text tokens per sample. -> [video, text] of joint_video_text_attention."""
    q, k, v, tq, tk, tv = tensors[:6]
    attention_mask = tensors[6] if len(tensors) > 6 else None
    (video_len,) = ints
    counts = counts_of(attention_mask, video_len, tq.shape[1], q.shape[0])
    return joint_video_text_attention(q, k, v, tq, tk, tv, counts, mesh, video_len)
