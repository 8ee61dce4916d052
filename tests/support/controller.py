"""A dummy worker group for the elastic controller, stepped one tick at a time with injected
failures (no Ray, no torch.distributed: the one place a dummy group is allowed), and the
replanning table and tick loop the controller tests drive it with."""

from __future__ import annotations

from dataclasses import dataclass

from raydit.runtime.errors import WorkerFailure


@dataclass(frozen=True)
class FakePlan:
    ulysses: int
    ring: int
    cfg: int
    predicted_step_seconds: float

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg


@dataclass(frozen=True)
class Req:
    num_inference_steps: int
    seed: int = 0


class DummyGroup:
    """A worker group whose "latents" are the list of steps applied; failures are injected
    per call: fail_at[("step", step_index)] = number of members lost, or an exception to
    raise (an application error, out of memory)."""

    def __init__(self, members: int, free: int = 0, fail_at=None, reserve_fails: int = 0):
        self.members = list(range(members))
        self.active = list(self.members)
        self.free = free
        self.fail_at = dict(fail_at or {})
        self.reserve_fails = reserve_fails
        self.formed = []
        self.state = None
        self.calls = []
        self.timeouts = []

    def prepare(self, request, checkpoint, timeout_s=None):
        self.timeouts.append(("prepare", timeout_s))
        self._maybe_fail("prepare", checkpoint["step_index"] if checkpoint else 0)
        self.calls.append(("prepare", checkpoint["step_index"] if checkpoint else 0))
        self.request = request
        self.state = list(checkpoint["applied"]) if checkpoint else []
        n = request.num_inference_steps
        return {"num_steps": n, "step_index": len(self.state), "timesteps": list(range(n, 0, -1))}

    def step(self, timeout_s=None):
        self.timeouts.append(("step", timeout_s))
        i = len(self.state)
        self._maybe_fail("step", i)
        self.calls.append(("step", i))
        self.state.append(i)
        return {"applied": list(self.state), "step_index": len(self.state), "latents": sum(self.state)}

    def decode(self, timeout_s=None):
        self._maybe_fail("decode", 0)
        return ("frames", tuple(self.state))

    def _maybe_fail(self, what, index):
        lost = self.fail_at.pop((what, index), 0)
        if isinstance(lost, Exception):
            self.active = []  # the real pool leaves the group an application error broke
            raise lost
        if lost:
            gone, self.members = self.members[:lost], self.members[lost:]
            raise WorkerFailure(f"injected loss of {lost}", lost=gone)

    def reset_group(self):
        self.calls.append(("reset",))
        self.active = []

    def free_slot_count(self):
        return self.free

    def grow_to(self, plan):
        need = plan.world_size - len(self.members)
        if need > 0 and self.reserve_fails:
            self.reserve_fails -= 1
            raise ValueError("the Ray cluster could not hold 1 x {'CPU': 1.0} within 1 s")
        if need > 0:
            assert need <= self.free
            self.free -= need
            self.members += [100 + k for k in range(need)]

    def form(self, plan, timeout_s):
        if plan.world_size > len(self.members):
            raise ValueError(f"plan needs {plan.world_size} ranks but the pool has {len(self.members)} workers")
        self.formed.append(plan)
        self.active = self.members[: plan.world_size]


def replan_for(capacity: int, min_sp: int | None = None) -> FakePlan:
    """30 heads: 4 -> ulysses 2 x ring 2, 3 -> ulysses 3, 2 -> ulysses 2, 1 -> one rank."""
    table = {4: FakePlan(2, 2, 1, 1.0), 3: FakePlan(3, 1, 1, 1.3), 2: FakePlan(2, 1, 1, 2.0), 1: FakePlan(1, 1, 1, 4.0)}
    if capacity < 1:
        raise ValueError("no devices")
    plan = table[min(capacity, 4)]
    if min_sp is not None and plan.ulysses * plan.ring < min_sp:
        raise ValueError(f"no plan with sequence parallelism >= {min_sp} on {capacity} devices")
    return plan


def run_ticks(ctrl, job, limit=100):
    seen = []
    while not job.done and len(seen) < limit:
        seen.append(ctrl.tick(job))
    return seen
