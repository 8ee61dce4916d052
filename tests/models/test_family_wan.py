"""The Wan family on one process: adapter, request checks, spec from a directory, resume.

Every parallel plan against one process is in tests/models/test_conformance.py (the Wan
cases come from raydit/models/families/wan/cases.py); the runner against diffusers' own pipelines
too, for the cases listed there. Here: what needs no process group.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raydit.models import conformance as harness
from raydit.models.adapter import GatherOutput, SequenceParallelPlan, SplitInput
from raydit.models.families.wan import cases, family, tiny
from raydit.models.requests import GenerationRequest, checker_image, image_to_png
from raydit.models.registry import get_adapter, supported_transformers
from raydit.models.runner import Runner
from raydit.parallel.mesh import build_mesh
from raydit.parallel.sharding import SeqLayout, shard_rotary


@pytest.fixture(scope="module")
def pipelines():
    """Loaders of the tiny pipelines (built once into the session's cache)."""
    return {name: (lambda d=str(make()): cases.wan_pipeline(d)) for name, make in family.FAMILY.tiny().items()}


def _request(**kw):
    base = dict(prompt="a red fox", num_frames=9, height=48, width=80, num_inference_steps=3, guidance_scale=5.0,
                seed=3)
    base.update(kw)
    return GenerationRequest(**base)


def _image(height=48, width=80):
    return image_to_png(checker_image(height, width))


# -- adapter -----------------------------------------------------------------------------------
def test_registry_finds_the_wan_adapter():
    transformer, _ = cases.wan_forward("t2v", 1, 2, 2, heads=2, head_dim=12)
    assert isinstance(get_adapter(transformer), family.WanAdapter)
    assert "WanTransformer3DModel" in supported_transformers()


@pytest.mark.parametrize("kind", ["t2v", "i2v", "ti2v"])
def test_one_rank_is_exact_and_reversible(kind):
    """sp = 1 runs the split hooks (every block's for a per-token temb), our processor with
    the cut rotary table, sp_attention and the gather hook: the same numbers as diffusers."""
    transformer, kwargs = cases.wan_forward(kind, 3, 4, 6, heads=6, head_dim=12)
    originals = [(b.attn1.processor, b.attn2.processor) for b in transformer.blocks]
    ref = harness.forward_once(transformer, kwargs)
    handle = family.WanAdapter().parallelize(transformer, build_mesh(1))
    assert all(isinstance(b.attn1.processor, family.WanSPAttnProcessor) for b in transformer.blocks)
    assert all(b.attn2.processor is o[1] for b, o in zip(transformer.blocks, originals))  # cross-attention kept
    # temb may be per token: every block gets a split hook.
    assert all(len(b._forward_pre_hooks) == 1 for b in transformer.blocks)
    torch.testing.assert_close(harness.forward_once(transformer, kwargs), ref, rtol=1e-6, atol=1e-6)
    handle.remove()
    assert [(b.attn1.processor, b.attn2.processor) for b in transformer.blocks] == originals
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in transformer.blocks)
    assert torch.equal(harness.forward_once(transformer, kwargs), ref)


def test_our_rotation_is_the_models():
    """The processor's rotary, dropped, changes the output: the table really is applied."""
    transformer, kwargs = cases.wan_forward("t2v", 3, 4, 6, heads=6, head_dim=12)
    ref = harness.forward_once(transformer, kwargs)
    with family.WanAdapter().parallelize(transformer, build_mesh(1)):
        original, family.rotate_pairs = family.rotate_pairs, (lambda x, c, s: x)
        try:
            unrotated = harness.forward_once(transformer, kwargs)
        finally:
            family.rotate_pairs = original
    assert (unrotated - ref).abs().max() > 1e-3


def test_shard_rotary_pads_and_checks_length():
    cos = torch.arange(7.0).view(1, 7, 1, 1).expand(1, 7, 1, 4)
    layout = SeqLayout(part_lengths=(7,), sp=3)  # chunks of 3: the last holds 1 real row
    c, s = shard_rotary((cos, cos), layout, 2, family.VIDEO, dim=1)
    assert c.shape == (1, 3, 1, 4) and c[0, :, 0, 0].tolist() == [6.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rotary table has 7 rows but the video has 8 tokens"):
        shard_rotary((cos, cos), SeqLayout(part_lengths=(8,), sp=2), 0, family.VIDEO, dim=1)


def test_validate_names_feasible_ulysses_degrees():
    transformer, _ = cases.wan_forward("t2v", 1, 2, 2, heads=40, head_dim=6)
    with pytest.raises(ValueError, match=r"ulysses_degree 3 does not divide the 40 attention heads; feasible: 1, 2, 4, 5"):
        family.WanAdapter().validate(transformer, SimpleNamespace(ulysses=3))


def test_plan_needs_an_input_that_fixes_each_part():
    with pytest.raises(ValueError, match="part 0 needs a split input without `ndim`"):
        SequenceParallelPlan("blocks", (SplitInput("temb", 0, ndim=4),), (GatherOutput(0, 0),), "attn1")
    plan = family.WanAdapter.plan
    assert plan.num_parts == 1
    assert [s.applies_to(torch.zeros(2, 6, 8)) for s in plan.split_inputs] == [True, False]
    assert [s.applies_to(torch.zeros(2, 5, 6, 8)) for s in plan.split_inputs] == [True, True]


# -- requests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, change, message", [
    ("tiny-wan", dict(image=True), "WanPipeline is a text-to-video pipeline and takes no image"),
    ("tiny-wan-i2v", dict(), "WanImageToVideoPipeline is an image-to-video pipeline; give an image"),
    ("tiny-wan", dict(guidance_scale_2=3.0), "guidance_scale_2 3.0 needs a two-expert pipeline"),
    ("tiny-wan", dict(num_frames=10), "num_frames 10 must be 4k \\+ 1; nearest: 9 or 13"),
    ("tiny-wan", dict(height=40), "height 40 must be a multiple of 16 .*nearest: 32 or 48"),
    ("tiny-wan-ti2v", dict(height=64, width=80), "width 80 must be a multiple of 32 \\(VAE scale 16 x patch 2\\); nearest: 64 or 96"),
])
def test_bad_requests_get_one_line(pipelines, name, change, message):
    image = _image() if change.pop("image", False) else None
    with pytest.raises(ValueError, match=message) as info:
        Runner(pipelines[name]()).prepare(_request(image=image, **change))
    assert "\n" not in str(info.value)


def test_ti2v_takes_an_image_or_none(pipelines):
    """TI2V-5B is saved as a WanPipeline and runs both text- and image-to-video."""
    runner = Runner(pipelines["tiny-wan-ti2v"]())
    for image in (None, _image(64, 96)):
        state = runner.prepare(_request(height=64, width=96, image=image))
        assert state.latents.shape == (1, 8, 3, 4, 6)


# -- spec from a directory ----------------------------------------------------------------------
def test_spec_from_the_tiny_directories():
    from raydit.planner import model_spec

    specs = {name: model_spec(str(make())) for name, make in family.FAMILY.tiny().items()}
    for spec in specs.values():
        assert (spec.family, spec.heads, spec.head_dim, spec.layers, spec.ffn_hidden) == ("wan", 6, 12, 2, 96)
        assert (spec.patch_size, spec.patch_size_t, spec.text_tokens, spec.text_in_sequence) == (2, 1, 512, False)
    assert [specs[n].experts for n in tiny.TINY_VARIANTS] == [1, 2, 1, 1, 2]
    assert [specs[n].in_channels for n in tiny.TINY_VARIANTS] == [4, 4, 8, 12, 12]
    assert [specs[n].vae_spatial for n in tiny.TINY_VARIANTS] == [8, 8, 16, 8, 8]
    # the image encoder counts with the text encoder
    assert specs["tiny-wan-i2v"].text_encoder_params > specs["tiny-wan"].text_encoder_params
    # request defaults small enough for a CPU demo, from the directory's raydit_defaults.json
    assert [(s.default_frames, s.default_height, s.default_width) for s in specs.values()] == [
        (9, 48, 80), (9, 48, 80), (9, 64, 96), (9, 48, 80), (9, 48, 80)]
    assert specs["tiny-wan"].geometry().video_tokens == 3 * 3 * 5


# -- steps against diffusers, resume -------------------------------------------------------------
def test_wan22_i2v_two_experts_match_diffusers(pipelines):
    """Wan 2.2 I2V A14B (no image encoder), guidance_scale_2 unset (both experts use
    guidance_scale): one process == WanImageToVideoPipeline(output_type="latent")."""
    pipe = pipelines["tiny-wan-a14b-i2v"]()
    request = _request(prompt="a kite", num_frames=5, height=48, width=64, seed=4, image=_image(48, 64))
    expected = family.FAMILY.reference_latents(pipe, request)
    state = harness.run_steps(Runner(pipe), request, request.num_inference_steps)
    assert float((state.latents - expected).abs().max() / expected.abs().max()) <= 1e-5


def test_without_guidance_one_branch_matches_diffusers(pipelines):
    pipe = pipelines["tiny-wan"]()
    request = _request(guidance_scale=1.0, num_inference_steps=2)
    expected = family.FAMILY.reference_latents(pipe, request)
    state = harness.run_steps(Runner(pipe), request, 2)
    assert len(state.branches) == 1
    torch.testing.assert_close(state.latents, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("at", [1, 3])
def test_resume_on_a_fresh_runner_is_exact(pipelines, at):
    """UniPC's multistep history and the expert switch (timesteps 999, 923 | 818, 667, 429)
    survive a checkpoint taken before (at 1) and after (at 3) the switch, resumed on a newly
    loaded pipeline. Stopped at step 4: the schedule's last update ignores the history."""
    request = _request(num_frames=5, num_inference_steps=5, guidance_scale_2=2.0, seed=8)
    first = Runner(pipelines["tiny-wan-a14b"]())
    checkpoint = first.checkpoint(harness.run_steps(first, request, at))
    straight = harness.run_steps(first, request, 4).latents
    resumed = harness.run_steps(Runner(pipelines["tiny-wan-a14b"]()), request, 4, checkpoint=checkpoint).latents
    assert torch.equal(resumed, straight)
    # The history matters: without it the resumed step differs.
    checkpoint["scheduler_state"] = {k: v for k, v in checkpoint["scheduler_state"].items()
                                     if k not in ("model_outputs", "timestep_list", "last_sample", "lower_order_nums")}
    other = harness.run_steps(Runner(pipelines["tiny-wan-a14b"]()), request, 4, checkpoint=checkpoint).latents
    assert not torch.equal(other, straight)


def test_decode_gives_frames(pipelines):
    runner = Runner(pipelines["tiny-wan-ti2v"]())
    state = harness.run_steps(runner, _request(height=64, width=96, num_inference_steps=1, image=_image(64, 96)), 1)
    frames = runner.decode(state)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype.name == "uint8"
    # With an image, the first latent frame is the image's (the pipeline's output has it).
    torch.testing.assert_close(state.latents[:, :, :1], state.context["condition"][:, :, :1], rtol=0, atol=0)
