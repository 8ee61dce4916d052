"""`raydit serve`: check everything a user can get wrong, then run the Serve application
in the foreground until SIGINT / SIGTERM.

Checked before Ray Serve starts (one line, exit status 2): options, the model and the
geometry (the planner's rules), the token file, the output directory, and whether the
cluster can hold the plan (the engine's own planner on the live cluster).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

APP_NAME = "raydit"
PASS_ENV = ("RAYDIT_CACHE", "RAYDIT_NO_PROGRESS", "HF_HOME", "HF_HUB_OFFLINE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCHINDUCTOR_CACHE_DIR")  # where --compile keeps what it compiled


def _say(message: str) -> None:
    print(f"raydit serve: {message}", file=sys.stderr, flush=True)


def check_before_start(opts: dict):
    """The model spec, after checking the model and the largest geometry served."""
    from raydit.models.loading import resolve_model_dir
    from raydit.planner import model_spec

    model_dir = str(resolve_model_dir(opts["model"]))
    spec = model_spec(model_dir)
    spec.geometry(opts.get("frames"), opts.get("height"), opts.get("width"))
    if opts.get("lora_table"):  # a LoRA for another model is refused here, before Ray starts
        from raydit.models.lora import LoraSpec, check_for_model

        for name, entry in opts["lora_table"].items():
            check_for_model(model_dir, LoraSpec(name, entry["path"], entry.get("target", "transformer")))
    return spec


def check_listen(host: str, port: int) -> None:
    """Where Ray is started here, Serve's HTTP proxy listens on this machine: bind the address
    once, now, so that a host that is not this machine's or a port in use is one line before
    Ray starts instead of Serve's proxy traceback after it."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"--host {host!r} is not an address ({exc.strerror or exc}); give an IP address of "
                         "this machine, 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    family, _, _, _, addr = infos[0]
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn binds: SO_REUSEADDR, so a port left in TIME_WAIT is not taken for busy.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port} is in use on {host}; stop what listens there or pick a free "
                             "port") from None
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); give an address of this "
                         "machine (127.0.0.1, 0.0.0.0) and a free port") from None
    finally:
        probe.close()


def _proxy_error(exc: Exception, host: str, port: int) -> Exception:
    """Serve's proxy that could not bind (a cluster elsewhere: not checked before Ray started)."""
    text = " ".join(str(exc).split())
    if "Failed to bind" in text:
        return ValueError(f"Serve's HTTP proxy could not listen on {host}:{port} on the cluster's head node; "
                          "give an address of that node (or 0.0.0.0) and a free --port")
    return exc


def _deploy_error(exc: Exception) -> Exception:
    """Serve reports a failed constructor with its whole traceback: keep the user's line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in reversed(lines):
        for kind in ("PlanError: ", "ValueError: "):
            if kind in ln:
                return ValueError(ln.split(kind, 1)[1])
    return RuntimeError(lines[-1] if lines else type(exc).__name__)


def run_server(opts: dict, stop: threading.Event | None = None) -> int:
    from raydit.serve.auth import load_or_create_token, token_digest
    from raydit.serve.config import token_file_path
    from raydit.serve.store import VideoStore

    spec = check_before_start(opts)
    if not (opts.get("address") or os.environ.get("RAY_ADDRESS")):
        check_listen(opts["host"], opts["port"])
    token_path = token_file_path(opts)
    token, created = load_or_create_token(token_path)
    store = VideoStore(opts["output_dir"])
    opts = dict(opts, output_dir=str(store.root), token_file=token_path)

    import ray
    from ray import serve

    from raydit.runtime.cluster import RayCluster
    from raydit.planner.devicemodel import run_mode
    from raydit.serve.app import VideoAPI

    workers, replicas = opts.get("workers"), opts.get("replicas", 1)
    cluster = RayCluster.connect(opts.get("address"), want_workers=None if workers is None else workers * replicas)
    stop = stop or threading.Event()
    deployed = False
    signalled: list[int] = []
    if threading.current_thread() is threading.main_thread():
        # A signal during start-up is kept and acted on once Serve is up, so that every
        # process started here is stopped the orderly way. The handler only appends: an
        # Event.set() there could deadlock on the lock the interrupted wait holds.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: signalled.append(signum))
    try:
        device = cluster.resolve_device(opts["device"])
        if workers is not None:
            cluster.cluster_spec(device, workers * replicas)
        cluster.plan(spec, frames=opts.get("frames"), height=opts.get("height"), width=opts.get("width"),
                     device=device, workers=workers, ulysses=opts.get("ulysses"), ring=opts.get("ring"),
                     cfg=opts.get("cfg"), shard_weights=True if opts.get("shard_weights") else None,
                     mode=run_mode(opts.get("quantize"), opts.get("attention"), opts.get("compile"),
                                       opts.get("full_precision_steps") or 0))
        try:
            serve.start(http_options={"host": opts["host"], "port": opts["port"]})
        except Exception as exc:
            raise _proxy_error(exc, opts["host"], opts["port"]) from None
        env = {k: os.environ[k] for k in PASS_ENV if os.environ.get(k)}
        # The replica writes --output-dir and reads the token file here: keep it on this node.
        node = f"node:{ray.util.get_node_ip_address()}"
        deployment = VideoAPI.options(ray_actor_options={
            "num_cpus": 0, "resources": {node: 0.001}, "runtime_env": {"env_vars": env},
        })
        _say(f"starting {opts['model']!r} on {device} (output {store.root})")
        try:
            serve.run(deployment.bind(opts, token_digest(token)), name=APP_NAME, route_prefix="/")
        except Exception as exc:  # the deployment's constructor failed (e.g. no room for the plan)
            raise _deploy_error(exc) from None
        deployed = True
        where = f"token file {token_path}" + (" (created, mode 0600)" if created else "") if token_path \
            else "token from $RAYDIT_API_TOKEN"
        _say(f"ready at http://{opts['host']}:{opts['port']}/  (API: /v1/videos, {where})")
        while not signalled and not stop.wait(timeout=0.25):
            pass
        _say("stopping (running requests are kept as queued and run again on the next start)")
        return 0
    finally:
        if deployed:
            try:  # the service first: running requests kept as queued, long polls answered
                serve.get_app_handle(APP_NAME).close_service.remote().result(timeout_s=90)
            except Exception as exc:
                _say(f"stopping the video service: {exc}")
        try:
            if opts.get("address") or os.environ.get("RAY_ADDRESS"):
                serve.delete(APP_NAME)  # a shared cluster: leave its other Serve apps running
            else:
                serve.shutdown()
        except Exception as exc:
            _say(f"stopping Serve: {exc}")
        cluster.close()
