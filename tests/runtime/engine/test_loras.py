"""LoRA adapters through the Ray engine and the CLI, against a real local Ray.

One 2-rank engine (ulysses x ring x cfg as planned) with a LoRA loaded at start: switching
it on, off and on gives each request its one-process reference (rtol 1e-4, atol 1e-4 in
float32, as tests/runtime/engine/test_engine.py), a base request after a LoRA request equals the
first base request bit for bit, a LoRA loaded later mixes with the first at other scales,
bad input is refused in one line and the engine keeps serving, and a rank killed mid-request
is replaced by a fresh actor that loads the adapters before the request resumes.
A second 2-rank engine fuses LoRA a at 0.5 into its weights (fuse_lora): it equals the unfused
one-process run of a at 0.5, on its first group and after a rank is replaced, and refuses
requests for anything else.
The CLI refuses bad --lora / --lora-scale with one line and status 2 before Ray starts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.lora_files import write_random_lora

from raydit.models import lora
from raydit.models.requests import GenerationRequest
from raydit.models.loading import load_pipeline
from raydit.models.runner import Runner

from support.actors import kill_at_step

RTOL, ATOL = 1e-4, 1e-4
PROMPT = "a red fox running through fresh snow"
GEN = dict(num_frames=5, height=32, width=32, num_inference_steps=3, guidance_scale=6.0, seed=7)


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-loras")
    pipe = load_pipeline("tiny")
    dirs = {name: str(write_random_lora(pipe, root / name, seed=seed)) for name, seed in (("a", 21), ("b", 22))}
    dirs["wan"] = str(write_random_lora(load_pipeline("tiny-wan"), root / "wan", seed=23))
    return dirs


@pytest.fixture(scope="module")
def references(lora_dirs):
    """One process: the base model, LoRA a, and a@0.5 + b@1.5."""
    from raydit.models.registry import family_for_pipeline

    pipe = load_pipeline("tiny")

    family = family_for_pipeline(pipe)
    for name in ("a", "b"):
        lora.load(pipe, family, lora.LoraSpec(name, str(lora.lora_file(lora_dirs[name]))))
    runner = Runner(pipe)
    out = {}
    for key, choice in (("base", None), ("a", "a"), ("ab", {"a": 0.5, "b": 1.5}), ("a05", {"a": 0.5})):
        state = runner.prepare(GenerationRequest(prompt=PROMPT, **GEN, lora=choice))
        while not state.done:
            state = runner.step(state)
        out[key] = state.latents.numpy()
    return out


@pytest.fixture(scope="module")
def engine(ray_local, lora_dirs):
    from raydit.runtime.engine import Engine

    engine = Engine(model="tiny", workers=2, device="cpu", show_plan=False, loras={"a": lora_dirs["a"]},
                    frames=GEN["num_frames"], height=GEN["height"], width=GEN["width"])
    yield engine
    engine.shutdown()


def _gen(engine, **kw):
    return engine.generate(PROMPT, progress=False, **{**GEN, **kw})


def _close(actual, expected):
    torch.testing.assert_close(torch.from_numpy(actual), torch.from_numpy(expected), rtol=RTOL, atol=ATOL)


def test_switching_on_off_on_gives_each_request_its_reference(engine, references, lora_dirs):
    assert engine.loras() == {"a": str(lora.lora_file(lora_dirs["a"]))}
    size = {n: lora.adapter_bytes(lora.LoraSpec(n, lora_dirs[n])) for n in ("a", "b")}
    assert engine.spec.adapter_bytes == size["a"] > 0  # what the planner counts per rank
    base = _gen(engine).latents
    _close(base, references["base"])
    with_a = _gen(engine, lora="a").latents
    _close(with_a, references["a"])
    assert np.abs(with_a - base).max() > 1e-2 * np.abs(base).max()
    assert np.array_equal(_gen(engine, lora=None).latents, base)  # nothing leaks
    assert np.array_equal(_gen(engine, lora={"a": 1.0}).latents, with_a)

    assert engine.load_lora(lora_dirs["b"]) == "b"
    assert sorted(engine.loras()) == ["a", "b"]
    assert engine.spec.adapter_bytes == size["a"] + size["b"]
    _close(_gen(engine, lora={"a": 0.5, "b": 1.5}).latents, references["ab"])
    engine.unload_lora("b")
    assert engine.spec.adapter_bytes == size["a"]
    with pytest.raises(ValueError, match="not loaded; loaded: a"):
        _gen(engine, lora={"b": 1.0})
    assert np.array_equal(_gen(engine).latents, base)


def test_bad_input_is_refused_and_the_engine_keeps_serving(engine, references, lora_dirs, tmp_path):
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        _gen(engine, lora="nope")
    with pytest.raises(ValueError, match=">= 0"):
        _gen(engine, lora={"a": -0.5})
    with pytest.raises(ValueError, match="another model"):
        engine.load_lora(lora_dirs["wan"])
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora(lora_dirs["b"], name="a")
    with pytest.raises(ValueError, match="does not exist"):
        engine.load_lora(tmp_path / "missing")
    with pytest.raises(ValueError, match="not loaded"):
        engine.unload_lora("b")
    assert list(engine.loras()) == ["a"]
    _close(_gen(engine, lora="a").latents, references["a"])


@pytest.mark.long  # stage two: a kill and a regroup
def test_a_rank_killed_mid_request_recovers_with_the_adapters(engine, references):
    """A rank killed after the first step: the request is re-planned and resumed with its LoRA
    active (what the survivors and any replacement hold); then a fresh actor joins (growth
    back to the first plan) and gets the LoRA when the group forms (WorkerPool.form ->
    sync_loras): a LoRA missing on it would change the 2-rank latents (non-zero B)."""
    first = engine.plan
    victim = engine.group.active[1].actor
    # ray.kill returns before the actor is dead: wait for it, or the request can finish first
    result = _gen(engine, lora="a", callback_on_step_end=kill_at_step(victim, 0))
    kinds = [e["event"] for e in result.events]
    assert "regrouped" in kinds, kinds
    assert all(m.actor is not victim for m in engine.group.members)
    _close(result.latents, references["a"])
    old_members = [m.actor for m in engine.group.members]
    engine.group.grow_to(first)
    engine.regroup(ulysses=first.ulysses, ring=first.ring, cfg=first.cfg)
    assert engine.plan.world_size == 2 and len(engine.group.active) == 2
    joined = [m for m in engine.group.active if m.actor not in old_members]
    assert joined or len(old_members) == 2  # a fresh actor, unless recovery already started one
    _close(_gen(engine, lora="a").latents, references["a"])
    _close(_gen(engine).latents, references["base"])


@pytest.mark.long  # stage two: another Engine and a replaced rank (~50 s)
def test_fused_lora_equals_unfused_and_survives_a_replaced_rank(ray_local, references, lora_dirs):
    """fuse_lora={"a": 0.5}: every rank merges a into its weights (diffusers' fuse_lora) and drops
    peft's layers; a request naming nothing runs with it. A rank killed mid-request is replaced
    by a fresh actor, which fuses a when the group forms: a rank without it changes the latents
    (non-zero B)."""
    from raydit.runtime.engine import Engine

    fused = Engine(model="tiny", workers=2, device="cpu", show_plan=False, loras={"a": lora_dirs["a"]},
                   fuse_lora={"a": 0.5}, frames=GEN["num_frames"], height=GEN["height"], width=GEN["width"])
    try:
        assert fused.fused_lora == {"a": 0.5} and fused.spec.adapter_bytes == 0
        first = fused.plan
        assert first.world_size == 2
        _close(_gen(fused).latents, references["a05"])
        for bad in ({"a": 1.0}, "b"):  # another scale, another LoRA: one line naming the fused one
            with pytest.raises(ValueError, match="serves LoRA 'a' fused into its weights at scale 0.5"):
                _gen(fused, lora=bad)
        with pytest.raises(ValueError, match="fused into this engine's weights"):
            fused.load_lora(lora_dirs["b"])
        with pytest.raises(ValueError, match="fused into this engine's weights"):
            fused.unload_lora("a")

        victim = fused.group.active[1].actor
        result = _gen(fused, lora={"a": 0.5}, callback_on_step_end=kill_at_step(victim, 0))  # killed, and gone
        assert "regrouped" in [e["event"] for e in result.events]
        _close(result.latents, references["a05"])
        old = [m.actor for m in fused.group.members]
        fused.group.grow_to(first)
        fused.regroup(ulysses=first.ulysses, ring=first.ring, cfg=first.cfg)
        assert fused.plan.world_size == 2 and all(m.actor is not victim for m in fused.group.active)
        assert [m for m in fused.group.active if m.actor not in old] or len(old) == 2
        _close(_gen(fused).latents, references["a05"])
    finally:
        fused.shutdown()


@pytest.mark.parametrize("args, message", [
    (["--lora", "/nonexistent/lora"], "does not exist"),
    (["--lora", "{a}", "--lora-scale", "x"], "is not a number"),
    (["--lora", "{a}", "--lora-scale", "-1"], ">= 0"),
    (["--lora", "{a}", "--lora-scale", "1", "--lora-scale", "2"], "one scale per --lora"),
    (["--lora", "{wan}"], "another model"),
])
def test_cli_refuses_bad_loras_before_ray(lora_dirs, capsys, args, message):
    from raydit.cli import main

    args = [a.format(**lora_dirs) for a in args]
    code = main(["generate", "--prompt", "x", "--model", "tiny", "--device", "cpu", "--workers", "1",
                 "--steps", "1", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert message in err and len(err.splitlines()) == 1, err


def test_job_config_loras_and_repeated_flags(lora_dirs, tmp_path):
    import argparse

    from raydit.commands import add_generate_arguments, resolve_generate_options

    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    config = tmp_path / "job.yaml"
    config.write_text(f"prompt: x\nloras:\n  - {lora_dirs['a']}\n  - {{path: {lora_dirs['b']}, scale: 0.5, name: detail}}\n")
    o = resolve_generate_options(parser.parse_args(["--config", str(config)]))
    assert o["lora_choice"] == {"a": 1.0, "detail": 0.5}
    assert o["lora_table"]["detail"]["path"] == str(lora.lora_file(lora_dirs["b"]))
    o = resolve_generate_options(parser.parse_args(
        ["--prompt", "x", "--lora", lora_dirs["a"], "--lora", lora_dirs["b"], "--lora-scale", "0.25"]))
    assert o["lora_choice"] == {"a": 0.25, "b": 1.0}
    # --lora-target in --lora's order (Wan 2.2's low-noise expert), the rest on the transformer.
    o = resolve_generate_options(parser.parse_args(
        ["--prompt", "x", "--lora", lora_dirs["a"], "--lora", lora_dirs["b"], "--lora-target", "transformer_2"]))
    assert [o["lora_table"][n]["target"] for n in ("a", "b")] == ["transformer_2", "transformer"]
    with pytest.raises(ValueError, match="target 'transfomer' is not one of transformer, transformer_2, both"):
        resolve_generate_options(parser.parse_args(["--prompt", "x", "--lora", lora_dirs["a"], "--lora-target",
                                                    "transfomer"]))
    config.write_text(f"prompt: x\nloras:\n  - {{path: {lora_dirs['a']}, scale: -1}}\n")
    with pytest.raises(ValueError, match=">= 0"):
        resolve_generate_options(parser.parse_args(["--config", str(config)]))


def test_fuse_lora_options(lora_dirs, tmp_path):
    """--fuse-lora / `fuse_lora: true` fuses the one LoRA at its scale; with none or two it is
    refused in one line before Ray starts; Engine(fuse_lora=...) forms are checked alike."""
    import argparse

    from raydit.commands import add_generate_arguments, resolve_generate_options

    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    o = resolve_generate_options(parser.parse_args(
        ["--prompt", "x", "--lora", lora_dirs["a"], "--lora-scale", "0.5", "--fuse-lora"]))
    assert o["fuse_lora"] and o["lora_choice"] == {"a": 0.5}
    config = tmp_path / "job.yaml"
    config.write_text(f"prompt: x\nfuse_lora: true\nloras:\n  - {lora_dirs['a']}\n  - {lora_dirs['b']}\n")
    with pytest.raises(ValueError, match="--fuse-lora fuses one LoRA into the weights, but 2 are given"):
        resolve_generate_options(parser.parse_args(["--config", str(config)]))
    with pytest.raises(ValueError, match="but 0 are given"):
        resolve_generate_options(parser.parse_args(["--prompt", "x", "--fuse-lora"]))

    table = {"a": lora.LoraSpec("a", "/a.safetensors")}
    assert lora.fuse_choice(True, table) == ("a", 1.0) and lora.fuse_choice({"a": 0.5}, table) == ("a", 0.5)
    assert lora.fuse_choice(None, table) is None and lora.fuse_choice(False, table) is None
    for fuse, needle in ((True, "exactly one LoRA"), ("b", "not among the engine's LoRAs"),
                         ({"a": -1}, ">= 0"), ({"a": 1, "b": 1}, "must name one LoRA")):
        with pytest.raises(ValueError, match=needle):
            lora.fuse_choice(fuse, {} if fuse is True else table)
    with pytest.raises(ValueError, match="holds that LoRA alone"):
        lora.fuse_choice("a", {**table, "b": lora.LoraSpec("b", "/b.safetensors")})
