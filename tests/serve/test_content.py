"""The mp4 response's pieces: behind Ray Serve every ASGI body message is one message from the
replica to the proxy, so their number is what a download costs the front."""

from __future__ import annotations

import asyncio
import os


def _messages(path, headers=(), response=None) -> list[dict]:
    # Imported here, not at collection: raydit.serve.app imports Ray, and Ray read at
    # collection time would miss the auth token the session fixture sets up (conftest).
    from raydit.serve.app import VideoFileResponse

    sent: list[dict] = []

    async def receive():  # the client stays connected until the response ends
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "headers": list(headers), "query_string": b""}
    response = response or VideoFileResponse(path, media_type="video/mp4")
    asyncio.run(response(scope, receive, send))
    return sent


def test_a_video_is_sent_in_one_mib_pieces(tmp_path):
    payload = os.urandom(3 * 2**20 + 5)
    path = tmp_path / "v.mp4"
    path.write_bytes(payload)
    sent = _messages(path)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    # 4 pieces (3 whole MiB and 5 bytes) where Starlette's default would send 49 of 64 KiB.
    assert [len(b) for b in bodies if b] == [2**20] * 3 + [5]
    assert b"".join(bodies) == payload


def test_a_byte_range_is_served_from_the_file(tmp_path):
    payload = os.urandom(2 * 2**20)
    path = tmp_path / "v.mp4"
    path.write_bytes(payload)
    sent = _messages(path, [(b"range", b"bytes=1048570-1048589")])
    assert sent[0]["status"] == 206
    assert b"".join(m["body"] for m in sent if m["type"] == "http.response.body") == payload[1048570:1048590]


def test_a_short_video_is_one_body_and_a_long_or_ranged_one_streams(tmp_path, monkeypatch):
    """The content route's choice (video_file_response): a video up to WHOLE_BODY_BYTES, no
    Range asked, goes as one body message; a larger one, or any Range request, streams from
    the file in 1 MiB pieces. Every way, the bytes are the file's and the name is the id."""
    from raydit.serve import app

    monkeypatch.setattr(app, "WHOLE_BODY_BYTES", 2 * 2**20)
    payload = os.urandom(2 * 2**20)
    path = tmp_path / "v.mp4"
    path.write_bytes(payload)

    def bodies(sent):
        return [m["body"] for m in sent if m["type"] == "http.response.body" and m["body"]]

    def header(sent, name):
        return dict(sent[0]["headers"]).get(name.encode(), b"").decode()

    whole = _messages(path, response=app.video_file_response(path, "video_1.mp4", ranged=False))
    assert whole[0]["status"] == 200 and bodies(whole) == [payload]
    assert header(whole, "content-disposition") == 'attachment; filename="video_1.mp4"'
    assert header(whole, "content-type") == "video/mp4"

    rng = [(b"range", b"bytes=10-19")]
    ranged = _messages(path, rng, response=app.video_file_response(path, "video_1.mp4", ranged=True))
    assert ranged[0]["status"] == 206 and b"".join(bodies(ranged)) == payload[10:20]

    path.write_bytes(payload + b"x")  # one byte over: streamed
    long = _messages(path, response=app.video_file_response(path, "video_1.mp4", ranged=False))
    assert [len(b) for b in bodies(long)] == [2**20, 2**20, 1] and b"".join(bodies(long)) == payload + b"x"
    assert 'filename="video_1.mp4"' in header(long, "content-disposition")
