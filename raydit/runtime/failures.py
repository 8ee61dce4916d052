"""What went wrong, in one word: the classification every recovery decision starts from.

A failure is one of

- `application`: code running inside a worker (raydit, diffusers, torch) raised. The same
  request would raise again on fresh workers, so it is reported to the user at once and
  never retried. `request_caused` (a ValueError or TypeError: a scheduler limit, an image,
  sizes) makes the CLI exit with status 2, anything else with 1.
- `oom`: the device ran out of memory. Recovered only by a plan that holds less per device
  (more sequence parallelism); otherwise reported with the figures.
- `lost`: a rank's process or node is gone (Ray reports the actor dead).
- `collective`: a collective or the group's rendezvous failed because a peer went away or
  stopped answering (gloo: "Connection closed by peer"; NCCL: DistBackendError).
- `deadline`: a call ran past its deadline (a stuck rank).

The last three are recoveries: regroup on what is left and resume from the last step.

`classify_local` runs inside a worker (where the exception is the original object);
`classify` runs on the driver and unwraps Ray's wrappers. Both look at class names through
the MRO, so this module imports neither torch nor ray and its tests need neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

APPLICATION = "application"
OOM = "oom"
LOST = "lost"
COLLECTIVE = "collective"
DEADLINE = "deadline"

RECOVERABLE = (LOST, COLLECTIVE, DEADLINE)
# When ranks disagree, the root cause wins: an application error on one rank makes its
# peers' collectives fail, not the other way round.
_PRIORITY = {APPLICATION: 0, OOM: 1, LOST: 2, DEADLINE: 3, COLLECTIVE: 4}

# Messages of collectives broken by a peer (gloo raises plain RuntimeErrors).
_COLLECTIVE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "gloo/transport",
    "timed out waiting",
    "socket timeout",
    "nccl communicator was aborted",
    "process group has not been initialized",
    "default process group has not been initialized",
    "ncclremoteerror",
    "ncclsystemerror",
)
_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


@dataclass(frozen=True)
class Failure:
    """One classified failure. `rank` is the rank it came from, where known."""

    kind: str
    type_name: str
    message: str
    request_caused: bool = False
    rank: int | None = None
    where: str = ""

    @property
    def recoverable(self) -> bool:
        return self.kind in RECOVERABLE

    def one_line(self) -> str:
        text = " ".join(self.message.split()) or self.type_name
        return text if text.startswith(self.type_name) else f"{self.type_name}: {text}"


class RankError(Exception):
    """What a worker raises instead of the original exception: the classification made
    where the exception's real type is known, plus the original type name and message.
    Plain values only, so it pickles across Ray without the original's module."""

    def __init__(self, kind: str, type_name: str, message: str, request_caused: bool = False, where: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.kind = kind
        self.type_name = type_name
        self.message = message
        self.request_caused = request_caused
        self.where = where

    def __reduce__(self):
        return (RankError, (self.kind, self.type_name, self.message, self.request_caused, self.where))

    @classmethod
    def wrap(cls, exc: BaseException, where: str = "") -> "RankError":
        f = classify_local(exc)
        return cls(f.kind, f.type_name, f.message, f.request_caused, where)


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else ""


def classify_local(exc: BaseException) -> Failure:
    """Classify an exception where it was raised (inside a worker, or any process)."""
    names = _names(exc)
    text = str(exc).lower()
    message = " ".join(str(exc).split())[:1000]  # the whole message, on one line
    type_name = type(exc).__name__
    if "OutOfMemoryError" in names or isinstance(exc, MemoryError) or any(m in text for m in _OOM_MARKERS):
        return Failure(OOM, type_name, message)
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}:
        return Failure(COLLECTIVE, type_name, message)
    if isinstance(exc, (ConnectionError, TimeoutError)) or any(m in text for m in _COLLECTIVE_MARKERS):
        return Failure(COLLECTIVE, type_name, message)
    return Failure(APPLICATION, type_name, message, request_caused=isinstance(exc, (ValueError, TypeError)))


def classify(exc: BaseException, rank: int | None = None) -> Failure:
    """Classify what `ray.get` raised on the driver for one rank's call."""
    names = _names(exc)
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RankError):
        exc = cause
    if isinstance(exc, RankError):
        return Failure(exc.kind, exc.type_name, exc.message, exc.request_caused, rank, exc.where)
    if names & {"RayActorError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError",
                "WorkerCrashedError", "LocalRayletDiedError", "ObjectLostError"}:
        return Failure(LOST, type(exc).__name__, _first_line(exc), rank=rank)
    if names & {"GetTimeoutError"}:
        return Failure(DEADLINE, type(exc).__name__, _first_line(exc), rank=rank)
    if "RayTaskError" in names and isinstance(cause, BaseException):
        # A worker method that raised outside the wrapped calls (open_store, join_group).
        f = classify_local(cause)
        return Failure(f.kind, f.type_name, f.message, f.request_caused, rank)
    f = classify_local(exc)
    return Failure(f.kind, f.type_name, f.message, f.request_caused, rank)


def root_cause(failures: Iterable[Failure]) -> Failure | None:
    """The failure that explains the others (lowest priority value; then the lowest rank)."""
    failures = list(failures)
    if not failures:
        return None
    return min(failures, key=lambda f: (_PRIORITY.get(f.kind, 9), f.rank if f.rank is not None else 1 << 30))
