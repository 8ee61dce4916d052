"""LoRA adapters: checked, loaded through diffusers' own loaders (peft), chosen per request.

A LoRA is what diffusers' `save_lora_weights` writes and what the LoRAs published for the
video models ship: a directory holding `pytorch_lora_weights.safetensors` (or exactly one
`.safetensors` file), or a single `.safetensors` file. Loading goes through the pipeline's
own `lora_state_dict` (which converts the non-diffusers formats diffusers knows, e.g. Wan's
original and musubi key names) and `load_lora_weights(state_dict, adapter_name=...)`, i.e.
peft's LoRA layers wrapped around the transformer's linear layers; nothing here re-implements
either. A family says how its pipeline loads one (`Family.load_lora`, e.g. Wan 2.2's second
expert through `load_into_transformer_2`).

Loaded adapters stay loaded and unfused; a request names the ones it uses with their scales
(`GenerationRequest.lora`), and `activate` makes exactly those active on every transformer
before the request's first step: `set_adapters(names, scales)` where the transformer holds
them, `disable_lora()` where it holds none. A disabled peft layer computes its base layer
alone, so a request without adapters after one with them gives the base model's numbers
exactly, with no reload.

An engine that serves one LoRA for every request can fuse it instead (`LoraSpec.fuse_scale`):
`load` then merges it into the transformer's weights at that scale (diffusers' `fuse_lora`) and
removes peft's layers (`unload_lora_weights`), so a step costs what the base model's does.
The pipeline remembers what it fused (`fused`); `activate` then accepts exactly that LoRA at
that scale and nothing else (no other LoRA, scale or base model: those weights are gone).

Checks are made before anything is loaded, so a bad file never leaves a half-loaded
adapter: the file must be a safetensors file of diffusers-format LoRA tensors
(`<module>.lora_A.weight` / `lora_B.weight`, prefixed by the component) whose every target
is a linear layer of the pipeline's transformer with matching shapes. `check_for_model` makes
the same check on the driver against the transformer built on the meta device from its
config (no weights read), so the CLI refuses a LoRA for another model before Ray starts.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' save_lora_weights default
TARGETS = ("transformer", "transformer_2", "both")  # which expert(s) a LoRA goes into
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.(?P<kind>weight|bias)$")


@dataclass(frozen=True)
class LoraSpec:
    """One adapter as the engine's table holds it (plain values, sent to every rank)."""

    name: str
    path: str  # the .safetensors file
    target: str = "transformer"  # "transformer", "transformer_2" (Wan 2.2's low-noise expert) or "both"
    fuse_scale: float | None = None  # set: merged into the weights at this scale (an engine's only LoRA)

    def components(self) -> tuple[str, ...]:
        return ("transformer", "transformer_2") if self.target == "both" else (self.target,)


def fuse_choice(fuse, table: Mapping[str, Any]) -> tuple[str, float] | None:
    """An engine's `fuse_lora` -> (name, scale) or None. `fuse`: None / False (unfused), True
    (the engine's one LoRA at 1.0), a name (scale 1.0) or {name: scale}. A fused engine holds
    that LoRA alone: ValueError naming the fix otherwise."""
    if fuse is None or fuse is False:
        return None
    if fuse is True:
        if len(table) != 1:
            raise ValueError(
                f"fuse_lora needs exactly one LoRA to fuse; {len(table)} are given"
                + (f" ({', '.join(sorted(table))})" if table else "")
                + ": give one --lora with --fuse-lora, or leave --fuse-lora out to switch adapters per request"
            )
        return next(iter(table)), 1.0
    choice = normalize_choice(fuse)
    if len(choice) != 1:
        raise ValueError(f"fuse_lora {fuse!r} must name one LoRA (a name or {{name: scale}})")
    name, scale = choice[0]
    if name not in table:
        raise ValueError(f"fuse_lora names {name!r}, which is not among the engine's LoRAs "
                         f"({', '.join(sorted(table)) or 'none'}); give it in loras= / --lora")
    if len(table) != 1:
        raise ValueError(
            f"fuse_lora {name!r}: an engine that fuses a LoRA holds that LoRA alone, but {len(table)} are given "
            f"({', '.join(sorted(table))}); leave fuse_lora out to switch adapters per request"
        )
    return name, scale


def adapter_bytes(spec: LoraSpec) -> int:
    """Bytes the LoRA occupies on a rank as loaded and unfused: its tensors' stored size (read
    from the safetensors header, no tensor read) once per transformer it goes into; 0 when
    fused (merged into weights the rank holds anyway)."""
    import json
    import struct

    if spec.fuse_scale is not None:
        return 0
    with open(lora_file(spec.path), "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    size = sum(int(t["data_offsets"][1]) - int(t["data_offsets"][0])
               for key, t in header.items() if key != "__metadata__")
    return size * len(spec.components())


# -- names, scales and a request's choice ------------------------------------------------------
def check_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"LoRA name {name!r} is not valid; use 1 to 64 letters, digits, '_', '-' or '.', starting "
            "with a letter or digit"
        )
    return name


def check_scale(scale, name: str = "") -> float:
    what = f"LoRA scale for {name!r}" if name else "LoRA scale"
    if isinstance(scale, str):
        try:
            scale = float(scale)
        except ValueError:
            raise ValueError(f"{what} {scale!r} is not a number; give a number >= 0 (1.0 is the LoRA as trained)") from None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"{what} {scale!r} must be a finite number >= 0 (1.0 is the LoRA as trained)")
    return float(scale)


def normalize_choice(lora) -> tuple[tuple[str, float], ...]:
    """What a request says about adapters -> ((name, scale), ...), in the order given.

    None or {} -> () (the base model); "name" -> ((name, 1.0),); {name: scale, ...};
    a sequence of names or of (name, scale) pairs (a checkpoint's JSON form)."""
    if lora is None:
        return ()
    if isinstance(lora, str):
        return ((check_name(lora), 1.0),)
    if isinstance(lora, Mapping):
        items = list(lora.items())
    elif isinstance(lora, (list, tuple)):
        items = []
        for entry in lora:
            if isinstance(entry, str):
                items.append((entry, 1.0))
            elif isinstance(entry, (list, tuple)) and len(entry) == 2:
                items.append((entry[0], entry[1]))
            else:
                raise ValueError(f"lora entry {entry!r} must be a name or a (name, scale) pair")
    else:
        raise ValueError(f"lora {lora!r} must be None, a name, or {{name: scale}}")
    out, seen = [], set()
    for name, scale in items:
        check_name(name)
        if name in seen:
            raise ValueError(f"LoRA {name!r} is named twice in one request; give it once with its scale")
        seen.add(name)
        out.append((name, check_scale(scale, name)))
    return tuple(out)


def default_name(path) -> str:
    """A name for a LoRA from its path: the directory's name, or the file's stem when the file
    has its own name (not diffusers' default `pytorch_lora_weights`)."""
    p = Path(str(path)).expanduser()
    if p.is_dir() or p.suffix != ".safetensors":
        stem = p.name
    elif p.stem == Path(WEIGHT_NAME).stem:
        stem = p.parent.name
    else:
        stem = p.stem
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", stem).lstrip("-_.")[:64]
    return name or "lora"


# -- the file ----------------------------------------------------------------------------------
def lora_file(path) -> Path:
    """The safetensors file of a LoRA given as a file or a directory; ValueError otherwise."""
    p = Path(str(path)).expanduser()
    if p.is_dir():
        if (p / WEIGHT_NAME).is_file():
            return (p / WEIGHT_NAME).resolve()
        found = sorted(p.glob("*.safetensors"))
        if len(found) == 1:
            return found[0].resolve()
        if not found:
            raise ValueError(
                f"LoRA directory {str(path)!r} holds no .safetensors file; give a directory written by "
                f"save_lora_weights (with {WEIGHT_NAME}) or the .safetensors file itself"
            )
        raise ValueError(
            f"LoRA directory {str(path)!r} holds {len(found)} .safetensors files and no {WEIGHT_NAME}; "
            "give the file to load"
        )
    if not p.exists():
        raise ValueError(f"LoRA {str(path)!r} does not exist; give a .safetensors file or a directory holding one")
    if p.suffix != ".safetensors":
        raise ValueError(f"LoRA {str(path)!r} is not a .safetensors file; raydit loads diffusers-format LoRAs in safetensors")
    return p.resolve()


def read_state_dict(pipeline_cls, path) -> dict:
    """The LoRA's tensors through the pipeline class's own `lora_state_dict` (which converts
    the other formats diffusers knows for that model: Wan's original and musubi names, Kijai's
    and diffusion-pipe's `lora_A` / `lora_B` repacks); ValueError for a file that is not one, or
    in a format none of its converters knows. The raw tensors the conversion leaves out are named
    in one logged line (`_name_dropped_keys`)."""
    file = lora_file(path)
    try:
        from safetensors.torch import load_file

        raw = load_file(str(file))
    except Exception as exc:  # noqa: BLE001 - any parse failure means "not a safetensors file"
        raise ValueError(f"LoRA {str(file)!r} is not a readable safetensors file ({type(exc).__name__})") from None
    first = ", ".join(sorted(raw)[:4])
    if not any(("lora" in k.lower()) for k in raw):
        raise ValueError(
            f"{str(file)!r} is not a LoRA: none of its {len(raw)} tensors is a LoRA weight (lora_A / lora_B / "
            f"lora_down / lora_up; its first keys: {first}); give a LoRA file of this model"
        )
    if not hasattr(pipeline_cls, "lora_state_dict"):
        raise ValueError(f"{pipeline_cls.__name__} does not take LoRAs in diffusers")
    unknown = f"LoRA {str(file)!r} is in a format {pipeline_cls.__name__}'s converters do not know (its first keys: {first})"
    try:
        # A copy: a converter may pop from the dict it is given, and `raw` is compared below.
        state_dict = pipeline_cls.lora_state_dict(dict(raw))
    except Exception as exc:  # noqa: BLE001 - diffusers' own conversion failed on these keys
        raise ValueError(f"{unknown}: {(str(exc).splitlines() or [type(exc).__name__])[0][:160]}") from None
    if isinstance(state_dict, tuple):  # some pipelines return (state_dict, network_alphas)
        state_dict = state_dict[0]
    state_dict = dict(state_dict)
    # Keys no converter matched come back as they were (Wan's names without `diffusion_model.`,
    # DiffSynth's `.lora_A.default.weight`); load_lora_weights would load none of them.
    components = tuple(getattr(pipeline_cls, "_lora_loadable_modules", ("transformer",)))
    if not any(k.split(".", 1)[0] in components for k in state_dict):
        raise ValueError(f"{unknown}; diffusers' format prefixes each key with the component ({', '.join(components)})")
    _name_dropped_keys(file, raw, state_dict)
    _complete_lora_biases(state_dict)
    return state_dict


def _complete_lora_biases(state_dict: dict) -> None:
    """A zero `lora_B.bias` for every LoRA layer without one, in a file that gives bias
    differences (Wan's `.diff_b`) on some layers only (Kijai's repacks: the FFN, CausVid's
    `time_projection`, the head). diffusers makes the whole adapter with peft's `lora_bias`, and
    under load_lora_weights' default `low_cpu_mem_usage` the layers the file gives no bias keep
    an empty one on the meta device, which the first step fails on. Zero is what peft's own
    initialisation gives them (load_lora_weights with low_cpu_mem_usage=False) and what the
    authors' runtimes do: no bias difference where the file has none."""
    if not any(k.endswith(".lora_B.bias") for k in state_dict):
        return
    for key in [k for k in state_dict if k.endswith(".lora_B.weight")]:
        bias = key.removesuffix("weight") + "bias"
        if bias not in state_dict:
            state_dict[bias] = state_dict[key].new_zeros(state_dict[key].shape[0])


# A LoRA factor or its alpha: converters rescale these into new tensors (alpha / rank), so they
# cannot be followed by identity; every other tensor a converter keeps, it keeps as it is.
_FACTOR = re.compile(r"\.(lora_(?:down|up|A|B)(?:\.|$)|alpha$)")


def _name_dropped_keys(file, raw: Mapping, converted: Mapping) -> None:
    """The file's tensors diffusers' converter leaves out, named in one logged line (how many
    of them are non-zero too): for Wan's original names a norm's `.diff` / `.diff_b`, a block's
    modulation `diff_m`, a full `.diff` on any layer but the head, AccVideo's `time_projection`
    `.diff_b` without its LoRA. Found by identity: a kept `.diff_b` (a LoRA bias) or the head's
    `.diff` is the file's tensor itself in the converted dict, a dropped one is in none of it.

    raydit loads a LoRA exactly as load_lora_weights does, so one worker equals diffusers; the
    authors' runtimes add such a key to the weight (weight += scale * diff), which diffusers (and
    so raydit) does not: the line says so instead of dropping them silently. The norm `.diff`
    keys of the published files are zeros, so there it changes nothing."""
    kept = {id(v) for v in converted.values()}
    dropped = sorted(k for k, v in raw.items() if not _FACTOR.search(k) and id(v) not in kept)
    if not dropped:
        return
    import logging

    nonzero = [k for k in dropped if bool(raw[k].ne(0).any())]
    shown = ", ".join(dropped[:4]) + (f" and {len(dropped) - 4} more" if len(dropped) > 4 else "")
    logging.getLogger(__name__).warning(
        "LoRA %s: %d keys (%d non-zero) are not applied, as diffusers' load_lora_weights drops them: %s",
        file.name, len(dropped), len(nonzero), shown)


def check_state_dict(state_dict: Mapping, transformers: Mapping[str, Any], where: str) -> None:
    """Every tensor must belong to a transformer component and be a LoRA factor of one of its
    linear layers with the layer's shape; ValueError naming every module the model lacks, else the
    first tensor that does not fit.

    `transformers`: component name -> module (a real transformer, or one on the meta device)."""
    import torch

    prefixes = sorted({k.split(".", 1)[0] for k in state_dict})
    if "transformer" not in prefixes:
        raise ValueError(
            f"LoRA {where} has no weights for the transformer (its tensors are for {', '.join(prefixes) or 'nothing'}); "
            "it is not a LoRA for this model"
        )
    module = transformers["transformer"]
    modules = dict(module.named_modules())
    # Every target the model lacks is named at once (not only the first): a user sees the whole
    # mismatch in one line.
    absent = sorted({m["module"] for k in state_dict if k.startswith("transformer.")
                     for m in [_KEY.match(k.partition(".")[2])] if m is not None and m["module"] not in modules})
    if absent:
        shown = ", ".join(repr(a) for a in absent[:8]) + (f" and {len(absent) - 8} more" if len(absent) > 8 else "")
        raise ValueError(
            f"LoRA {where} targets {len(absent)} module{'s' if len(absent) > 1 else ''} this "
            f"{type(module).__name__} does not have ({shown}); it is a LoRA for another model"
        )
    for key, tensor in state_dict.items():
        prefix, _, inner = key.partition(".")
        if prefix != "transformer":
            raise ValueError(f"LoRA {where}: tensor {key!r} is for {prefix!r}; raydit loads LoRAs into the transformer only")
        m = _KEY.match(inner)
        if m is None:
            raise ValueError(f"LoRA {where}: tensor {key!r} is not a diffusers LoRA weight (<module>.lora_A.weight)")
        target = modules.get(m["module"])
        if target is None:
            raise ValueError(
                f"LoRA {where} targets {m['module']!r}, which this {type(module).__name__} does not have; "
                "it is a LoRA for another model"
            )
        base = getattr(target, "base_layer", target)
        if not isinstance(base, torch.nn.Linear):
            raise ValueError(f"LoRA {where} targets {m['module']!r}, a {type(base).__name__}; raydit loads LoRAs of linear layers")
        if m["kind"] == "bias":
            ok = m["part"] == "lora_B" and tuple(tensor.shape) == (base.out_features,)
        elif m["part"] == "lora_A":
            ok = tensor.ndim == 2 and tensor.shape[1] == base.in_features
        else:
            ok = tensor.ndim == 2 and tensor.shape[0] == base.out_features
        if not ok:
            raise ValueError(
                f"LoRA {where}: {key} has shape {tuple(tensor.shape)}, which does not fit {m['module']} "
                f"({base.in_features} -> {base.out_features}); it is a LoRA for another model size"
            )


def check_for_model(model_dir, spec: LoraSpec) -> None:
    """Check a LoRA against a pipeline directory without loading its weights: the transformer(s)
    are built on the meta device from their config.json (what the driver does before Ray)."""
    import json

    import diffusers
    import torch

    model_dir = Path(model_dir)
    index = json.loads((model_dir / "model_index.json").read_text())
    pipeline_cls = getattr(diffusers, str(index.get("_class_name", "")), None)
    if pipeline_cls is None:
        raise ValueError(f"{model_dir}: pipeline class {index.get('_class_name')!r} is not in diffusers")
    state_dict = read_state_dict(pipeline_cls, spec.path)
    built = {}
    for component in spec.components():
        entry = index.get(component)
        if not isinstance(entry, list) or entry[1] is None:
            raise ValueError(
                f"LoRA {spec.name!r} goes into {component!r}, which {model_dir.name} does not have"
                + ("; only Wan 2.2 A14B pipelines have a second expert" if component == "transformer_2" else "")
            )
        cls = getattr(diffusers, entry[1])
        with torch.device("meta"):
            built[component] = cls.from_config(cls.load_config(str(model_dir / component)))
    for component, module in built.items():
        check_state_dict(state_dict, {"transformer": module}, f"{spec.name!r} ({component})")


# -- on a loaded pipeline ----------------------------------------------------------------------
def loaded(pipe) -> dict[str, list[str]]:
    """component -> names of the adapters it holds (diffusers' get_list_adapters)."""
    try:
        return {k: list(v) for k, v in pipe.get_list_adapters().items()}
    except (AttributeError, ValueError):
        return {}


def _components(pipe, spec: LoraSpec) -> dict[str, Any]:
    out = {}
    for component in spec.components():
        module = getattr(pipe, component, None)
        if module is None:
            raise ValueError(
                f"LoRA {spec.name!r} goes into {component!r}, which this {type(pipe).__name__} does not have"
                + ("; only Wan 2.2 A14B pipelines have a second expert" if component == "transformer_2" else "")
            )
        out[component] = module
    return out


def load(pipe, family, spec: LoraSpec) -> None:
    """Load `spec` into the pipeline under its name, through the family's `load_lora` (diffusers'
    load_lora_weights). Checked first; on any failure nothing of it stays loaded."""
    check_name(spec.name)
    if spec.target not in TARGETS:
        raise ValueError(f"LoRA target {spec.target!r} is not one of {', '.join(TARGETS)}")
    have = {n for names in loaded(pipe).values() for n in names}
    if spec.name in have:
        raise ValueError(f"a LoRA named {spec.name!r} is already loaded; unload it first or choose another name")
    from raydit.models.quantize import quantized

    done = [quantized(t) for t in family.transformers(pipe) if quantized(t) is not None]
    if done:
        # Fused into FP8-rounded weights it would not be rounded itself; switched, refused (quantize_options).
        raise ValueError(f"LoRA {spec.name!r} cannot be loaded into weights quantized {done[0].mode} already; "
                         "load (and fuse) it before the pipeline is quantized")
    state_dict = read_state_dict(type(pipe), spec.path)
    components = _components(pipe, spec)
    for component, module in components.items():
        check_state_dict(state_dict, {"transformer": module}, f"{spec.name!r} ({component})")
    try:
        with _quiet_peft_keys():
            family.load_lora(pipe, state_dict, spec.name, components=tuple(components))
        missing = [c for c in components if spec.name not in loaded(pipe).get(c, [])]
        if missing:
            raise ValueError(f"LoRA {spec.name!r} matched no layer of {', '.join(missing)}; it is a LoRA for another model")
    except Exception as exc:
        unload(pipe, spec.name)
        if isinstance(exc, ValueError):
            raise
        raise ValueError(f"LoRA {spec.name!r} could not be loaded: {str(exc).splitlines()[0][:200]}") from None
    if spec.fuse_scale is not None:
        _fuse(pipe, spec, tuple(components))


def _fuse(pipe, spec: LoraSpec, components: tuple[str, ...]) -> None:
    """Merge the just-loaded adapter into `components`' weights at `spec.fuse_scale` and drop
    peft's layers: W <- W + scale * (alpha / r) * B @ A on every targeted linear layer."""
    if fused(pipe):
        raise ValueError(f"LoRA {spec.name!r} cannot be fused: {', '.join(fused(pipe))} is fused already")
    others = {n for names in loaded(pipe).values() for n in names} - {spec.name}
    if others:
        raise ValueError(f"LoRA {spec.name!r} cannot be fused while {', '.join(sorted(others))} is loaded unfused; "
                         "an engine that fuses a LoRA holds that LoRA alone")
    scale = check_scale(spec.fuse_scale, spec.name)
    for component in components:
        # The adapter at weight 1.0 (scaling alpha / r); fuse_lora multiplies by lora_scale.
        getattr(pipe, component).set_adapters([spec.name], [1.0])
    pipe.fuse_lora(components=list(components), lora_scale=scale, adapter_names=[spec.name])
    pipe.unload_lora_weights()
    pipe.__dict__["_raydit_fused"] = {spec.name: scale}


def fused(pipe) -> dict[str, float]:
    """The LoRA merged into this pipeline's weights by `load` (name -> scale), or {}."""
    return dict(pipe.__dict__.get("_raydit_fused", {}))


@contextlib.contextmanager
def _quiet_peft_keys():
    """diffusers 0.42 with peft 0.21 warns of "missing keys" naming the very LoRA tensors it
    has just loaded (checked: the layers hold the file's values); every key was matched to a
    layer by `check_state_dict` before loading, so the warning says nothing here."""
    import diffusers

    level = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers.utils.logging.set_verbosity(level)


def unload(pipe, name: str) -> None:
    """Delete the adapter `name` from every component that holds it (no-op where none does),
    including layers a failed load left half-made."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if name in fused(pipe):
        raise ValueError(f"LoRA {name!r} is fused into the weights and cannot be unloaded; "
                         "restart without fusing it to switch adapters")
    for component in ("transformer", "transformer_2"):
        module = getattr(pipe, component, None)
        if module is None:
            continue
        if name in getattr(module, "peft_config", {}):
            module.delete_adapters([name])
        for layer in module.modules():
            if isinstance(layer, BaseTunerLayer) and name in getattr(layer, "lora_A", {}):
                layer.delete_adapter(name)


def activate(pipe, transformers: Iterable, choice: tuple[tuple[str, float], ...]) -> None:
    """Make exactly the adapters of `choice` active, with their scales, on every transformer:
    the ones a transformer holds get `set_adapters(names, scales)` + `enable_lora()`; a
    transformer holding none of them gets `disable_lora()` (its base layers alone). A pipeline
    with a fused LoRA takes exactly that LoRA at its fused scale."""
    merged = fused(pipe)
    if merged:
        if dict(choice) != merged:
            (name, scale), = merged.items()
            raise ValueError(
                f"LoRA {name!r} is fused into this engine's weights at scale {scale:g}; a request can only "
                f"use it at that scale (asked: {dict(choice) or 'the base model'})"
            )
        return
    have = {n for names in loaded(pipe).values() for n in names}
    unknown = [n for n, _ in choice if n not in have]
    if unknown:
        raise ValueError(
            f"LoRA {unknown[0]!r} is not loaded on this rank; loaded: {', '.join(sorted(have)) or 'none'}"
        )
    for transformer in transformers:
        config = getattr(transformer, "peft_config", None)
        if not config:
            continue  # never held an adapter: nothing to switch
        mine = [(n, s) for n, s in choice if n in config]
        if mine:
            transformer.set_adapters([n for n, _ in mine], [s for _, s in mine])
            transformer.enable_lora()
        else:
            transformer.disable_lora()

