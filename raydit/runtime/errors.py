"""Failure types shared by the worker pool and the controller (no Ray import here, so the
controller's unit tests run without a cluster)."""

from __future__ import annotations


class WorkerFailure(RuntimeError):
    """Some ranks were lost (dead actor or node) or a collective failed mid-call.

    `lost` lists the members that no longer answer; survivors are still in the pool.
    """

    def __init__(self, message: str, lost: list, cause: BaseException | None = None):
        super().__init__(message)
        self.lost = lost
        self.cause = cause
