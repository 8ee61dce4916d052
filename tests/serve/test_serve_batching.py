"""`raydit serve --max-batch 6` (step-level batching) called with OpenAI's client: concurrent
requests of one geometry share a replica's steps (each video's record names the videos it
shared steps with; /metrics counts them and shows the running batch), each video is the one its
request makes alone, one of another geometry runs on its own, a DELETE of a running request
lets the others of its batch finish, and a rank killed mid-batch loses none of its requests."""

from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

import openai  # noqa: E402  (a declared test dependency: missing, the serve stage fails)
import requests  # noqa: E402  (a declared test dependency: missing, the serve stage fails)
import psutil  # noqa: E402,F401  (a declared test dependency: missing, the serve stage fails)

from serving import Server, running  # noqa: E402

STEPS = 30
# A tiny-wan step takes about 20 ms on a quiet machine, less than a POST through Serve's proxy:
# requests meant to share steps are queued while the replica is held by one of another geometry
# (`_hold_the_replica`), which is then deleted, so they start together whatever the POSTs took.


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running(Server(tmp_path_factory.mktemp("serve-batch"), model="tiny-wan", workers=2,
                              args=("--frames", "9", "--height", "48", "--width", "80", "--max-batch", "6")))


def _metric(server, name: str) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not in /metrics:\n{text}")


def _frames(client, video_id, tmp_path):
    from raydit.runtime.video import read_mp4

    path = tmp_path / f"{video_id}.mp4"
    path.write_bytes(client.videos.download_content(video_id).read())
    return read_mp4(str(path))


def _assert_same_video(a, b, what: str) -> None:
    """Two decodes of latents equal to 1e-4 (batched or re-planned against solo), each through
    H.264: a few pixels may differ by some levels (up to 9 seen on 2 ranks), the video as a whole
    by almost nothing (mean 0.015 seen; two seeds' videos differ by tens of levels on average)."""
    diff = np.abs(a.astype(int) - b.astype(int))
    assert diff.max() <= 16 and diff.mean() <= 0.05, f"{what}: max {diff.max()}, mean {diff.mean():.4f}"


def _hold_the_replica(client):
    """A request of another geometry (64x48: batched with none of the tests' 80x48 requests)
    with 1000 steps (the most the server takes: tens of seconds), once it runs: the requests
    created next wait together behind it until it is deleted."""
    video = client.videos.create(prompt="a placeholder", size="64x48",
                                 extra_body={"num_inference_steps": 1000, "num_frames": 9})
    deadline = time.time() + 240
    while time.time() < deadline and client.videos.retrieve(video.id).status != "in_progress":
        time.sleep(0.1)
    assert client.videos.retrieve(video.id).status == "in_progress"
    return video


def test_concurrent_requests_share_steps_and_each_is_its_own_video(server, tmp_path):
    client = server.client()
    before = _metric(server, "raydit_batched_requests_total")

    def create(seed, frames=9):
        return client.videos.create(prompt="a red fox runs", extra_body={"num_inference_steps": STEPS, "seed": seed,
                                                                         "num_frames": frames})

    hold = _hold_the_replica(client)
    with cf.ThreadPoolExecutor(7) as pool:
        created = list(pool.map(lambda s: create(s, 5 if s == 6 else 9), range(7)))
    assert client.videos.delete(hold.id).deleted
    done = [client.videos.poll(v.id, poll_interval_ms=100) for v in created]
    assert all(v.status == "completed" for v in done), [(v.status, v.error) for v in done]
    same, other = done[:6], done[6]
    ids = {v.id for v in same}
    for v in same:
        peers = v.model_extra["raydit"]["batched_with"]
        assert peers and set(peers) <= ids - {v.id}, (v.id, peers)
    assert other.model_extra["raydit"]["batched_with"] == []  # another geometry: alone
    assert _metric(server, "raydit_batched_requests_total") - before == 6
    assert _metric(server, "raydit_replica_batch") == 0  # idle now
    # Each video is its request's own: seed 0 run again alone gives the same frames.
    again = client.videos.poll(create(0).id, poll_interval_ms=100)
    assert again.model_extra["raydit"]["batched_with"] == []
    a, b = _frames(client, same[0].id, tmp_path), _frames(client, again.id, tmp_path)
    assert a.shape == b.shape == (9, 48, 80, 3)
    _assert_same_video(a, b, "the batched video is not its request's own")
    other_seed = np.abs(a.astype(int) - _frames(client, same[1].id, tmp_path).astype(int)).mean()
    assert other_seed > 1.0, other_seed  # and not another seed's


def test_a_request_deleted_mid_batch_leaves_the_others_to_finish(server):
    client = server.client()
    videos = [client.videos.create(prompt="a lantern", extra_body={"num_inference_steps": 200, "seed": s,
                                                                   "num_frames": 9}) for s in range(3)]
    # Deleted once all three have run steps (so together: one replica, one batch), not once the
    # second alone has: a third that joins after the second left never shared a step with it.
    deadline = time.time() + 120
    while time.time() < deadline and min(client.videos.retrieve(v.id).progress for v in videos) < 2:
        time.sleep(0.1)
    assert client.videos.delete(videos[1].id).deleted
    for v in (videos[0], videos[2]):
        finished = client.videos.poll(v.id, poll_interval_ms=100)
        assert finished.status == "completed", finished.error
        assert videos[1].id in finished.model_extra["raydit"]["batched_with"]  # they shared steps before it left


def test_a_request_joins_a_running_batch_and_one_with_a_lora_runs_apart(server, tmp_path):
    """A request created while another of its geometry is mid-way joins it at a step boundary
    (both records name each other) and is still its request's own video (its solo run gives the
    same frames); a request naming a LoRA the others do not is not batched with them."""
    from support.lora_files import write_random_lora
    from raydit.models.loading import load_pipeline

    write_random_lora(load_pipeline("tiny-wan"), server.lora_dir / "wan-style", seed=5)
    r = server.http("POST", "/v1/loras", json={"path": "wan-style", "name": "wan-style"})
    assert r.status_code == 200, r.text
    client = server.client()

    def create(seed, steps=60, **extra):
        return client.videos.create(prompt="a paper boat", extra_body={"num_inference_steps": steps, "seed": seed,
                                                                       "num_frames": 9, **extra})

    # The first runs long enough (300 steps: seconds) that the second's POST lands mid-way.
    first = create(21, steps=300)
    deadline = time.time() + 120
    while time.time() < deadline and client.videos.retrieve(first.id).progress < 5:
        time.sleep(0.05)
    joined, styled = create(22), create(23, lora='{"wan-style": 1.0}')
    # Until the batch is done the LoRA request waits for its turn: `queued`, never `in_progress`
    # while the batch's last request has steps to go (it starts after that one's decode).
    while True:
        waiting, batch = client.videos.retrieve(styled.id), client.videos.retrieve(joined.id)
        if batch.status == "completed" or batch.progress >= 99:
            break
        assert waiting.status == "queued", (waiting.status, batch.status, batch.progress)
        time.sleep(0.05)
    first, joined, styled = (client.videos.poll(v.id, poll_interval_ms=100) for v in (first, joined, styled))
    assert first.status == joined.status == styled.status == "completed", (first.error, joined.error, styled.error)
    assert joined.id in first.model_extra["raydit"]["batched_with"]
    assert first.id in joined.model_extra["raydit"]["batched_with"]
    assert not {first.id, joined.id} & set(styled.model_extra["raydit"]["batched_with"])
    assert styled.model_extra["raydit"]["lora"] == {"wan-style": 1.0}
    alone = client.videos.poll(create(22).id, poll_interval_ms=100)
    assert alone.model_extra["raydit"]["batched_with"] == []
    a, b = _frames(client, joined.id, tmp_path), _frames(client, alone.id, tmp_path)
    _assert_same_video(a, b, "the request that joined mid-way is not its own video")
    assert server.http("DELETE", "/v1/loras/wan-style").status_code == 200


def test_a_rank_killed_mid_batch_loses_no_request(server, tmp_path):
    """SIGKILL one of the replica's two ranks while three requests share its steps: the replica
    re-plans on the rank left, every request of the batch resumes from its last step and
    completes (each record counts the recovery), and each video is its request's own (its solo
    run on the re-planned replica gives the same frames)."""
    import os
    import signal

    client = server.client()
    before = _metric(server, "raydit_recoveries_total")

    def create(seed):
        return client.videos.create(prompt="a lighthouse", extra_body={"num_inference_steps": 120, "seed": seed,
                                                                       "num_frames": 9})

    # All three start together behind a held replica and step in lockstep: once each has run a
    # step, every one has over a hundred to go when the kill lands.
    hold = _hold_the_replica(client)
    videos = [create(s) for s in (31, 32, 33)]
    assert client.videos.delete(hold.id).deleted
    deadline = time.time() + 120
    while time.time() < deadline and min(client.videos.retrieve(v.id).progress for v in videos) < 2:
        time.sleep(0.05)
    ranks = server.rank_pids()
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    done = [client.videos.poll(v.id, poll_interval_ms=100) for v in videos]
    assert all(v.status == "completed" for v in done), [(v.status, v.error) for v in done]
    ids = {v.id for v in done}
    for v in done:
        assert set(v.model_extra["raydit"]["batched_with"]) == ids - {v.id}, v.model_extra["raydit"]
        assert v.model_extra["raydit"]["recoveries"] >= 1, "the kill landed after the batch finished"
    # The recovery's seconds are every request's (they all waited for it), not the batch lead's.
    seconds = [v.model_extra["raydit"]["timings"].get("recovery_seconds") for v in done]
    assert seconds[0] and seconds[0] > 0 and len(set(seconds)) == 1, seconds
    assert _metric(server, "raydit_recoveries_total") >= before + 3
    alone = client.videos.poll(create(32).id, poll_interval_ms=100)
    a, b = _frames(client, done[1].id, tmp_path), _frames(client, alone.id, tmp_path)
    _assert_same_video(a, b, "a request of the batch lost its own video in the recovery")
