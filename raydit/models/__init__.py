"""Model families: make diffusers video pipelines sequence-parallel without editing them.

    runner = Runner(pipe, mesh)                    # the family found from the pipeline's class
    handle = parallelize(pipe.transformer, mesh)   # adapter found from the transformer's class
    ...; handle.remove()                           # or unparallelize(pipe.transformer)

A family is one module or package in `raydit/models/families/` (see `raydit.models.family`). Importing
this package imports neither torch nor diffusers; the names below load on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DenoiseState": "raydit.models.family",
    "Family": "raydit.models.family",
    "GenerationRequest": "raydit.models.requests",
    "image_to_png": "raydit.models.requests",
    "Runner": "raydit.models.runner",
    "compile_blocks": "raydit.models.compile",
    "family_for_pipeline": "raydit.models.registry",
    "get_adapter": "raydit.models.registry",
    "parallelize": "raydit.models.registry",
    "register_adapter": "raydit.models.registry",
    "supported_pipelines": "raydit.models.registry",
    "supported_transformers": "raydit.models.registry",
    "tiny_models": "raydit.models.registry",
    "unparallelize": "raydit.models.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'raydit.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
