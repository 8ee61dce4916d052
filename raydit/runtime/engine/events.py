"""The Engine's event log: what happened (started, failure, regrouped, replica_added ...),
in order, as dicts with the event's name and time; every part records through one."""

from __future__ import annotations

import time


class EventLog:
    def __init__(self):
        self.events: list[dict] = []

    def __call__(self, kind: str, **data) -> None:
        self.events.append({"event": kind, "time": time.time(), **data})

    def since(self, index: int) -> list[dict]:
        return self.events[index:]

    def __len__(self) -> int:
        return len(self.events)
