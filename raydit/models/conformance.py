"""Conformance harness every model adapter passes: parallel == one process, for every plan.

Model-independent. An adapter contributes *cases* (frozen, picklable descriptions naming a
builder by import path, so spawned gloo processes can rebuild the same model with the same
seeded weights); the harness enumerates the feasible plans of a world size and runs all
cases under all plans inside ONE process group (spawning is the slow part), returning the
outputs for the test to compare with the single-process reference.

- ForwardCase: `build(**kwargs) -> (transformer, forward_kwargs)`; one transformer forward.
  A family's first forward case is its main case: it runs on every world size, and in
  bfloat16 as well as float32 (`family_cases()["main"]`, `at_dtype`).
  In bfloat16 the plans are held to raydit.models.precision's rule against float64 at two
  places: the forward's output, and every sp_attention call inside it (`bf16_errors`).
- RunnerCase: `build(**kwargs) -> pipeline`; a few denoising steps of the generic Runner,
  also resumed from a checkpoint taken by another world size.

Each family contributes its cases from its own module (`Family.conformance_cases`);
`family_cases` collects them all, so the suite runs every family on every plan.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from raydit.models.tiny import resolve_builder as _resolve
from raydit.planner.layouts import mesh_layouts
from raydit.planner.runconfig import GroupModes


@dataclass(frozen=True)
class ForwardCase:
    name: str
    build: str  # "package.module:function" -> (transformer, forward kwargs)
    heads: int  # feasible ulysses degrees divide it
    kwargs: dict = field(default_factory=dict)
    worlds: tuple[int, ...] | None = None  # world sizes run (None: every one the suite runs)
    options: dict = field(default_factory=dict)  # parallelize options every plan runs with
    # "package.module:function" (transformer, dtype) -> the transformer in dtype, for a model
    # that a plain .to(dtype) breaks (Kandinsky 5 keeps its time embedding in float32); None: .to
    cast: str | None = None

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
    image: str | None = None  # "checker": a deterministic test image goes with the request
    cfg: bool = True  # cfg plans apply (the request uses guidance)
    branch_degrees: tuple[int, ...] = (2,)  # the cfg (branch) degrees above 1 its plans take
    checkpoint_step: int = 1  # the one-process checkpoint every plan resumes from (< steps)
    # World sizes run (None: every one the suite runs). A family runs its main case on every
    # world and its variants on a few, to keep the suite's one spawned group affordable.
    worlds: tuple[int, ...] | None = None
    options: dict = field(default_factory=dict)  # the Runner's parallel_options on every plan

    def make(self, dtype: torch.dtype | None = None):
        """The pipeline; in `dtype`, loaded in it where the builder takes a `dtype` (as
        from_pretrained(dtype=...) loads: modules a model keeps in float32 stay so, Kandinsky 5's
        time embedding), else cast with .to(dtype=...)."""
        import inspect

        build = _resolve(self.build)
        if dtype is None:
            return build(**self.kwargs)
        if "dtype" in inspect.signature(build).parameters:
            return build(**self.kwargs, dtype=dtype)
        return build(**self.kwargs).to(dtype=dtype)

    def cfg_degrees(self, world_size: int, cfg_world_sizes) -> tuple[int, ...]:
        """The cfg degrees of its plans on `world_size` ranks (cfg plans on `cfg_world_sizes`)."""
        return (1,) + (self.branch_degrees if self.cfg and world_size in cfg_world_sizes else ())

    def make_request(self):
        from raydit.models.requests import GenerationRequest, checker_image, image_to_png

        image = None if self.image is None else image_to_png(checker_image(self.request["height"], self.request["width"]))
        return GenerationRequest(**self.request, image=image)


class _Unbuilt(dict):
    def __missing__(self, name):
        return f"<{name}: not built>"


def family_cases(build: bool = True) -> dict[str, list]:
    """Every family's forward and runner cases, and "main": each family's first forward case
    (a family lists its plainest case first, on every world size, its variants after it).
    `build=False` lists them without building the tiny pipelines
    (test collection: names, heads and plans only)."""
    from raydit.models.registry import families, tiny_models

    base_dirs = {name: str(make()) for name, make in tiny_models().items()} if build else _Unbuilt()
    out = {"forward": [], "runner": [], "main": []}
    for family in families().values():
        cases = family.conformance_cases(base_dirs)
        out["forward"] += cases.get("forward", [])
        out["runner"] += cases.get("runner", [])
        out["main"] += cases.get("forward", [])[:1]
    return out


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


def case_worlds(case, world_sizes) -> list[int]:
    """The world sizes of `world_sizes` this case runs on."""
    return [w for w in world_sizes if case.worlds is None or w in case.worlds]


def feasible_plans(world_size: int, heads: int, cfg_degrees: tuple[int, ...] = (1,)) -> list[MeshPlan]:
    """Every (ulysses, ring, cfg) with product world_size and ulysses dividing heads."""
    return [MeshPlan(*layout) for layout in mesh_layouts(heads, world_size, cfg_degrees)]


def forward_once(transformer, forward_kwargs: dict) -> torch.Tensor:
    """The transformer's output; a model with several output streams (LTX-2: video and audio)
    gives them all, each flattened per sample and concatenated, so every one is compared."""
    with torch.no_grad():
        outputs = transformer(**forward_kwargs, return_dict=False)
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat([o.flatten(1) for o in outputs], dim=1)


def at_dtype(transformer, forward_kwargs: dict, dtype: torch.dtype, cast_model: str | None = None):
    """The transformer (in place; through `cast_model`, a ForwardCase's `cast`, where given) and
    its floating inputs in `dtype`; other inputs (token ids, integer timesteps and masks, sizes)
    as they are. -> (transformer, forward kwargs)."""
    cast = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in forward_kwargs.items()}
    model = _resolve(cast_model)(transformer, dtype) if cast_model else transformer.to(dtype)
    return model, cast


def latent_streams(latents) -> tuple:
    """Family.output_latents' / reference_latents' answer as a tuple of tensors: (latents,), or
    (video, audio) for a pipeline that makes sound too (LTX-2); comparisons check each."""
    return latents if isinstance(latents, tuple) else (latents,)


def run_steps(runner, request, steps: int | None, checkpoint: dict | None = None):
    """prepare (or resume) and step until `steps` steps are done (None: all of them; a
    diffusion-forcing request runs more steps than num_inference_steps); returns the state."""
    state = runner.prepare(request, checkpoint=checkpoint)
    while not state.done if steps is None else state.step_index < steps:
        state = runner.step(state)
    return state


def run_switching(first, second, request, at: set):
    """Final latents of `request` stepped by `first` at the step indices in `at` and by
    `second` at the others (two Runners on pipelines of the same weights: a run stepped by
    hand, e.g. unquantized and quantized). Each prepares the request first, as a Runner does
    before it steps one (a compiled Runner warms up there); `first`'s state is carried."""
    second.prepare(request)
    state = first.prepare(request)
    while not state.done:
        state = (first if state.step_index in at else second).step(state)
    return state.latents


def mode_plan_runs(rank: int, world_size: int, cases, plans, modes: dict, reference: str = "float64") -> dict:
    """Per case, in bfloat16: one rank and every plan of `plans` under each mode (name -> the
    RunConfig's keyword arguments; one pipeline per mode, every Runner on it), and one rank in
    the `reference` dtype under no mode from the bf16 run's initial noise. Keys (case,
    reference) and (case, mode, str(plan or None)); a worker for
    raydit.parallel.testing.run_distributed.

    A scheduler that draws noise at every step draws it in the latents' dtype: CPU torch's
    bfloat16 draws are its float32 draws rounded (for sizes a multiple of 16), its float64
    draws are other numbers, so such a request takes a float32 reference."""
    from raydit.models.runner import Runner
    from raydit.planner.runconfig import RunConfig

    bf16 = torch.bfloat16
    ref_dtype = getattr(torch, reference)
    out = {}
    for case in cases:
        request = case.make_request()
        runner = Runner(case.make(ref_dtype), dtype=ref_dtype, init_dtype=bf16)
        try:
            out[(case.name, reference)] = run_steps(runner, request, case.steps).latents
        finally:
            runner.close()
        for mode, kwargs in modes.items():
            pipe = case.make(bf16)
            for plan in (None, *plans):
                runner = Runner(pipe, None if plan is None else prefix_mesh(plan), dtype=bf16, run=RunConfig(**kwargs))
                try:
                    out[(case.name, mode, str(plan))] = run_steps(runner, request, case.steps).latents
                finally:
                    runner.close()
    return out


def run_batched(runner, requests: list, joins: list[int]) -> list:
    """Step-level batching as a replica runs it: request i is prepared at tick joins[i] and
    joins the batch from then on; every tick steps the batch's unfinished requests as one
    (Runner.step_batch); a request leaves when its own steps are done. Returns each
    request's final state, in order."""
    states: dict[int, object] = {}
    tick = 0
    while len(states) < len(requests) or any(not s.done for s in states.values()):
        for i, request in enumerate(requests):
            if joins[i] == tick:
                states[i] = runner.prepare(request)
        live = [i for i in sorted(states) if not states[i].done]
        if live:
            for i, new in zip(live, runner.step_batch([states[i] for i in live])):
                states[i] = new
        tick += 1
    return [states[i] for i in range(len(requests))]


def batching_worker(rank: int, world_size: int, build: str, kwargs: dict, requests: list[dict], joins: list[int],
                    plans: list[tuple[int, int, int]]) -> dict[str, list]:
    """`run_batched` of the requests under every (ulysses, ring, cfg) plan of this world:
    {plan: [latents per request]}."""
    from raydit.models.requests import GenerationRequest
    from raydit.models.runner import Runner

    pipe = _resolve(build)(**kwargs)
    out = {}
    for u, r, c in plans:
        plan = MeshPlan(u, r, c)
        runner = Runner(pipe, prefix_mesh(plan))
        try:
            states = run_batched(runner, [GenerationRequest(**q) for q in requests], joins)
            out[str(plan)] = [s.latents for s in states]
        finally:
            runner.close()
    return out


# -- bfloat16 against float64 (raydit.models.precision) -------------------------------------
def gather_attention_call(calls: list[dict]) -> dict[str, torch.Tensor]:
    """One sp_attention call as every rank of its sp group recorded it (`recording_attention`)
    -> q, k, v, out over the whole sequence (B, H, L, D): parts in order, padding dropped."""
    from raydit.parallel.sharding import SeqLayout

    calls = sorted(calls, key=lambda c: c["sp_index"])
    layout = SeqLayout(calls[0]["parts"], len(calls))
    full = {}
    for name in ("q", "k", "v", "out"):
        chunks = [layout.split_local(c[name], dim=2) for c in calls]  # per rank: its chunk of each part
        full[name] = torch.cat([layout.unshard([mine[p] for mine in chunks], p, dim=2)
                                for p in range(layout.num_parts)], dim=2)
    return full


def bf16_errors(case: ForwardCase, results: list[dict], world_sizes) -> list[dict]:
    """The bf16 rule's figures for a case that conformance_worker ran in bfloat16 (`results`:
    its return value by rank). Two places per plan, each against float64 on the same inputs:
      "output rank r": the forward's output on rank r; float64 = the bfloat16 model and
        inputs cast to float64, one process = the same forward in bfloat16 here;
      "attention call i": the plan's i-th sp_attention output gathered over its ranks;
        float64 = exact attention of the gathered q, k, v; one process = torch's SDPA in
        bfloat16 on them (what diffusers' processors call on one device).
    -> rows {plan, where, error, one_process_error, ratio, ok} (relative L2 errors)."""
    import torch.nn.functional as F

    from raydit.models.precision import error_ratio, relative_error, within_bf16_rule

    def row(plan, where, out, reference, one_process):
        error, one_error = relative_error(out, reference), relative_error(one_process, reference)
        return dict(plan=str(plan), where=where, error=error, one_process_error=one_error,
                    ratio=error_ratio(error, one_error), ok=within_bf16_rule(error, one_error))

    transformer, forward_kwargs = at_dtype(*case.make(), torch.bfloat16, case.cast)
    one_process = forward_once(transformer, forward_kwargs)
    reference = forward_once(*at_dtype(transformer, forward_kwargs, torch.float64, case.cast))
    rows = []
    for world_size in case_worlds(case, world_sizes):
        for plan in feasible_plans(world_size, case.heads):
            key = (case.name, str(plan))
            for rank in range(plan.world_size):
                rows.append(row(plan, f"output rank {rank}", results[rank]["forward_bf16"][key], reference, one_process))
            per_rank = [results[rank]["attention_bf16"][key] for rank in range(plan.world_size)]
            if not per_rank[0] or any(len(calls) != len(per_rank[0]) for calls in per_rank):
                raise AssertionError(f"{key}: sp_attention calls recorded per rank {[len(c) for c in per_rank]}")
            for i, calls in enumerate(zip(*per_rank)):
                full = gather_attention_call(list(calls))
                q, k, v = full["q"], full["k"], full["v"]
                with torch.no_grad():
                    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=calls[0]["scale"])
                    one = F.scaled_dot_product_attention(q, k, v, scale=calls[0]["scale"])
                rows.append(row(plan, f"attention call {i}", full["out"], exact, one))
    return rows


# -- meshes on a prefix of the world --------------------------------------------------------
def prefix_mesh(plan: MeshPlan):
    """The mesh of `plan` on global ranks 0 .. plan.world_size - 1 of a possibly larger world.

    Spawning processes dominates the suite's time, so one group of the largest world size
    runs every smaller world on its first ranks. Collective over the whole default group
    (new_group is); None on ranks outside the prefix.
    """
    from raydit.parallel.mesh import build_mesh, release_mesh

    # Callers use one mesh at a time, every rank in step: the previous mesh's groups are done
    # with, and each holds gloo threads that would otherwise pile up (see release_mesh). Its
    # release is local: first every rank must be past its groups' connection (on a loaded
    # machine a peer may still be connecting them: "Connection closed by peer" otherwise).
    if _LAST_MESH:
        dist.barrier()
    release_mesh(_LAST_MESH.pop() if _LAST_MESH else None)
    mesh = build_mesh(plan.ulysses, plan.ring, plan.cfg, ranks=list(range(plan.world_size)))
    _LAST_MESH.append(mesh)
    return mesh


_LAST_MESH: list = []  # the mesh prefix_mesh built last in this process


# -- what runs inside each spawned rank ----------------------------------------------------
@contextlib.contextmanager
def recording_attention(calls: list):
    """Every sp_attention call while inside appends {sp_index, parts, scale, q, k, v, out} (this
    rank's local (B, H, S, D) tensors, copied). The real sp_attention runs: the processors
    import it from its module when called, so replacing the module's name reaches them."""
    from raydit.parallel import attention

    real = attention.sp_attention

    def recorded(q, k, v, mesh, layout, *args, **kwargs):
        out = real(q, k, v, mesh, layout, *args, **kwargs)
        scale = kwargs.get("scale", args[0] if args else None)
        calls.append(dict(sp_index=mesh.sp_index, parts=layout.part_lengths, scale=scale,
                          **{name: t.detach().clone() for name, t in (("q", q), ("k", k), ("v", v), ("out", out))}))
        return out

    attention.sp_attention = recorded
    try:
        yield calls
    finally:
        attention.sp_attention = real


def forward_worker(
    world_sizes, cases: list[ForwardCase], bf16_cases=()
) -> dict[str, dict[tuple[str, str], Any]]:
    """Every case under every feasible sp plan of each world size in float32, and the cases
    named in `bf16_cases` again in bfloat16 (inputs rounded to bfloat16 once, `at_dtype`),
    with their sp_attention calls recorded -> {"float32": {(case, plan): output},
    "bfloat16": {(case, plan): output}, "bfloat16_attention": {(case, plan): [call, ...]}}."""
    from raydit.models.registry import parallelize

    outputs = {"float32": {}, "bfloat16": {}, "bfloat16_attention": {}}
    for case in cases:
        transformer, forward_kwargs = case.make()
        dtypes = (torch.float32, torch.bfloat16) if case.name in bf16_cases else (torch.float32,)
        for dtype in dtypes:
            transformer, forward_kwargs = at_dtype(transformer, forward_kwargs, dtype, case.cast)
            for world_size in case_worlds(case, world_sizes):
                for plan in feasible_plans(world_size, case.heads):
                    mesh = prefix_mesh(plan)
                    if mesh is None:
                        continue
                    key = (case.name, str(plan))
                    with parallelize(transformer, mesh, case.options):
                        if dtype == torch.float32:
                            outputs["float32"][key] = forward_once(transformer, forward_kwargs)
                            continue
                        with recording_attention(outputs["bfloat16_attention"].setdefault(key, [])):
                            outputs["bfloat16"][key] = forward_once(transformer, forward_kwargs)
    return outputs


def runner_worker(
    world_sizes, cases: list[RunnerCase], checkpoints: dict[str, dict], cfg_world_sizes=()
) -> dict[tuple[str, str, str], torch.Tensor]:
    """Every runner case under every feasible (ulysses, ring) plan, and its cfg plans
    (RunnerCase.branch_degrees) on `cfg_world_sizes`.

    Returns {(case, plan, "fresh"): latents after case.steps steps from the seed,
             (case, plan, "resumed"): latents after resuming from checkpoints[case]}.
    """
    from raydit.models.runner import Runner

    outputs = {}
    for case in cases:
        pipe = case.make()
        request = case.make_request()
        for world_size in case_worlds(case, world_sizes):
            degrees = case.cfg_degrees(world_size, cfg_world_sizes)
            for plan in feasible_plans(world_size, case.heads, cfg_degrees=degrees):
                mesh = prefix_mesh(plan)
                if mesh is None:
                    continue
                runner = Runner(pipe, mesh, group=GroupModes(parallel_options=case.options))
                try:
                    outputs[(case.name, str(plan), "fresh")] = run_steps(runner, request, case.steps).latents
                    if case.name in checkpoints:
                        resumed = run_steps(runner, request, case.steps, checkpoint=checkpoints[case.name])
                        outputs[(case.name, str(plan), "resumed")] = resumed.latents
                finally:
                    runner.close()
    return outputs


def conformance_worker(
    rank: int, world_size: int, forward_cases, runner_cases, checkpoints, world_sizes=None, cfg_world_sizes=(),
    bf16_forward=(),
) -> dict[str, Any]:
    """Both suites for each of `world_sizes` (default 1 .. world_size), in one process group;
    the forward cases named in `bf16_forward` in bfloat16 too ("forward_bf16", and their
    attention calls "attention_bf16")."""
    world_sizes = list(world_sizes or range(1, world_size + 1))
    assert max(world_sizes) <= world_size
    forward = forward_worker(world_sizes, forward_cases, bf16_forward)
    return {
        "forward": forward["float32"],
        "forward_bf16": forward["bfloat16"],
        "attention_bf16": forward["bfloat16_attention"],
        "runner": runner_worker(world_sizes, runner_cases, checkpoints, cfg_world_sizes),
    }
