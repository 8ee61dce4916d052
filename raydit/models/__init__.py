"""Model adapters: make diffusers transformers sequence-parallel without editing them.

    handle = parallelize(pipe.transformer, mesh)   # adapter found by get_adapter
    ...; handle.remove()                           # or unparallelize(pipe.transformer)

diffusers itself is imported only when an adapter, the tiny pipeline or a runner needs it.
"""

from raydit.models.registry import get_adapter, parallelize, register_adapter, supported_transformers, unparallelize
from raydit.models.runner import CogVideoXRunner, DenoiseState, GenerationRequest
from raydit.models.tiny import build_tiny_pipeline, load_tiny_pipeline, tiny_pipeline_dir

__all__ = [
    "CogVideoXRunner",
    "DenoiseState",
    "GenerationRequest",
    "build_tiny_pipeline",
    "get_adapter",
    "load_tiny_pipeline",
    "parallelize",
    "register_adapter",
    "supported_transformers",
    "tiny_pipeline_dir",
    "unparallelize",
]
