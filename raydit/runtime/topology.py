"""Read the live Ray cluster as the planner's ClusterSpec.

Each alive node becomes one `NodeSpec` named by its Ray node id (the runtime pins a rank's
placement group to that id), with its GPU count and type, or its CPU slots on `cpu`.
The type comes from the node label `ray.io/accelerator-type`, else the resource
`accelerator_type:<T>`, looked up in the planner's device table (aliases included). An
unknown or missing type is planned with conservative figures and a note, never an error.

What the table says is replaced by what was measured, where something was:
  - GPU memory: one probe task per GPU type reads `total_memory` of its device (skipped,
    with a note, when no GPU of the type is free or CUDA is not usable in the task, as with
    the fake GPUs of `ray.cluster_utils.Cluster`);
  - rate and links: the cached calibration (`raydit.runtime.calibration_cache`), measured once per
    device type.
Links: inside a node the type's link (calibrated when measured); between nodes the
planner's default network figures.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from raydit.planner import ClusterSpec, DeviceType, NodeSpec, device_type
from raydit.runtime.devices import (  # noqa: F401 - re-exported: topology's public names
    ACCELERATOR_LABEL,
    ACCELERATOR_RESOURCE,
    CONSERVATIVE,
    _alive,
    accelerator_type,
    resolve_device,
    table_device,
)

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class LiveNode:
    """One alive Ray node as the planner sees it.

    node_id: Ray NodeID (the NodeSpec's name); ray_type: the accelerator type Ray reports
    ("" when none); device: the DeviceType planned with (table, calibrated or conservative);
    count: devices offered to the plan (GPUs, or CPU slots on `cpu`, after `counts`).
    """

    node_id: str
    ip: str
    cpus: int
    gpus: int
    ray_type: str
    device: DeviceType
    count: int
    source: str  # "table", "calibrated", "conservative"; "+memory probe" when probed

    def to_dict(self) -> dict:
        d = self.device
        return {"node_id": self.node_id, "ip": self.ip, "cpus": self.cpus, "gpus": self.gpus,
                "ray_type": self.ray_type, "device_type": d.name, "count": self.count,
                "memory_gb": round(d.memory_gb, 2), "tflops": round(d.tflops, 4),
                "efficiency": d.efficiency, "link_gb_s": round(d.link_gb_s, 3),
                "link_kind": d.link_kind, "source": self.source}


@dataclass(frozen=True)
class LiveCluster:
    """What `read_live_cluster` saw: the spec for the planner, per-node detail, notes."""

    spec: ClusterSpec
    nodes: tuple[LiveNode, ...]
    notes: tuple[str, ...] = field(default=())


def build_live_cluster(nodes: list[dict], device: str, counts: Mapping[str, int] | None = None,
                       calibrated: Mapping[str, DeviceType] | None = None,
                       probed_memory_gb: Mapping[str, float] | None = None,
                       notes: tuple[str, ...] = (), **network) -> LiveCluster:
    """The planner's view of `ray.nodes()` records (pure: no Ray calls).

    calibrated: device type name -> measured DeviceType (replaces the table's entry);
    probed_memory_gb: Ray accelerator type -> device memory read on a GPU of that type;
    network: `network_gb_s` / `network_latency_us` between nodes (default: the planner's).
    """
    device = resolve_device(device, nodes)
    calibrated = calibrated or {}
    probed_memory_gb = probed_memory_gb or {}
    out_notes = list(notes)
    live: list[LiveNode] = []
    for n in _alive(nodes):
        res = n.get("Resources") or {}
        node_id = n["NodeID"]
        gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
        if device == "cuda":
            ray_type = accelerator_type(n)
            dev, note = table_device(ray_type)
            source = "conservative" if note else "table"
            if note and gpus > 0 and note not in out_notes:
                out_notes.append(note)
            key = ray_type or ""
            offered = gpus
        else:
            ray_type, dev, source, key, offered = "", device_type("cpu"), "table", None, cpus
        if dev.name in calibrated:
            dev, source = calibrated[dev.name], "calibrated"
        if key is not None and key in probed_memory_gb:
            dev = replace(dev, memory_gb=probed_memory_gb[key])
            source += "+memory probe"
        count = offered if counts is None else int(counts.get(node_id, 0))
        if count > 0:
            live.append(LiveNode(node_id, str(n.get("NodeManagerAddress", "")), cpus, gpus,
                                 ray_type, dev, count, source))
    if not live:
        what = "GPUs" if device == "cuda" else "CPUs"
        raise ValueError(f"the Ray cluster has no {what} to run on"
                         + (" (after the given counts)" if counts is not None else ""))
    spec = ClusterSpec(nodes=tuple(NodeSpec(name=x.node_id, gpu_type=x.device, count=x.count)
                                   for x in live), **network)
    return LiveCluster(spec, tuple(live), tuple(out_notes))


# -- Ray: read, probe, connect ---------------------------------------------------------------


def _probe_memory_task():
    """Runs on one GPU of the type (Ray sets CUDA_VISIBLE_DEVICES: index 0 is ours)."""
    # No GPU device files (NVIDIA, WSL, ROCm): a fake GPU; answer before importing torch.
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(0).total_memory) / 1e9


def probe_gpu_memory(nodes: list[dict], timeout_s: float = 20.0) -> tuple[dict[str, float], list[str]]:
    """Device memory per Ray accelerator type, read by one `num_gpus=1` task per type on a
    node with a free GPU. Types that cannot be probed are left out, with a note."""
    import ray
    from ray._private.state import available_resources_per_node
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    free = {k: v.get("GPU", 0) for k, v in available_resources_per_node().items()}
    by_type: dict[str, str] = {}
    for n in _alive(nodes):
        t = accelerator_type(n)
        if (n.get("Resources") or {}).get("GPU", 0) >= 1 and free.get(n["NodeID"], 0) >= 1:
            by_type.setdefault(t, n["NodeID"])
    wanted = {accelerator_type(n) for n in _alive(nodes) if (n.get("Resources") or {}).get("GPU", 0) >= 1}
    notes = [f"GPU memory of {t or 'untyped GPUs'} not probed: no free GPU of the type; table figure used"
             for t in sorted(wanted - set(by_type))]
    # max_calls=1: the worker exits after the task, so no CUDA context stays on the GPU.
    task = ray.remote(num_gpus=1, num_cpus=0, max_retries=0, max_calls=1)(_probe_memory_task)
    refs = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(): t
            for t, node in by_type.items()}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    out: dict[str, float] = {}
    unusable = []
    for ref in ready:
        try:
            gb = ray.get(ref)
        except Exception as exc:  # a broken driver or node: the table figure is the fallback
            notes.append(f"GPU memory probe of {refs[ref] or 'untyped GPUs'} failed "
                         f"({type(exc).__name__}); table figure used")
            continue
        if gb is None:
            unusable.append(refs[ref] or "untyped GPUs")
        else:
            out[refs[ref]] = gb
    if unusable:
        notes.append(f"GPU memory not probed on {', '.join(sorted(unusable))}: CUDA is not usable in "
                     "a task there (fake GPUs?); table figures used")
    for ref in pending:
        ray.cancel(ref, force=True)
        notes.append(f"GPU memory probe of {refs[ref] or 'untyped GPUs'} did not finish in "
                     f"{timeout_s:g} s; table figure used")
    return out, notes


def read_live_cluster(device: str = "cuda", counts: Mapping[str, int] | None = None,
                      calibration=None, *, probe: bool = True,
                      probe_timeout_s: float = 20.0, **network) -> LiveCluster:
    """Read the connected Ray cluster (`ray.init` done by the caller).

    counts: node id -> devices, replacing what each node offers (nodes left out offer
    none), e.g. survivors plus free devices after a failure.
    calibration: None: apply the cached calibration (no measuring); False: table figures
    only; "measure": measure device types the cache lacks first (seconds per type), then
    apply; or a mapping device type name -> DeviceType to apply.
    probe: read GPU memory with a task per GPU type (skipped where no GPU is free).
    network: `network_gb_s` / `network_latency_us` between nodes (default: the planner's
    DEFAULT_NETWORK_GB_S / _LATENCY_US; Ray does not report the fabric).
    """
    import ray

    nodes = ray.nodes()
    device = resolve_device(device, nodes)
    notes: list[str] = []
    calibrated: Mapping[str, DeviceType]
    if calibration is False:
        calibrated = {}
    elif calibration is None or calibration == "measure":
        from raydit.runtime import calibrate, calibration_cache

        if calibration == "measure":
            notes += calibrate.calibrate_cluster(device)
        try:
            calibrated = calibration_cache.calibrated_device_types(notes=notes)
        except ValueError as exc:  # a broken cache must not stop a run: plan with the table
            notes.append(f"{exc}; table figures used")
            calibrated = {}
    elif isinstance(calibration, Mapping):
        calibrated = dict(calibration)
    else:
        raise ValueError(f"calibration {calibration!r} must be None (cached), False (table), "
                         "'measure' or a mapping of device type name to DeviceType")
    probed: dict[str, float] = {}
    if probe and device == "cuda":
        probed, probe_notes = probe_gpu_memory(nodes, probe_timeout_s)
        notes += probe_notes
    live = build_live_cluster(nodes, device, counts, calibrated, probed, tuple(notes), **network)
    for note in live.notes:
        log.info("%s", note)
    return live


def live_cluster_spec(device: str = "cuda", counts: dict[str, int] | None = None,
                      calibration=None, **kwargs) -> ClusterSpec:
    """The connected Ray cluster as the planner's ClusterSpec (see `read_live_cluster`)."""
    return read_live_cluster(device, counts, calibration, **kwargs).spec


def describe_live_cluster(device: str = "auto", probe: bool = False) -> list[dict]:
    """One dict per alive node offering devices (for `raydit doctor` and the CLI)."""
    live = read_live_cluster(device, probe=probe)
    return [n.to_dict() for n in live.nodes]


def resolve_address(address: str) -> str:
    """`auto`: RAY_ADDRESS, else the running local cluster; anything else as given.
    ValueError when `auto` finds nothing."""
    if address != "auto":
        return address
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        return canonicalize_bootstrap_address_or_die("auto")
    except (ConnectionError, ValueError) as exc:
        raise ValueError(f"--address auto found no running Ray cluster ({' '.join(str(exc).split()[:8])}...);"
                         " start one with `ray start --head` or give HOST:PORT") from None


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `host:port`, `ray://host:port` or `http(s)://host:port`; None if unparsable."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, the
# Ray Client server) answers with its own SETTINGS frame (frame type 4 in the 9-byte header).
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _answers_grpc(conn: socket.socket, timeout_s: float) -> bool:
    """Whether the server on `conn` speaks HTTP/2 (gRPC) within `timeout_s`."""
    conn.settimeout(timeout_s)
    try:
        conn.sendall(HTTP2_PREFACE)
        head = b""
        while len(head) < 9:
            chunk = conn.recv(9 - len(head))
            if not chunk:
                break
            head += chunk
    except OSError:
        return False
    return len(head) == 9 and head[3] == 4


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """A TCP connect to the address and an HTTP/2 greeting, bounded: `ray.init` on a dead
    address, or on a port that is not Ray's (the dashboard's 8265, a web server), retries for
    minutes, so refuse one that does not answer as a gRPC server (skipped under RAY_USE_TLS,
    whose handshake comes first)."""
    hp = _host_port(address)
    if hp is None or not 0 < hp[1] < 65536:
        raise ValueError(f"Ray address {address!r} is not HOST:PORT (or ray://HOST:PORT, port 1-65535); "
                         "e.g. 10.0.0.1:6379")
    try:
        conn = socket.create_connection(hp, timeout=timeout_s)
    except OSError as exc:
        raise ValueError(f"cannot reach a Ray cluster at {address} ({exc.strerror or type(exc).__name__} "
                         f"within {timeout_s:g} s); check the address or start the cluster") from None
    with conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true") or _answers_grpc(conn, timeout_s):
            return
    raise ValueError(f"{address} answers, but not as a Ray cluster (no gRPC greeting within {timeout_s:g} s): give "
                     "the GCS address, HOST:6379 by default (`ray status` prints it), not the dashboard's 8265")


def reachable_address(address: str, timeout_s: float = 3.0) -> str:
    """The address to give ray.init: `local` as is, `auto` resolved, and anything else only
    once a TCP connect to it succeeds (ValueError in one line otherwise)."""
    if address == "local":
        return address
    resolved = resolve_address(address)
    check_reachable(resolved, timeout_s)
    return resolved


@contextmanager
def attached(address: str, timeout_s: float = 3.0):
    """Connect to the Ray cluster at `address` (`auto` allowed) for the block, then
    disconnect. An existing connection in this process is used as is and kept."""
    import ray

    if ray.is_initialized():
        yield
        return
    resolved = reachable_address(address, timeout_s)
    try:
        ray.init(address=resolved, logging_level="ERROR", log_to_driver=False)
    except Exception as exc:  # auth, version mismatch: say it in one line
        raise ValueError(f"cannot connect to the Ray cluster at {resolved}: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]}") from None
    try:
        yield
    finally:
        ray.shutdown()


__all__ = ["LiveCluster", "LiveNode", "accelerator_type", "attached", "build_live_cluster",
           "check_reachable", "describe_live_cluster", "live_cluster_spec", "probe_gpu_memory",
           "reachable_address", "read_live_cluster", "resolve_address", "resolve_device", "table_device"]
