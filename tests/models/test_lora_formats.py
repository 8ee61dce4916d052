"""LoRA files as people download them (raydit.models.lora), on one worker against diffusers.

Each file is made here from a random diffusers-format LoRA of the tiny Wan, rewritten in the
names its authors' tools write:
- Wan's original names (`diffusion_model.blocks.N.self_attn.q.lora_down.weight`, `.alpha`,
  `.diff_b`), with the keys diffusers' converter drops: a zeroed norm `.diff`, a block's
  modulation `diff_m`, a full `.diff` on a projection and AccVideo's `time_projection.1.diff_b`
  without its LoRA, all named in one logged line;
- musubi-tuner's (`lora_unet_blocks_0_self_attn_q.lora_down.weight`, `.alpha` on every layer);
- Kijai's and diffusion-pipe's repacks (`lora_A` / `lora_B` under `diffusion_model.`), with the
  FFN's and CausVid's embedding layers (`time_projection.1`, `time_embedding.0/2`,
  `text_embedding.0/2`, `head.head`) and `.diff_b` on some of them;
- LightX2V's distill LoRAs' full weight difference on the output head (`head.head.diff`, with
  its `.diff_b`), which diffusers turns into a LoRA of rank out_features.
Each runs on one worker exactly as diffusers' WanPipeline runs it after `load_lora_weights` on
the same file (its converters `_convert_non_diffusers_wan_lora_to_diffusers` and
`_convert_musubi_wan_lora_to_diffusers`), with LightX2V's scheduler and sigma list, and differs
from the base model. Tolerance (float32): rtol 1e-4, atol 1e-4.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from raydit.models import lora
from raydit.models.loading import load_pipeline
from raydit.models.registry import family_for_pipeline
from raydit.models.requests import GenerationRequest, reference_call
from raydit.models.runner import Runner
from raydit.models.schedules import own_scheduler
from support.lora_files import write_random_lora

TOL = dict(rtol=1e-4, atol=1e-4)
REQUEST = dict(prompt="a red fox", num_frames=5, height=48, width=80, guidance_scale=5.0, seed=3,
               scheduler="FlowMatchEulerDiscreteScheduler", scheduler_options={"shift": 5.0},
               sigmas=(1.0, 0.75, 0.5, 0.25), num_inference_steps=4)
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
FFN = ("net.0.proj", "net.2")
EMBEDDINGS = ("time_proj", "linear_1", "linear_2", "proj_out")  # peft matches name suffixes

# diffusers' module names -> Wan's original ones (the authors' code, kept by musubi and Kijai).
_IN_BLOCK = {f"attn{n}.{ours}": f"{attn}.{theirs}"
             for n, attn in ((1, "self_attn"), (2, "cross_attn"))
             for ours, theirs in zip(ATTENTION, "qkvo")} | {"ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
_TOP = {"condition_embedder.time_proj": "time_projection.1",
        "condition_embedder.time_embedder.linear_1": "time_embedding.0",
        "condition_embedder.time_embedder.linear_2": "time_embedding.2",
        "condition_embedder.text_embedder.linear_1": "text_embedding.0",
        "condition_embedder.text_embedder.linear_2": "text_embedding.2",
        "proj_out": "head.head"}


def _original(module: str) -> str:
    if module.startswith("blocks."):
        _, block, rest = module.split(".", 2)
        return f"blocks.{block}.{_IN_BLOCK[rest]}"
    return _TOP[module]


def _random_factors(pipe, directory, targets, seed=21) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """diffusers module name -> (lora_A, lora_B) of a random rank-4 LoRA on `targets`."""
    file = lora.lora_file(write_random_lora(pipe, directory / "diffusers", seed=seed, targets=targets, std=0.3))
    factors: dict[str, list] = {}
    for key, value in load_file(str(file)).items():
        module, part = key.removeprefix("transformer.").rsplit(".", 2)[:2]
        factors.setdefault(module, [None, None])["AB".index(part[-1])] = value
    return {m: (a, b) for m, (a, b) in factors.items()}


def _original_wan_file(pipe, directory) -> str:
    """Wan's original names: an alpha on every self-attention projection, a bias difference on
    every projection, and four keys diffusers drops (a zeroed norm `.diff`, a non-zero modulation
    `diff_m`, a full `.diff` on a projection, AccVideo's `time_projection.1.diff_b` alone)."""
    out, g = {}, torch.Generator().manual_seed(5)
    for module, (down, up) in _random_factors(pipe, directory, ATTENTION).items():
        stem = f"diffusion_model.{_original(module)}"
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down, up
        if "attn1" in module:
            out[f"{stem}.alpha"] = torch.tensor(2.0 * down.shape[0])
        out[f"{stem}.diff_b"] = torch.randn(up.shape[0], generator=g) * 0.1
    width = pipe.transformer.config.num_attention_heads * pipe.transformer.config.attention_head_dim
    out["diffusion_model.blocks.0.norm3.diff"] = torch.zeros(width)
    out["diffusion_model.blocks.0.diff_m"] = torch.randn(1, 6, width, generator=g) * 0.01
    out["diffusion_model.blocks.1.self_attn.q.diff"] = torch.randn(width, width, generator=g) * 0.01
    out["diffusion_model.time_projection.1.diff_b"] = torch.randn(6 * width, generator=g) * 0.01
    return _save(out, directory / "wan_original.safetensors")


def _musubi_file(pipe, directory) -> str:
    """musubi-tuner's names: every attention and FFN layer of every block (its converter needs
    them all), each with its alpha (here 2 x rank: the LoRA at twice its factors' product)."""
    out = {}
    for module, (down, up) in _random_factors(pipe, directory, ATTENTION + FFN).items():
        stem = "lora_unet_" + _original(module).replace(".", "_")
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down, up
        out[f"{stem}.alpha"] = torch.tensor(2.0 * down.shape[0])
    return _save(out, directory / "musubi.safetensors")


def _kijai_file(pipe, directory) -> str:
    """Kijai's and diffusion-pipe's repacks: `lora_A` / `lora_B` under `diffusion_model.`, on
    the attention, the FFN (an alpha on `ffn.2`) and CausVid's embedding layers and head, with a
    bias difference on the first FFN layer, `time_projection.1`, both embeddings' first layers
    and the head (and none elsewhere)."""
    out, g = {}, torch.Generator().manual_seed(6)
    for module, (down, up) in _random_factors(pipe, directory, ATTENTION + FFN + EMBEDDINGS).items():
        name = _original(module)
        stem = f"diffusion_model.{name}"
        out[f"{stem}.lora_A.weight"], out[f"{stem}.lora_B.weight"] = down, up
        if name.endswith("ffn.2"):
            out[f"{stem}.alpha"] = torch.tensor(0.5 * down.shape[0])
        if name.endswith(("ffn.0", "time_projection.1", "embedding.0", "head.head")):
            out[f"{stem}.diff_b"] = torch.randn(up.shape[0], generator=g) * 0.1
    return _save(out, directory / "kijai.safetensors")


def _head_diff_file(pipe, directory) -> str:
    """LightX2V's distill LoRAs: Wan's original attention LoRA plus a full weight difference
    and a bias difference on the output head (`head.head.diff`, `head.head.diff_b`)."""
    out, g = {}, torch.Generator().manual_seed(7)
    for module, (down, up) in _random_factors(pipe, directory, ATTENTION).items():
        stem = f"diffusion_model.{_original(module)}"
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down, up
    head = pipe.transformer.proj_out
    out["diffusion_model.head.head.diff"] = torch.randn(head.out_features, head.in_features, generator=g) * 0.3
    out["diffusion_model.head.head.diff_b"] = torch.randn(head.out_features, generator=g) * 0.1
    return _save(out, directory / "head_diff.safetensors")


def _save(tensors: dict, path) -> str:
    save_file(tensors, str(path))
    return str(path)


def _denoise(runner: Runner, request: GenerationRequest) -> torch.Tensor:
    state = runner.prepare(request)
    while not state.done:
        state = runner.step(state)
    return state.latents


def _diffusers(path: str, request: GenerationRequest) -> torch.Tensor:
    """WanPipeline's own latents with `load_lora_weights(path)` at the request's scale. With
    low_cpu_mem_usage=False: with `.diff_b` on some LoRA layers only (Kijai's, LightX2V's head),
    the default leaves the other layers' LoRA biases on the meta device and the pipeline fails;
    this way peft initialises them to zero."""
    from diffusers import WanPipeline

    (name, scale), = request.lora
    reference = load_pipeline("tiny-wan")
    reference.load_lora_weights(path, adapter_name=name, low_cpu_mem_usage=False)
    reference.set_adapters([name], [scale])
    reference = WanPipeline(**dict(reference.components, scheduler=own_scheduler(reference.scheduler, request)))
    reference.set_progress_bar_config(disable=True)
    return reference(**reference_call(request)).frames


def _check_on_one_worker(pipe, path: str, caplog) -> list[str]:
    """Load `path` into `pipe` through raydit, run one worker, hold it to diffusers and to the
    base model; the lines raydit logged while loading."""
    request = GenerationRequest(**REQUEST, lora={"downloaded": 0.8})
    with caplog.at_level(logging.WARNING, logger="raydit.models.lora"):
        lora.load(pipe, family_for_pipeline(pipe), lora.LoraSpec("downloaded", path))
    lines = [r.getMessage() for r in caplog.records if r.name == "raydit.models.lora"]
    runner = Runner(pipe)
    expected = _diffusers(path, request)
    torch.testing.assert_close(_denoise(runner, request), expected, **TOL)
    # The LoRA matters: the base model gives other latents.
    assert (_denoise(runner, GenerationRequest(**REQUEST)) - expected).abs().max() > 1e-2
    return lines


def test_original_wan_keys_run_as_diffusers_loads_them(tmp_path, caplog):
    pipe = load_pipeline("tiny-wan")
    lines = _check_on_one_worker(pipe, _original_wan_file(pipe, tmp_path), caplog)
    assert len(lines) == 1 and "4 keys (3 non-zero) are not applied" in lines[0]
    for key in ("blocks.0.diff_m", "blocks.0.norm3.diff", "blocks.1.self_attn.q.diff", "time_projection.1.diff_b"):
        assert f"diffusion_model.{key}" in lines[0]


FORMATS = {
    "musubi": (_musubi_file, {f"blocks.{b}.{m}" for b in (0, 1) for m in _IN_BLOCK}),
    "kijai": (_kijai_file, {f"blocks.{b}.{m}" for b in (0, 1) for m in _IN_BLOCK} | set(_TOP)),
    "head-diff": (_head_diff_file, {f"blocks.{b}.{m}" for b in (0, 1) for m in _IN_BLOCK if "ffn" not in m}
                  | {"proj_out"}),
}


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_downloaded_formats_run_as_diffusers_loads_them(form, tmp_path, caplog):
    """Every LoRA layer of the file is loaded (no key dropped, no line logged), and one worker
    equals diffusers on the same file."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    build, modules = FORMATS[form]
    pipe = load_pipeline("tiny-wan")
    lines = _check_on_one_worker(pipe, build(pipe, tmp_path), caplog)
    assert lines == []
    assert {n for n, m in pipe.transformer.named_modules() if isinstance(m, BaseTunerLayer)} == modules


UNKNOWN_FILES = {
    "unknown layer": ({"diffusion_model.blocks.0.mystery.lora_down.weight": (4, 8),
                       "diffusion_model.blocks.0.mystery.lora_up.weight": (8, 4)},
                      "format WanPipeline's converters do not know.*blocks.0.mystery.lora_down"),
    # Wan's names without `diffusion_model.` (DiffSynth's files): no converter matches them and
    # load_lora_weights would load none of them.
    "no prefix": ({"blocks.0.self_attn.q.lora_A.default.weight": (4, 72),
                   "blocks.0.self_attn.q.lora_B.default.weight": (72, 4)},
                  "converters do not know .its first keys: blocks.0.self_attn.q.lora_A"),
    "not a LoRA": ({"model.layer.weight": (2, 2)}, "first keys: model.layer.weight"),
}


@pytest.mark.parametrize("kind", sorted(UNKNOWN_FILES))
def test_a_file_no_converter_knows_is_named_by_its_first_keys(tmp_path, kind):
    keys, match = UNKNOWN_FILES[kind]
    path = tmp_path / "file.safetensors"
    save_file({k: torch.zeros(shape) for k, shape in keys.items()}, str(path))
    with pytest.raises(ValueError, match=match) as info:
        lora.read_state_dict(type(load_pipeline("tiny-wan")), path)
    assert "\n" not in str(info.value)
