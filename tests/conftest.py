"""Shared fixtures: one local Ray per test session, a private model cache."""

from __future__ import annotations

import os
import secrets

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    # The tiny pipeline is built once per session in a private cache, through the same
    # save_pretrained / from_pretrained path a user's first run takes.
    if "RAYDIT_CACHE" not in os.environ:
        os.environ["RAYDIT_CACHE"] = str(tmp_path_factory.mktemp("raydit-cache"))
    os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
    # torch.compile tests (tests/models/test_compile.py): one private Inductor cache for the
    # session's processes (spawned ranks, Ray workers), so a graph compiled once is compiled
    # C++ for the next process; compiling in this process, not in a pool that must start first.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # Ray 2.60 turns token authentication on for new clusters. Keep it on, but with a
    # token private to this session (not the user's ~/.ray/auth_token): every cluster the
    # tests start, and every client they run, reads it from here.
    if "RAY_AUTH_TOKEN_PATH" not in os.environ:
        token = tmp_path_factory.mktemp("ray-auth") / "auth_token"
        token.write_text(secrets.token_hex(32))
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    yield


def pytest_collection_finish(session):
    """Ray reads its auth settings when it is first imported; the session fixture above sets
    them up. A test module that imports Ray (or raydit.serve.app) at collection time leaves
    every later cluster unreachable ("InvalidAuthToken ... RAY_AUTH_MODE is currently
    'disabled'"), so say which rule was broken instead."""
    import sys

    if "ray" in sys.modules and "RAY_AUTH_TOKEN_PATH" not in os.environ:
        raise pytest.UsageError(
            "a test module imported Ray while being collected, before the session's Ray auth token "
            "was set up (tests/conftest.py); import Ray, or raydit modules that import it, inside "
            "the test or a fixture"
        )


_LOCAL = {"up": False}


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray instance shared by the runtime tests (8 CPU slots declared so that
    4-rank plans fit on a 2-core machine; the tests are about correctness, not speed).
    Started once and reused by every module; a module that needs a multi-node cluster
    (`ray_cluster`) takes it down and the next module that asks starts it again."""
    import ray

    if not (ray.is_initialized() and _LOCAL["up"]):
        if ray.is_initialized():
            ray.shutdown()
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            object_store_memory=200 * 1024 * 1024,
            logging_level="WARNING",
            runtime_env={"env_vars": {k: os.environ[k] for k in ("RAYDIT_CACHE", "TORCHINDUCTOR_CACHE_DIR",
                                                                 "TORCHINDUCTOR_COMPILE_THREADS")}},
        )
        _LOCAL["up"] = True
    yield ray


@pytest.fixture(scope="module")
def ray_cluster():
    """A multi-node Ray cluster on this machine (ray.cluster_utils.Cluster) with fast health
    checks, so a removed node is declared dead in about 2 s. The head has no CPUs: every
    rank lands on a worker node a test can remove."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    _LOCAL["up"] = False
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 100 * 1024 * 1024,
            "_system_config": {
                "health_check_initial_delay_ms": 0,
                "health_check_period_ms": 500,
                "health_check_failure_threshold": 4,
            },
        },
    )
    ray.init(
        address=cluster.address,
        logging_level="WARNING",
        runtime_env={"env_vars": {"RAYDIT_CACHE": os.environ["RAYDIT_CACHE"]}},
    )
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _ray_down_at_exit():
    yield
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


# The slowest files first (seconds, summed over the file's tests, in the runs of 2026-12-02 on
# 2 cores, two streams): with the README's `-n 2 --dist loadfile` the two streams take files in
# this order, so the long ones start at once and the short ones fill in behind; the rest keep
# their collection order. A file absent from a stage is skipped over.
_SLOW_FILES = (
    "tests/models/test_conformance.py",  # stage one ~330 (1..3 ranks), stage two the 4..8 rank group
    "tests/runtime/test_cli_jobs.py",  # ~190 / ~750 (verify, ray job submit, the notebook)
    "tests/runtime/test_cli_models.py",  # stage two ~240
    "tests/runtime/test_elastic.py",  # stage two ~220
    "tests/runtime/test_faults.py",  # stage two ~300
    "tests/serve/test_serve_http.py",  # stage two ~450
    "tests/test_bench.py",  # ~40 / ~250
    "tests/runtime/engine/test_engine.py",  # ~150 / ~330
    "tests/models/test_cache.py",  # stage two ~190
    "tests/models/test_shard_quantize.py",  # ~110 / ~110
    "tests/models/test_vae_parallel.py",  # ~90
    "tests/parallel/test_sp_distributed.py",  # ~90
    "tests/models/test_batching.py",  # ~60 / ~60
    "tests/runtime/test_elastic_families.py",  # ~80 / ~220
    "tests/runtime/test_checkpoint_integrity.py",  # ~80
    "tests/models/test_lora.py",  # ~30 / ~90
    "tests/models/test_runner_decode.py",  # ~75
    "tests/runtime/test_topology.py",  # ~70 / ~155
    "tests/serve/test_serve_batching.py",  # stage two ~80
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole
