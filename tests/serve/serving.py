"""`raydit serve` started as a user starts it, for the tests that call it over HTTP: its own
local Ray, a tiny model, on loopback; every process it starts is found by parent PID and
stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import requests

SIZE = 32
START_TIMEOUT_S = 420  # a cold Ray + Serve + 2 ranks: ~40 s on a quiet 2-core machine


def _reserved_port() -> socket.socket:
    """A port for a server, held until the server is done with it: bound with SO_REUSEADDR and
    never listening. `raydit serve`'s check and Serve's proxy (both SO_REUSEADDR) bind and listen
    on it all the same; the kernel hands it to no other bind(0) or outgoing connection meanwhile.
    (A port found free and released at once could be taken, in the tens of seconds before
    Serve's proxy binds it, by any process asking the kernel for a free port: the Ray processes
    started in between, the other xdist worker's.)"""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class Server:
    """`raydit serve` in a subprocess; restartable on the same output directory. `model` and
    `args` (its geometry and anything else; default: tiny at 17 x SIZE x SIZE)."""

    def __init__(self, root: Path, model: str = "tiny", args: tuple[str, ...] | None = None, workers: int = 2):
        self.root = root
        self.model = model
        self.workers = workers
        self.args = list(args) if args is not None else ["--frames", "17", "--height", str(SIZE), "--width", str(SIZE)]
        self.out = root / "videos"
        self.token_file = root / "secrets" / "api_token"
        self.lora_dir = root / "loras"
        self.lora_dir.mkdir(exist_ok=True)
        self._port_hold = _reserved_port()
        self.port = self._port_hold.getsockname()[1]
        self.proc: subprocess.Popen | None = None
        self.children: dict[int, float] = {}  # pid -> creation time (a reused pid is not ours)
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYDIT_API_TOKEN")}
        env["RAYDIT_NO_PROGRESS"] = "1"
        self.starts += 1
        self.log = self.root / f"serve-{self.starts}.log"
        argv = [sys.executable, "-m", "raydit.cli", "serve", "--model", self.model, "--workers", str(self.workers),
                "--device", "cpu", "--port", str(self.port), "--output-dir", str(self.out),
                "--token-file", str(self.token_file), "--max-queue", "7", *self.args,
                "--default-steps", "2", "--max-steps", "5000", "--lora-dir", str(self.lora_dir)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            self._note_children()
            if "raydit serve: ready at" in self.log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"raydit serve exited {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.5)
        raise RuntimeError(f"raydit serve not ready in {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def _note_children(self) -> None:
        try:
            for c in psutil.Process(self.proc.pid).children(recursive=True):
                self.children.setdefault(c.pid, c.create_time())
        except psutil.Error:
            pass

    def _pids(self, title: str) -> list[int]:
        """Our Ray processes whose title (ray::<actor class>) contains `title`."""
        pids = []
        for c in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if c.status() != psutil.STATUS_ZOMBIE and title in " ".join(c.cmdline()):
                    pids.append(c.pid)
                    self.children.setdefault(c.pid, c.create_time())
            except psutil.Error:
                pass
        return pids

    def rank_pids(self) -> list[int]:
        return self._pids("ray::RankWorker")

    def front_pid(self, wait: bool = True) -> int | None:
        """The Serve replica holding the service and its engine."""
        pids = self._pids("ray::ServeReplica:raydit:VideoAPI")
        if wait:
            assert len(pids) == 1, pids
        return pids[0] if len(pids) == 1 else None

    def stop(self) -> int | None:
        """SIGTERM (the orderly path: Serve, then Ray, shut down), then SIGKILL by PID for
        anything of ours still alive. Returns the server's exit status."""
        if self.proc is None:
            return None
        self._note_children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        code = self.proc.returncode
        for pid, created in self.children.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created:
                    proc.kill()
            except psutil.Error:
                pass
        self.children.clear()
        self.proc = None
        return code

    def client(self, token: str | None = None):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=token or self.token, max_retries=0, timeout=60)

    def http(self, method: str, path: str, token: str | None = None, headers: dict | None = None, **kw):
        headers = {"Authorization": f"Bearer {token or self.token}", **(headers or {})}
        return requests.request(method, self.url + path, headers=headers, timeout=60, **kw)


def running(srv: Server):
    """A module fixture's body: start `srv`, hand it to the tests, stop it; its SIGTERM exit
    status must be 0 (`yield from running(Server(...))`)."""
    try:
        srv.start()
        yield srv
    finally:
        code = srv.stop()
        srv._port_hold.close()
    assert code == 0, f"raydit serve exited {code} on SIGTERM:\n{srv.tail()}"
