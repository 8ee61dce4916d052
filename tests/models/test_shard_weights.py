"""Sharded transformer weights (issue 42): every plan with sharding equals the same plan without
it, bit for bit, in float32 and bfloat16, on CPU ranks (gloo), for one runner case of every
family and a LoRA case.

Rule: bit for bit (torch.equal). The sharded run computes with the very bytes the unsharded
run holds (all-gathered raw bytes, views aligned as allocations are), with the same kernels,
batch and threads, so nothing may differ.
"""

from __future__ import annotations

import pytest
import torch

from raydit.models import conformance as harness

WORLD = 2


def _one_per_family(cases):
    seen, out = set(), []
    for case in cases:
        family = case.build.split(":")[0]
        if family not in seen:
            seen.add(family)
            out.append(case)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from shard_conformance import shard_worker
    from support.lora_files import write_random_lora

    from raydit.models.loading import load_pipeline, resolve_model_dir
    from raydit.parallel.testing import run_distributed

    cases = _one_per_family(harness.family_cases()["runner"])
    # LoRA: two adapters loaded before sharding stay whole on every rank, their base layers
    # (peft's `base_layer`) are sharded with the block.
    root = tmp_path_factory.mktemp("shard-lora")
    pipe = load_pipeline("tiny-wan")
    loras = {name: (str(write_random_lora(pipe, root / name, seed=seed)), "transformer")
             for name, seed in (("a", 11), ("b", 12))}
    cases.append(harness.RunnerCase(
        "lora-wan", "support.lora_files:conformance_pipeline", 6,
        dict(prompt="a red fox", num_frames=5, height=48, width=80, num_inference_steps=2, guidance_scale=5.0,
             seed=3, lora={"a": 0.7, "b": 1.3}),
        dict(build="raydit.models.families.wan.cases:wan_pipeline", build_kwargs=dict(base_dir=str(resolve_model_dir("tiny-wan"))),
             loras=loras)))
    # Step caching: blocks skipped on cached steps (their gathers still run, in every rank's order).
    cases.append(harness.RunnerCase(
        "wan-fbcache", "raydit.models.families.wan.cases:wan_pipeline", 6,
        dict(prompt="a red fox", num_frames=5, height=48, width=80, num_inference_steps=4, guidance_scale=5.0,
             seed=3, cache="fbcache", cache_threshold=1.1),
        dict(base_dir=str(resolve_model_dir("tiny-wan"))), steps=4))
    outputs = run_distributed(shard_worker, WORLD, cases, ("float32", "bfloat16"), timeout=1200)
    return cases, outputs


@pytest.mark.long
def test_one_case_per_family_is_covered(results):
    from raydit.models.registry import families

    cases, _ = results
    # raydit.models.families.<family>[.<module of its package>]: the family's module or package.
    covered = {c.build.split(":")[0].split(".")[3] for c in cases if c.build.startswith("raydit.models.families")}
    assert covered == {f.adapter.__module__.split(".")[3] for f in families().values()}


@pytest.mark.long
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_plans_equal_unsharded_bit_for_bit(results, dtype):
    cases, outputs = results
    for rank_out in outputs:
        keys = [k for k in rank_out if k[2] == dtype and k[3] == "plain"]
        assert {k[0] for k in keys} == {c.name for c in cases}
        for key in keys:
            plain, sharded = rank_out[key], rank_out[key[:3] + ("sharded",)]
            assert plain.dtype == sharded.dtype and torch.isfinite(plain.float()).all(), key
            assert torch.equal(plain, sharded), (key, (plain.float() - sharded.float()).abs().max().item())


@pytest.mark.long
def test_each_rank_holds_half_of_the_block_weights(results):
    _, outputs = results
    for rank_out in outputs:
        for key, (held, peak, full) in ((k, v) for k, v in rank_out.items() if k[3] == "held"):
            # 1/N of the blocks' bytes (each block padded to N aligned chunks) ...
            assert held * WORLD == full, key
            # ... and at the peak of a step no more than the shard plus every block gathered
            assert held < peak <= held + full, key


@pytest.mark.long
def test_compiled_blocks_sharded_equal_unsharded():
    """compile=True: the gathers stay outside the compiled block forwards (module hooks); the
    graphs compiled for the unsharded run serve the sharded one (2 s against 117 s here)."""
    from shard_conformance import shard_worker
    from raydit.parallel.testing import run_distributed

    case = next(c for c in harness.family_cases()["runner"] if c.name == "wan-t2v")
    outputs = run_distributed(shard_worker, WORLD, [case], ("float32",), compile=True, plans=("u2r1c1",), timeout=900)
    for rank_out in outputs:
        key = ("wan-t2v", "u2r1c1", "float32")
        assert torch.equal(rank_out[key + ("plain",)], rank_out[key + ("sharded",)])


@pytest.mark.long
def test_two_experts_sharded_equal_unsharded():
    """Wan 2.2 A14B: both experts' blocks sharded, the switch at step 2 (steps 0-1 on
    `transformer`, 2-3 on `transformer_2`), every plan of 2 ranks, float32 and bf16 (60 s)."""
    from shard_conformance import shard_worker
    from raydit.parallel.testing import run_distributed

    case = next(c for c in harness.family_cases()["runner"] if c.name == "wan-a14b-resume-after-switch")
    outputs = run_distributed(shard_worker, WORLD, [case], ("float32", "bfloat16"), timeout=900)
    for rank_out in outputs:
        keys = [k for k in rank_out if k[3] == "plain"]
        assert len(keys) == 6  # 3 plans x 2 dtypes
        for key in keys:
            assert torch.equal(rank_out[key], rank_out[key[:3] + ("sharded",)]), key
