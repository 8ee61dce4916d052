"""LoRA files as people download them (raydit.models.lora), on one worker against diffusers.

A file in Wan's original key names (`diffusion_model.blocks.N.self_attn.q.lora_down.weight`,
`.alpha`, `.diff_b`, zeroed norm `.diff`, a non-zero `blocks.N.diff_m`), made here from a
random diffusers-format LoRA of the tiny Wan, runs on one worker exactly as diffusers' WanPipeline
runs it after `load_lora_weights` (its converter `_convert_non_diffusers_wan_lora_to_diffusers`),
with LightX2V's scheduler and sigma list; the keys that converter drops are named in one logged
line. Tolerance (float32): rtol 1e-4, atol 1e-4.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from raydit.models import lora
from raydit.models.requests import GenerationRequest
from raydit.models.loading import load_pipeline
from raydit.models.registry import family_for_pipeline
from raydit.models.requests import reference_call
from raydit.models.runner import Runner
from raydit.models.schedules import own_scheduler
from support.lora_files import write_random_lora

TOL = dict(rtol=1e-4, atol=1e-4)
REQUEST = dict(prompt="a red fox", num_frames=5, height=48, width=80, guidance_scale=5.0, seed=3,
               scheduler="FlowMatchEulerDiscreteScheduler", scheduler_options={"shift": 5.0},
               sigmas=(1.0, 0.75, 0.5, 0.25), num_inference_steps=4)
_NAMES = {"attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}


def _original_wan_file(pipe, directory) -> str:
    """A random LoRA of `pipe`'s transformer, rewritten in Wan's original key names with an
    alpha on every self-attention projection, a bias difference on every projection, a zeroed
    norm `.diff` and a non-zero modulation `diff_m`."""
    diffusers_file = lora.lora_file(write_random_lora(pipe, directory / "diffusers", seed=21))
    out, g = {}, torch.Generator().manual_seed(5)
    for key, value in load_file(str(diffusers_file)).items():
        _, _, block, attn, proj, *rest = key.split(".")
        if proj == "to_out":
            proj, rest = "to_out.0", rest[1:]
        part = {"lora_A": "lora_down", "lora_B": "lora_up"}[rest[0]]
        stem = f"diffusion_model.blocks.{block}.{_NAMES[attn]}.{_NAMES[proj]}"
        out[f"{stem}.{part}.weight"] = value
        if attn == "attn1" and part == "lora_down":
            out[f"{stem}.alpha"] = torch.tensor(2.0 * value.shape[0])
        if part == "lora_up":  # the published files carry a bias difference on every projection
            out[f"{stem}.diff_b"] = torch.randn(value.shape[0], generator=g) * 0.1
    width = pipe.transformer.config.num_attention_heads * pipe.transformer.config.attention_head_dim
    out["diffusion_model.blocks.0.norm3.diff"] = torch.zeros(width)
    out["diffusion_model.blocks.0.diff_m"] = torch.randn(1, 6, width, generator=g) * 0.01
    path = directory / "wan_original.safetensors"
    save_file(out, str(path))
    return str(path)


def test_original_wan_keys_run_as_diffusers_loads_them(tmp_path, caplog):
    pipe = load_pipeline("tiny-wan")
    path = _original_wan_file(pipe, tmp_path)
    request = GenerationRequest(**REQUEST, lora={"lightning": 0.8})
    with caplog.at_level(logging.WARNING, logger="raydit.models.lora"):
        lora.load(pipe, family_for_pipeline(pipe), lora.LoraSpec("lightning", path))
    lines = [r.getMessage() for r in caplog.records if r.name == "raydit.models.lora"]
    assert len(lines) == 1 and "2 weight-difference keys (1 non-zero)" in lines[0]
    assert "blocks.0.diff_m" in lines[0] and "blocks.0.norm3.diff" in lines[0]
    runner = Runner(pipe)
    state = runner.prepare(request)
    while not state.done:
        state = runner.step(state)

    from diffusers import WanPipeline

    reference = load_pipeline("tiny-wan")
    reference.load_lora_weights(path, adapter_name="lightning")
    reference.set_adapters(["lightning"], [0.8])
    reference = WanPipeline(**dict(reference.components, scheduler=own_scheduler(reference.scheduler, request)))
    reference.set_progress_bar_config(disable=True)
    expected = reference(**reference_call(request)).frames
    torch.testing.assert_close(state.latents, expected, **TOL)
    # The LoRA matters: the base model gives other latents.
    base = runner.prepare(GenerationRequest(**REQUEST))
    while not base.done:
        base = runner.step(base)
    assert (base.latents - expected).abs().max() > 1e-2


def test_a_file_no_converter_knows_is_named_by_its_first_keys(tmp_path):
    pipe = load_pipeline("tiny-wan")
    weird = tmp_path / "weird.safetensors"
    save_file({"diffusion_model.blocks.0.mystery.lora_down.weight": torch.zeros(4, 8),
               "diffusion_model.blocks.0.mystery.lora_up.weight": torch.zeros(8, 4)}, str(weird))
    with pytest.raises(ValueError, match="format WanPipeline's converters do not know.*blocks.0.mystery.lora_down") as info:
        lora.read_state_dict(type(pipe), weird)
    assert "\n" not in str(info.value)
    plain = tmp_path / "plain.safetensors"
    save_file({"model.layer.weight": torch.zeros(2, 2)}, str(plain))
    with pytest.raises(ValueError, match="first keys: model.layer.weight"):
        lora.read_state_dict(type(pipe), plain)
