"""Measure each device type of a Ray cluster once and cache the figures for the planner
(`raydit doctor --calibrate`).

`calibrate_type` pins 1 or 2 `CalibrationWorker` actors to one node of the type; they run
raydit.runtime.measure (compute; links when 2 devices of the type share the node; a model's
own step with `--model`). `calibrate_cluster` does so for every device type of the cluster
the cache lacks, on the node offering the most of it, and files the entries in the cache
(raydit.runtime.calibration_cache, which also says how the figures replace the table's).
"""

from __future__ import annotations

import socket
import time
from datetime import datetime, timedelta, timezone

from raydit.runtime.calibration_cache import load_calibration, save_calibration
from raydit.runtime.measure import (CPU_LINK_BYTES, CUDA_LINK_BYTES, measure_compute, measure_links,
                                    measure_model)


class CalibrationWorker:
    """One device of the type being measured; wrapped with `ray.remote` by `calibrate_type`."""

    def __init__(self, device: str):
        import torch

        torch.set_num_threads(1)
        self.device = device
        self._store = None

    def usable(self) -> dict:
        import ray
        import torch

        out = {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
               "cuda": torch.cuda.is_available(), "torch": torch.__version__}
        if self.device == "cuda" and out["cuda"]:
            props = torch.cuda.get_device_properties(0)
            out["memory_gb"] = props.total_memory / 1e9
            out["name"] = props.name
        return out

    def compute(self, sizes=None) -> dict:
        return measure_compute(self.device, tuple(sizes) if sizes else None)

    def model(self, model_dir: str, geometry: dict) -> dict:
        return measure_model(model_dir, self.device, **geometry)

    def open_store(self, timeout_s: float) -> tuple[str, int]:
        import ray
        import torch.distributed as dist

        ip = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
        return ip, int(self._store.port)

    def links(self, rank: int, addr: tuple[str, int], nbytes: int, timeout_s: float) -> dict:
        import torch
        import torch.distributed as dist

        store = self._store if rank == 0 else dist.TCPStore(
            addr[0], addr[1], is_master=False, timeout=timedelta(seconds=timeout_s))
        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", 0) if backend == "nccl" else None)
        try:
            return measure_links(rank, self.device, nbytes)
        finally:
            dist.destroy_process_group()


# -- orchestration on Ray ------------------------------------------------------------------


def calibrate_type(name: str, node_id: str, device: str, pair: bool, *,
                   timeout_s: float = 120.0, sizes=None, link_bytes: int | None = None,
                   model: str | None = None, geometry: dict | None = None) -> dict:
    """Measure device type `name` on node `node_id` with 1 actor (2 when `pair`: links too);
    with `model` (a pipeline directory the node can read), that model's own rates too
    (measure_model at `geometry`: frames, height, width; default the model's request).
    Returns a cache entry; ValueError when the device cannot be used there (fake GPUs)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    t_start = time.perf_counter()
    opts = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
            "num_cpus": 1, "max_restarts": 0,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
    if device == "cuda":
        opts.update(num_gpus=1, num_cpus=0)
    cls = ray.remote(CalibrationWorker)
    actors = [cls.options(**opts).remote(device) for _ in range(2 if pair else 1)]
    try:
        infos = ray.get([a.usable.remote() for a in actors], timeout=timeout_s)
        if device == "cuda" and not all(i["cuda"] for i in infos):
            raise ValueError(f"cannot calibrate {name} on node {node_id[:12]}: CUDA is not usable "
                             "in a task there (fake GPUs?)")
        measured = ray.get(actors[0].compute.remote(sizes), timeout=timeout_s)
        notes = []
        if pair:
            nbytes = link_bytes or (CUDA_LINK_BYTES if device == "cuda" else CPU_LINK_BYTES)
            addr = ray.get(actors[0].open_store.remote(timeout_s), timeout=timeout_s)
            outs = ray.get([a.links.remote(r, addr, nbytes, timeout_s) for r, a in enumerate(actors)],
                           timeout=timeout_s)
            # Rank 0's view; both ranks time the same collectives.
            measured.update(outs[0])
        else:
            notes.append("one device of the type on its node: links keep the table's figures")
        if device == "cuda" and infos[0].get("memory_gb"):
            measured["memory_gb"] = infos[0]["memory_gb"]
        models = {}
        if model is not None:
            # Loading and a few steps of a real pipeline take longer than the bare figures.
            got = ray.get(actors[0].model.remote(str(model), dict(geometry or {})), timeout=max(timeout_s, 600.0))
            models[got["key"]] = got
        return {"name": name, "device": device, "measured": measured, "notes": notes, "models": models,
                "node_id": node_id, "host": infos[0]["host"], "device_name": infos[0].get("name", ""),
                "torch": infos[0].get("torch", ""),
                "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "seconds": round(time.perf_counter() - t_start, 2)}
    except ray.exceptions.GetTimeoutError:
        raise ValueError(f"calibrating {name} on node {node_id[:12]} did not finish in {timeout_s:g} s "
                         "(no free device of the type, or a machine too busy to measure it?)") from None
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def calibrate_cluster(device: str, *, force: bool = False, path=None, timeout_s: float = 120.0,
                      model: str | None = None, geometry: dict | None = None) -> list[str]:
    """Measure every device type of the connected cluster that the cache lacks (all with
    `force`), on the node offering the most of it; with `model`, that model's own rates on
    each type too (calibrate_type). Returns notes (skipped types, why)."""
    import ray

    from raydit.runtime.devices import accelerator_type, resolve_device, table_device

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    device = resolve_device(device, nodes)
    key = "GPU" if device == "cuda" else "CPU"
    best: dict[str, tuple[int, str]] = {}
    for n in nodes:
        count = int((n.get("Resources") or {}).get(key, 0))
        name = table_device(accelerator_type(n))[0].name if device == "cuda" else "cpu"
        if count > 0 and count > best.get(name, (0, ""))[0]:
            best[name] = (count, n["NodeID"])
    cached = load_calibration(path)
    notes, new = [], {}
    for name, (count, node_id) in best.items():
        if name in cached and not force:
            continue
        try:
            new[name] = calibrate_type(name, node_id, device, pair=count >= 2, timeout_s=timeout_s,
                                       model=model, geometry=geometry)
        except ValueError as exc:
            notes.append(str(exc))
    if new:
        save_calibration(new, path)
    return notes


__all__ = ["CalibrationWorker", "calibrate_cluster", "calibrate_type"]
