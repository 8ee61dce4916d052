"""`raydit doctor`: what this machine and cluster will run, said up front.

A user of another project lost days to a shape mismatch that came from a missing optional
kernel package; raydit reports which attention kernel runs, and why, before any job.
"""

from __future__ import annotations

import importlib.util
import platform


def collect(address: str | None = None) -> dict:
    import torch
    import torch.distributed as dist

    from raydit.parallel.kernel_report import describe_kernels
    from raydit.runtime.calibration_cache import seed_kernel_choices

    # A calibration of this GPU's type decides its kernels (as in a worker); else doctor
    # probes them, as a worker would.
    seed_kernel_choices()
    info: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl_available": dist.is_nccl_available(),
        "gloo_available": dist.is_gloo_available(),
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
        "kernels": describe_kernels(),
    }
    for mod in ("diffusers", "transformers", "ray"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # a broken install is exactly what doctor must show
            info[mod] = f"not importable: {exc}"
    info["cluster"] = _cluster(address)
    info["calibration"] = _calibration()
    return info


def _calibration() -> dict:
    """The cached per-device-type measurements the planner uses instead of the table."""
    from raydit.runtime.calibration_cache import cache_path, describe_calibration

    return {"path": str(cache_path()), "lines": describe_calibration()}


def _cluster(address: str | None) -> dict:
    import os

    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        return {"status": "no cluster given (generate starts a local Ray)"}
    try:
        from raydit.runtime.topology import reachable_address

        address = reachable_address(address)
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as exc:
        return {"status": f"cannot connect to {address}: {type(exc).__name__}: {exc}"}
    try:
        nodes = []
        for n in ray.nodes():
            res = n.get("Resources", {})
            nodes.append(
                {
                    "node_id": n["NodeID"][:12],
                    "ip": n.get("NodeManagerAddress"),
                    "alive": bool(n.get("Alive")),
                    "cpus": res.get("CPU", 0),
                    "gpus": res.get("GPU", 0),
                    "accelerator": (n.get("Labels") or {}).get("ray.io/accelerator-type", "")
                    or next((k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")), ""),
                }
            )
        return {"status": f"connected to {address}", "nodes": nodes}
    finally:
        ray.shutdown()


def format_report(info: dict) -> str:
    k = info["kernels"]
    lines = [
        f"python        {info['python']}",
        f"torch         {info['torch']} (CUDA {info['cuda_version'] or 'none'})",
        f"diffusers     {info['diffusers']}",
        f"transformers  {info['transformers']}",
        f"ray           {info['ray']}",
        f"GPUs          {', '.join(info['gpus']) or 'none visible'}",
        f"NCCL          {'available' if info['nccl_available'] else 'not available'}",
        f"gloo          {'available' if info['gloo_available'] else 'not available'}",
        f"flash-attn    {'installed' if info['flash_attn_installed'] else 'not installed'}",
        f"attention     {_kernel_line(k)}",
        f"cluster       {info['cluster']['status']}",
    ]
    for n in info["cluster"].get("nodes", []):
        lines.append(
            f"  node {n['node_id']} {n['ip']} {'alive' if n['alive'] else 'DEAD'} "
            f"cpus={n['cpus']:g} gpus={n['gpus']:g} {n['accelerator']}"
        )
    cal = info.get("calibration")
    if cal is not None:
        lines.append(f"calibration   {cal['path']}" + ("" if cal["lines"] else " (none cached: table figures)"))
        lines.extend(f"  {line}" for line in cal["lines"])
    return "\n".join(lines)


def _kernel_line(k: dict) -> str:
    """Per device and head dim, one line each, the LSE kernel that runs and why, e.g.
    'cuda bfloat16 d64: torch-cudnn (probe: torch-cudnn 540, torch-flash 300 TFLOP/s)' or
    'cpu float32 d64: torch-cpu (only candidate)'. Ring 1 runs torch's SDPA instead."""
    parts = []
    for key in ("cuda", "cpu"):
        entry = k.get(key)
        if not isinstance(entry, dict):
            continue
        by_dim = entry.get("by_head_dim") or {}
        for d in sorted(by_dim, key=int):
            c = by_dim[d]
            parts.append(f"{key} {entry.get('dtype', '')} d{d}: {c.get('text') or c.get('kernel')}")
        if not by_dim and entry.get("selected"):
            parts.append(f"{key}: {entry['selected']} (of {', '.join(entry.get('available', []))})")
    return "\n              ".join(parts) if parts else "no attention kernel found"
