"""Failure probing for a WorkerPool: which ranks still answer (a ping from their second thread),
settling every call in flight after a failure, and the nodes suspected dead since the last
failure with the probes that clear them. The classification of what went wrong is
raydit.runtime.failures (no Ray there); this is the part that asks Ray.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import ray

from raydit.runtime.cluster import free_slots
from raydit.runtime.failures import DEADLINE, LOST, Failure, classify

# How long a rank's second thread may take to answer a ping before it counts as silent
# (stopped, wedged or gone); generous, since a loaded host answers late.
PING_S = 5.0
# How long free_slots waits for a suspect node's probe when that node is all there is (no
# rank left, no other free device): the probe needs a fresh worker process, which a loaded
# host starts in more than PING_S, and giving up then fails the request although the node
# is well. A node that is really dead is declared so by Ray's health checks within this
# (about 30 s by default), which ends its probe at once.
SUSPECT_PROBE_S = 60.0

logger = logging.getLogger("raydit.runtime.pool")


class Suspects:
    """Nodes suspected dead since the last failure (until Ray notices a node's death it still
    reports that node's devices as free), and one probe per suspect node that clears it."""

    def __init__(self):
        self.nodes: set[str] = set()
        # Suspect node -> its probe, still running or not yet read; None: it failed.
        self._probes: dict[str, Any] = {}

    def replace(self, nodes: set[str]) -> None:
        """A new failure names its own suspects; the probes of an earlier one are cancelled."""
        self.nodes = set(nodes)
        self.forget_probes()

    def forget_probes(self) -> None:
        for ref in self._probes.values():
            try:
                if ref is not None:
                    ray.cancel(ref, force=True)
            except Exception:
                pass
        self._probes = {}

    def leave_out(self, slots: dict[str, int], has_members: bool) -> dict[str, int]:
        """`slots` (free devices per node) without the nodes still suspected."""
        self._clear_live(slots, has_members)
        return {n: c for n, c in slots.items() if n not in self.nodes}

    def _clear_live(self, slots: dict[str, int], has_members: bool) -> None:
        """A suspect node that Ray still lists with free devices either died and is not yet
        declared dead, or lost only a rank's process (a SIGKILL, the OOM killer) and is well.
        Without telling the two apart, a node that lost its only rank's process stayed
        suspect until the next failure: its devices never counted, and a replica with no
        rank left could never be repaired on it. A task pinned to the node tells: a live
        raylet runs it. A node that answers is suspected no more; one whose probe fails is
        not asked again (Ray declared it dead, or cannot place work there).

        Each suspect node is probed once. The first look waits PING_S for the answer; a probe
        that has not answered by then stays out, and later looks read it without waiting,
        so a node on a loaded host (whose raylet took longer to start the probe's worker)
        counts again once it answers. When the suspect nodes are all there is (the pool has
        no rank left and no other node has a free device) the answer decides whether the
        request can run at all: that look waits up to SUSPECT_PROBE_S for it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ask = [n for n in self.nodes if n in slots and n not in self._probes]
        if ask:
            probe = ray.remote(num_cpus=0, max_retries=0)(node_id)
            for n in ask:
                self._probes[n] = probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
        waiting = {ref: n for n, ref in self._probes.items() if ref is not None and n in slots and n in self.nodes}
        if not waiting:
            return
        alone = not has_members and not (set(slots) - self.nodes)
        wait_s = SUSPECT_PROBE_S if alone else PING_S if ask else 0.0
        deadline = time.monotonic() + wait_s
        while waiting:
            # Alone: the first node that answers is enough; otherwise wait for all (bounded).
            ready, _ = ray.wait(list(waiting), num_returns=1 if alone else len(waiting),
                                timeout=max(0.0, deadline - time.monotonic()))
            answered = False
            for ref in ready:
                n = waiting.pop(ref)
                try:
                    ok = ray.get(ref) == n
                except Exception:
                    ok = False
                if ok:
                    del self._probes[n]
                    self.nodes = self.nodes - {n}
                    answered = True
                else:
                    self._probes[n] = None  # not asked again
            if answered or not ready or time.monotonic() >= deadline:
                return


def settle(members: list, refs: list, settle_s: float, *, device: str, drop: Callable, probe: bool = False,
           silent_members: list | None = None) -> tuple[list, list, set, dict | None]:
    """After a failure, let every in-flight call finish before anything else touches the
    actors (destroying a process group under a running collective is undefined).
    Returns (lost members, one classified Failure per failed call, the nodes now suspected,
    the free devices before the first drop or None).

    A survivor whose collective failed leaves its process group at once: closing its
    connections is what unblocks a peer still waiting on it (a ring receive, say), instead
    of that peer waiting out the collective timeout. A member whose call ends in an actor
    error is dead; one still running after `settle_s` is stuck. `probe` (a missed deadline):
    members that do not answer a ping from their second thread within PING_S are stuck
    (stopped, wedged) and dropped at once (`drop`), which breaks their peers' collectives;
    `silent_members`: those the caller's ping found so already. Nodes of the dead are
    suspected: until Ray notices a node's death it still reports its devices as free."""
    pending = dict(zip(refs, members))
    rank_of = {id(m): r for r, m in enumerate(members)}
    lost, suspect, outcomes = [], set(), []
    before = None  # free devices before the first drop (the release the pool then waits for)
    if probe:
        if silent_members is None:
            silent_members = silent(list(pending.values()), timeout_s=PING_S)
        if silent_members:
            before = free_slots("GPU" if device == "cuda" else "CPU")
        silent_ids = {id(m) for m in silent_members}
        for ref, m in list(pending.items()):
            if id(m) in silent_ids:
                pending.pop(ref)
                lost.append(m)
                outcomes.append(Failure(DEADLINE, "DeadlineExceeded", "rank stopped answering",
                                        rank=rank_of.get(id(m))))
                drop(m)
    start = time.monotonic()
    deadline = start + settle_s
    aborted = False
    said = False
    leaving = []  # survivors leaving their broken group (which unblocks their peers)
    while pending and time.monotonic() < deadline:
        if not said and time.monotonic() - start > 10.0:
            # A node that died without closing its connections is declared dead only
            # after Ray's health checks give up (about 30 s by default): say why we wait.
            said = True
            logger.warning("raydit: %s rank(s) have not answered since a peer failed; waiting up to "
                           "%.0f s more (a lost node is declared dead by Ray's health checks)",
                           len(pending), max(0.0, deadline - time.monotonic()))
        if not aborted and device == "cuda" and time.monotonic() - start > 2.0:
            # NCCL survivors may hang rather than fail: abort their communicators
            # from the actor's second thread.
            for m in pending.values():
                m.actor.abort_group.remote()
            aborted = True
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.5)
        for ref in ready:
            m = pending.pop(ref)
            try:
                ray.get(ref)
                continue
            except Exception as exc:
                failure = classify(exc, rank=rank_of.get(id(m)))
                # Ray says "killed ... by ray.kill" past the first line the Failure keeps.
                killed_by_us = "ray.kill" in str(exc)
            outcomes.append(failure)
            if failure.kind == LOST:
                lost.append(m)
                if not killed_by_us:
                    suspect.add(m.node_id)
                continue
            leaving.append(m.actor.leave_group.remote())
    for ref, m in pending.items():
        lost.append(m)
        suspect.add(m.node_id)
        outcomes.append(Failure(DEADLINE, "DeadlineExceeded", f"rank still busy {settle_s:.0f} s after a peer failed",
                                rank=rank_of.get(id(m))))
    if leaving:  # done before anything re-forms them (a join must not overlap the leave)
        ray.wait(leaving, num_returns=len(leaving), timeout=10.0)
    return lost, outcomes, suspect, before


def node_id() -> str:
    """The node a task runs on (the probe of a suspect node)."""
    return ray.get_runtime_context().get_node_id()


def died(ref) -> bool:
    """Whether a finished call's actor is gone (its result is Ray's word that it died)."""
    try:
        ray.get(ref, timeout=0)
    except Exception as exc:
        return classify(exc).kind == LOST
    return False


def dead(members: list, timeout_s: float) -> list:
    """Members whose actor Ray reports dead: their ping fails with the actor's death (a process
    killed between requests). One that is only slow to answer is not among them."""
    refs = {m.actor.ping.remote(): m for m in members}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    gone = {id(refs[ref]) for ref in ready if died(ref)}
    return [m for m in members if id(m) in gone]


def silent(members: list, timeout_s: float) -> list:
    """Members whose actor does not answer a ping (its second thread) within `timeout_s`."""
    refs = {m.actor.ping.remote(): m for m in members}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    answered = set()
    for ref in ready:
        try:
            ray.get(ref)
            answered.add(id(refs[ref]))
        except Exception:
            pass
    return [m for m in members if id(m) not in answered]
