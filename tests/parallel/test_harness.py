"""run_distributed: errors come back with the child's traceback; nothing hangs."""

import time

import pytest
import torch
import torch.distributed as dist

from raydit.parallel.testing import run_distributed


def fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("bad value 42 on rank 1")
    dist.barrier()  # rank 0 would wait forever for rank 1: the parent must not
    return torch.ones(3) * rank


def sleep_forever(rank, world):
    time.sleep(3600)


def test_child_exception_is_reraised_with_traceback():
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad value 42 on rank 1") as info:
        run_distributed(fail_on_rank_1, 2, timeout=120)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 1 of 2 failed" in notes and "in fail_on_rank_1" in notes
    assert time.monotonic() - start < 110  # did not wait for the barrier's timeout


def test_timeout_raises_instead_of_hanging():
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 1 did not finish within 8 s"):
        run_distributed(sleep_forever, 1, timeout=8)


def test_world_size_validated():
    with pytest.raises(ValueError, match="world_size 0"):
        run_distributed(sleep_forever, 0)
