"""Failure types shared by the worker pool, the controller and the queue (no Ray import
here, so the controller's unit tests run without a cluster).

What a user can see: `RequestError` (a ValueError: the request caused it, CLI status 2),
`ApplicationError` (worker code raised for another reason, status 1), `OutOfMemory`,
`NoCapacity` (every replica is gone and nothing is free), `RequestFailed` (a recovery gave
up). Internal only: `WorkerFailure` (recoverable, handled by the controller) and
`HandBack` (a replica cannot go on; the queue gives the request to another).
"""

from __future__ import annotations

from raydit.runtime.failures import Failure


class WorkerFailure(RuntimeError):
    """Some ranks were lost (dead actor or node), a collective failed, or a call ran past
    its deadline: a recovery.

    `lost` lists the members that no longer answer; survivors are still in the pool.
    """

    def __init__(self, message: str, lost: list, cause: BaseException | None = None, failure: Failure | None = None):
        super().__init__(message)
        self.lost = lost
        self.cause = cause
        self.failure = failure


class _Reported:
    failure: Failure | None = None


class RequestError(_Reported, ValueError):
    """Worker code refused the request (a ValueError / TypeError raised by raydit, diffusers
    or torch on every rank). Reported at once; never retried."""

    def __init__(self, message: str, failure: Failure | None = None):
        super().__init__(message)
        self.failure = failure


class ApplicationError(_Reported, RuntimeError):
    """Worker code raised for a reason other than the request. Reported at once."""

    def __init__(self, message: str, failure: Failure | None = None):
        super().__init__(message)
        self.failure = failure


class OutOfMemory(_Reported, RuntimeError):
    """The device ran out of memory and no plan with more sequence parallelism fits."""

    def __init__(self, message: str, failure: Failure | None = None):
        super().__init__(message)
        self.failure = failure


class RequestFailed(RuntimeError):
    """Recovery gave up on a request (the same step failed twice on fresh workers, or too
    many recoveries)."""


class Interrupted(RuntimeError):
    """A running request stopped at its next step because the Engine's `with` block ended by a
    KeyboardInterrupt (Ctrl-C): its last finished step is in its checkpoint directory, if any."""


class NoCapacity(RuntimeError):
    """No replica can run the request and the cluster has no free devices to rebuild one."""


class HandBack(Exception):
    """Raised by a replica that cannot finish its request (too few ranks left and nothing
    free): the queue gives the request, with its progress, to another replica."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def reported(failure: Failure, where: str) -> Exception:
    """The user-facing exception for a non-recoverable failure."""
    line = failure.one_line()
    suffix = f" (raised in the workers during {where}; not retried)"
    if failure.kind == "oom":
        return OutOfMemory(f"out of memory during {where}: {line}", failure)
    if failure.request_caused:
        return RequestError(line + suffix, failure)
    return ApplicationError(line + suffix, failure)
