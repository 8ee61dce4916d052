"""Every plan under an 8-bit attention mode equals one rank under the same mode (Runner level).

Two families' runner cases (Wan, CogVideoX), bfloat16, on 2 gloo ranks: Ulysses 2, ring 2, cfg 2,
under attention "int8" and "fp8" (the torch implementation of the scheme on a CPU). Rule, per
plan, measured in the same test against a float64 run of the same request (same noise):
- the mode must cost something on one rank (its output differs from bf16's), so a mode that
  was silently not applied fails;
- every plan's error against float64 at most BF16_ERROR_FACTOR (2) times one rank's error under
  the mode (raydit.models.precision's rule): a ring merges blocks smoothed and scaled on their
  own keys, Ulysses and cfg attend the same keys as one rank does, and a wrong lse in the merge
  would be off by far more.
"""

from __future__ import annotations

import pytest
import torch

from raydit.models import conformance as harness
from raydit.models.precision import BF16_ERROR_FACTOR, relative_error

PLANS = (harness.MeshPlan(2, 1), harness.MeshPlan(1, 2), harness.MeshPlan(1, 1, 2))
CASES = ("wan-t2v", "cogvideox-2b-h30-rows30")
MODES = ("bf16", "int8", "fp8")


@pytest.mark.slow
@pytest.mark.long  # the second stage (suite time)
def test_every_plan_under_an_8bit_attention_mode_equals_one_rank_within_its_noise():
    from raydit.parallel.testing import run_distributed

    cases = [c for c in harness.family_cases(build=True)["runner"] if c.name in CASES]
    assert len(cases) == len(CASES)
    results = run_distributed(harness.mode_plan_runs, 2, cases, PLANS, {m: {"attention": m} for m in MODES},
                              timeout=900)
    for rank, out in enumerate(results):
        for case in cases:
            truth = out[(case.name, "float64")]
            one_bf16 = out[(case.name, "bf16", "None")]
            for mode in ("int8", "fp8"):
                one = out[(case.name, mode, "None")]
                assert not torch.equal(one, one_bf16), f"{case.name}: attention {mode} changed nothing"
                e_one = relative_error(one, truth)
                for plan in PLANS:
                    e_plan = relative_error(out[(case.name, mode, str(plan))], truth)
                    assert e_plan <= BF16_ERROR_FACTOR * e_one, \
                        f"rank {rank} {case.name} {plan} {mode}: error {e_plan:.3g} against one rank's {e_one:.3g}"
