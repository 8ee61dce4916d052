"""LoRA files for tests: a random LoRA in diffusers' format for a tiny pipeline, and a
conformance builder that loads LoRAs on every spawned rank. Not a test module: tests import it
(`from support.lora_files import ...`, tests/ being on the path through tests/conftest.py), and
spawned ranks import it by name ("support.lora_files:conformance_pipeline")."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from raydit.models.lora import LoraSpec, load, lora_file


def write_random_lora(pipe, directory, *, seed: int = 0, rank: int = 4, alpha: float | None = None,
                      targets=("to_q", "to_k", "to_v", "to_out.0"), std: float = 0.5,
                      component: str = "transformer") -> Path:
    """Write a random LoRA for `pipe`'s transformer in diffusers' format (save_lora_weights).

    Made with peft on a copy of the transformer (LoraConfig on the attention projections), with
    every factor drawn from `seed` (non-zero B: a rank without the LoRA gives other numbers).
    Returns the directory."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    transformer = copy.deepcopy(getattr(pipe, component))
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in transformer.modules():
            if isinstance(module, LoraLayer):
                for factor in (module.lora_A["default"], module.lora_B["default"]):
                    factor.weight.copy_(torch.randn(factor.weight.shape, generator=generator) * std)
    layers = get_peft_model_state_dict(transformer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(str(directory), transformer_lora_layers=layers)
    return directory


def conformance_pipeline(build: str, build_kwargs: dict, loras: Mapping[str, tuple[str, str]]):
    """A conformance-harness builder (raydit.models.conformance.RunnerCase): the pipeline that
    `build(**build_kwargs)` makes, with the LoRAs `loras` (name -> (path, target)) loaded
    through `load`, so every spawned rank rebuilds the same adapted pipeline."""
    from raydit.models.registry import family_for_pipeline
    from raydit.models.tiny import resolve_builder

    pipe = resolve_builder(build)(**build_kwargs)
    family = family_for_pipeline(pipe)
    for name, (path, target) in loras.items():
        load(pipe, family, LoraSpec(name, str(lora_file(path)), target))
    return pipe
