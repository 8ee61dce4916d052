"""Registry from diffusers transformer classes to raydit model adapters.

A new model family is one new module defining a `ModelAdapter` subclass decorated with
`@register_adapter`, imported in `_ADAPTER_MODULES`, plus the shared conformance tests.
"""

from __future__ import annotations

import importlib

from torch import nn

# Modules whose import registers their adapters; imported lazily by get_adapter.
_ADAPTER_MODULES = ("raydit.models.cogvideox",)

# transformer class -> adapter class. Filled by @register_adapter at import time.
_REGISTRY: dict[type, type] = {}


def register_adapter(adapter_cls: type) -> type:
    """Class decorator: map each of `adapter_cls.transformer_classes` to `adapter_cls`."""
    if not adapter_cls.transformer_classes:
        raise ValueError(f"{adapter_cls.__name__}.transformer_classes is empty; name the diffusers classes it adapts")
    for cls in adapter_cls.transformer_classes:
        owner = _REGISTRY.get(cls)
        if owner is not None and owner is not adapter_cls and owner.__qualname__ != adapter_cls.__qualname__:
            raise ValueError(f"{cls.__name__} already has adapter {owner.__name__}; cannot also register {adapter_cls.__name__}")
        _REGISTRY[cls] = adapter_cls
    return adapter_cls


def _load_builtin_adapters() -> None:
    for module in _ADAPTER_MODULES:
        importlib.import_module(module)


def supported_transformers() -> list[str]:
    _load_builtin_adapters()
    return sorted(cls.__name__ for cls in _REGISTRY)


def get_adapter(transformer: nn.Module):
    """The adapter instance for this transformer (matched on its class and base classes)."""
    _load_builtin_adapters()
    for cls in type(transformer).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]()
    raise ValueError(
        f"no raydit adapter for {type(transformer).__name__}; supported: {', '.join(supported_transformers())}"
    )


def parallelize(transformer: nn.Module, mesh):
    """Make `transformer` sequence-parallel on `mesh`; returns a handle whose remove() undoes it."""
    return get_adapter(transformer).parallelize(transformer, mesh)


def unparallelize(transformer: nn.Module) -> None:
    """Undo `parallelize`; a no-op on a transformer that is not parallelized."""
    from raydit.models.adapter import HANDLE_ATTR

    handle = getattr(transformer, HANDLE_ATTR, None)
    if handle is not None:
        handle.remove()
