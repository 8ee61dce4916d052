"""LoRA adapters under every plan up to 4 gloo ranks (cfg 2 on 2 and 4 ranks) equal one process;
LTX-2 and Kandinsky 5 on their 2-rank plans only (Ulysses, ring, cfg 2), as their own conformance
cases keep to a few worlds for the suite's time.

The conformance harness runs each case on every feasible plan in one spawned group of 4
(raydit.models.conformance); the builder loads the LoRAs on every rank through
raydit.models.lora (what a worker does). Requests use two LoRAs at different scales; the
LoRAs' B factors are non-zero, so a rank computing without them gives other latents.
Tolerance (float32): rtol 1e-4, atol 1e-4, as the conformance suite's latents.
"""

from __future__ import annotations

import pytest
import torch
from support.lora_files import write_random_lora

from raydit.models import conformance as harness
from raydit.models.families.ltx2 import cases as ltx2_cases
from raydit.models.loading import load_pipeline, resolve_model_dir
from raydit.models.runner import Runner

WORLDS = (1, 2, 3, 4)
CFG_WORLDS = (2, 4)
TOL = dict(rtol=1e-4, atol=1e-4)
MODELS = {  # model: (builder, heads, builder overrides, request, worlds (None: every one))
    # CogVideoX: 2 heads (Ulysses 1, 2), text and video in one sequence.
    "tiny": ("raydit.models.families.cogvideox.cases:cogvideox_pipeline", 2, dict(num_attention_heads=2),
             dict(prompt="a red fox", num_frames=5, height=32, width=48, num_inference_steps=2, seed=3), None),
    # Wan 2.1: 6 heads (Ulysses 1, 2, 3), 2 x 3 x 5 = 30 video tokens (4 ranks pad).
    "tiny-wan": ("raydit.models.families.wan.cases:wan_pipeline", 6, dict(),
                 dict(prompt="a red fox", num_frames=5, height=48, width=80, num_inference_steps=2,
                      guidance_scale=5.0, seed=3), None),
    # LTX-2: 6 heads, 39 video tokens and 18 audio tokens; cfg, STG and modality passes, so cfg 2
    # puts the main pass on one group and the perturbed passes on the other, each with the LoRAs.
    "tiny-ltx2": ("raydit.models.families.ltx2.cases:ltx2_pipeline", ltx2_cases.TINY_HEADS, dict(),
                  dict(ltx2_cases.TINY_REQUEST), (2,)),
    # Kandinsky 5: 6 heads, 3 x 2 x 3 = 18 video tokens; the LoRA on every attention's
    # to_query / to_key / to_value (the sequence-parallel processor calls the adapted layers).
    "tiny-kandinsky5": ("raydit.models.families.kandinsky5.cases:kandinsky5_pipeline", 6, dict(),
                        dict(prompt="a red fox", negative_prompt="blur", num_frames=9, height=32, width=48,
                             num_inference_steps=2, guidance_scale=5.0, seed=3), (2,)),
    # Mochi 1: 6 heads, 2 x 2 x 3 = 12 video tokens with the valid text laid out across the ranks.
    "tiny-mochi": ("raydit.models.families.mochi.cases:mochi_pipeline", 6, dict(),
                   dict(prompt="a red fox", num_frames=7, height=32, width=48, num_inference_steps=2, seed=3), (2,)),
}
# The LoRA's target modules where the attention projections are not named to_q / to_k / to_v / to_out.0.
LORA_TARGETS = {"tiny-kandinsky5": ("to_query", "to_key", "to_value")}


def rel(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = []
    for model, (build, heads, overrides, request, worlds) in MODELS.items():
        base_dir = str(resolve_model_dir(model))
        kwargs = dict(base_dir=base_dir, **overrides) if model == "tiny" else dict(base_dir=base_dir)
        pipe = load_pipeline(model)
        root = tmp_path_factory.mktemp(f"lora-par-{model}")
        targets = {"targets": LORA_TARGETS[model]} if model in LORA_TARGETS else {}
        loras = {name: (str(write_random_lora(pipe, root / name, seed=seed, **targets)), "transformer")
                 for name, seed in (("a", 11), ("b", 12))}
        out.append(harness.RunnerCase(
            f"lora-{model}", "support.lora_files:conformance_pipeline", heads,
            dict(request, lora={"a": 0.7, "b": 1.3}),
            dict(build=build, build_kwargs=kwargs, loras=loras), worlds=worlds))
    return out


@pytest.fixture(scope="module")
def references(cases):
    refs, checkpoints = {}, {}
    for case in cases:
        runner = Runner(case.make())
        request = case.make_request()
        checkpoints[case.name] = runner.checkpoint(harness.run_steps(runner, request, 1))
        refs[case.name] = harness.run_steps(runner, request, case.steps).latents
        # The LoRAs matter: the base model's latents are far from these.
        base = harness.run_steps(runner, request.__class__(**{**request.to_dict(), "lora": ()}), case.steps)
        assert rel(base.latents, refs[case.name]) > 1e-2
    return refs, checkpoints


@pytest.mark.long  # stage two: every plan's spawned group (~65 s)
@pytest.mark.slow
def test_every_plan_with_loras_equals_one_process(cases, references):
    from raydit.parallel.testing import run_distributed

    refs, checkpoints = references
    outputs = run_distributed(harness.conformance_worker, max(WORLDS), [], cases, checkpoints, WORLDS, CFG_WORLDS,
                              timeout=900)
    seen, largest = 0, 0.0
    for case in cases:
        for world in harness.case_worlds(case, WORLDS):
            cfgs = (1, 2) if world in CFG_WORLDS else (1,)
            for plan in harness.feasible_plans(world, case.heads, cfg_degrees=cfgs):
                for kind in ("fresh", "resumed"):
                    got = outputs[0]["runner"][(case.name, str(plan), kind)]
                    torch.testing.assert_close(got, refs[case.name], **TOL,
                                               msg=lambda m: f"{case.name} {plan} {kind}: {m}")
                    largest = max(largest, rel(got, refs[case.name]))
                    for rank in range(1, plan.world_size):
                        assert torch.equal(outputs[rank]["runner"][(case.name, str(plan), kind)], got)
                seen += 1
    assert seen == 28  # 9 CogVideoX plans, 10 Wan plans, 3 LTX-2, 3 Kandinsky 5 and 3 Mochi plans, cfg 2 included
