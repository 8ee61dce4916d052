"""LoRA adapters on one process: the Runner with a LoRA equals diffusers' own pipeline given the
same LoRA (load_lora_weights + set_adapters), switching adapters between requests is exact, and
bad LoRAs are refused with one line before anything is loaded.

LoRAs are random (peft LoraConfig on the attention projections, non-zero B, written with the
pipeline's save_lora_weights); nothing is downloaded. Tolerance against diffusers: max relative
difference 1e-5 (float32, the same ops in the same order: in practice 0).
"""

from __future__ import annotations

import pytest
import torch
from support.lora_files import write_random_lora

from raydit.models import conformance as harness
from raydit.models import lora
from raydit.models.families.ltx2 import cases as ltx2_cases
from raydit.models.requests import GenerationRequest
from raydit.models.loading import load_pipeline, resolve_model_dir
from raydit.models.registry import family_for_pipeline
from raydit.models.runner import Runner

REQUESTS = {
    "tiny": dict(prompt="a red fox", negative_prompt="blur", num_frames=5, height=32, width=32,
                 num_inference_steps=2, guidance_scale=6.0, seed=3),
    "tiny-wan": dict(prompt="a red fox", negative_prompt="blur", num_frames=5, height=32, width=32,
                     num_inference_steps=2, guidance_scale=5.0, seed=3),
    # timesteps 999, 857, 600 with the switch at 875: both experts run.
    "tiny-wan-a14b": dict(prompt="waves", negative_prompt="blur", num_frames=5, height=32, width=32,
                          num_inference_steps=3, guidance_scale=5.0, guidance_scale_2=3.0, seed=5),
    # LTX-2 (LTX2LoraLoaderMixin): every guidance pass (cfg, STG in block 1, modality) runs the
    # LoRA's layers; write_random_lora's targets hit all six attentions of a block (video and
    # audio self-attention and prompt cross-attention, audio-to-video, video-to-audio).
    "tiny-ltx2": dict(ltx2_cases.TINY_REQUEST),
    # Mochi 1 (Mochi1LoraLoaderMixin): the LoRA's layers are the joint attention's video projections.
    "tiny-mochi": dict(prompt="a red fox", negative_prompt="blur", num_frames=7, height=32, width=48,
                       num_inference_steps=2, guidance_scale=4.5, seed=3),
    # SkyReels-V2 diffusion forcing (SkyReelsV2LoraLoaderMixin): a timestep per frame, frames a step apart.
    "tiny-skyreels-df": dict(prompt="a red fox", negative_prompt="blur", num_frames=9, height=32, width=32,
                             num_inference_steps=2, guidance_scale=5.0, seed=3, guidance_options=dict(ar_step=1)),
}
# Tests of adapter switching and resuming run many requests: LTX-2's without the perturbed
# passes (one transformer call a step instead of three; the LoRA still runs in every call).
SWITCHING = {**REQUESTS, "tiny-ltx2": dict(ltx2_cases.TINY_REQUEST, guidance_options=ltx2_cases.NO_STG_NO_MODALITY)}


def rel(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def run(pipe, request: GenerationRequest, runner: Runner | None = None):
    """The latents as the pipeline's output_type="latent" gives them (LTX-2 unpacks and
    denormalizes its two streams; the other families' runner latents are that already)."""
    runner = runner or Runner(pipe)
    state = runner.prepare(request)
    while not state.done:
        state = runner.step(state)
    return flat(runner.family.output_latents(pipe, state))


def flat(latents):
    """Every stream of the pipeline's latent output in one flat tensor (LTX-2: video, then audio)."""
    return torch.cat([t.flatten() for t in harness.latent_streams(latents)])


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """Two random LoRAs per tiny model: name -> directory."""
    out = {}
    for model in REQUESTS:
        pipe = load_pipeline(model)
        root = tmp_path_factory.mktemp(f"lora-{model}")
        out[model] = {name: str(write_random_lora(pipe, root / name, seed=seed, rank=rank))
                      for name, seed, rank in (("a", 1, 4), ("b", 2, 2))}
    # A14B: a LoRA for the second expert (its own weights; same architecture here).
    pipe = load_pipeline("tiny-wan-a14b")
    out["tiny-wan-a14b"]["low"] = str(write_random_lora(
        pipe, tmp_path_factory.mktemp("lora-a14b-low") / "low", seed=3, component="transformer_2"))
    return out


def _raydit(model, specs):
    pipe = load_pipeline(model)
    family = family_for_pipeline(pipe)
    for name, path, target in specs:
        lora.load(pipe, family, lora.LoraSpec(name, str(lora.lora_file(path)), target))
    return pipe


# LTX-2 and SkyReels' diffusion forcing (~45 s each) in stage two
@pytest.mark.parametrize("model", ["tiny", "tiny-wan", pytest.param("tiny-ltx2", marks=pytest.mark.long), "tiny-mochi",
                                   pytest.param("tiny-skyreels-df", marks=pytest.mark.long)])
def test_runner_with_two_loras_equals_diffusers(loras, model):
    """One LoRA, then two at different scales, against diffusers' pipeline with the same
    load_lora_weights / set_adapters: max relative difference <= 1e-5, and each visibly
    different from the base model (a LoRA that did nothing would pass otherwise)."""
    request = REQUESTS[model]
    pipe = _raydit(model, [("a", loras[model]["a"], "transformer"), ("b", loras[model]["b"], "transformer")])
    ref = load_pipeline(model)
    family = family_for_pipeline(ref)
    base = flat(family.reference_latents(ref, GenerationRequest(**request)))
    ref.load_lora_weights(loras[model]["a"], adapter_name="a")
    ref.load_lora_weights(loras[model]["b"], adapter_name="b")
    for choice in ({"a": 0.8}, {"a": 0.5, "b": 1.5}):
        ref.set_adapters(list(choice), list(choice.values()))
        expected = flat(family.reference_latents(ref, GenerationRequest(**request)))
        got = run(pipe, GenerationRequest(**request, lora=choice))
        assert rel(got, expected) <= 1e-5, choice
        assert rel(expected, base) > 1e-3, f"LoRA {choice} changed nothing"
    assert rel(run(pipe, GenerationRequest(**request, lora={"a": 0.5, "b": 1.5})),
               run(pipe, GenerationRequest(**request, lora={"a": 0.8}))) > 1e-3


@pytest.mark.parametrize("model", ["tiny", pytest.param("tiny-ltx2", marks=pytest.mark.long)])  # LTX-2 in stage two
def test_switching_adapters_is_exact_and_leaves_nothing(loras, model):
    """base, a, base, a@0.3, a: every base request equals a pipeline that never saw a LoRA bit
    for bit; every LoRA request equals its first run bit for bit (no reload, no leak)."""
    request = SWITCHING[model]
    plain = run(load_pipeline(model), GenerationRequest(**request))
    pipe = _raydit(model, [("a", loras[model]["a"], "transformer")])
    runner = Runner(pipe)

    def go(choice):
        return run(pipe, GenerationRequest(**request, lora=choice), runner)

    first_a, first_low = go("a"), go({"a": 0.3})
    assert rel(first_a, plain) > 1e-3 and rel(first_low, first_a) > 1e-4
    for choice, expected in ((None, plain), ("a", first_a), ({}, plain), ({"a": 0.3}, first_low),
                             (None, plain), ({"a": 1.0}, first_a)):
        assert torch.equal(go(choice), expected), choice


def test_a14b_loras_per_expert_equal_diffusers(loras):
    """Wan 2.2 A14B: one LoRA into both experts, another into the second expert only
    (diffusers' load_into_transformer_2), against diffusers' pipeline loaded the same way."""
    model, request = "tiny-wan-a14b", REQUESTS["tiny-wan-a14b"]
    pipe = _raydit(model, [("a", loras[model]["a"], "both"), ("low", loras[model]["low"], "transformer_2")])
    assert lora.loaded(pipe) == {"transformer": ["a"], "transformer_2": ["a", "low"]}
    ref = load_pipeline(model)
    ref.load_lora_weights(loras[model]["a"], adapter_name="a")
    ref.load_lora_weights(loras[model]["a"], adapter_name="a", load_into_transformer_2=True)
    ref.load_lora_weights(loras[model]["low"], adapter_name="low", load_into_transformer_2=True)
    ref.set_adapters(["a", "low"], [0.7, 1.2])
    expected = flat(family_for_pipeline(ref).reference_latents(ref, GenerationRequest(**request)))
    got = run(pipe, GenerationRequest(**request, lora={"a": 0.7, "low": 1.2}))
    assert rel(got, expected) <= 1e-5
    ref.disable_lora()
    base = flat(family_for_pipeline(ref).reference_latents(ref, GenerationRequest(**request)))
    assert rel(got, base) > 1e-3
    assert torch.equal(run(pipe, GenerationRequest(**request)), run(load_pipeline(model), GenerationRequest(**request)))


@pytest.mark.parametrize("model", ["tiny", "tiny-ltx2"])
def test_checkpoint_records_adapters_and_resume_keeps_them(loras, model):
    request = GenerationRequest(**SWITCHING[model], lora={"a": 0.8})
    pipe = _raydit(model, [("a", loras[model]["a"], "transformer")])
    runner = Runner(pipe)
    state = runner.step(runner.prepare(request))
    checkpoint = runner.checkpoint(state)
    assert checkpoint["request"]["lora"] == (("a", 0.8),)
    # A checkpoint read back from JSON holds lists: still the same request.
    assert GenerationRequest(**{**checkpoint["request"], "lora": [["a", 0.8]]}) == request
    full = runner.step(state).latents
    # Resumed after a base request ran on the same runner: the adapters come back with it.
    run(pipe, GenerationRequest(**SWITCHING[model]), runner)
    resumed = runner.step(runner.prepare(request, checkpoint=checkpoint)).latents
    assert torch.equal(resumed, full)
    with pytest.raises(ValueError, match="checkpoint belongs to request"):
        runner.prepare(GenerationRequest(**SWITCHING[model], lora={"a": 0.5}), checkpoint=checkpoint)


def test_ltx2_original_key_format_loads_and_connector_loras_are_refused(loras, tmp_path):
    """LTX-2's original (non-diffusers) key names, `diffusion_model.<module>`, are converted by
    LTX2Pipeline.lora_state_dict into the diffusers-format tensors, which load as such; a LoRA
    that also holds the text connectors' layers (`text_embedding_projection.`, diffusers'
    `connectors.`) is refused in one line before anything is loaded: raydit switches adapters on
    the transformer only, and only the encoding rank holds the connectors."""
    from diffusers import LTX2Pipeline
    from safetensors.torch import load_file, save_file

    diffusers_format = load_file(str(lora.lora_file(loras["tiny-ltx2"]["a"])))
    original = {"diffusion_model." + k.removeprefix("transformer."): v for k, v in diffusers_format.items()}
    save_file(original, tmp_path / "original.safetensors")
    read = lora.read_state_dict(LTX2Pipeline, tmp_path / "original.safetensors")
    assert read.keys() == diffusers_format.keys()
    assert all(torch.equal(read[k], diffusers_format[k]) for k in read)
    pipe = _raydit("tiny-ltx2", [("orig", tmp_path / "original.safetensors", "transformer")])
    assert lora.loaded(pipe) == {"transformer": ["orig"]}

    connector = {"text_embedding_projection.aggregate_embed.lora_A.weight": torch.ones(4, 48),
                 "text_embedding_projection.aggregate_embed.lora_B.weight": torch.ones(16, 4)}
    save_file({**original, **connector}, tmp_path / "with-connectors.safetensors")
    spec = lora.LoraSpec("conn", str(tmp_path / "with-connectors.safetensors"))
    with pytest.raises(ValueError, match="is for 'connectors'; raydit loads LoRAs into the transformer only") as info:
        lora.load(pipe, family_for_pipeline(pipe), spec)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="transformer only"):  # the driver's check, before Ray
        lora.check_for_model(resolve_model_dir("tiny-ltx2"), spec)
    assert lora.loaded(pipe) == {"transformer": ["orig"]}


def test_bad_loras_are_refused_in_one_line_and_nothing_stays(loras, tmp_path):
    from safetensors.torch import save_file

    pipe = _raydit("tiny", [("a", loras["tiny"]["a"], "transformer")])
    family = family_for_pipeline(pipe)
    before = run(pipe, GenerationRequest(**REQUESTS["tiny"], lora="a"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    save_file({"transformer.proj_out.weight": torch.zeros(4, 4)}, tmp_path / "weights.safetensors")
    (tmp_path / "empty").mkdir()
    # A CogVideoX LoRA of another size: 4 heads x 16 instead of 2 x 16.
    from raydit.models.families.cogvideox.cases import cogvideox_pipeline

    other = write_random_lora(cogvideox_pipeline(str(resolve_model_dir("tiny")), num_attention_heads=4),
                                   tmp_path / "other-size")
    cases = [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "holds no .safetensors"),
        (tmp_path / "junk.safetensors", "not a readable safetensors"),
        (tmp_path / "weights.safetensors", "is not a LoRA"),
        (loras["tiny-wan"]["a"], "another model"),  # a Wan LoRA: modules CogVideoX lacks
        (other, "another model size"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            lora.load(pipe, family, lora.LoraSpec("bad", str(path)))
        assert "\n" not in str(info.value)
        # The driver's check against the model directory (meta device) says the same.
        if message not in ("does not exist", "holds no .safetensors"):
            with pytest.raises(ValueError, match=message):
                lora.check_for_model(resolve_model_dir("tiny"), lora.LoraSpec("bad", str(lora.lora_file(path))))
    with pytest.raises(ValueError, match="already loaded"):
        lora.load(pipe, family, lora.LoraSpec("a", str(lora.lora_file(loras["tiny"]["b"]))))
    with pytest.raises(ValueError, match="does not have"):
        lora.load(pipe, family, lora.LoraSpec("b", str(lora.lora_file(loras["tiny"]["b"])), "transformer_2"))
    with pytest.raises(ValueError, match="not loaded"):
        Runner(pipe).prepare(GenerationRequest(**REQUESTS["tiny"], lora="nope"))
    assert lora.loaded(pipe) == {"transformer": ["a"]}
    assert torch.equal(run(pipe, GenerationRequest(**REQUESTS["tiny"], lora="a")), before)


@pytest.mark.parametrize("lora_value, message", [
    ({"a": -1.0}, "must be a finite number >= 0"),
    ({"a": "x"}, "is not a number"),
    ({"a": float("nan")}, "must be a finite number"),
    ({"a b": 1.0}, "is not valid"),
    (3, "must be None, a name"),
    ([("a", 1.0), ("a", 2.0)], "named twice"),
])
def test_bad_choices_are_refused(lora_value, message):
    with pytest.raises(ValueError, match=message):
        GenerationRequest(**REQUESTS["tiny"], lora=lora_value)


def test_choices_normalize():
    assert lora.normalize_choice(None) == ()
    assert lora.normalize_choice("a") == (("a", 1.0),)
    assert lora.normalize_choice({"a": 1, "b": "0.5"}) == (("a", 1.0), ("b", 0.5))
    assert lora.normalize_choice([["a", 2]]) == (("a", 2.0),)
    assert lora.default_name("/x/my_style/pytorch_lora_weights.safetensors") == "my_style"
    assert lora.default_name("/x/detail v2.safetensors") == "detail-v2"


def test_adapter_bytes_are_the_tensors_bytes_per_transformer(loras):
    """What the planner is given (ModelSpec.adapter_bytes): the LoRA's tensor bytes from the
    safetensors header, once per transformer it loads into, 0 once fused into the weights."""
    from safetensors.torch import load_file

    path = str(lora.lora_file(loras["tiny"]["a"]))
    size = sum(t.numel() * t.element_size() for t in load_file(path).values())
    assert size > 0
    assert lora.adapter_bytes(lora.LoraSpec("a", path)) == size
    assert lora.adapter_bytes(lora.LoraSpec("a", path, target="both")) == 2 * size
    assert lora.adapter_bytes(lora.LoraSpec("a", path, fuse_scale=1.0)) == 0


def test_fused_lora_equals_the_unfused_one_and_takes_nothing_else(loras):
    """One process: `load` with fuse_scale merges the LoRA (diffusers fuse_lora) and drops peft's
    layers; the result equals the unfused LoRA at that scale; other choices are refused."""
    request = dict(REQUESTS["tiny-wan"])
    path = str(lora.lora_file(loras["tiny-wan"]["a"]))
    unfused = load_pipeline("tiny-wan")
    family = family_for_pipeline(unfused)
    lora.load(unfused, family, lora.LoraSpec("a", path))
    expected = run(unfused, GenerationRequest(**request, lora={"a": 0.7}))
    fused = load_pipeline("tiny-wan")
    lora.load(fused, family, lora.LoraSpec("a", path, fuse_scale=0.7))
    assert lora.fused(fused) == {"a": 0.7} and lora.loaded(fused) == {}
    assert not any("lora_" in name for name, _ in fused.transformer.named_parameters())
    torch.testing.assert_close(run(fused, GenerationRequest(**request, lora={"a": 0.7})), expected, rtol=1e-4, atol=1e-5)
    for choice in (None, {"a": 1.0}):
        with pytest.raises(ValueError, match="fused into this engine's weights at scale 0.7"):
            run(fused, GenerationRequest(**request, lora=choice))
    with pytest.raises(ValueError, match="cannot be unloaded"):
        lora.unload(fused, "a")
