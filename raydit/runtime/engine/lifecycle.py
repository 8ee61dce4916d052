"""An Engine's lifetime: what to close, in order, once (queued requests cancelled, running ones
awaited, actors killed, reservations released, the cluster disconnected)."""

from __future__ import annotations

import threading
from typing import Callable


class Lifecycle:
    """Closers run once, in order, by `shutdown` (safe to call twice, from any thread)."""

    def __init__(self):
        self._closers: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def add(self, close: Callable[[], None], first: bool = False) -> None:
        """`first`: before those added already (a part built later closes earlier)."""
        with self._lock:
            if first:
                self._closers.insert(0, close)
            else:
                self._closers.append(close)

    def shutdown(self) -> None:
        with self._lock:
            closers, self._closers = self._closers, []
        for close in closers:
            close()
