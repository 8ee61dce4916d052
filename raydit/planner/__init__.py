"""The planner: pure Python, imports neither torch nor ray.

    from raydit.planner import plan
    result = plan("cogvideox-2b", 49, 480, 720, gpus=8)
    result.best.ulysses, result.best.ring, result.best.cfg, result.best.placement

Layers: `model` (ModelSpec, geometry of a request), `registry` (the built-in models and
pipeline readers the model families register; `model_spec`), `pipeline_dir` (a diffusers
pipeline directory's configs and parameter counts, read without loading it), `hardware` (device table), `cluster` (ClusterSpec), `cost` (step
time and memory model, with the formulas), `decode` (the VAE decode each spec's decoder
costs), `layouts` (the mesh layouts every layer walks), `plans` (Plan, PlanResult: a plan as
data), `judge` (one layout: feasible, placed, priced), `ranking` (best first), `search`
(`plan`: enumerate, judge, rank), `report` (the readable table). It names no model family.
"""

from raydit.planner.cluster import ClusterSpec, NodeSpec
from raydit.planner.hardware import DEVICE_TYPES, DeviceType, device_type
from raydit.planner.model import ModelSpec, VideoGeometry
from raydit.planner.registry import BUILTIN_MODELS, model_spec
from raydit.planner.plans import Plan, PlanError, PlanResult, Rank, Rejection
from raydit.planner.search import plan

__all__ = [
    "BUILTIN_MODELS",
    "ClusterSpec",
    "DEVICE_TYPES",
    "DeviceType",
    "ModelSpec",
    "NodeSpec",
    "Plan",
    "PlanError",
    "PlanResult",
    "Rank",
    "Rejection",
    "VideoGeometry",
    "device_type",
    "model_spec",
    "plan",
]
