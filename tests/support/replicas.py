"""Plain replicas for driving the request queue (raydit.runtime.queue) without Ray: the
dispatcher reads only their index, plan, busy and in_rotation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    predicted_step_seconds: float


@dataclass
class R:
    index: int
    plan: Plan
    busy: bool = False
    in_rotation: bool = True
