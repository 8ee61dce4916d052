"""Step-level batching: queued requests with the running one's batch key join its replica's
steps at a step boundary and leave when their own steps are done (Engine(max_batch=N))."""

from __future__ import annotations

from typing import Any

from raydit.runtime.engine.validation import family_of
from raydit.runtime.errors import HandBack
from raydit.runtime.queue import RESOLVED, Item


class Batching:
    """Which requests share steps (their batch key), how many a replica carries, and running
    a batch on a replica for the request runner (`runner`: its begin / step_hooks / result)."""

    def __init__(self, model_dir: str, max_batch: int, planning, event):
        self.model_dir = model_dir
        self.max_batch = max_batch
        self.planning = planning
        self._event = event
        self._family = None  # the model's Family, for batch keys (looked up once)

    def key(self, request):
        """Requests with equal keys share steps on a replica (Family.batch_key); None: alone."""
        if self.max_batch <= 1:
            return None
        if self._family is None:
            self._family = family_of(self.model_dir)
        return self._family.batch_key(None, request)  # the driver holds no pipeline

    def limit(self, replica: Any) -> int:
        """The most requests `replica` carries per step: max_batch, within its plan's memory."""
        return self.planning.batch_limit(self.max_batch, replica.plan)

    def run(self, runner, queue, replica: Any, first: Item, key) -> Any:
        """Run `first` and the queued requests of the same batch key that join it, each at
        the step boundary after it arrives, up to the replica's batch limit (once `first` has
        left, only those queued ahead of any request of another key); each leaves when
        its own steps are done (its future is resolved then). A request whose callback raises
        (a cancel) or whose own prepare or decode fails leaves alone; a failure of the shared
        step fails them all; a replica that must hand back gives every request back with its
        progress. Returns RESOLVED: every future is set here."""
        limit = self.limit(replica)
        batch: list[Item] = []
        hooks: dict[int, tuple] = {}

        def admit(item: Item) -> None:
            used = {it.job.slot for it in batch}
            slot = min(s for s in range(limit) if s not in used)
            runner.begin(replica, item, slot, alone=not batch)
            hooks[id(item)] = runner.step_hooks(item)
            item.batched_with = []
            if batch:
                self._event("batch_joined", replica=replica.index, tag=item.tag, slot=slot,
                            batch=[it.tag for it in batch] + [item.tag])
            batch.append(item)

        def leave(item: Item, exc: BaseException | None = None, result=None) -> None:
            batch.remove(item)
            bar = hooks.pop(id(item))[1]
            if bar is not None:
                bar.close()
            if exc is not None:
                if item.job.prepared and not item.job.done:
                    replica.pool.forget(item.job.slot)
                item.future.set_exception(exc)
            else:
                item.future.set_result(result)

        admit(first)
        replica.batch_size = 1
        try:
            while batch:
                if len(batch) < limit:
                    # Joiners may pass a request of another key queued before them only while the
                    # batch's first request is in it: a batch fed by a stream of its own kind
                    # would otherwise keep that request waiting for as long as the stream lasts.
                    passing = any(it is first for it in batch)
                    for item in queue.take_matching(lambda r: self.key(r) == key, limit - len(batch), passing=passing):
                        try:
                            admit(item)
                        except Exception as exc:  # taken from the queue: never left unanswered
                            bar = hooks.pop(id(item), (None, None))[1]
                            if bar is not None:
                                bar.close()
                            item.future.set_exception(exc)
                replica.batch_size = len(batch)
                jobs = [it.job for it in batch]
                try:
                    what, did = replica.controller.tick_batch(jobs)
                except HandBack:  # every request left goes back with its progress; `first`, if
                    # still here, by the dispatcher (which requeues no finished request)
                    queue.hand_back([it for it in batch if it is not first])
                    raise
                except Exception as exc:
                    failed = getattr(exc, "failed_job", None)
                    owner = [it for it in batch if it.job is failed]
                    for item in (owner or list(batch)):
                        leave(item, exc)
                    continue
                by_job = {id(it.job): it for it in batch}
                if what == "stepped":
                    tags = [by_job[id(j)].tag for j in did]
                    for job in did:
                        item = by_job[id(job)]
                        for tag in tags:
                            if tag != item.tag and tag not in item.batched_with:
                                item.batched_with.append(tag)
                        try:
                            hooks[id(item)][0](job)
                        except BaseException as exc:  # a callback's refusal (a cancel): it alone leaves
                            leave(item, exc)
                elif what == "decoded":
                    item = by_job[id(did[0])]
                    try:
                        result = runner.result(replica, item)
                    except Exception as exc:  # its result could not be made (the frames' copy: memory)
                        leave(item, exc)
                    else:
                        leave(item, result=result)
        except HandBack:
            raise
        except BaseException as exc:  # nothing here expects it: no partner is left unanswered
            for item in batch:
                if item is not first and not item.future.done():
                    item.future.set_exception(exc)
            raise
        finally:
            replica.batch_size = 0
            for item in list(batch):
                bar = hooks.pop(id(item), (None, None))[1]
                if bar is not None:
                    bar.close()
        return RESOLVED
