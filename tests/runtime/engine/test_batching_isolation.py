"""Step-level batching (Engine(max_batch=N)) against a real local Ray and the tiny Wan
pipeline: cases an audit of raydit.runtime.engine.batching found."""

from __future__ import annotations

import threading

import pytest

PROMPT = "a fox"


@pytest.mark.long
def test_a_stream_of_one_geometry_does_not_keep_a_request_of_another_waiting(ray_local):
    """Requests of the running batch's key joined it at every step boundary, passing a request
    of another key queued before them: while such requests kept arriving (a server under steady
    traffic) that request never started. Joiners may pass it only while the batch's first request
    runs (one queued behind a waiting request still joins then); after that the batch drains."""
    from raydit.runtime.engine import Engine

    order, lock, chain = [], threading.Lock(), []
    queued = threading.Event()

    def on_start(tag):
        return lambda: order.append(tag)

    with Engine(model="tiny-wan", workers=1, device="cpu", show_plan=False, max_batch=2) as engine:
        def feeder(pipe, step, timestep, kwargs):
            queued.wait(60)  # the other geometry's request is queued first (a loaded machine)
            with lock:  # after every step of the batch, one more request of its geometry arrives
                if len(chain) < 6:
                    tag = f"k{len(chain)}"
                    chain.append(engine.submit(PROMPT, num_inference_steps=3, seed=10 + len(chain), tag=tag,
                                               on_start=on_start(tag), callback_on_step_end=feeder, progress=False))
            return kwargs

        first = engine.submit(PROMPT, num_inference_steps=3, seed=1, tag="first", on_start=on_start("first"),
                              callback_on_step_end=feeder, progress=False)
        other = engine.submit(PROMPT, num_frames=13, num_inference_steps=2, seed=2, tag="other",
                              on_start=on_start("other"), progress=False)
        queued.set()
        first.result(timeout=300), other.result(timeout=300)
        done = 0  # every request of the stream finished: none is left to bring another
        while done < len(chain):
            chain[done].result(timeout=300)
            done += 1
        futures = list(chain)
    # k0 joined the first request's batch (passing `other`); the ones after it waited for `other`.
    assert order[:3] == ["first", "k0", "other"], order
    assert futures[0].result().batched_with == ["first"] and other.result().batched_with == []


@pytest.mark.long  # an engine of its own (about 25 s): the second stage
def test_a_result_that_cannot_be_made_fails_its_request_alone_and_no_partner_hangs(ray_local):
    """Making a finished request's result on the driver (a copy of its frames) can fail, e.g.
    out of host memory. That exception left the batch loop: the dispatcher answered the batch's
    first request with it and every partner's future was never resolved (a caller waiting on it
    hung). Now the request whose result failed gets the error and its partners finish."""
    from raydit.runtime.engine import Engine

    with Engine(model="tiny-wan", workers=1, device="cpu", show_plan=False, max_batch=2) as engine:
        made = engine.runner.result
        failed = []

        def result_once_out_of_memory(replica, item):
            if not failed:
                failed.append(item.tag)
                raise MemoryError("cannot allocate the frames' copy")
            return made(replica, item)

        engine.runner.result = result_once_out_of_memory
        queued = threading.Event()

        def held(pipe, step, timestep, kwargs):
            queued.wait(60)  # the partner is queued before the first request's second step
            return kwargs

        first = engine.submit(PROMPT, num_inference_steps=2, seed=1, tag="first", callback_on_step_end=held,
                              progress=False)
        partner = engine.submit(PROMPT, num_inference_steps=4, seed=2, tag="partner", progress=False)
        queued.set()
        with pytest.raises(MemoryError, match="frames' copy"):
            first.result(timeout=300)
        result = partner.result(timeout=300)
        assert failed == ["first"] and "first" in result.batched_with
