"""Conformance harness every model adapter passes: parallel == one process, for every plan.

Model-independent. An adapter contributes *cases* (frozen, picklable descriptions naming a
builder by import path, so spawned gloo processes can rebuild the same model with the same
seeded weights); the harness enumerates the feasible plans of a world size and runs all
cases under all plans inside ONE process group (spawning is the slow part), returning the
outputs for the test to compare with the single-process reference.

- ForwardCase: `build(**kwargs) -> (transformer, forward_kwargs)`; one transformer forward.
- RunnerCase: `build(**kwargs) -> pipeline`; a few denoising steps of CogVideoXRunner, also
  resumed from a checkpoint taken by another world size.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch


def _resolve(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ForwardCase:
    name: str
    build: str  # "package.module:function" -> (transformer, forward kwargs)
    heads: int  # feasible ulysses degrees divide it
    kwargs: dict = field(default_factory=dict)

    def make(self):
        return _resolve(self.build)(**self.kwargs)


@dataclass(frozen=True)
class RunnerCase:
    name: str
    build: str  # "package.module:function" -> a diffusers pipeline
    heads: int
    request: dict  # GenerationRequest fields
    kwargs: dict = field(default_factory=dict)
    steps: int = 2  # denoising steps run (<= request num_inference_steps)

    def make(self):
        return _resolve(self.build)(**self.kwargs)


@dataclass(frozen=True)
class MeshPlan:
    ulysses: int
    ring: int
    cfg: int = 1

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg

    def __str__(self) -> str:
        return f"u{self.ulysses}r{self.ring}c{self.cfg}"


def feasible_plans(world_size: int, heads: int, cfg_degrees: tuple[int, ...] = (1,)) -> list[MeshPlan]:
    """Every (ulysses, ring, cfg) with product world_size and ulysses dividing heads."""
    plans = []
    for cfg in cfg_degrees:
        if world_size % cfg:
            continue
        sp = world_size // cfg
        for ulysses in range(1, sp + 1):
            if sp % ulysses == 0 and heads % ulysses == 0:
                plans.append(MeshPlan(ulysses, sp // ulysses, cfg))
    return plans


def forward_once(transformer, forward_kwargs: dict) -> torch.Tensor:
    with torch.no_grad():
        return transformer(**forward_kwargs, return_dict=False)[0]


def run_steps(runner, request, steps: int, checkpoint: dict | None = None):
    """prepare (or resume) and step until `steps` steps are done; returns the state."""
    state = runner.prepare(request, checkpoint=checkpoint)
    while state.step_index < steps:
        state = runner.step(state)
    return state


# -- what runs inside each spawned rank ----------------------------------------------------
def forward_worker(rank: int, world_size: int, cases: list[ForwardCase]) -> dict[tuple[str, str], torch.Tensor]:
    """Every case under every feasible sp plan of this world size -> {(case, plan): output}."""
    from raydit.models.registry import parallelize
    from raydit.parallel.mesh import build_mesh

    outputs = {}
    for case in cases:
        transformer, forward_kwargs = case.make()
        for plan in feasible_plans(world_size, case.heads):
            mesh = build_mesh(plan.ulysses, plan.ring)
            with parallelize(transformer, mesh):
                outputs[(case.name, str(plan))] = forward_once(transformer, forward_kwargs)
    return outputs


def runner_worker(
    rank: int, world_size: int, cases: list[RunnerCase], checkpoints: dict[str, dict]
) -> dict[tuple[str, str, str], torch.Tensor]:
    """Every runner case under every feasible (ulysses, ring, cfg) plan.

    Returns {(case, plan, "fresh"): latents after case.steps steps from the seed,
             (case, plan, "resumed"): latents after resuming from checkpoints[case]}.
    """
    from raydit.models.runner import CogVideoXRunner, GenerationRequest
    from raydit.parallel.mesh import build_mesh

    outputs = {}
    for case in cases:
        pipe = case.make()
        request = GenerationRequest(**case.request)
        for plan in feasible_plans(world_size, case.heads, cfg_degrees=(1, 2)):
            mesh = build_mesh(plan.ulysses, plan.ring, plan.cfg)
            runner = CogVideoXRunner(pipe, mesh)
            try:
                outputs[(case.name, str(plan), "fresh")] = run_steps(runner, request, case.steps).latents
                if case.name in checkpoints:
                    resumed = run_steps(runner, request, case.steps, checkpoint=checkpoints[case.name])
                    outputs[(case.name, str(plan), "resumed")] = resumed.latents
            finally:
                runner.close()
    return outputs


def conformance_worker(rank: int, world_size: int, forward_cases, runner_cases, checkpoints) -> dict[str, Any]:
    """Both suites in one process group."""
    return {
        "forward": forward_worker(rank, world_size, forward_cases),
        "runner": runner_worker(rank, world_size, runner_cases, checkpoints),
    }
