"""Failure classification (raydit.runtime.failures): one small unit, no cluster.

The exceptions are the real ones: torch's, a real gloo "connection closed by peer" message,
Ray's own exception classes, and a RankError that went through pickle as it does between
a worker and the driver.
"""

from __future__ import annotations

import pickle

import pytest

from raydit.runtime.errors import ApplicationError, OutOfMemory, RequestError, reported
from raydit.runtime.failures import (
    APPLICATION,
    COLLECTIVE,
    DEADLINE,
    LOST,
    OOM,
    Failure,
    RankError,
    classify,
    classify_local,
    root_cause,
)

GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:35251. This is typically caused by a remote worker crashing."
)
SCHEDULER_LIMIT = (
    "`num_inference_steps`: 20 cannot be larger than `self.config.train_timesteps`: 10 as the unet "
    "model trained with this scheduler can only handle maximal 10 timesteps."
)


def _over_the_wire(exc: BaseException, where: str = "step") -> BaseException:
    """What ray.get raises on the driver for a worker call that raised `exc` (wrapped)."""
    import ray.exceptions

    wrapped = pickle.loads(pickle.dumps(RankError.wrap(exc, where)))
    try:
        raise wrapped
    except RankError as e:
        return ray.exceptions.RayTaskError(where, "traceback", e).as_instanceof_cause()


@pytest.mark.parametrize(
    "exc, kind, request_caused",
    [
        (ValueError(SCHEDULER_LIMIT), APPLICATION, True),
        (TypeError("expected str, got int"), APPLICATION, True),
        (KeyError("transformer"), APPLICATION, False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"), APPLICATION, False),
        (RuntimeError(GLOO_PEER_GONE), COLLECTIVE, False),
        (RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete"), COLLECTIVE, False),
        (ConnectionResetError("Connection reset by peer"), COLLECTIVE, False),
        (MemoryError(), OOM, False),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), OOM, False),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"), OOM, False),
    ],
)
def test_worker_side_exceptions_are_classified_where_raised_and_survive_the_trip(exc, kind, request_caused):
    local = classify_local(exc)
    assert (local.kind, local.request_caused) == (kind, request_caused)
    remote = classify(_over_the_wire(exc), rank=3)
    assert (remote.kind, remote.request_caused, remote.rank, remote.where) == (kind, request_caused, 3, "step")
    assert remote.type_name == type(exc).__name__
    assert remote.recoverable == (kind in (LOST, COLLECTIVE, DEADLINE))


def test_torch_types_classify_without_message_patterns():
    import torch
    import torch.distributed as dist

    assert classify_local(torch.OutOfMemoryError("no room")).kind == OOM
    assert classify_local(dist.DistNetworkError("peer went away")).kind == COLLECTIVE
    assert classify_local(dist.DistStoreError("wait timeout")).kind == COLLECTIVE


def test_ray_exceptions_on_the_driver():
    import ray.exceptions

    assert classify(ray.exceptions.ActorDiedError()).kind == LOST
    assert classify(ray.exceptions.GetTimeoutError("late")).kind == DEADLINE
    # A method outside the wrapped calls raised: Ray's own wrapper, classified by its cause.
    try:
        raise RuntimeError(GLOO_PEER_GONE)
    except RuntimeError as e:
        wrapped = ray.exceptions.RayTaskError("join_group", "tb", e).as_instanceof_cause()
    assert classify(wrapped).kind == COLLECTIVE


def test_root_cause_prefers_the_application_error_over_the_peers_broken_collectives():
    peers = [Failure(COLLECTIVE, "RuntimeError", GLOO_PEER_GONE, rank=r) for r in (0, 2, 3)]
    culprit = Failure(APPLICATION, "ValueError", SCHEDULER_LIMIT, request_caused=True, rank=1)
    assert root_cause([*peers, culprit]) is culprit
    lost = Failure(LOST, "ActorDiedError", "died", rank=2)
    assert root_cause([*peers, lost]) is lost
    assert root_cause([]) is None


def test_reported_errors_carry_the_original_message_on_one_line_and_the_exit_class():
    f = classify(_over_the_wire(ValueError(SCHEDULER_LIMIT + "\n  second line"), "prepare"))
    err = reported(f, "prepare")
    assert isinstance(err, RequestError) and isinstance(err, ValueError)  # CLI: status 2
    assert "\n" not in str(err) and SCHEDULER_LIMIT in str(err) and "second line" in str(err)
    assert "not retried" in str(err)
    other = reported(classify(_over_the_wire(KeyError("vae"))), "decode")
    assert isinstance(other, ApplicationError) and not isinstance(other, ValueError)  # status 1
    assert isinstance(reported(classify(_over_the_wire(MemoryError())), "step"), OutOfMemory)
