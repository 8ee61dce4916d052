"""An Engine's lifetime: shutdown (queued requests cancelled, running ones awaited, actors
killed, reservations released) and the context manager (left by Ctrl-C: running requests stop
at their next step)."""

from __future__ import annotations

import threading


class LifecyclePart:
    """The Engine's lifetime (a part of raydit.runtime.engine.Engine)."""

    def shutdown(self) -> None:
        """Cancel queued requests, wait for running ones, kill the actors, release their
        reservations, disconnect what we connected."""
        stop = getattr(self, "_stop_scaling", None)
        if stop is not None:
            stop.set()
            scaler = getattr(self, "_autoscaler", None)
            if scaler is not None and scaler is not threading.current_thread():
                scaler.join(timeout=600)
        dispatcher = getattr(self, "_dispatcher", None)
        if dispatcher is not None:
            dispatcher.close()
        for r in getattr(self, "replicas", []):
            r.pool.close()
        self.replicas = []
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            # Ctrl-C: running requests stop at their next step (each finished step is in its
            # checkpoint directory, if it has one) instead of running to the end before shutdown.
            self._interrupted = True
        self.shutdown()

    def __del__(self):  # a forgotten engine must not leave actors pinning GPUs
        try:
            if getattr(self, "replicas", None):
                self.shutdown()
        except Exception:
            pass
