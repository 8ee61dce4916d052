"""Adapter, plan and registry on one process (the multi-rank proof is the conformance suite)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from raydit.models import get_adapter, parallelize, register_adapter, supported_transformers, unparallelize
from raydit.models.adapter import GatherOutput, ModelAdapter, SequenceParallelPlan, SplitInput
from raydit.models.families.cogvideox.family import VIDEO, CogVideoXAdapter, CogVideoXSPAttnProcessor
from raydit.models.conformance import forward_once
from raydit.models.families.cogvideox.cases import cogvideox_forward
from raydit.parallel.mesh import build_mesh
from raydit.parallel.sharding import SeqLayout, shard_rotary


@pytest.fixture
def model_and_inputs():
    return cogvideox_forward(3, 6, 6, num_attention_heads=6, attention_head_dim=16,
                             use_rotary_positional_embeddings=True)


def test_get_adapter_finds_cogvideox(model_and_inputs):
    transformer, _ = model_and_inputs
    assert isinstance(get_adapter(transformer), CogVideoXAdapter)
    assert "CogVideoXTransformer3DModel" in supported_transformers()


def test_get_adapter_unsupported_names_class_and_supported():
    with pytest.raises(ValueError, match=r"no raydit adapter for Linear; supported: .*CogVideoXTransformer3DModel"):
        get_adapter(nn.Linear(2, 2))


def test_register_adapter_needs_classes():
    class Empty(ModelAdapter):
        transformer_classes = ()

    with pytest.raises(ValueError, match="transformer_classes is empty"):
        register_adapter(Empty)


def test_register_adapter_refuses_a_second_owner():
    from diffusers import CogVideoXTransformer3DModel

    class Other(ModelAdapter):
        transformer_classes = (CogVideoXTransformer3DModel,)

    with pytest.raises(ValueError, match="already has adapter CogVideoXAdapter"):
        register_adapter(Other)


def test_plan_validates_parts():
    with pytest.raises(ValueError, match="must be 0..n-1"):
        SequenceParallelPlan("blocks", (SplitInput("a", 0), SplitInput("b", 2)), (GatherOutput(0, 0),), "attn")
    with pytest.raises(ValueError, match="exactly the parts"):
        SequenceParallelPlan("blocks", (SplitInput("a", 0), SplitInput("b", 1)), (GatherOutput(0, 0),), "attn")


def test_parallelize_on_one_rank_is_exact_and_reversible(model_and_inputs):
    """sp = 1 runs the split hook, our processor, sp_attention and the gather hook."""
    transformer, kwargs = model_and_inputs
    originals = [b.attn1.processor for b in transformer.transformer_blocks]
    ref = forward_once(transformer, kwargs)

    handle = parallelize(transformer, build_mesh(1))
    assert all(isinstance(b.attn1.processor, CogVideoXSPAttnProcessor) for b in transformer.transformer_blocks)
    torch.testing.assert_close(forward_once(transformer, kwargs), ref, rtol=1e-5, atol=1e-6)

    handle.remove()
    assert [b.attn1.processor for b in transformer.transformer_blocks] == originals
    assert not transformer.transformer_blocks[0]._forward_pre_hooks
    assert not transformer.transformer_blocks[-1]._forward_hooks
    assert torch.equal(forward_once(transformer, kwargs), ref)
    handle.remove()  # a second remove is a no-op


def test_parallelize_twice_is_refused(model_and_inputs):
    transformer, _ = model_and_inputs
    with parallelize(transformer, build_mesh(1)):
        with pytest.raises(ValueError, match="already parallelized by raydit .*handle.remove"):
            parallelize(transformer, build_mesh(1))
    parallelize(transformer, build_mesh(1))  # allowed again once removed
    unparallelize(transformer)
    unparallelize(transformer)  # no-op
    assert isinstance(get_adapter(transformer).parallelize(transformer, build_mesh(1)).transformer, nn.Module)
    unparallelize(transformer)


def test_ulysses_must_divide_heads(model_and_inputs):
    transformer, _ = model_and_inputs
    mesh = dataclasses.replace(build_mesh(1), ulysses=4)
    with pytest.raises(ValueError, match=r"^ulysses_degree 4 does not divide the 6 attention heads; feasible: 1, 2, 3, 6$"):
        parallelize(transformer, mesh)
    assert all(not isinstance(b.attn1.processor, CogVideoXSPAttnProcessor) for b in transformer.transformer_blocks)


def test_fused_projections_are_refused(model_and_inputs):
    transformer, _ = model_and_inputs
    transformer.fuse_qkv_projections()
    with pytest.raises(ValueError, match="unfuse_qkv_projections"):
        parallelize(transformer, build_mesh(1))


@pytest.mark.parametrize("video_len, sp", [(10, 4), (27, 6), (12, 3), (5, 8)])
def test_shard_rotary_chunks_rebuild_the_table(video_len, sp):
    layout = SeqLayout(part_lengths=(13, video_len), sp=sp)
    cos = torch.arange(video_len * 4, dtype=torch.float32).view(video_len, 4)
    sin = -cos
    chunks = [shard_rotary((cos, sin), layout, s, VIDEO, dim=0) for s in range(sp)]
    chunk = layout.chunk_lengths[1]
    assert all(c.shape == (chunk, 4) and s.shape == (chunk, 4) for c, s in chunks)
    torch.testing.assert_close(torch.cat([c for c, _ in chunks])[:video_len], cos, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s for _, s in chunks])[:video_len], sin, rtol=0, atol=0)
    assert not torch.cat([c for c, _ in chunks])[video_len:].any()  # pad rows are zero


def test_shard_rotary_refuses_a_table_of_another_size():
    layout = SeqLayout(part_lengths=(13, 10), sp=2)
    with pytest.raises(ValueError, match="rotary table has 12 rows but the video has 10 tokens"):
        shard_rotary((torch.zeros(12, 4), torch.zeros(12, 4)), layout, 0, VIDEO, dim=0)


def test_split_hook_binds_positional_arguments(model_and_inputs):
    """A block called with positional tensors is sharded the same as with keywords."""
    transformer, kwargs = model_and_inputs
    block = transformer.transformer_blocks[0]
    with torch.no_grad():
        hidden = torch.randn(2, 27, 96)
        text = torch.randn(2, 13, 96)
        temb = torch.randn(2, transformer.config.time_embed_dim)
        ref = block(hidden, text, temb, kwargs["image_rotary_emb"])
        with parallelize(transformer, build_mesh(1)):
            # one block: split before it, gather after the last block (not this one)
            out = block(hidden, text, temb, kwargs["image_rotary_emb"])
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-6)
