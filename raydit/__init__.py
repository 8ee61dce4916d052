"""raydit: elastic, sequence-parallel video diffusion inference on Ray.

`import raydit` stays cheap: the planner is pure Python; `raydit.Engine` (torch, Ray) is
imported only when first asked for.
"""

from raydit import planner as _planner
from raydit.planner import ClusterSpec, ModelSpec, NodeSpec, PlanError
from raydit.planner.registry import set_model_source as _set_model_source

__version__ = "0.1.0"

__all__ = ["ClusterSpec", "Engine", "ModelSpec", "NodeSpec", "PlanError", "model_spec", "plan"]


def _load_families() -> None:
    from raydit.models.registry import load_families

    load_families()


# The planner names no family: its built-in models and pipeline readers come from the model
# families, which this package (above both layers) makes its source. Every import of a raydit
# module runs this file first, so no lookup has to load the families beforehand; loading them
# imports neither torch nor diffusers.
_set_model_source(_load_families)


def model_spec(name_or_dir):
    """`raydit.planner.model_spec`, and a tiny built-in the planner's table does not list (a
    family's test variant) read from the directory its family writes (this one builds it,
    with torch)."""
    from raydit.models.registry import tiny_models

    if isinstance(name_or_dir, str) and name_or_dir not in _planner.BUILTIN_MODELS:
        build = tiny_models().get(name_or_dir)
        if build is not None:
            return _planner.model_spec(str(build()))
    return _planner.model_spec(name_or_dir)


def plan(model, *args, **kwargs):
    """`raydit.planner.plan` (see its docstring), with `model_spec`'s tiny variants."""
    return _planner.plan(model_spec(model), *args, **kwargs)


def __getattr__(name):
    if name == "Engine":
        from raydit.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'raydit' has no attribute {name!r}")
