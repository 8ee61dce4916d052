"""raydit: elastic, sequence-parallel video diffusion inference on Ray.

`import raydit` stays cheap: the planner is pure Python; `raydit.Engine` (torch, Ray) is
imported only when first asked for.
"""

from raydit.planner import ClusterSpec, ModelSpec, NodeSpec, PlanError, model_spec, plan

__version__ = "0.1.0"

__all__ = ["ClusterSpec", "Engine", "ModelSpec", "NodeSpec", "PlanError", "model_spec", "plan"]


def __getattr__(name):
    if name == "Engine":
        from raydit.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'raydit' has no attribute {name!r}")
