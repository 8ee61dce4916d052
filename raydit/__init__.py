"""raydit: elastic, sequence-parallel video diffusion inference on Ray.

`import raydit` stays cheap: the planner is pure Python; `raydit.Engine` (torch, Ray) is
imported only when first asked for.
"""

from raydit import planner as _planner
from raydit.planner import ClusterSpec, ModelSpec, NodeSpec, PlanError

__version__ = "0.1.0"

__all__ = ["ClusterSpec", "Engine", "ModelSpec", "NodeSpec", "PlanError", "model_spec", "plan"]


def model_spec(name_or_dir):
    """`raydit.planner.model_spec`, with the model families loaded (they read pipeline
    directories; loading them imports neither torch nor diffusers)."""
    from raydit.models.registry import load_families

    load_families()
    return _planner.model_spec(name_or_dir)


def plan(model, *args, **kwargs):
    """`raydit.planner.plan` (see its docstring), with the model families loaded."""
    from raydit.models.registry import load_families

    load_families()
    return _planner.plan(model, *args, **kwargs)


def __getattr__(name):
    if name == "Engine":
        from raydit.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'raydit' has no attribute {name!r}")
