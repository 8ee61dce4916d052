"""Reading a local diffusers pipeline directory without loading it: the components' configs
(`read_pipeline_configs`), parameter counts from safetensors headers (`component_params`), and
the helpers a family's spec reader uses to turn its transformer config into a ModelSpec.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _safetensors_bytes(folder: Path) -> float | None:
    """Total tensor bytes of a diffusers component folder, from safetensors headers only."""
    if not folder.is_dir():
        return None
    for index in folder.glob("*.safetensors.index.json"):
        total = _read_json(index).get("metadata", {}).get("total_size")
        if isinstance(total, (int, float)) and total > 0:
            return float(total)
    total = 0
    for f in folder.glob("*.safetensors"):
        tensors = _safetensors_tensors(f)
        if tensors is None:
            return None
        for info in tensors.values():
            begin, end = info["data_offsets"]
            total += end - begin
    return float(total) if total else None


def _safetensors_tensors(path: Path) -> dict | None:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets), read from its
    header alone (8 bytes of length, then JSON); None where the file cannot be read as one."""
    try:
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error):
        return None
    return {key: info for key, info in header.items() if key != "__metadata__"}


def _dtype_bytes(folder: Path) -> int:
    """Bytes per parameter of the stored weights (to turn stored bytes into a count)."""
    for f in folder.glob("*.safetensors"):
        tensors = _safetensors_tensors(f)
        if tensors is None:
            break
        for info in tensors.values():
            return {"F32": 4, "F16": 2, "BF16": 2}.get(info.get("dtype"), 2)
    return 2


def _param_count(folder: Path) -> float | None:
    stored = _safetensors_bytes(folder)
    return None if stored is None else stored / _dtype_bytes(folder)


def _t5_estimate(config: dict) -> float:
    d, ff, n = config.get("d_model", 4096), config.get("d_ff", 10240), config.get("num_layers", 24)
    vocab = config.get("vocab_size", 32128)
    return float(vocab * d + n * (4 * d * d + 3 * d * ff))


# Component folders whose config a reader may need; `configs[""]` is model_index.json.
_COMPONENT_CONFIGS = {
    "transformer": "config.json", "transformer_2": "config.json", "vae": "config.json",
    "text_encoder": "config.json", "image_encoder": "config.json", "audio_vae": "config.json",
    "tokenizer": "tokenizer_config.json", "scheduler": "scheduler_config.json",
}


def read_pipeline_configs(path: Path) -> dict[str, dict]:
    """{component: parsed config} of a diffusers pipeline directory ("" = model_index.json)."""
    configs = {"": _read_json(path / "model_index.json")}
    for component, filename in _COMPONENT_CONFIGS.items():
        f = path / component / filename
        if f.is_file():
            configs[component] = _read_json(f)
    return configs


def component_params(folder: Path) -> float | None:
    """Parameter count of a component folder from its safetensors headers (no weights read)."""
    return _param_count(folder)


def t5_encoder_params(path: Path, configs: Mapping[str, dict]) -> float:
    """Parameters of a pipeline directory's T5-style text encoder: from its weights' headers, else
    estimated from its config, else 0 (no text encoder)."""
    counted = component_params(path / "text_encoder")
    if counted is not None:
        return counted
    return _t5_estimate(configs["text_encoder"]) if "text_encoder" in configs else 0.0


def require(config: dict, key: str, where: str):
    """config[key], or a one-line ValueError naming the file and the key."""
    if key not in config:
        raise ValueError(f"{where}: missing {key!r}")
    return config[key]


def transformer_config(path: Path, configs: Mapping[str, dict], supported, pipeline: str,
                       component: str = "transformer") -> tuple[dict, str]:
    """(config, where it was read) of a pipeline directory's transformer, read by a family's
    spec reader; a transformer class `supported` does not take (a class name, or a function of
    it) is refused in one line naming the file and `pipeline` ("a Wan pipeline")."""
    cfg = dict(configs.get(component, {}))
    where = str(path / component / "config.json")
    cls = str(cfg.get("_class_name", ""))
    if not (supported(cls) if callable(supported) else cls == supported):
        raise ValueError(f"{where}: transformer class {cls or '(none)'!r} is not supported by {pipeline}")
    return cfg, where


def attention_shape(config: dict, where: str) -> tuple[int, int]:
    """(heads, head dim) of a transformer config with num_attention_heads and attention_head_dim."""
    return int(require(config, "num_attention_heads", where)), int(require(config, "attention_head_dim", where))

