"""Step caching that every rank agrees on: first-block cache and TeaCache-style skipping.

When the transformer's work changes little from one denoising step to the next, a step can
reuse the residual the blocks added at the last computed step instead of running them:

- `fbcache` (first-block cache, as in ParaAttention and diffusers' FirstBlockCache): run the
  first block; r1 = its output - its input (the hidden stream). If
      rel = sum |r1 - r1_prev| / sum |r1_prev|     (relative L1, r1_prev: last computed step)
  is below the threshold, skip the other blocks: every output stream = first block's output
  + the residual the other blocks added at the last computed step.
- `teacache` (TeaCache-style, Liu et al. 2024): before any block runs, accumulate the
  relative L1 change of the timestep embedding the blocks receive (`temb`) since the last
  step; while the sum stays below the threshold, skip ALL blocks (outputs = inputs + the
  residual of all blocks at the last computed step). The first and the last step always
  compute. Without TeaCache's per-model rescaling polynomial (fitted on the real models):
  thresholds are on the raw relative change.

Agreement. A rank-local decision would let one rank skip the blocks (and their attention
collectives) while another runs them: a hang. The decision quantity is a ratio of two sums;
each rank adds its share (its local tokens, pad tokens excluded; its guidance branch) and the
two sums are all-reduced over the sequence-parallel group and then over the cfg pair, so
every rank computes the same ratio and decides the same. What the sums cover does not depend
on the plan: one transformer call of one process. With the branches batched (CogVideoX) that
call holds both branches, so on a cfg-2 mesh both cfg ranks contribute; with two calls per
step (Wan) the decision is made at the step's first call (the unconditional branch, or the
only one) and the second call follows it, so on a cfg-2 mesh only the rank running that
branch contributes. A family with more branches (LTX-2: the negative and positive pass as one
call, then STG and modality passes) decides the same way: `BranchPlan` says, from the request
alone, which branches each call of each cfg group covers, and which one-process call decides.
A step is cached or computed as a whole, on every rank.

State. The residuals live in `DenoiseState.carry` (checkpointed): FULL sequences (gathered,
padding removed), one tensor per guidance branch ("uncond"/"cond", or branch0.. for more, batch
1) and output stream, exchanged over the cfg group, so every rank holds all of them and a checkpoint from any rank
resumes on any world size: each rank cuts its local shard from the full tensor at every step.
The cost is one all-gather of the first block's output per COMPUTED step (fbcache; teacache
needs none: its residual is taken against the full input) and, on a cfg-2 mesh, one exchange
of the residuals over the cfg pair per computed step. Skipped steps communicate two scalars.

Hooks. On every transformer of the pipeline, the blocks named by its adapter's plan get: a
forward pre-hook on the first block that runs before the adapter's split (the full inputs),
their `forward` wrapped (the first block decides; the others pass their inputs through when
the step is skipped), and a forward hook on the last block after the adapter's gather (the
full outputs). Outside a cached step the wrappers call the model's own forward unchanged.

Legend: B batch (branches of one call), L tokens of a part (full) or of a chunk (local), C channels.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

# The request's options (methods, defaults, checks) live in a leaf module: GenerationRequest
# checks them without importing this one.
from raydit.models.cache_options import cache_threshold

PREFIX = "cache/"
CACHED_STEPS = PREFIX + "cached_steps"  # carry key: steps served from the cache so far
_MODEL = PREFIX + "model"  # which transformer of the pipeline computed the cached residuals
_ACCUM = PREFIX + "accumulated"  # teacache: relative change accumulated since the last compute





def branch_labels(n: int) -> tuple[str, ...]:
    """The names of a step's guidance branches in the carry, in `guidance_branches` order: the
    classifier-free pair keeps its names ("uncond", "cond"; one branch: "cond"), others are
    numbered (LTX-2's four passes: branch0..branch3)."""
    if n == 1:
        return ("cond",)
    if n == 2:
        return ("uncond", "cond")
    return tuple(f"branch{i}" for i in range(n))


@dataclass(frozen=True)
class BranchPlan:
    """Which guidance branches the transformer calls of one step cover, as every rank computes
    them from the request alone: `groups[g]` the label tuples of the calls group g makes that
    run the model (a slot that predicts without one, LTX-2's pass turned off, has none), in
    call order; `live` every branch some call runs; `deciding` the branches of a one-process
    step's first call (what the decision quantity covers)."""

    labels: tuple[str, ...]
    live: tuple[str, ...]
    deciding: tuple[str, ...]
    groups: tuple[tuple[tuple[str, ...], ...], ...]


def branch_plan(family, pipe, request, groups: int) -> BranchPlan:
    """The BranchPlan of `request` on `groups` cfg groups (mirrors Runner._branches: group g
    takes the g-th of `groups` equal consecutive shares; one branch runs on every group)."""
    # The branches' structure does not depend on the embeddings: stand-ins are enough.
    dummies = family.guidance_branches(pipe, request, {}, {} if family.do_cfg(pipe, request) else None)
    labels = branch_labels(len(dummies))

    def calls_of(indices: list[int]) -> tuple[tuple[str, ...], ...]:
        calls = family.group_calls([dummies[i] for i in indices])
        out, at = [], 0
        for call, k in zip(calls, family.call_branch_counts(calls, len(indices))):
            if family.call_runs_model(call):
                out.append(tuple(labels[i] for i in indices[at:at + k]))
            at += k
        return tuple(out)

    n = len(labels)
    one = calls_of(list(range(n)))
    if n > 1 and groups > 1:
        k = n // groups
        per_group = tuple(calls_of(list(range(g * k, (g + 1) * k))) for g in range(groups))
    else:
        per_group = (one,) * groups
    return BranchPlan(labels, tuple(b for call in one for b in call), one[0] if one else (), per_group)


@dataclass(frozen=True)
class _Stream:
    """One output of a block: output `index` updates forward argument `arg`, a sequence of
    layout part `part` along `dim` (part None: not split, whole on every rank)."""

    index: int
    arg: str
    part: int | None
    dim: int = 1
    when: str | None = None  # split only in forwards where the adapter's flag is set (GatherOutput.when)


def _streams(adapter, block, count: int | None) -> tuple[_Stream, ...] | None:
    """The block's output streams: `adapter.block_outputs`, else its first `count` forward
    arguments (a block returns them updated: CogVideoX hidden_states, encoder_hidden_states;
    Wan hidden_states); None while `count` is unknown."""
    names = adapter.block_outputs
    if names is None:
        if count is None:
            return None
        names = tuple(inspect.signature(block.forward).parameters)[:count]
    gathered = {g.index: g for g in adapter.plan.gather_outputs}
    return tuple(_Stream(i, name, gathered[i].part if i in gathered else None,
                         gathered[i].dim if i in gathered else 1, gathered[i].when if i in gathered else None)
                 for i, name in enumerate(names))


def _key(kind: str, branch: str, index: int | None = None) -> str:
    return f"{PREFIX}{kind}/{branch}" + ("" if index is None else f"/{index}")


class StepCache:
    """The hooks on one Runner's transformers; `begin(state)` drives them for one step."""

    def __init__(self, runner):
        adapter = runner.family.adapter()
        self.runner = runner
        self.mesh = runner.mesh
        self.temb_arg = adapter.block_temb
        self._installed: list = []  # (block, the instance `forward` it had or None)
        self._hooks: list = []
        self._run: _Run | None = None
        self.models = []  # per transformer: [its output streams (None until known), its SP handle]
        self._first = []
        self.adapter = adapter
        try:
            for m, transformer in enumerate(runner.family.transformers(runner.pipe)):
                blocks = adapter.plan.block_list(transformer)
                handle = runner.handles[m] if m < len(runner.handles) else None
                self.models.append([_streams(adapter, blocks[0], None), handle])
                self._first.append(blocks[0])
                self._install(m, blocks)
        except BaseException:
            self.remove()
            raise

    def _install(self, m: int, blocks) -> None:
        first, last = blocks[0], blocks[-1]
        signature = inspect.signature(first.forward)

        def capture(module, args, kwargs):
            if self._run is not None:
                bound = signature.bind_partial(*args, **kwargs).arguments
                self._run.capture(m, bound)

        def after_last(module, args, output):
            if self._run is not None:
                self._run.after_last(m, output)

        # Before the adapter's split pre-hook (full inputs); after its gather hook (full outputs).
        self._hooks.append(first.register_forward_pre_hook(capture, with_kwargs=True, prepend=True))
        for j, block in enumerate(blocks):
            own = block.__dict__.get("forward")
            original = block.forward

            @functools.wraps(original)
            def forward(*args, _m=m, _j=j, _original=original, **kwargs):
                run = self._run
                if run is None:
                    return _original(*args, **kwargs)
                return run.block(_m, _j, _original, args, kwargs)

            block.forward = forward
            self._installed.append((block, own))
        self._hooks.append(last.register_forward_hook(after_last))

    def streams(self, m: int, count: int | None = None) -> tuple[_Stream, ...]:
        if self.models[m][0] is None:
            self.models[m][0] = _streams(self.adapter, self._first[m], count)
        return self.models[m][0]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for block, own in self._installed:
            if own is None:
                del block.forward
            else:
                block.forward = own
        self._hooks, self._installed, self._run = [], [], None

    def begin(self, state) -> "_Run":
        runner, request = self.runner, state.request
        groups = runner.branch_degree if runner.cfg_parallel else 1
        plan = branch_plan(runner.family, runner.pipe, request, groups)
        if len(plan.labels) != state.branch_count:
            raise RuntimeError(f"the step cache counted {len(plan.labels)} guidance branches, the runner "
                               f"{state.branch_count}")
        if not all(plan.groups):
            # Every rank computes this from the request alone, so every rank refuses together.
            raise ValueError(f"step caching needs a transformer call on every cfg group, but with this request's "
                             f"guidance a group of cfg {groups} has none; run it on a plan of a lower cfg degree")
        return _Run(
            self, state,
            method=request.cache,
            threshold=cache_threshold(request.cache, request.cache_threshold),
            plan=plan,
            forwards=plan.groups[runner.mesh.cfg_rank if runner.cfg_parallel else 0],
        )


class _NoCache:
    """The step of a request without caching."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def merge(self, carry: dict) -> dict:
        return carry


NO_CACHE = _NoCache()


class _Run:
    """One step of one request: decides once, then serves every transformer call of the step."""

    def __init__(self, cache: StepCache, state, method: str, threshold: float, plan: BranchPlan, forwards):
        self.cache, self.state, self.method, self.threshold, self.plan = cache, state, method, threshold, plan
        self.forwards, self.deciding = forwards, plan.deciding
        self.several = len(plan.labels) > 1  # guidance branches (else one, run on every cfg group)
        self.carry = {k: v for k, v in state.carry.items() if k.startswith(PREFIX)}
        self.calls = 0  # transformer calls started in this step
        self.skip: bool | None = None  # the step's decision, made at its first call
        self.skipping = False  # the current call skips its blocks
        self.new: dict = {}  # residuals of this step (computed steps), this rank's branches
        self.inputs = None  # full inputs of the current call's first block
        self.out0 = None  # local outputs of the current call's first block (fbcache)
        self.quantity = None  # (sum |change|, sum |previous|) after the reduction, for tests and logs
        self.branches, self.model = self.forwards[0], None  # of the current call
        self._tembs: dict = {}  # teacache: this step's timestep embedding per branch (full)
        self._accumulated = 0.0

    # -- context: the runner wraps its transformer calls of one step ----------------------
    def __enter__(self):
        self.cache._run = self
        return self

    def __exit__(self, *exc):
        self.cache._run = None
        return False

    def merge(self, carry: dict) -> dict:
        """The family's new carry plus this step's cache state (collective on a cfg-2 mesh:
        every rank calls it once per step, after its transformer calls)."""
        out = {k: v for k, v in carry.items() if not k.startswith(PREFIX)}
        new = dict(self.carry)
        new[CACHED_STEPS] = int(new.get(CACHED_STEPS, 0)) + (1 if self.skip else 0)
        if not self.skip:
            new = {k: v for k, v in new.items() if not k.startswith((PREFIX + "r1/", PREFIX + "rest/"))}
            new.update(self._exchange(self.new))
        if self.method == "teacache":
            new[_ACCUM] = self._accumulated if self.skip else 0.0
            new.update({_key("temb", b): t for b, t in self._tembs.items() if b in self.deciding})
        out.update(new)
        return out

    # -- the hooks ---------------------------------------------------------------------------
    def capture(self, m: int, bound: dict) -> None:
        self.inputs = bound

    def block(self, m: int, j: int, original, args, kwargs):
        if j == 0:
            return self._first_block(m, original, args, kwargs)
        if self.skipping:
            return self._pass_through(m, original, args, kwargs)
        return original(*args, **kwargs)

    def after_last(self, m: int, output) -> None:
        if self.skipping:
            return
        full_last = output if isinstance(output, (tuple, list)) else (output,)
        streams = self.cache.streams(m, len(full_last))
        if self.method == "fbcache":
            full0 = [self._gather(m, self.out0[s.index], s) for s in streams]
            r1 = full0[0] - self.inputs[streams[0].arg]
            self._store("r1", r1, None)
            base = full0
        else:
            base = [self.inputs[s.arg] for s in streams]
        for s, last, b in zip(streams, full_last, base):
            self._store("rest", last - b, s.index)
        self.inputs = self.out0 = None

    # -- decisions ---------------------------------------------------------------------------
    def _first_block(self, m: int, original, args, kwargs):
        call = self.calls
        self.calls += 1
        assert call < len(self.forwards), (call, self.forwards)
        self.branches, self.model = self.forwards[call], m
        if self.method == "teacache":
            if call == 0:
                self.skip = self._decide_teacache(m)
            self.skipping = self.skip
            if self.skipping:
                # As many streams as the residuals in the carry (block 0 may not have run yet here).
                count = sum(1 for k in self.carry if k.startswith(_key("rest", self.branches[0]) + "/"))
                streams = self.cache.streams(m, count)
                local = self._bound(original, args, kwargs)
                return self._outputs(streams, [local[s.arg] + self._cached_rest(m, s) for s in streams])
            return original(*args, **kwargs)
        out = original(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        streams = self.cache.streams(m, len(outs))
        if call == 0:
            local = self._bound(original, args, kwargs)
            self.skip = self._decide_fbcache(m, outs[0] - local[streams[0].arg])
        self.skipping = self.skip
        if self.skipping:
            return self._outputs(streams, [o + self._cached_rest(m, s) for o, s in zip(outs, streams)])
        self.out0 = outs
        return out

    def _usable(self, m: int) -> bool:
        """Whether the carry holds residuals this step may use: the same on every rank (the
        carry is), so every rank takes the same branch below and calls the same collectives."""
        carry, state = self.carry, self.state
        if state.step_index == 0 or carry.get(_MODEL) != m:
            return False
        needed = [_key("rest", b, 0) for b in self.plan.live]
        if self.method == "fbcache":
            needed += [_key("r1", b) for b in self.deciding]
        else:
            if state.step_index >= state.num_steps - 1:
                return False
            needed += [_key("temb", b) for b in self.deciding]
        return all(k in carry for k in needed)

    def _contributes(self) -> bool:
        """Whether this rank's first call is part of what the decision covers (once)."""
        runner = self.cache.runner
        if not runner.cfg_parallel:
            return True
        if not self.several:
            from raydit.models.family import COND

            return runner.mesh.cfg_rank == COND  # every cfg group runs cond: count it once
        return set(self.branches) <= set(self.deciding)

    def _reduce(self, sums):
        """[sum |change|, sum |previous|] -> the same two sums over every rank of the mesh."""
        import torch.distributed as dist

        runner = self.cache.runner
        mesh = runner.mesh
        if mesh is not None and mesh.sp_group is not None:
            dist.all_reduce(sums, group=mesh.sp_group)
        if runner.cfg_parallel:
            dist.all_reduce(sums, group=mesh.cfg_group)
        return sums

    def _ratio(self, sums) -> float:
        change, previous = (float(x) for x in self._reduce(sums))
        self.quantity = (change, previous)
        return change / previous if previous > 0 else math.inf

    def _decide_fbcache(self, m: int, r1_local) -> bool:
        import torch

        if not self._usable(m):
            return False
        streams = self.cache.streams(m)
        sums = torch.zeros(2, dtype=torch.float64, device=r1_local.device)
        if self._contributes():
            prev = self._local(m, streams[0], [self.carry[_key("r1", b)] for b in self.branches])
            valid = self._valid(m, streams[0])
            now, prev = r1_local.narrow(streams[0].dim, 0, valid), prev.narrow(streams[0].dim, 0, valid)
            sums[0] = (now.float() - prev.float()).abs().sum(dtype=torch.float64)
            sums[1] = prev.float().abs().sum(dtype=torch.float64)
        return self._ratio(sums) < self.threshold

    def _decide_teacache(self, m: int) -> bool:
        import torch

        temb = self.inputs[self.cache.temb_arg]
        # Per branch, batch 1 (the embedding is full on every rank: taken before the split).
        self._tembs = dict(zip(self.branches, temb.detach().chunk(len(self.branches))))
        if self.cache.runner.cfg_parallel:
            self._tembs = self._exchange_tembs(self._tembs)
        self._accumulated = float(self.carry.get(_ACCUM, 0.0))
        if not self._usable(m):
            return False
        sums = torch.zeros(2, dtype=torch.float64, device=temb.device)
        # The embedding is whole on every rank of the sp group: counted once, by sp index 0.
        mesh = self.cache.mesh
        if self._contributes() and (mesh is None or mesh.sp_index == 0):
            now = torch.cat([self._tembs[b] for b in self.branches]).float()
            prev = torch.cat([self.carry[_key("temb", b)] for b in self.branches]).float()
            sums[0] = (now - prev).abs().sum(dtype=torch.float64)
            sums[1] = prev.abs().sum(dtype=torch.float64)
        self._accumulated += self._ratio(sums)
        return self._accumulated < self.threshold

    # -- tensors -----------------------------------------------------------------------------
    @staticmethod
    def _bound(original, args, kwargs) -> dict:
        return inspect.signature(original).bind_partial(*args, **kwargs).arguments

    @staticmethod
    def _outputs(streams, tensors):
        return tensors[0] if len(streams) == 1 else tuple(tensors)

    def _pass_through(self, m: int, original, args, kwargs):
        streams = self.cache.streams(m)
        local = self._bound(original, args, kwargs)
        return self._outputs(streams, [local[s.arg] for s in streams])

    def _layout(self, m: int):
        _, handle = self.cache.models[m]
        return None if handle is None else handle.context.layout

    def _split_part(self, m: int, s: _Stream) -> int | None:
        """The layout part stream `s` is split as in this forward; None: whole on every rank."""
        _, handle = self.cache.models[m]
        if handle is None or s.part is None or (s.when is not None and not handle.context.flags.get(s.when)):
            return None
        return s.part

    def _valid(self, m: int, s: _Stream) -> int:
        part = self._split_part(m, s)
        if part is None:
            return self.inputs[s.arg].size(s.dim)
        return self._layout(m).valid_counts(self.cache.mesh.sp_index)[part]

    def _local(self, m: int, s: _Stream, full_per_branch):
        """Full tensors of the branches of this call -> this rank's local chunk [B, chunk, ...]."""
        import torch

        full = torch.cat(full_per_branch) if len(full_per_branch) > 1 else full_per_branch[0]
        part = self._split_part(m, s)
        if part is None:
            return full
        return self._layout(m).shard(full, part, self.cache.mesh.sp_index, dim=s.dim)

    def _cached_rest(self, m: int, s: _Stream):
        return self._local(m, s, [self.carry[_key("rest", b, s.index)] for b in self.branches])

    def _gather(self, m: int, local, s: _Stream):
        part = self._split_part(m, s)
        if part is None:
            return local
        from raydit.parallel.mesh import gather_sequence

        return gather_sequence(local, self.cache.mesh, self._layout(m), part, dim=s.dim)

    def _store(self, kind: str, full, index: int | None) -> None:
        """A full residual of this call [B, L, ...] -> one entry per branch, batch 1."""
        for branch, part in zip(self.branches, full.detach().chunk(len(self.branches))):
            self.new[_key(kind, branch, index)] = part.contiguous()
        self.new[_MODEL] = self.model

    def _exchange(self, new: dict) -> dict:
        """cfg mesh with several branches: each group computed its share; every rank gets all.
        The keys name their branches, so a group's entries keep their names: each group's are
        listed (names, shapes, dtypes) to all, then broadcast from it over the cfg group."""
        runner = self.cache.runner
        if not (runner.cfg_parallel and self.several):
            return new
        import torch
        import torch.distributed as dist

        group, mine = runner.mesh.cfg_group, runner.mesh.cfg_rank
        tensors = {k: v for k, v in new.items() if isinstance(v, torch.Tensor)}
        out = {k: v for k, v in new.items() if not isinstance(v, torch.Tensor)}
        listing = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sorted(tensors.items())]
        listings = [None] * runner.mesh.cfg
        dist.all_gather_object(listings, listing, group=group)
        device = next(iter(tensors.values())).device if tensors else torch.device(runner.device)
        for c, entries in enumerate(listings):
            src = dist.get_global_rank(group, c)
            for key, shape, dtype in entries:
                tensor = tensors[key].contiguous() if c == mine else torch.empty(shape, dtype=getattr(torch, dtype),
                                                                                  device=device)
                dist.broadcast(tensor, src=src, group=group)
                out[key] = tensor
        return out

    def _exchange_tembs(self, tembs: dict) -> dict:
        if not self.several:
            return tembs
        return {k.rsplit("/", 1)[1]: v for k, v in self._exchange({_key("temb", b): t for b, t in tembs.items()}).items()}
