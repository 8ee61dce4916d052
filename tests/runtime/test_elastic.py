"""Elastic runs on a real multi-node Ray (ray.cluster_utils.Cluster): lose a node or an
actor mid-generation, gain a node between requests, keep a queue, give up cleanly.

Every interrupted run's final latents equal an uninterrupted run's within rtol 1e-4 and
atol 1e-4 (float32; the runtime tests' tolerance, see test_engine.py). One engine goes
through the whole story, in order, to keep actor start-ups few on a 2-core machine.
"""

from __future__ import annotations

import pytest
import torch

from support.actors import kill_and_wait

pytestmark = pytest.mark.long  # stage two: a multi-node cluster's story (~220 s on 2 cores); stage one kills ranks in test_elastic_families.py

STEPS = 4
TOL = dict(rtol=1e-4, atol=1e-4)
PROMPT = "a kite over a windy beach"


@pytest.fixture(scope="module")
def story(ray_cluster):
    from raydit.runtime.engine import Engine

    nodes = [ray_cluster.add_node(num_cpus=2, object_store_memory=80 * 1024 * 1024) for _ in range(2)]
    ray_cluster.wait_for_nodes()
    engine = Engine(model="tiny", workers=4, device="cpu", grow="always", show_plan=False)
    refs = {}
    for seed in (3, 4, 5):
        refs[seed] = torch.from_numpy(_gen(engine, seed).latents)
    state = {"engine": engine, "cluster": ray_cluster, "nodes": nodes, "refs": refs}
    yield state
    engine.shutdown()


def _gen(engine, seed, callback=None):
    return engine.generate(PROMPT, num_inference_steps=STEPS, seed=seed, progress=False,
                           callback_on_step_end=callback)


def _node_of_rank(engine, rank):
    return engine.group.active[rank].node_id


def _kinds(result):
    return [e["event"] for e in result.events]


def _remove_node_and_wait(cluster, node, timeout=60):
    """Kill a node and wait until Ray declares it dead, so the failure lands between two
    steps (the tiny model's steps are faster than a node's death)."""
    import time

    import ray

    cluster.remove_node(node, allow_graceful=False)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
            return
        time.sleep(0.2)
    raise AssertionError(f"node {node.node_id} was not declared dead within {timeout} s")


def test_1_node_removed_mid_generation_finishes_with_same_latents(story):
    engine, cluster = story["engine"], story["cluster"]
    assert engine.plan.world_size == 4
    victim_id = _node_of_rank(engine, 3)
    victim = next(n for n in story["nodes"] if n.node_id == victim_id)

    def kill_node(eng, step, timestep, kwargs):
        if step == 1:
            _remove_node_and_wait(cluster, victim)
            story["nodes"].remove(victim)
        return kwargs

    result = _gen(engine, 3, kill_node)
    assert _kinds(result).count("failure") >= 1 and "regrouped" in _kinds(result), result.events
    assert result.plan.world_size == 2, result.events  # the 2 ranks on the surviving node
    regroup = [e for e in result.events if e["event"] == "regrouped"][-1]
    assert regroup["resume_step"] == 2  # steps 0 and 1 were finished before the loss
    assert len(result.timings["step_seconds"]) == STEPS
    torch.testing.assert_close(torch.from_numpy(result.latents), story["refs"][3], **TOL)


def test_2_node_added_between_requests_is_used_by_the_next(story):
    engine, cluster = story["engine"], story["cluster"]
    story["nodes"].append(cluster.add_node(num_cpus=2, object_store_memory=80 * 1024 * 1024))
    cluster.wait_for_nodes()
    result = _gen(engine, 4)
    assert "grew" in _kinds(result), result.events
    assert result.plan.world_size == 4, result.events
    assert {m.node_id for m in engine.group.active} == {n.node_id for n in story["nodes"]}
    torch.testing.assert_close(torch.from_numpy(result.latents), story["refs"][4], **TOL)


def test_3_killed_actor_is_replaced_and_the_run_resumes(story):
    engine = story["engine"]
    victim = engine.group.active[1].actor

    def kill_actor(eng, step, timestep, kwargs):
        if step == 2:
            kill_and_wait(victim)
        return kwargs

    result = _gen(engine, 5, kill_actor)
    assert "regrouped" in _kinds(result)
    # The killed actor's reservation was released, so a fresh actor took its place.
    assert result.plan.world_size == 4, result.events
    assert victim not in [m.actor for m in engine.group.members]
    torch.testing.assert_close(torch.from_numpy(result.latents), story["refs"][5], **TOL)


def test_4_queued_requests_each_complete_exactly_once_while_a_node_dies(story):
    engine, cluster = story["engine"], story["cluster"]
    victim_id = _node_of_rank(engine, 0)
    victim = next(n for n in story["nodes"] if n.node_id == victim_id)
    calls = {3: [], 4: [], 5: []}

    def recorder(seed, kill):
        def cb(eng, step, timestep, kwargs):
            calls[seed].append(step)
            if kill and step == 1:
                _remove_node_and_wait(cluster, victim)
                story["nodes"].remove(victim)  # the next test must not remove it again
            return kwargs

        return cb

    futures = {
        seed: engine.submit(PROMPT, num_inference_steps=STEPS, seed=seed, callback_on_step_end=recorder(seed, seed == 3))
        for seed in (3, 4, 5)
    }
    results = {}
    for seed, f in futures.items():
        try:
            results[seed] = f.result(timeout=300)
        except Exception as exc:  # say what the engine saw, not only the last exception
            raise AssertionError(f"request {seed} failed: {exc!r}; engine events: {engine.events}") from exc
    for seed, result in results.items():
        torch.testing.assert_close(torch.from_numpy(result.latents), story["refs"][seed], **TOL)
        assert result.request.seed == seed
        # Every step of every request finished exactly once (a resumed request does not
        # repeat the steps it had finished).
        assert calls[seed] == list(range(STEPS)), (seed, calls[seed])
    assert "regrouped" in _kinds(results[3])


def test_5_nothing_left_fails_cleanly(story):
    engine, cluster = story["engine"], story["cluster"]
    doomed = list(story["nodes"])

    def kill_all(eng, step, timestep, kwargs):
        if step == 0:
            for n in doomed:
                _remove_node_and_wait(cluster, n)
        return kwargs

    from raydit.runtime.errors import NoCapacity

    with pytest.raises(NoCapacity, match="no workers are left alive and no free devices"):
        _gen(engine, 3, kill_all)
    story["nodes"].clear()
    # The replica handed the request back; with no other replica and nothing to repair
    # from, the queue answered at once instead of waiting.
    assert "handed_back" in [e["event"] for e in engine.events]
