"""Pure helpers on Ray node records: accelerator types, the device table, `auto` devices.

A leaf module (no Ray, no other runtime module): `topology` reads the live cluster with
them and `calibrate` measures device types with them, and neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from raydit.planner import DeviceType, device_type

ACCELERATOR_LABEL = "ray.io/accelerator-type"
ACCELERATOR_RESOURCE = "accelerator_type:"

# Planned for a GPU whose type the table does not know: the smallest GPU in the table
# (T4: 16 GB, 65 TFLOP/s, PCIe gen3), so that a plan never expects more than it gets.
CONSERVATIVE = device_type("T4")


# -- pure: node records -> types and counts ------------------------------------------------


def accelerator_type(node: Mapping) -> str:
    """The accelerator type Ray reports for a `ray.nodes()` record; "" when none."""
    labels = node.get("Labels") or {}
    if labels.get(ACCELERATOR_LABEL):
        return str(labels[ACCELERATOR_LABEL])
    for key in node.get("Resources") or {}:
        if key.startswith(ACCELERATOR_RESOURCE):
            return key[len(ACCELERATOR_RESOURCE):]
    return ""


def table_device(ray_type: str) -> tuple[DeviceType, str | None]:
    """(device type, note): the table's entry for a Ray accelerator name, or conservative
    figures under the Ray name with a note saying so."""
    if ray_type:
        try:
            return device_type(ray_type), None
        except ValueError:
            pass
    name = ray_type or "unknown-gpu"
    what = f"GPU type {ray_type!r} is not in the device table" if ray_type else \
        "a node reports GPUs but no accelerator type"
    note = (f"{what}: planned as {name} with conservative T4 figures ({CONSERVATIVE.memory_gb:g} GB "
            f"unless probed, {CONSERVATIVE.tflops:g} TFLOP/s, {CONSERVATIVE.link_gb_s:g} GB/s "
            "PCIe); run `raydit plan --cluster FILE` with its figures or calibrate it")
    return replace(CONSERVATIVE, name=name, fp8=None), note  # its FP8: the runtime checks the GPU


def _alive(nodes: list[dict]) -> list[dict]:
    return [n for n in nodes if n.get("Alive")]


def resolve_device(device: str, nodes: list[dict]) -> str:
    """`auto` -> cuda when the cluster has a GPU, else cpu; cuda without GPUs is an error."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device {device!r} must be one of auto, cuda, cpu")
    gpus = sum((n.get("Resources") or {}).get("GPU", 0) for n in _alive(nodes))
    if device == "auto":
        return "cuda" if gpus >= 1 else "cpu"
    if device == "cuda" and gpus < 1:
        raise ValueError("device 'cuda' asked for, but the Ray cluster has no GPUs; use --device cpu")
    return device
