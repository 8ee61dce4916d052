"""The models the planner knows: the built-in ones, each declared by its family (register_models),
and the readers of local diffusers pipeline directories, one per pipeline class
(register_spec_reader). `model_spec(name_or_dir)` finds a ModelSpec by either. The planner lists
no model and no reader itself: `set_model_source` names who makes them known.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from raydit.planner.model import ModelSpec
from raydit.planner.pipeline_dir import read_pipeline_configs


# name -> ModelSpec: the built-in models, each declared by its family (register_models); the
# planner lists none itself. `set_model_source` names who makes them known (the package that
# loads the families, raydit/__init__.py): it is called once, at the first lookup, so no caller
# has to load the families before asking for a model.
_BUILTINS: dict[str, ModelSpec] = {}
_SOURCES: list[Callable[[], None]] = []
_LOADED = False


def register_models(specs) -> None:
    """Make `specs` (ModelSpecs) built-in models, looked up by name (case-insensitive)."""
    for spec in specs:
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"a built-in model must be a ModelSpec, got {type(spec).__name__}")
        owner = _BUILTINS.get(spec.name)
        if owner is not None and owner != spec:
            raise ValueError(f"built-in model {spec.name!r} is declared twice, differently ({owner.family}, "
                             f"{spec.family}); give one of them another name")
        _BUILTINS[spec.name] = spec


def set_model_source(load: Callable[[], None]) -> None:
    """`load()` registers the built-in models and pipeline readers (register_models,
    register_spec_reader); it runs once, before the first lookup that needs them."""
    if load not in _SOURCES:
        _SOURCES.append(load)


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True  # set first: a source that looks a model up while loading sees what is there
    for load in list(_SOURCES):
        load()


class _BuiltinModels(Mapping):
    """The built-in models, read-only; reading it loads their sources first."""

    def __getitem__(self, name: str) -> ModelSpec:
        _load()
        return _BUILTINS[name]

    def __iter__(self):
        _load()
        return iter(dict(_BUILTINS))

    def __len__(self) -> int:
        _load()
        return len(_BUILTINS)

    def __repr__(self) -> str:
        return f"BUILTIN_MODELS({', '.join(self)})"


BUILTIN_MODELS: Mapping[str, ModelSpec] = _BuiltinModels()


def model_spec(name_or_dir) -> ModelSpec:
    """A ModelSpec from a built-in name or a local diffusers pipeline directory."""
    if isinstance(name_or_dir, ModelSpec):
        return name_or_dir
    key = str(name_or_dir)
    for name, spec in BUILTIN_MODELS.items():
        if name.lower() == key.lower():
            return spec
    path = Path(key).expanduser()
    if path.is_dir():
        return _spec_from_dir(path)
    if path.exists():
        raise ValueError(f"model {key!r} is a file; give a built-in name or a diffusers pipeline directory")
    raise ValueError(
        f"unknown model {key!r}; built-in: {', '.join(BUILTIN_MODELS)}, or a local diffusers "
        "pipeline directory (with model_index.json and transformer/config.json)"
    )


# Pipeline class (model_index.json `_class_name`) -> reader(path, configs) -> ModelSpec.
# Filled by the model families (through the model source); the planner names none.
_SPEC_READERS: dict[str, Callable] = {}


def register_spec_reader(pipelines, reader: Callable) -> None:
    """Read directories holding any of `pipelines` with `reader(path, configs)`."""
    for name in pipelines:
        _SPEC_READERS[name] = reader


def _spec_from_dir(path: Path) -> ModelSpec:
    if not (path / "model_index.json").is_file():
        raise ValueError(
            f"model directory {str(path)!r} is not a diffusers pipeline (no model_index.json); give a "
            "directory saved with save_pretrained, or a built-in name"
        )
    configs = read_pipeline_configs(path)
    class_name = str(configs[""].get("_class_name", ""))
    _load()
    reader = _SPEC_READERS.get(class_name)
    if reader is None:
        if not _SPEC_READERS:
            raise ValueError(
                "pipeline directories are read through raydit's model families, and none is known: "
                "import raydit (it makes them known) before raydit.planner"
            )
        raise ValueError(
            f"model directory {str(path)!r} holds a {class_name or '(no _class_name)'}; raydit plans "
            f"{', '.join(sorted(_SPEC_READERS))}"
        )
    if "transformer" not in configs:
        raise ValueError(
            f"model directory {str(path)!r} has no transformer/config.json; give a diffusers "
            "pipeline directory (saved with save_pretrained) or a built-in name"
        )
    return reader(path, configs)
