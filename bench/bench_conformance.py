"""The conformance suite's figures: for every family's cases (raydit.models.conformance, the same
cases, plans and world sizes as tests/models/test_conformance.py), the largest difference of
each plan from one process, and of one process from diffusers' own pipeline.

Not a timing: the suite asserts the tolerances (forward rtol 1e-4 / atol 1e-5, latents rtol
1e-4 / atol 1e-4, one process vs diffusers max relative 1e-5); this writes what the
differences were, so a closing note can list every plan tested with the largest seen.
Per (case, plan): max |parallel - one process| over every rank's output (forward) or rank 0's
latents (runner, fresh from the seed and resumed from a one-process checkpoint), and that
divided by max |one process|.

    python bench/bench_conformance.py [--cases hunyuanvideo ltx ...] [--out docs/benchmarks]

`--cases`: case-name prefixes (default: every case of every family).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

WORLDS = (1, 2, 3, 4, 5, 6, 8)  # as tests/models/test_conformance.py
CFG_WORLDS = (2, 4)


def _diff(actual, expected) -> dict:
    top = float(expected.abs().max())
    err = float((actual - expected).abs().max())
    return {"max_abs": err, "max_rel": err / top if top else float("inf"), "max_abs_reference": top}


def diffusers_row(case, pipe, request) -> dict:
    """One process against the family's diffusers pipeline, both in the pipeline's latent
    output layout (Family.output_latents: LTX and LTX-2 unpack and denormalize)."""
    from raydit.models import conformance as harness
    from raydit.models.registry import family_for_pipeline
    from raydit.models.runner import Runner

    import torch

    family = family_for_pipeline(pipe)
    # every stream the pipeline returns (LTX-2: video and audio), in one flat tensor
    expected = torch.cat([t.flatten() for t in harness.latent_streams(family.reference_latents(pipe, request))])
    mine = family.output_latents(pipe, harness.run_steps(Runner(pipe), request, request.num_inference_steps))
    mine = torch.cat([t.flatten() for t in harness.latent_streams(mine)])
    return {"case": case.name, "steps": request.num_inference_steps, **_diff(mine, expected)}


def run(prefixes: list[str] | None, all_worlds: bool = False) -> dict:
    import dataclasses

    import torch

    from raydit.models import conformance as harness
    from raydit.models.runner import Runner
    from raydit.parallel.testing import run_distributed

    def chosen(case) -> bool:
        return not prefixes or any(case.name.startswith(p) for p in prefixes)

    cases = harness.family_cases(build=True)
    forward_cases = [c for c in cases["forward"] if chosen(c)]
    runner_cases = [c for c in cases["runner"] if chosen(c)]
    if all_worlds:  # every world of WORLDS, not the few the suite gives a variant case
        forward_cases = [dataclasses.replace(c, worlds=None) for c in forward_cases]
        runner_cases = [dataclasses.replace(c, worlds=None) for c in runner_cases]
    forward_refs = {c.name: harness.forward_once(*c.make()) for c in forward_cases}
    refs, checkpoints, diffusers_rows = {}, {}, []
    for case in runner_cases:
        pipe = case.make()
        runner, request = Runner(pipe), case.make_request()
        checkpoints[case.name] = runner.checkpoint(harness.run_steps(runner, request, case.checkpoint_step))
        refs[case.name] = harness.run_steps(runner, request, case.steps).latents
        diffusers_rows.append(diffusers_row(case, pipe, request))
    worlds = list(WORLDS)
    results = run_distributed(harness.conformance_worker, max(worlds), forward_cases, runner_cases, checkpoints,
                              worlds, CFG_WORLDS, timeout=1800)
    rows = []
    for case in forward_cases:
        for world in harness.case_worlds(case, worlds):
            for plan in harness.feasible_plans(world, case.heads):
                outs = [results[r]["forward"].get((case.name, str(plan))) for r in range(plan.world_size)]
                if any(o is None for o in outs):
                    continue
                worst = max((_diff(o, forward_refs[case.name]) for o in outs), key=lambda d: d["max_abs"])
                rows.append({"kind": "forward", "case": case.name, "plan": str(plan), **worst})
    for case in runner_cases:
        for world in harness.case_worlds(case, worlds):
            for plan in harness.feasible_plans(world, case.heads, cfg_degrees=case.cfg_degrees(world, CFG_WORLDS)):
                for kind in ("fresh", "resumed"):
                    got = results[0]["runner"].get((case.name, str(plan), kind))
                    if got is None:
                        continue
                    same = all(torch.equal(results[r]["runner"][(case.name, str(plan), kind)], got)
                               for r in range(1, plan.world_size))
                    rows.append({"kind": f"runner {kind}", "case": case.name, "plan": str(plan),
                                 "ranks_identical": same, **_diff(got, refs[case.name])})
    return {"machine": benchlib.machine(),
            "worlds": worlds, "cfg_worlds": list(CFG_WORLDS), "prefixes": prefixes or [],
            "plans": rows, "one_process_vs_diffusers": diffusers_rows}


def write_md(result: dict, path: Path, command: str) -> None:
    lines = ["# Conformance: every plan against one process, one process against diffusers", "",
             f"Command: `{command}`. CPU, gloo, float32; plans `uUrRcC` = Ulysses U x ring R x cfg C.", "",
             "## Largest difference per case (over its plans)", "",
             "| case | kind | plans | worst plan | max abs | max abs / max abs of one process |",
             "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list] = {}
    for row in result["plans"]:
        groups.setdefault((row["case"], row["kind"]), []).append(row)
    for (case, kind), rows in groups.items():
        worst = max(rows, key=lambda r: r["max_abs"])
        lines.append(f"| {case} | {kind} | {', '.join(r['plan'] for r in rows)} | {worst['plan']} | "
                     f"{worst['max_abs']:.2e} | {worst['max_rel']:.2e} |")
    lines += ["", "## One process against the family's diffusers pipeline (output_type=\"latent\")", "",
              "| case | steps | max abs | max relative |", "|---|---|---|---|"]
    for row in result["one_process_vs_diffusers"]:
        lines.append(f"| {row['case']} | {row['steps']} | {row['max_abs']:.2e} | {row['max_rel']:.2e} |")
    not_identical = [r for r in result["plans"] if r.get("ranks_identical") is False]
    lines += ["", f"Runner plans whose ranks did not hold identical latents: {len(not_identical)}."]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=None, help="case-name prefixes (default: all)")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    ap.add_argument("--all-worlds", action="store_true",
                    help="run every case on every world of the suite (the suite gives variant cases a few)")
    ap.add_argument("--name", default="conformance", help="file name of the results (.json, .md)")
    args = ap.parse_args(argv)
    result = run(args.cases, args.all_worlds)
    out = Path(args.out)
    command = ("python bench/bench_conformance.py" + (f" --cases {' '.join(args.cases)}" if args.cases else "")
               + (" --all-worlds" if args.all_worlds else "") + (f" --name {args.name}" if args.name != "conformance" else ""))
    print("wrote", benchlib.write_json(args.name, result, out))
    write_md(result, out / f"{args.name}.md", command)
    print("wrote", out / f"{args.name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
