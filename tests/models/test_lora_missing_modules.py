"""Audit of raydit.models' LoRA checks: a LoRA targeting modules the model lacks is refused in
one line naming every such module (not only the first), before anything is loaded."""

import pytest
import torch
from support.lora_files import write_random_lora

from raydit.models import lora


def test_lora_refusal_names_every_missing_module(tmp_path):
    from safetensors.torch import load_file, save_file

    from raydit.models.loading import load_pipeline
    from raydit.models.registry import family_for_pipeline

    pipe = load_pipeline("tiny-wan")
    family = family_for_pipeline(pipe)
    path = lora.lora_file(write_random_lora(pipe, tmp_path / "a", seed=1, targets=("to_q", "to_k")))
    tensors = load_file(str(path))
    renamed = {}
    for key, value in tensors.items():  # blocks.0's to_q and to_k -> blocks.98 / blocks.99 (absent)
        if "blocks.0.attn1.to_q." in key:
            key = key.replace("blocks.0.", "blocks.98.")
        elif "blocks.0.attn1.to_k." in key:
            key = key.replace("blocks.0.", "blocks.99.")
        renamed[key] = value.clone()
    bad = tmp_path / "bad.safetensors"
    save_file(renamed, str(bad), metadata={"format": "pt"})
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    with pytest.raises(ValueError) as info:
        lora.load(pipe, family, lora.LoraSpec("bad", str(bad)))
    message = str(info.value)
    assert "\n" not in message
    assert "'blocks.98.attn1.to_q'" in message and "'blocks.99.attn1.to_k'" in message, message
    assert "another model" in message
    assert lora.loaded(pipe) == {}
    after = pipe.transformer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
