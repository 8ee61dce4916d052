"""Bad inputs found by an audit of raydit serve, each answered with a 4xx in OpenAI's error
shape naming the value and the fix: a body giving `seconds` and `num_frames` that disagree
(num_frames silently won), and a Range header on GET /v1/videos/{id}/content that Starlette's
file response refused in plain text (400 without JSON, a bare 416)."""

from __future__ import annotations

import os

import pytest

from raydit.planner import model_spec
from raydit.serve.schema import Limits, RequestError, parse_body, resolve

TINY = model_spec("tiny")  # frames = 1 + 4k
LIMITS = Limits(model="tiny", max_frames=33, max_height=64, max_width=64, max_steps=50, default_steps=2, fps=8,
                vae_temporal=4)


def test_seconds_and_num_frames_that_disagree_are_refused_naming_both():
    with pytest.raises(RequestError) as err:
        resolve(parse_body({"prompt": "x", "seconds": 4, "num_frames": 9}), LIMITS, TINY)
    assert err.value.param == "seconds" and err.value.status == 400
    assert "seconds 4 and num_frames 9 disagree" in err.value.message and "33 frames" in err.value.message
    # Both naming one length, or either alone, are taken as before.
    assert resolve(parse_body({"prompt": "x", "seconds": 2, "num_frames": 17}), LIMITS, TINY)["num_frames"] == 17
    assert resolve(parse_body({"prompt": "x", "seconds": "2"}), LIMITS, TINY)["num_frames"] == 17
    assert resolve(parse_body({"prompt": "x", "num_frames": 9}), LIMITS, TINY)["num_frames"] == 9


def _content(tmp_path, range_header: str | None, written: bool = True):
    """GET /v1/videos/{id}/content's answer through the app (its exception handlers and the
    route), with a stand-in service holding one completed video of 1000 bytes (`written`
    False: its mp4 is gone, as after a DELETE between the lookup and the read)."""
    import asyncio
    from types import SimpleNamespace

    from raydit.serve import app as appmod

    path = tmp_path / "video_0123456789abcdef01234567.mp4"
    if written:
        path.write_bytes(os.urandom(1000))
    job = SimpleNamespace(status="completed")
    front = SimpleNamespace(
        _auth=lambda request: None, _job=lambda video_id: job,
        service=SimpleNamespace(store=SimpleNamespace(video_path=lambda video_id: path)))
    headers = [(b"range", range_header.encode())] if range_header is not None else []
    scope = {"type": "http", "method": "GET", "path": "/", "headers": headers, "query_string": b""}
    from starlette.requests import Request

    request = Request(scope)
    sent: list[dict] = []

    async def receive():
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def answer():
        try:
            response = await appmod.VideoAPI.func_or_class.content(front, request, path.stem)
        except appmod.RequestError as exc:
            response = await appmod._request_error(request, exc)
        await response(scope, receive, send)

    asyncio.run(answer())
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict((k.decode(), v.decode()) for k, v in start["headers"]), body


@pytest.mark.parametrize("header, status", [("bytes=abc", 400), ("items=0-9", 400), ("bytes=9-3", 400),
                                            ("bytes=5000-", 416)])
def test_a_bad_range_is_an_openai_error_naming_it(tmp_path, header, status):
    import json

    got, headers, body = _content(tmp_path, header)
    assert got == status, (got, body)
    assert headers["content-type"] == "application/json", (headers, body)
    error = json.loads(body)["error"]
    assert error["param"] == "range" and header in error["message"] and "bytes=START-END" in error["message"], error
    if status == 416:
        assert error["code"] == "range_not_satisfiable" and headers["content-range"] == "bytes */1000"


def test_a_good_range_and_no_range_still_serve_the_video(tmp_path):
    got, headers, body = _content(tmp_path, "bytes=10-19")
    assert got == 206 and len(body) == 10 and headers["content-range"] == "bytes 10-19/1000"
    got, headers, body = _content(tmp_path, None)
    assert got == 200 and len(body) == 1000


@pytest.mark.parametrize("header", [None, "bytes=0-9"])
def test_a_video_deleted_while_its_content_is_asked_for_is_a_404(tmp_path, header):
    """A DELETE between the route's lookup of the video and its read of the mp4 left the route
    reading a file that was gone: a 500 (Starlette's "File at path ... does not exist")."""
    import json

    got, headers, body = _content(tmp_path, header, written=False)
    assert got == 404 and headers["content-type"] == "application/json", (got, body)
    assert json.loads(body)["error"]["code"] == "not_found"


# -- the service's hand-off to the engine (no HTTP, no Ray: an engine with Engine.submit's
# contract whose futures stay pending until the test starts or ends them) --------------------


class _PendingEngine:
    """Engine.submit's contract: a pending Future per request; `gate` holds submit itself."""

    takes_image = False

    def __init__(self):
        import threading
        from types import SimpleNamespace

        self.replicas = [SimpleNamespace(index=0, plan=None, batch_size=0)]

        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.submitted: list = []

    def submit(self, **kwargs):
        from concurrent.futures import Future

        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        f = Future()
        self.submitted.append((kwargs, f))
        return f


PARAMS = dict(prompt="a fox", negative_prompt="", num_frames=9, height=64, width=64, num_inference_steps=2,
              guidance_scale=6.0, seed=0)


def _until(cond, timeout=10.0):
    import time

    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_a_request_being_handed_to_the_engine_as_the_server_stops_is_cancelled_there(tmp_path):
    """close() cancels the requests waiting in the engine's queue, but one the dispatch thread
    was handing over at that moment (no engine future yet) was left in the engine's queue: a
    replica started it during shutdown (and close waited for it)."""
    import json
    import threading

    from raydit.serve.service import VideoService
    from raydit.serve.store import VideoStore

    engine = _PendingEngine()
    engine.gate.clear()
    service = VideoService(engine, VideoStore(tmp_path), LIMITS, max_queue=8)
    job = service.create(dict(PARAMS))
    assert engine.entered.wait(10)  # the dispatch thread is inside engine.submit
    closer = threading.Thread(target=service.close, kwargs={"timeout_s": 5})
    closer.start()
    _until(lambda: service._closing)
    engine.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    (_, future), = engine.submitted
    assert future.cancelled(), "handed to the engine during shutdown and left to run"
    assert json.loads((tmp_path / f"{job.id}.json").read_text())["status"] == "queued"


def test_deleting_a_queued_video_does_not_count_as_stopping_a_running_one(tmp_path):
    """raydit_cancelled_running ("Running requests stopped by a DELETE") counted a DELETE of a
    video still waiting in the engine's queue, which stopped nothing that ran."""
    from raydit.serve.service import VideoService
    from raydit.serve.store import VideoStore

    engine = _PendingEngine()
    service = VideoService(engine, VideoStore(tmp_path), LIMITS, max_queue=8)

    def cancelled_running() -> float:
        return service._metrics.registry.get_sample_value("raydit_cancelled_running_total")

    try:
        running, queued = service.create(dict(PARAMS, seed=1)), service.create(dict(PARAMS, seed=2))
        _until(lambda: len(engine.submitted) == 2)
        (kw_running, f_running), (_, f_queued) = engine.submitted
        f_running.set_running_or_notify_cancel()
        kw_running["on_start"]()
        assert service.get(running.id).status == "in_progress"
        # The queued one: cancelled in the engine's queue, never started.
        assert service.delete(queued.id)
        assert f_queued.cancelled()
        _until(lambda: queued.id not in service._running)
        # The running one: its next step's callback refuses, and the engine ends it.
        assert service.delete(running.id)
        try:
            kw_running["callback_on_step_end"](engine, 0, 999, {"num_steps": 2})
        except Exception as exc:
            f_running.set_exception(exc)
        else:
            raise AssertionError("the step callback of a deleted video did not stop it")
        _until(lambda: not service._running)
        _until(lambda: service._writes.empty() and cancelled_running() is not None and cancelled_running() >= 1)
        assert cancelled_running() == 1.0
    finally:
        service.close(timeout_s=2)


def test_an_engine_that_may_grow_gets_a_waiting_request_per_slot_of_every_replica_it_may_have(tmp_path):
    """raydit serve --max-batch 4 --max-replicas 4: the service handed the engine at most
    2 x max(slots now, max_replicas) = 8 requests; two replicas' batches ran all 8, none waited
    in the engine's queue, so its autoscaler (which follows that queue) never added the third
    and fourth replica while requests waited in the service's queue."""
    from types import SimpleNamespace

    from raydit.serve.service import VideoService
    from raydit.serve.store import VideoStore

    engine = _PendingEngine()
    engine.max_batch, engine.max_replicas = 4, 4
    service = VideoService(engine, VideoStore(tmp_path), LIMITS, max_queue=64)
    try:
        for i in range(40):
            service.create(dict(PARAMS, seed=i))
        engine.replicas.append(SimpleNamespace(index=1, plan=None, batch_size=0))  # the autoscaler added one
        for kwargs, f in engine.submitted[:8]:  # two batches of 4 run
            f.set_running_or_notify_cancel()
            kwargs["on_start"]()
        # Two per slot of the 4 replicas it may have: requests wait in the engine's own queue.
        _until(lambda: len(engine.submitted) == 2 * 4 * 4)
        assert service.counts()["in_progress"] == 8 and service.counts()["queued"] == 32
    finally:
        service.close(timeout_s=2)


def test_a_video_that_finishes_while_the_server_stops_is_stored_not_run_again(tmp_path):
    """close() flags the running requests to stop at their next step; one already past its last
    step (decoding) finishes anyway. Its video was thrown away and the request stored as queued,
    to be run again from the start by the next server."""
    import json
    import threading
    import time

    import numpy as np

    from raydit.serve.service import VideoService
    from raydit.serve.store import VideoStore

    class Result:
        frames = np.zeros((9, 64, 64, 3), dtype=np.uint8)
        timings = {"step_seconds": [0.1, 0.1]}
        plan = type("Plan", (), {"ulysses": 1, "ring": 1, "cfg": 1, "world_size": 1})()

    class SlowRelease(VideoService):
        """The engine's thread pauses after freeing the request's place (a loaded machine):
        close() ended the writer then, before the outcome was queued for it, and the video
        was never stored (this test failed now and then without the pause)."""

        def _release(self, run):
            super()._release(run)
            if run.job.id == job.id:
                time.sleep(0.5)

    engine = _PendingEngine()
    store = VideoStore(tmp_path)
    service = SlowRelease(engine, store, LIMITS, max_queue=8)
    job = service.create(dict(PARAMS))
    _until(lambda: len(engine.submitted) == 1)
    (kwargs, future), = engine.submitted
    future.set_running_or_notify_cancel()
    kwargs["on_start"]()
    closer = threading.Thread(target=service.close, kwargs={"timeout_s": 30})
    closer.start()
    _until(lambda: service._closing)
    future.set_result(Result())  # its decode ends after the stop was asked for
    closer.join(60)
    assert not closer.is_alive()
    assert json.loads((tmp_path / f"{job.id}.json").read_text())["status"] == "completed"
    assert store.video_path(job.id).is_file()
    # A restarted service serves it and runs nothing again.
    engine2 = _PendingEngine()
    again = VideoService(engine2, store, LIMITS, max_queue=8)
    try:
        assert again.get(job.id).status == "completed" and not engine2.submitted
    finally:
        again.close(timeout_s=2)


def test_a_video_object_never_shows_a_status_half_changed(tmp_path):
    """GET /v1/videos/{id} (and the list) read the video's fields without the service's lock while
    the writer thread changed status, progress and completed_at together under it: a poll could
    see `completed` with completed_at null or progress 99 (39 such objects in 5 s of polling)."""
    import json
    import sys
    import threading
    import time
    from types import SimpleNamespace

    from raydit.serve import app as appmod
    from raydit.serve.service import VideoService
    from raydit.serve.store import VideoStore

    engine = _PendingEngine()
    engine.gate.clear()  # nothing reaches the engine: the test changes the video's status itself
    service = VideoService(engine, VideoStore(tmp_path), LIMITS, max_queue=8)
    job = service.create(dict(PARAMS))
    front = SimpleNamespace(service=service)
    stop = threading.Event()

    def writer():  # as the service's writer and on_start change a status: under its lock
        while not stop.is_set():
            with service._cond:
                job.status, job.progress, job.completed_at = "in_progress", 99, None
            with service._cond:
                job.status, job.progress, job.completed_at = "completed", 100, time.time()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=writer)
    thread.start()
    torn = []
    try:
        for _ in range(100_000):
            video = json.loads(appmod.VideoAPI.func_or_class._video_response(front, job).body)
            done = video["status"] == "completed"
            if done != (video["completed_at"] is not None) or done != (video["progress"] == 100):
                torn.append(video)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
        engine.gate.set()
        service.close(timeout_s=2)
    assert not torn, f"{len(torn)} half-changed objects, e.g. {torn[0]}"


def test_metrics_are_read_under_the_lock_while_requests_start_and_finish(tmp_path):
    """/metrics' queue-length and in-flight gauges counted the running requests without the
    service's lock: a scrape while a request started or finished could raise "dictionary
    changed size during iteration" (a 500 for the scraper; 12 in 20000 scrapes here)."""
    import sys
    import threading

    from raydit.serve.service import VideoService, _Running
    from raydit.serve.store import VideoStore

    engine = _PendingEngine()
    service = VideoService(engine, VideoStore(tmp_path), LIMITS, max_queue=8)
    stop = threading.Event()

    def churn():  # requests start and finish, as the dispatch thread and the engine's do: under the lock
        i = 0
        while not stop.is_set():
            with service._cond:
                service._running[f"r{i}"] = _Running(job=None)
            with service._cond:
                service._running.pop(f"r{i}", None)
            i += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=churn)
    thread.start()
    failures = []
    try:
        for _ in range(10_000):
            try:
                service.metrics_text()
            except RuntimeError as exc:
                failures.append(exc)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
        service.close(timeout_s=2)
    assert not failures, f"{len(failures)} scrapes failed: {failures[0]!r}"
    text = service.metrics_text()[0].decode()
    assert "raydit_queue_length 0.0" in text and "raydit_requests_in_flight 0.0" in text
