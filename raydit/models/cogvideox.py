"""CogVideoX adapter: sequence parallelism for diffusers' CogVideoXTransformer3DModel.

Covers CogVideoX-2b (sinusoidal positions, added in the patch embedding before the split),
CogVideoX-5b (rotary positions, applied per rank in the processor), CogVideoX1.5
(patch_size_t = 2) and the image-to-video variants (image latents joined in the channels,
which only changes the patch embedding, before the split).

The model is left as diffusers built it. After the patch embedding the model slices its
sequence into text (encoder_hidden_states) and video (hidden_states) and passes both to each
block; the split hook shards both per the layout, every block then works on
[text chunk s | video chunk s], and the gather hook restores both after the last block,
before the final norm and projection.

Legend: B batch, H heads, L local sequence (text chunk + video chunk), D head dim, C = H*D.
"""

from __future__ import annotations

import torch

from raydit.models.adapter import (
    ForwardContext,
    GatherOutput,
    ModelAdapter,
    SequenceParallelPlan,
    SplitInput,
)
from raydit.models.registry import register_adapter
from raydit.parallel.attention import feasible_ulysses

TEXT, VIDEO = 0, 1  # part indices of the layout: text first, then video (docs/design.md)


def shard_rotary(freqs: tuple[torch.Tensor, torch.Tensor], layout, sp_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the rotary table of all video tokens down to this rank's video chunk.

    cos, sin: [L_video, D] -> [chunk_video, D], zero rows for pad tokens (pad queries are
    dropped at gather and pad keys are masked, so their rotation is irrelevant).
    """
    cos, sin = freqs
    if cos.shape[0] != layout.part_lengths[VIDEO]:
        raise ValueError(
            f"rotary table has {cos.shape[0]} rows but the video has {layout.part_lengths[VIDEO]} tokens; "
            "build image_rotary_emb for the same frames/height/width as the latents"
        )
    return (layout.shard(cos, VIDEO, sp_index, dim=0), layout.shard(sin, VIDEO, sp_index, dim=0))


class CogVideoXSPAttnProcessor:
    """Sequence-parallel replacement for CogVideoX's attention processor.

    Projections, QK layer norms and rotary are per token, so they run on the local chunk as in
    the single-device model; only the attention itself needs the other ranks (sp_attention).
    """

    def __init__(self, context: ForwardContext):
        self.context = context

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.embeddings import apply_rotary_emb

        from raydit.parallel.attention import sp_attention

        if attention_mask is not None:
            raise ValueError("attention_mask is not supported under sequence parallelism; CogVideoX does not use one")
        mesh, layout = self.context.mesh, self.context.layout
        assert layout is not None, "split hook did not run before attention"
        text_len = encoder_hidden_states.shape[1]  # this rank's text chunk
        x_BLC = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        B, L, _ = x_BLC.shape
        assert L == layout.local_len, (L, layout.local_len)

        def heads(t_BLC: torch.Tensor) -> torch.Tensor:
            # [B, L, C] -> [B, H, L, D]
            return t_BLC.view(B, L, attn.heads, -1).transpose(1, 2)

        q_BHLD, k_BHLD, v_BHLD = heads(attn.to_q(x_BLC)), heads(attn.to_k(x_BLC)), heads(attn.to_v(x_BLC))
        if attn.norm_q is not None:
            q_BHLD = attn.norm_q(q_BHLD)
        if attn.norm_k is not None:
            k_BHLD = attn.norm_k(k_BHLD)

        if image_rotary_emb is not None:
            # Rotary applies to video tokens only; the table covers all video tokens, so take
            # the rows of this rank's video chunk.
            freqs = shard_rotary(image_rotary_emb, layout, mesh.sp_index)
            q_BHLD = torch.cat([q_BHLD[:, :, :text_len], apply_rotary_emb(q_BHLD[:, :, text_len:], freqs)], dim=2)
            if not attn.is_cross_attention:
                k_BHLD = torch.cat([k_BHLD[:, :, :text_len], apply_rotary_emb(k_BHLD[:, :, text_len:], freqs)], dim=2)

        out_BHLD = sp_attention(q_BHLD, k_BHLD, v_BHLD, mesh, layout)
        out_BLC = out_BHLD.transpose(1, 2).reshape(B, L, -1)
        out_BLC = attn.to_out[1](attn.to_out[0](out_BLC))  # linear, dropout
        text_out, video_out = out_BLC.split([text_len, L - text_len], dim=1)
        return video_out, text_out


def _cogvideox_classes() -> tuple[type, ...]:
    from diffusers import CogVideoXTransformer3DModel

    return (CogVideoXTransformer3DModel,)


@register_adapter
class CogVideoXAdapter(ModelAdapter):
    name = "cogvideox"
    transformer_classes = _cogvideox_classes()
    plan = SequenceParallelPlan(
        blocks="transformer_blocks",
        # CogVideoXBlock.forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb, ...)
        split_inputs=(SplitInput("encoder_hidden_states", TEXT), SplitInput("hidden_states", VIDEO)),
        # CogVideoXBlock returns (hidden_states, encoder_hidden_states)
        gather_outputs=(GatherOutput(0, VIDEO), GatherOutput(1, TEXT)),
        attention="attn1",
    )

    def validate(self, transformer, mesh) -> None:
        heads = transformer.config.num_attention_heads
        if heads % mesh.ulysses != 0:
            raise ValueError(
                f"ulysses_degree {mesh.ulysses} does not divide the {heads} attention heads; "
                f"feasible: {', '.join(map(str, feasible_ulysses(heads)))}"
            )
        for block in getattr(transformer, self.plan.blocks):
            if getattr(getattr(block, self.plan.attention), "fused_projections", False):
                raise ValueError("the transformer has fused QKV projections; call transformer.unfuse_qkv_projections() first")

    def make_processor(self, context: ForwardContext) -> CogVideoXSPAttnProcessor:
        return CogVideoXSPAttnProcessor(context)
