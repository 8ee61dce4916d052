"""The HTTP front's cost: requests per minute and p50 / p95 latency through `raydit serve`'s
API (Ray Serve, the openai client, mp4s written to the output directory) against the same
Engine configuration called directly (`Engine.submit`), with a queue of `--requests`.

Both sides are started up front on one local Ray (4 CPU slots declared, 1 rank each, the
bench model of benchlib: ~0.5 s a step) and stay warm; rounds alternate which side serves
a burst (the idle side sleeps), so both see the same machine. A burst submits every
request at once:
  - direct: `engine.submit(...)` x N; a request's latency is submit -> its future done;
  - HTTP: N threads each POST /v1/videos with the openai client, then (`--client wait`, the
    default) ask for their video with GET /v1/videos/{id}?wait=60, raydit's long poll, which
    answers when the video is done, and download it (GET .../content); or (`--client poll`)
    one poller lists the burst's videos every 0.25 s and a video seen completed is downloaded.
    Latency is POST -> mp4 downloaded. The front therefore pays HTTP, the wait or the polls
    (up to 0.25 s late), the mp4 encode and the download; the direct side pays none of them.
Both Engines are built alike (the server's options: 1 rank, growth as by default) and both
are driven at a Ray worker's priority (the direct side's driver thread takes the niceness Ray
gives its workers, which the Serve replica has).
Throughput = N / (first submit -> last result) x 60. Target: HTTP >= 98% of direct.

    python bench/bench_serve.py [--requests 16] [--steps 2] [--rounds 3] [--client wait|poll] [--name serve]
    python bench/bench_serve.py --batched [--requests 16] [--steps 4] [--rounds 3] [--max-batch 16]

`--batched` (step-level batching, issue 33): two Engines of one rank each on one local Ray (2 CPU
slots), one with batching off (max_batch 1), one with `--max-batch`, serve the same bursts of
small requests of one geometry (a Wan-1.3B-shaped transformer of 2 layers, float32, 9 x 48 x 80:
45 video tokens, where a step is mostly overhead that a batch shares); rounds alternate which
side runs first. Throughput, p50 / p95 latency per side and the batch sizes seen
(NAME serve-batched). The requests go to `Engine.submit` (the HTTP front's own cost is the
default run's subject).

The front's cost per request is about fixed (the mp4, the polls, the download, the hand-offs on
the Serve replica), so its share falls as requests get longer: run_all measures 4-step
requests (about 4 s each on this machine; the target) and 1-step ones (about 1.5 s: the
worst case, `--name serve-short`).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import secrets
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402

warnings.filterwarnings("ignore", message=".*Sora API.*")
PROMPT = "a red fox"
ENGINE = dict(workers=1, replicas=1)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats(latencies: list[float], wall: float, busy: list[float]) -> dict:
    """`busy`: each request's run time on the replica (the engine's timings["total_seconds"]:
    its start there -> its frames back on the engine's driver). The replica runs one request at
    a time, so wall - sum(busy) is time the replica spent between requests, plus the tail after
    the last one (the HTTP side: mp4 write, poll, download)."""
    n = len(latencies)
    return {"seconds": round(wall, 4), "requests_per_minute": round(n / wall * 60, 4),
            "p50_s": round(_percentile(latencies, 0.5), 4), "p95_s": round(_percentile(latencies, 0.95), 4),
            "run_seconds_sum": round(sum(busy), 4), "run_seconds_mean": round(sum(busy) / n, 4),
            "outside_runs_seconds": round(wall - sum(busy), 4)}


def burst_direct(engine, n: int, steps: int, seed0: int) -> dict:
    done: dict[int, float] = {}
    t0 = time.perf_counter()
    starts, futures = [], []
    for i in range(n):
        starts.append(time.perf_counter())
        f = engine.submit(PROMPT, num_inference_steps=steps, seed=seed0 + i)
        f.add_done_callback(lambda f, i=i: done.__setitem__(i, time.perf_counter()))
        futures.append(f)
    results = [f.result(timeout=1800) for f in futures]
    busy = [r.timings["total_seconds"] for r in results]
    wall = max(done.values()) - t0
    out = _stats([done[i] - starts[i] for i in range(n)], wall, busy)
    out["shared_with_mean"] = round(sum(len(r.batched_with) for r in results) / n, 3)  # peers per request
    return out


BATCH_MODEL = {"num_frames": 9, "height": 48, "width": 80}


def run_batched(requests: int, steps: int, rounds: int, max_batch: int) -> dict:
    """Batching off against on, same bursts, one run (module docstring)."""
    import ray

    from raydit.runtime.engine import Engine

    model_dir = benchlib.wan_bench_dir(layers=2, dtype="float32", defaults=BATCH_MODEL)
    env = {k: os.environ[k] for k in ("RAYDIT_CACHE", "RAYDIT_NO_PROGRESS") if k in os.environ}
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             object_store_memory=256 * 1024 * 1024, runtime_env={"env_vars": env})
    engines: dict = {}
    records = []
    try:
        for side, batch in (("off", 1), ("on", max_batch)):
            engines[side] = Engine(model=model_dir, device="cpu", show_plan=False, max_batch=batch, **ENGINE)
            engines[side].generate(PROMPT, num_inference_steps=1, seed=0, progress=False)  # warm-up
        for rnd in range(rounds):
            for side in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                load = benchlib.loadavg()
                r = burst_direct(engines[side], requests, steps, 1000 * rnd)
                records.append({"round": rnd, "side": side, "load": load, **r})
                print(f"round {rnd} batching {side:3s}: {r['requests_per_minute']:7.1f} requests/min, "
                      f"p50 {r['p50_s']:.2f} s, p95 {r['p95_s']:.2f} s, {r['shared_with_mean']:.1f} peers per request, "
                      f"load {load[0] if load else '?'}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
        ray.shutdown()
    by = {s: [r for r in records if r["side"] == s] for s in ("off", "on")}
    ratios = [on["requests_per_minute"] / off["requests_per_minute"] for off, on in zip(by["off"], by["on"])]
    return {
        "machine": benchlib.machine(), "model": {"dir": model_dir, "transformer": "wan-1.3b-shaped, 2 layers, float32",
                                                  **BATCH_MODEL},
        "engine": ENGINE, "requests_per_burst": requests, "steps": steps, "max_batch": max_batch,
        "rows": {s: {k: benchlib.summary([r[k] for r in rs], 4)
                     for k in ("requests_per_minute", "p50_s", "p95_s", "seconds", "shared_with_mean")}
                 for s, rs in by.items()},
        "throughput_ratio_on_over_off": benchlib.summary(ratios, 4),
        "rounds": records,
    }


def write_batched_md(result: dict, path: Path) -> None:
    rows, m = result["rows"], result["machine"]
    lines = [
        "# Step-level batching: one replica, batching off against on",
        "",
        f"Command: `python bench/bench_serve.py --batched --requests {result['requests_per_burst']} --steps "
        f"{result['steps']} --rounds {result['throughput_ratio_on_over_off']['n']} --max-batch {result['max_batch']}` "
        f"({m['date_utc']} UTC). Machine: {m['processor']}, {m['cpu_count']} cores, no GPU, torch {m['torch']}, "
        f"Ray {m.get('ray')}; 1-min load {', '.join(str(r['load'][0]) for r in result['rounds'])} at each burst.",
        "",
        f"A burst is {result['requests_per_burst']} requests of {result['model']['num_frames']} x "
        f"{result['model']['height']} x {result['model']['width']} submitted at once to one replica of 1 rank "
        f"({result['model']['transformer']}, {result['steps']} steps each, one seed each). Figures: median (min-max, "
        "n rounds).",
        "",
        "| batching | requests / min | p50 latency | p95 latency | burst | peers per request |",
        "|---|---|---|---|---|---|",
    ]
    for side in ("off", "on"):
        r = rows[side]
        lines.append(f"| {side}{'' if side == 'off' else ' (max ' + str(result['max_batch']) + ')'} | "
                     f"{benchlib.fmt(r['requests_per_minute'], '')} | {benchlib.fmt(r['p50_s'])} | "
                     f"{benchlib.fmt(r['p95_s'])} | {benchlib.fmt(r['seconds'])} | "
                     f"{benchlib.fmt(r['shared_with_mean'], '')} |")
    lines += ["", f"Throughput, on / off: {benchlib.fmt(result['throughput_ratio_on_over_off'], 'x')}.", ""]
    path.write_text("\n".join(lines))


def burst_http(client, n: int, steps: int, seed0: int, how: str = "wait") -> dict:
    """`how`: "wait": each of n client threads POSTs its request, then asks for it with
    GET /v1/videos/{id}?wait=60 (raydit's long poll: answered when the video is done) and
    downloads it; "poll": after the POSTs, one poller lists the burst's videos every 0.25 s
    and downloads each one seen completed."""
    starts, ids = [0.0] * n, [None] * n
    finished: dict[str, float] = {}
    busy: dict[str, float] = {}
    t0 = time.perf_counter()

    def create(i):
        starts[i] = time.perf_counter()
        v = client.videos.create(prompt=PROMPT, extra_body={"num_inference_steps": steps, "seed": seed0 + i})
        ids[i] = v.id
        return v

    def done(v):
        if v.status == "failed":
            raise RuntimeError(f"{v.id} failed: {v.error}")
        extra = (v.model_extra or {}).get("raydit") or {}
        busy[v.id] = float(extra["timings"]["total_seconds"])

    def download(video_id):
        client.videos.download_content(video_id).read()
        finished[video_id] = time.perf_counter()

    if how == "wait":
        def one(i):
            v = create(i)
            deadline = time.time() + 1800
            while v.status in ("queued", "in_progress") and time.time() < deadline:
                v = client.videos.retrieve(v.id, extra_query={"wait": 60})
            done(v)
            download(v.id)

        with cf.ThreadPoolExecutor(n) as pool:
            list(pool.map(one, range(n)))
    else:
        with cf.ThreadPoolExecutor(n) as pool:
            list(pool.map(create, range(n)))
        mine = set(ids)
        with cf.ThreadPoolExecutor(4) as pool:
            seen: set[str] = set()
            deadline = time.time() + 1800
            while len(seen) < n and time.time() < deadline:
                page = client.videos.list(limit=n)  # newest first: this burst's videos
                for v in page.data:
                    if v.id in mine and v.id not in seen and v.status in ("completed", "failed"):
                        done(v)
                        seen.add(v.id)
                        pool.submit(download, v.id)
                time.sleep(0.25)
    if len(finished) < n:
        raise RuntimeError(f"only {len(finished)} of {n} videos finished")
    wall = max(finished.values()) - t0
    return _stats([finished[ids[i]] - starts[i] for i in range(n)], wall, list(busy.values()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(requests: int, steps: int, rounds: int, how: str = "wait") -> dict:
    import openai
    import ray
    from ray import serve

    from raydit.runtime.engine import Engine
    from raydit.serve.app import VideoAPI
    from raydit.serve.auth import token_digest
    from raydit.serve.config import resolve_serve_options

    model_dir = benchlib.bench_model_dir()
    env = {k: os.environ[k] for k in ("RAYDIT_CACHE", "RAYDIT_NO_PROGRESS") if k in os.environ}
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING",
             object_store_memory=256 * 1024 * 1024, runtime_env={"env_vars": env})
    out_dir = tempfile.mkdtemp(prefix="raydit-bench-serve-")
    token, port = secrets.token_urlsafe(24), _free_port()
    records = []
    engine = None
    # The Serve replica drives its Engine from a Ray worker, at the niceness Ray gives its
    # workers (15 by default); the direct side's Engine is driven from this process. So that
    # both drivers, and both sides' callers (the openai client threads, the submitting
    # thread), run at the same priority, this thread and every thread it starts from here on
    # (the direct Engine's dispatcher, the client pools) take the workers' niceness. Ray's
    # own processes (raylet, GCS), started above, keep theirs.
    worker_nice = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote())  # by value: run_all imports this file
    os.nice(worker_nice - os.nice(0))
    try:
        engine = Engine(model=model_dir, device="cpu", show_plan=False, **ENGINE)  # as the server builds it
        engine.generate(PROMPT, num_inference_steps=1, seed=0, progress=False)  # warm-up
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        opts = resolve_serve_options({"model": model_dir, "device": "cpu", "output_dir": out_dir,
                                      "max_queue": 4 * requests, "default_steps": steps, **ENGINE})
        serve.run(VideoAPI.options(ray_actor_options={"num_cpus": 0}).bind(opts, token_digest(token)),
                  name="raydit", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0, timeout=600)
        client.videos.create_and_poll(prompt=PROMPT, extra_body={"num_inference_steps": 1},
                                      poll_interval_ms=100)  # warm-up
        sides = {"direct": lambda s: burst_direct(engine, requests, steps, s),
                 "http": lambda s: burst_http(client, requests, steps, s, how)}
        for rnd in range(rounds):
            for side in (("direct", "http") if rnd % 2 == 0 else ("http", "direct")):
                load, busy0, c0 = benchlib.loadavg(), benchlib.machine_busy_seconds(), time.perf_counter()
                procs0 = benchlib.cpu_by_process()
                waits0 = benchlib.runqueue_wait_by_process(procs0)
                r = sides[side](1000 * rnd)
                busy = benchlib.machine_busy_seconds() - busy0
                procs1 = benchlib.cpu_by_process()
                r["cpu_seconds_by_process"] = benchlib.delta_by_name(procs0, procs1, top=40)
                # Seconds each process's threads were runnable but waited for a CPU.
                r["runqueue_wait_seconds_by_process"] = benchlib.delta_by_name(
                    waits0, benchlib.runqueue_wait_by_process(procs1))
                records.append({"round": rnd, "side": side, "load": load,
                                "machine_busy_fraction": round(busy / (time.perf_counter() - c0) / (os.cpu_count() or 1), 3),
                                **r})
                print(f"round {rnd} {side:6s}: {r['requests_per_minute']:7.2f} requests/min, p50 {r['p50_s']:.2f} s, "
                      f"p95 {r['p95_s']:.2f} s ({requests} in {r['seconds']:.1f} s; runs {r['run_seconds_sum']:.1f} s, "
                      f"outside runs {r['outside_runs_seconds']:.2f} s), load {load[0] if load else '?'}",
                      flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            if engine is not None:
                engine.shutdown()
            ray.shutdown()
    by = {s: [r for r in records if r["side"] == s] for s in ("direct", "http")}
    ratios = [h["requests_per_minute"] / d["requests_per_minute"]
              for d, h in zip(by["direct"], by["http"])]
    return {
        "machine": benchlib.machine(), "model": {"dir": model_dir, **benchlib.BENCH_MODEL},
        "engine": ENGINE, "requests_per_burst": requests, "steps": steps, "client": how,
        "driver_niceness": worker_nice,
        "rows": {s: {k: benchlib.summary([r[k] for r in rs], 4)
                     for k in ("requests_per_minute", "p50_s", "p95_s", "seconds", "run_seconds_mean",
                                   "outside_runs_seconds")} for s, rs in by.items()},
        "throughput_ratio_http_over_direct": benchlib.summary(ratios, 4),
        "front_cost_percent": round((1 - benchlib.summary(ratios, 4)["median"]) * 100, 2),
        "target_front_cost_percent_at_most": 2.0,
        "rounds": records,
    }


FRONT = (("the Serve replica", "ray::ServeReplica"), ("the HTTP proxy", "ray::ProxyActor"))


def front_cpu_ms(result: dict) -> tuple[dict, dict]:
    """CPU milliseconds per request of the Serve replica and the HTTP proxy during the HTTP
    side's bursts, and the same net of what those processes spent during the direct side's
    burst of the same round (where they only idle), each a summary over rounds."""
    n = result["requests_per_burst"]

    def ms(r, prefix):
        return sum(v for k, v in r["cpu_seconds_by_process"].items() if k.startswith(prefix)) / n * 1e3

    by_round: dict[int, dict] = {}
    for r in result["rounds"]:
        by_round.setdefault(r["round"], {})[r["side"]] = r
    pairs = [p for p in by_round.values() if "http" in p and "direct" in p]
    gross = {label: benchlib.summary([ms(p["http"], prefix) for p in pairs], 1) for label, prefix in FRONT}
    # A process missing from a burst's record was below its top entries, not idle at zero:
    # such rounds are left out of the net figure.
    net = {}
    for label, prefix in FRONT:
        values = [ms(p["http"], prefix) - ms(p["direct"], prefix) for p in pairs
                  if any(k.startswith(prefix) for k in p["direct"]["cpu_seconds_by_process"])]
        if values:
            net[label] = benchlib.summary(values, 1)
    return gross, net


def write_md(result: dict, path: Path) -> None:
    rows, ratio = result["rows"], result["throughput_ratio_http_over_direct"]
    m = result["machine"]
    lines = [
        "# raydit serve: the HTTP front against the Engine called directly",
        "",
        f"Command: `python bench/bench_serve.py --requests {result['requests_per_burst']} --steps {result['steps']} "
        f"--rounds {ratio['n']} --client {result.get('client', 'poll')}"
        + ("" if result.get("name", "serve") == "serve" else f" --name {result['name']}")
        + f"` ({m['date_utc']} UTC). Machine: {m['processor']}, {m['cpu_count']} cores, no GPU, "
        f"torch {m['torch']}, Ray {m.get('ray')}; shared with other engineers' runs (1-min load "
        f"{', '.join(str(r['load'][0]) for r in result['rounds'])} at the start of each burst).",
        "",
        f"A burst is {result['requests_per_burst']} requests submitted at once to one engine replica of "
        f"{result['engine']['workers']} rank (the bench model, {result['steps']} steps each). Figures: median "
        "(min-max, n rounds); sides alternate within a round.",
        "",
        "| side | requests / min | p50 latency | p95 latency | a request's run on the replica (mean) | burst time outside runs |",
        "|---|---|---|---|---|---|",
    ]
    for side, label in (("direct", "Engine.submit (direct)"), ("http", "HTTP: openai client -> raydit serve")):
        r = rows[side]
        lines.append(f"| {label} | {benchlib.fmt(r['requests_per_minute'], 'req/min', 2)} | {benchlib.fmt(r['p50_s'])} | "
                     f"{benchlib.fmt(r['p95_s'])} | {benchlib.fmt(r['run_seconds_mean'])} | {benchlib.fmt(r['outside_runs_seconds'])} |")
    met = "met" if result["front_cost_percent"] <= result["target_front_cost_percent_at_most"] else "**not met**"
    lines += [
        "",
        f"Throughput through HTTP / direct, per round: {benchlib.fmt(ratio, 'x', 4)}; the front costs "
        f"{result['front_cost_percent']}% of throughput (target at most 2%: {met}).",
        "",
        "The HTTP side also pays what the direct side does not: the mp4 encode and write, "
        + ("one long poll per video (GET /v1/videos/{id}?wait=60, answered when it is done)"
           if result.get("client") == "wait" else "polling (one list call every 0.25 s)")
        + " and the download of every video. Raw values: `" + result.get("name", "serve") + ".json`; how "
        "it is measured: the docstring of `bench/bench_serve.py`.",
        "",
    ]
    front, net = front_cpu_ms(result)
    lines += [
        "CPU the front spent per request on the HTTP side (its POST, its wait or its share of the polls, its mp4, "
        "its download, and the replica's Engine driver): "
        + "; ".join(f"{label} {benchlib.fmt(st, 'ms', 1)}" for label, st in front.items())
        + ((". Less what the same processes spend while the direct side runs its burst of the round (idle: "
            "health checks, metrics): " + "; ".join(f"{label} {benchlib.fmt(st, 'ms', 1)}" for label, st in net.items()))
           if net else "")
        + ". On these 2 cores it competes with the rank, which uses one core throughout.",
        "",
    ]
    if all("runqueue_wait_seconds_by_process" in r for r in result["rounds"]):
        wait = {side: benchlib.summary([r["runqueue_wait_seconds_by_process"].get("ray::RankWorker", 0.0)
                                        for r in result["rounds"] if r["side"] == side], 3)
                for side in ("direct", "http")}
        lines += [
            "Time the rank's threads were runnable but waited for a CPU, per burst (/proc schedstat): "
            f"direct {benchlib.fmt(wait['direct'])}, HTTP {benchlib.fmt(wait['http'])}.",
            "",
        ]
    rank_cpu = {side: [r["cpu_seconds_by_process"].get("ray::RankWorker") for r in result["rounds"]
                       if r["side"] == side] for side in ("direct", "http")}
    if all(v is not None for vs in rank_cpu.values() for v in vs):
        st = {side: benchlib.summary(vs, 2) for side, vs in rank_cpu.items()}
        lines += [
            "The rank's own CPU seconds per burst, the same requests on both sides: direct "
            f"{benchlib.fmt(st['direct'])}, HTTP {benchlib.fmt(st['http'])}: a difference is the rank "
            "computing slower or faster for the same work (on this shared machine it varies by a few "
            "percent from burst to burst, either way).",
            "",
        ]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    ap.add_argument("--client", choices=("wait", "poll"), default="wait",
                    help="how the HTTP side learns a video is done: wait (one long poll per video, "
                         "GET ?wait=60) or poll (one list call every 0.25 s)")
    ap.add_argument("--name", default="serve", help="result files NAME.json / NAME.md (serve-short: 1-step requests)")
    ap.add_argument("--rewrite-md", action="store_true",
                    help="measure nothing: write NAME.md again from the rounds stored in NAME.json")
    ap.add_argument("--batched", action="store_true",
                    help="step-level batching: one replica with batching off against on (NAME serve-batched)")
    ap.add_argument("--max-batch", type=int, default=16, help="with --batched: the batching side's max_batch")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.batched:
        os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
        name = args.name if args.name != "serve" else "serve-batched"
        result = run_batched(args.requests, args.steps, args.rounds, args.max_batch)
        result["name"] = name
        print("wrote", benchlib.write_json(name, result, out))
        write_batched_md(result, out / f"{name}.md")
        print("wrote", out / f"{name}.md")
        return 0
    if args.rewrite_md:
        import json

        result = json.loads((out / f"{args.name}.json").read_text())
        result.setdefault("name", args.name)
        write_md(result, out / f"{args.name}.md")
        print("wrote", out / f"{args.name}.md")
        return 0
    os.environ.setdefault("RAYDIT_NO_PROGRESS", "1")
    result = run(args.requests, args.steps, args.rounds, args.client)
    result["name"] = args.name
    print("wrote", benchlib.write_json(args.name, result, out))
    write_md(result, out / f"{args.name}.md")
    print("wrote", out / f"{args.name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
