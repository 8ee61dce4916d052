"""Kandinsky 5: what the shared conformance suite does not cover.

The suite (tests/models/test_conformance.py) runs the family's cases on every plan and checks
one process against diffusers' own pipelines (float32 1e-5, bf16 and fp16 bit for bit). Here:
the tiny tokenizer's template (the pipeline's 128-token crop leaves the prompt), guidance off,
the empty negative prompt, frame rounding, the one-line refusals (bad requests, NABLA sparse
attention and a Ulysses degree that does not divide the heads under sequence parallelism).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raydit.models.requests import GenerationRequest, checker_image, image_to_png
from raydit.models.families.kandinsky5 import cases as k5_cases
from raydit.models.families.kandinsky5 import family as k5
from raydit.models.families.kandinsky5 import tiny as k5_tiny
from raydit.models.runner import Runner
from raydit.parallel.mesh import build_mesh


@pytest.fixture(scope="module")
def pipe():
    return k5_cases.kandinsky5_pipeline(str(k5_tiny.tiny_pipeline_dir()))


@pytest.fixture(scope="module")
def i2v_pipe():
    return k5_cases.kandinsky5_pipeline(str(k5_tiny.tiny_i2v_pipeline_dir()))


REQUEST = GenerationRequest(prompt="a red fox runs", negative_prompt="blur", num_frames=5, height=32, width=48,
                            num_inference_steps=2, guidance_scale=3.0, seed=3)


def test_the_prompt_survives_the_template_crop(pipe):
    """The tiny chat template is 128 tokens before the prompt, the pipeline's crop: what the
    transformer sees is the prompt's own tokens ("a", "c", "##a", "##t") and <|im_end|>."""
    a, pooled_a, cu_a = pipe.encode_prompt("a cat", device="cpu")
    b, pooled_b, _ = pipe.encode_prompt("a dog", device="cpu")
    assert a.shape == (1, 5, k5_tiny.TINY_TEXT_DIM) and cu_a.tolist() == [0, 5]
    assert pooled_a.shape == (1, k5_tiny.TINY_POOLED_DIM)
    assert not torch.equal(a, b) and not torch.equal(pooled_a, pooled_b)


def test_guidance_off_runs_one_branch_as_the_pipeline(pipe):
    """guidance_scale 1: one transformer call per step, no negative prompt encoded; the same
    latents as diffusers' pipeline (float32, 1e-5)."""
    request = dataclasses.replace(REQUEST, guidance_scale=1.0)
    runner = Runner(pipe)
    state = runner.prepare(request)
    assert len(state.branches) == 1 and state.branch_count == 1
    while not state.done:
        state = runner.step(state)
    expected = k5.FAMILY.reference_latents(pipe, request)
    torch.testing.assert_close(state.latents, expected, rtol=1e-5, atol=1e-5)


def test_an_empty_negative_prompt_is_the_pipelines_default(pipe):
    """negative_prompt "" runs the pipeline's default negative prompt (its negative_prompt=None:
    the text both pipelines' __call__ set, read from their source), which differs from an
    explicit one."""
    import inspect
    import re

    from diffusers import Kandinsky5I2VPipeline, Kandinsky5T2VPipeline

    for cls in (Kandinsky5T2VPipeline, Kandinsky5I2VPipeline):
        found = re.findall(r'negative_prompt = "([^"]+)"', inspect.getsource(cls.__call__))
        assert found == [k5.DEFAULT_NEGATIVE_PROMPT], (cls.__name__, found)
    runner = Runner(pipe)
    empty = runner.prepare(dataclasses.replace(REQUEST, negative_prompt=""))
    default = runner.prepare(dataclasses.replace(REQUEST, negative_prompt=k5.DEFAULT_NEGATIVE_PROMPT))
    blur = runner.prepare(REQUEST)
    assert torch.equal(empty.branches[0]["encoder_hidden_states"], default.branches[0]["encoder_hidden_states"])
    assert empty.branches[0]["encoder_hidden_states"].shape != blur.branches[0]["encoder_hidden_states"].shape


def test_frames_round_as_the_pipeline():
    assert [k5.FAMILY.round_frames(n, 4) for n in (5, 6, 8, 12, 13)] == [5, 5, 9, 13, 13]


@pytest.mark.parametrize("change, message", [
    (dict(num_frames=8), "num_frames 8 must be 4k \\+ 1; nearest: 5 or 9"),
    (dict(height=40), "height 40 must be a multiple of 16 .*; nearest: 32 or 48"),
    (dict(width=8), "width 8 must be a multiple of 16 .*; nearest: 16"),
    (dict(guidance_scale_2=2.0), "guidance_scale_2 is for two-expert pipelines"),
    (dict(true_cfg_scale=2.0), "true_cfg_scale 2 is for pipelines whose guidance is embedded"),
    (dict(image=image_to_png(checker_image(32, 48))), "text-to-video pipeline and takes no image"),
])
def test_bad_requests_get_one_line(pipe, change, message):
    with pytest.raises(ValueError, match=message) as err:
        Runner(pipe).prepare(dataclasses.replace(REQUEST, **change))
    assert "\n" not in str(err.value)


def test_a_time_embedding_cast_off_float32_is_refused_in_one_line():
    """diffusers' model breaks (a dtype mismatch deep in the forward) when its time embedding is
    cast with .to(bfloat16) or to float64: the runner refuses such a pipeline up front."""
    for dtype in (torch.bfloat16, torch.float64):
        cast = k5_cases.kandinsky5_pipeline(str(k5_tiny.tiny_pipeline_dir())).to(dtype=dtype)
        with pytest.raises(ValueError, match="time embedding is .* needs it float32: load the pipeline with") as err:
            Runner(cast, dtype=dtype).prepare(REQUEST)
        assert "\n" not in str(err.value)


def test_i2v_needs_an_image_and_five_latent_frames(i2v_pipe):
    """The I2V pipeline renormalizes latent frames 0-3 against the next ones: with fewer than 5
    latent frames its output is NaN, so such a request is refused in one line."""
    image = image_to_png(checker_image(32, 48))
    with pytest.raises(ValueError, match="num_frames 9 is too few for Kandinsky5I2VPipeline.*at least 17") as err:
        Runner(i2v_pipe).prepare(dataclasses.replace(REQUEST, num_frames=9, image=image))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="image-to-video pipeline; give an image"):
        Runner(i2v_pipe).prepare(REQUEST)


def test_nabla_attention_is_refused_under_sequence_parallelism():
    """NABLA's block mask needs the whole sequence: parallelizing such a transformer is refused
    in one line, and the processor refuses sparse parameters should they reach it."""
    transformer = k5_tiny.tiny_transformer(1, attention_type="nabla", attention_P=0.9, attention_wT=11,
                                      attention_wH=3, attention_wW=3, attention_add_sta=True,
                                      attention_method="topcdf")
    mesh = dataclasses.replace(build_mesh(1), ulysses=2)
    with pytest.raises(ValueError, match="attention_type 'nabla' .* cannot run under sequence parallelism") as err:
        k5.Kandinsky5Adapter().validate(transformer, mesh)
    assert "\n" not in str(err.value)
    from raydit.models.adapter import ForwardContext

    processor = k5.Kandinsky5SPAttnProcessor(ForwardContext(mesh=mesh))
    block = transformer.visual_transformer_blocks[0].self_attention
    with pytest.raises(ValueError, match="NABLA sparse attention .* cannot run under sequence parallelism"):
        processor(block, torch.zeros(1, 4, 48), sparse_params={"sta_mask": None})


def test_ulysses_must_divide_the_heads():
    transformer = k5_tiny.tiny_transformer(1)  # 6 heads: model_dim 48 / head dim 8
    mesh = dataclasses.replace(build_mesh(1), ulysses=4)
    with pytest.raises(ValueError, match=r"^ulysses_degree 4 does not divide the 6 attention heads; feasible: 1, 2, 3, 6$"):
        k5.Kandinsky5Adapter().validate(transformer, mesh)


# Kandinsky5Transformer3DModel configs of the released checkpoints, as kandinskylab's configs set
# them (configs/k5_lite_t2v_*.yaml, k5_pro_{t2v,i2v}_*.yaml, whose dit_params the Diffusers
# conversions carry; nothing can be downloaded here).
_RELEASED_COMMON = dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768,
                        patch_size=(1, 2, 2), visual_cond=True)
_LITE = dict(_RELEASED_COMMON, time_dim=512, model_dim=1792, ff_dim=7168, num_text_blocks=2, num_visual_blocks=32,
             axes_dims=(16, 24, 24))
_PRO = dict(_RELEASED_COMMON, time_dim=1024, model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=60,
            axes_dims=(32, 48, 48))


@pytest.mark.parametrize("name, config", [("kandinsky5-t2v-lite", _LITE), ("kandinsky5-t2v-pro", _PRO),
                                          ("kandinsky5-i2v-pro", _PRO)])
def test_builtin_matches_the_released_transformer_config(tmp_path, name, config):
    """Each planner built-in's shape and parameter count (within 1%) is what diffusers builds
    from the released config on the meta device; the family's spec_from_dir reads the same
    geometry from a directory holding that config."""
    import json

    import diffusers
    from accelerate import init_empty_weights

    import raydit

    with init_empty_weights():
        model = diffusers.Kandinsky5Transformer3DModel(**config)
    params = sum(p.numel() for p in model.parameters())
    spec = raydit.model_spec(name)
    attn = model.visual_transformer_blocks[0].self_attention
    assert (spec.heads, spec.head_dim, spec.layers) == (attn.num_heads, sum(config["axes_dims"]), len(model.visual_transformer_blocks))
    assert spec.ffn_hidden == model.visual_transformer_blocks[0].feed_forward.in_layer.out_features
    assert spec.in_channels == model.visual_embeddings.in_layer.in_features // 4  # patch 1 x 2 x 2
    assert (spec.patch_size_t, spec.patch_size) == tuple(config["patch_size"][:2])
    assert spec.params == pytest.approx(params, rel=0.01), f"{name}: diffusers builds {params:.4e} parameters"
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "Kandinsky5Transformer3DModel", **config}))
    (tmp_path / "model_index.json").write_text(json.dumps(
        {"_class_name": "Kandinsky5I2VPipeline" if "i2v" in name else "Kandinsky5T2VPipeline"}))
    from_dir = raydit.model_spec(str(tmp_path))
    for field in ("heads", "head_dim", "layers", "ffn_hidden", "patch_size", "patch_size_t", "in_channels",
                  "text_tokens", "text_in_sequence", "default_frames", "default_height", "default_width"):
        assert getattr(from_dir, field) == getattr(spec, field), field
    assert from_dir.params == pytest.approx(params, rel=0.01)  # the estimate without weights


def test_a_lora_on_the_attention_projections_equals_diffusers(tmp_path):
    """A random LoRA on every attention's to_query / to_key / to_value (text self-attention,
    visual self- and cross-attention), loaded through raydit, equals diffusers' pipeline with the
    same load_lora_weights / set_adapters (max relative difference 1e-5), and changes the result."""
    from raydit.models import lora
    from support.lora_files import write_random_lora
    from raydit.models.loading import load_pipeline

    request = dict(prompt="a red fox", negative_prompt="blur", num_frames=5, height=32, width=32,
                   num_inference_steps=2, guidance_scale=5.0, seed=3)
    pipe = load_pipeline("tiny-kandinsky5")
    path = write_random_lora(pipe, tmp_path / "a", seed=1, rank=4, targets=("to_query", "to_key", "to_value"))
    lora.load(pipe, k5.FAMILY, lora.LoraSpec("a", str(lora.lora_file(path)), "transformer"))
    ref = load_pipeline("tiny-kandinsky5")
    base = k5.FAMILY.reference_latents(ref, GenerationRequest(**request))
    ref.load_lora_weights(str(path), adapter_name="a")
    ref.set_adapters(["a"], [0.8])
    expected = k5.FAMILY.reference_latents(ref, GenerationRequest(**request))
    runner = Runner(pipe)
    state = runner.prepare(GenerationRequest(**request, lora={"a": 0.8}))
    while not state.done:
        state = runner.step(state)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    assert rel(state.latents, expected) <= 1e-5
    assert rel(expected, base) > 1e-3


def test_a_qwen2vl_processor_checkpoint_loads_without_torchvision(tmp_path):
    """A checkpoint saved as the released ones are (its `tokenizer` a Qwen2VLProcessor, with an
    image and a video processor config): without torchvision diffusers cannot load it, raydit's
    loader gives the pipeline the processor's text tokenizer, and the pipeline makes the same
    latents as with the tiny tokenizer (the same ids: the pipelines tokenize text only)."""
    import json
    import shutil

    from transformers.utils import is_torchvision_available

    from raydit.models.loading import load_pipeline

    source = k5_tiny.tiny_pipeline_dir()
    target = tmp_path / "released-layout"
    shutil.copytree(source, target)
    index = json.loads((target / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "Qwen2VLProcessor"]
    (target / "model_index.json").write_text(json.dumps(index))
    tok = target / "tokenizer"
    (tok / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    (tok / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}))
    (tok / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor"}))
    if not is_torchvision_available():
        from diffusers import DiffusionPipeline

        with pytest.raises(Exception, match="[Tt]orchvision"):
            DiffusionPipeline.from_pretrained(str(target))
    pipe = load_pipeline(str(target))
    request = dataclasses.replace(REQUEST, num_inference_steps=1)
    expected = k5.FAMILY.reference_latents(load_pipeline("tiny-kandinsky5"), request)
    assert torch.equal(k5.FAMILY.reference_latents(pipe, request), expected)
