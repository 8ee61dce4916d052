"""raydit: elastic, sequence-parallel video diffusion inference on Ray.

`import raydit` stays cheap: the planner is pure Python; `raydit.Engine` (torch, Ray) is
imported only when first asked for.
"""

from raydit import planner as _planner
from raydit.planner import ClusterSpec, ModelSpec, NodeSpec, PlanError

__version__ = "0.1.0"

__all__ = ["ClusterSpec", "Engine", "ModelSpec", "NodeSpec", "PlanError", "model_spec", "plan"]


def model_spec(name_or_dir):
    """`raydit.planner.model_spec` with the model families loaded (they read pipeline
    directories; loading them imports neither torch nor diffusers). A tiny built-in the
    planner's table does not list (a family's test variant) is read from the directory its
    family writes (this one builds it, with torch)."""
    from raydit.models.registry import load_families, tiny_models

    load_families()
    if isinstance(name_or_dir, str) and name_or_dir not in _planner.BUILTIN_MODELS:
        build = tiny_models().get(name_or_dir)
        if build is not None:
            return _planner.model_spec(str(build()))
    return _planner.model_spec(name_or_dir)


def plan(model, *args, **kwargs):
    """`raydit.planner.plan` (see its docstring), with the model families loaded."""
    return _planner.plan(model_spec(model), *args, **kwargs)


def __getattr__(name):
    if name == "Engine":
        from raydit.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'raydit' has no attribute {name!r}")
