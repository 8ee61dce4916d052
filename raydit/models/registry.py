"""The registry: model families found on disk, and adapters keyed by transformer class.

A family is one module or package in `raydit/models/families/` defining `FAMILY` (a
`raydit.models.family.Family`); nothing lists them: `families()` imports every module of
that package once. Everything else (loading, the runtime, the CLI, the planner's reading of
a pipeline directory) goes through the functions here, keyed by the pipeline class in
`model_index.json` or by the transformer's class.

`register_adapter` still maps extra transformer classes to an adapter class (for adapters
that live outside a family, e.g. in a user's code or a test).

Importing this module imports neither torch nor diffusers.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading

# transformer class name -> adapter class: filled from the families and by register_adapter.
_REGISTRY: dict[str, type] = {}
_FAMILIES: dict[str, object] = {}
_LOCK = threading.Lock()


def register_adapter(adapter_cls: type) -> type:
    """Class decorator: map each of `adapter_cls.transformer_classes` (classes or class
    names) to `adapter_cls`."""
    if not adapter_cls.transformer_classes:
        raise ValueError(f"{adapter_cls.__name__}.transformer_classes is empty; name the diffusers classes it adapts")
    for cls in adapter_cls.transformer_classes:
        key = cls if isinstance(cls, str) else cls.__name__
        owner = _REGISTRY.get(key)
        if owner is not None and owner is not adapter_cls and owner.__qualname__ != adapter_cls.__qualname__:
            raise ValueError(f"{key} already has adapter {owner.__name__}; cannot also register {adapter_cls.__name__}")
        _REGISTRY[key] = adapter_cls
    return adapter_cls


def families() -> dict[str, object]:
    """name -> Family, every module of raydit.models.families imported once."""
    if _FAMILIES:
        return dict(_FAMILIES)
    with _LOCK:
        if not _FAMILIES:
            from raydit.planner.registry import register_models, register_spec_reader

            package = importlib.import_module("raydit.models.families")

            found = {}
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
                module = importlib.import_module(f"{package.__name__}.{info.name}")
                family = getattr(module, "FAMILY", None)
                if family is None:
                    continue
                if family.name in found:
                    raise ValueError(f"two families are named {family.name!r}")
                found[family.name] = family
                if family.adapter is not None:
                    register_adapter(family.adapter)
                register_spec_reader(family.pipelines, _spec_reader(family))
                register_models(_with_decoder(family, spec) for spec in family.models())
            _FAMILIES.update(found)
    return dict(_FAMILIES)


def _with_decoder(family, spec):
    """The spec with its family's decoder, its blocks' elementwise bytes and launches, whether it
    batches the guidance branches, whether its FFN is gated and its attention masked, and its FP8 weight count
    (the planner prices the decode, the step's non-GEMM ops and fp8's weights with them), where
    the spec does not give its own."""
    import dataclasses

    if spec.decoder is None:
        spec = dataclasses.replace(spec, decoder=family.decoder_for(spec))
    if not spec.elementwise_bytes and family.elementwise_bytes:
        spec = dataclasses.replace(spec, elementwise_bytes=float(family.elementwise_bytes))
    if not spec.elementwise_launches and family.elementwise_launches:
        spec = dataclasses.replace(spec, elementwise_launches=int(family.elementwise_launches))
    if family.batch_branches and not spec.batched_branches:
        spec = dataclasses.replace(spec, batched_branches=True)
    if family.gated_ffn and not spec.gated_ffn:
        spec = dataclasses.replace(spec, gated_ffn=True)
    if family.masked_attention and not spec.masked_attention:
        spec = dataclasses.replace(spec, masked_attention=True)
    if not spec.fp8_params:
        # from the widths; never more than the parameters counted (a directory's weights)
        spec = dataclasses.replace(spec, fp8_params=min(float(family.fp8_weight_params(spec)), spec.params))
    return spec


def _spec_reader(family):
    def read(path, configs):
        return _with_decoder(family, family.spec_from_dir(path, configs))

    return read


def load_families() -> None:
    """Make every family known: its adapter, its built-in models and pipeline readers (the
    planner's lookups call this themselves: raydit/__init__.py makes it their model source)."""
    families()


def supported_pipelines() -> list[str]:
    return sorted(p for f in families().values() for p in f.pipelines)


def family_for_class(class_name: str):
    """The family serving the pipeline class `class_name` (model_index.json `_class_name`)."""
    for family in families().values():
        if class_name in family.pipelines:
            return family
    raise ValueError(
        f"raydit has no model family for {class_name or '(no _class_name)'}; supported pipelines: "
        f"{', '.join(supported_pipelines())}"
    )


def family_for_pipeline(pipe):
    """The family of a loaded diffusers pipeline (matched on its class and base classes)."""
    names = [cls.__name__ for cls in type(pipe).__mro__]
    for family in families().values():
        if any(n in family.pipelines for n in names):
            return family
    raise ValueError(
        f"raydit cannot run a {type(pipe).__name__}; load one of {', '.join(supported_pipelines())} "
        "with from_pretrained"
    )


def tiny_models() -> dict:
    """Built-in tiny pipelines of every family: name -> builder returning its directory."""
    out = {}
    for family in families().values():
        out.update(family.tiny())
    return out


def supported_transformers() -> list[str]:
    families()
    return sorted(_REGISTRY)


def get_adapter(transformer):
    """The adapter instance for this transformer (matched on its class and base classes)."""
    families()
    for cls in type(transformer).__mro__:
        if cls.__name__ in _REGISTRY:
            return _REGISTRY[cls.__name__]()
    raise ValueError(
        f"no raydit adapter for {type(transformer).__name__}; supported: {', '.join(supported_transformers())}"
    )


def parallelize(transformer, mesh, options: dict | None = None):
    """Make `transformer` sequence-parallel on `mesh`; returns a handle whose remove() undoes it.
    options: the plan's further choices for this model (its adapter's `options`)."""
    return get_adapter(transformer).parallelize(transformer, mesh, options)


def unparallelize(transformer) -> None:
    """Undo `parallelize`; a no-op on a transformer that is not parallelized."""
    from raydit.models.adapter import HANDLE_ATTR

    handle = getattr(transformer, HANDLE_ATTR, None)
    if handle is not None:
        handle.remove()
