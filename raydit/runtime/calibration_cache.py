"""The calibration cache, and how its entries become the planner's device types.

What an entry holds is measured by raydit.runtime.measure on a node of the type, through
raydit.runtime.calibrate (`raydit doctor --calibrate`).

How the figures replace the table's (`calibrated_device_type`):
  tflops <- the measured matmul rate (or the DiT block's faster part, if one outran it);
  efficiency <- the DiT block's linear part over tflops, attention_efficiency <- the
      attention kernel's rate over tflops, per head dim: the planner then predicts each part
      at its measured rate. An entry without the DiT figures (measured before they existed)
      keeps the table's `efficiency`;
  link_gb_s <- all-to-all bandwidth; link_latency_us <- tiny all-to-all latency;
  memory_gb <- the device's total memory (GPUs);
  model_rates <- each calibrated model's rates (used for that model only: DeviceType.rates_for).
Cache: JSON at `$RAYDIT_CACHE/calibration.json` (default `~/.cache/raydit/`), keyed by
device type name (the table's name, e.g. `A100-80GB`, or Ray's name for unknown types).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

from raydit.planner import DeviceType
from raydit.runtime.measure import CUDA_ATTENTION_TOKENS

CACHE_VERSION = 1


def cache_path() -> Path:
    """`$RAYDIT_CACHE/calibration.json`, else `~/.cache/raydit/calibration.json`."""
    root = os.environ.get("RAYDIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "raydit")
    return Path(root) / "calibration.json"


def load_calibration(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """Device type name -> measured entry; {} when there is no cache. A cache that does not
    parse is reported (ValueError names the file and the fix), not silently dropped."""
    p = Path(path) if path is not None else cache_path()
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration cache {str(p)!r} is unreadable ({exc}); "
                         "delete it to measure again") from None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or \
            not isinstance(data.get("devices"), dict):
        raise ValueError(f"calibration cache {str(p)!r} is not version {CACHE_VERSION} raydit calibration; "
                         "delete it to measure again")
    return dict(data["devices"])


def save_calibration(entries: dict[str, dict], path: str | os.PathLike | None = None) -> Path:
    """Write entries (merged over what the file holds) atomically; returns the path."""
    p = Path(path) if path is not None else cache_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    merged = load_calibration(p)
    for name, entry in entries.items():
        # A device measured again keeps the models calibrated on it (their rates are the
        # models' own, not the device's figures), unless the new entry brings them.
        old_models = (merged.get(name) or {}).get("models") or {}
        if old_models:
            entry = dict(entry, models={**old_models, **(entry.get("models") or {})})
        merged[name] = entry
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"version": CACHE_VERSION, "devices": merged}, indent=1, sort_keys=True))
    os.replace(tmp, p)
    return p


def apply_entry(base: DeviceType, entry: dict) -> DeviceType:
    """`base` with the measured fields of a cache entry (module docstring: which, and why).
    Where the type has a priced op table (raydit.planner.devicemodel) the table still prices
    the step: the entry's compute figures then price the decode and the text encoding only (and
    `entry_problem` refuses an entry more than 2x from the table); a model's own rates
    (`models`) still take that model's step."""
    m = entry.get("measured", {})
    fields = {}
    if _positive(m.get("matmul_tflops")):
        fields["tflops"] = float(m["matmul_tflops"])
        attn = _rates_by_dim(m.get("attention_tflops_by_head_dim"))
        plain = _rates_by_dim(m.get("attention_plain_tflops_by_head_dim"))
        if _positive(m.get("dit_linear_tflops")):
            # The DiT block's parts as fractions of the fastest measured rate (a block's large
            # GEMMs can outrun the square matmuls), so that each part's rate is the measured one.
            linear = float(m["dit_linear_tflops"])
            top = fields["tflops"] = max(fields["tflops"], linear, *attn.values(), *plain.values())
            fields["efficiency"] = linear / top
            if attn:
                fields["attention_efficiency"] = tuple(sorted((d, r / top) for d, r in attn.items()))
            if plain:
                fields["plain_attention_efficiency"] = tuple(sorted((d, r / top) for d, r in plain.items()))
    if _positive(m.get("all_to_all_gb_s")):
        fields["link_gb_s"] = float(m["all_to_all_gb_s"])
    if _positive(m.get("latency_us")):
        fields["link_latency_us"] = float(m["latency_us"])
    if _positive(m.get("memory_gb")):
        fields["memory_gb"] = float(m["memory_gb"])
    models = [(key, e["linear_tflops"], e["lse_attention_tflops"], e["plain_attention_tflops"])
              for key, e in sorted((entry.get("models") or {}).items())
              if all(_positive(e.get(k)) for k in ("linear_tflops", "lse_attention_tflops", "plain_attention_tflops"))]
    if models:
        fields["model_rates"] = tuple(models)
    fields["calibrated"] = f"{entry.get('when', '?')} on {entry.get('host', '?')}"
    return replace(base, **fields)


def _words(text: str) -> list[str]:
    return [w for w in re.split(r"[\s\-_/]+", text.upper()) if w]


def names_gpu(type_name: str, device_name: str) -> bool:
    """Whether the GPU torch names `device_name` ("NVIDIA H100 80GB HBM3", "NVIDIA
    A100-SXM4-40GB", "NVIDIA GeForce RTX 4090") is of the type `type_name` ("H100",
    "A100-80GB", "RTX4090"): the type's model is a word of the name (or two adjacent words
    joined), never a part of one (L4 is not L40S, H20 is not H200), and a memory size in the
    type's name is not contradicted by another in the GPU's."""
    want, words = _words(type_name), _words(device_name)
    if not want:
        return False
    if want[0] not in set(words) | {a + b for a, b in zip(words, words[1:])}:
        return False
    sizes = {m.group(1) for m in (re.fullmatch(r"(\d+)GB?", w) for w in words) if m}
    for w in want[1:]:
        m = re.fullmatch(r"(\d+)GB?", w)
        if m and sizes and m.group(1) not in sizes:
            return False
    return True


def entry_problem(name: str, entry: dict, torch_version: str | None = None) -> str | None:
    """One line saying why a cached entry must not be used, or None: measured on another GPU
    than its type (`device_name` does not name it), with another torch than `torch_version`
    (default: this process's), or disagreeing with the type's op table by more than
    DISAGREE_FACTOR (raydit.planner.devicemodel; reported, not silently used)."""
    seen = str(entry.get("device_name") or "")
    if entry.get("device") == "cuda" and seen and not names_gpu(name, seen):
        return (f"calibration entry {name!r} was measured on {seen!r}, another GPU: not used; "
                f"run `raydit doctor --calibrate --force` on a {name}")
    if torch_version is None:
        try:
            import torch

            torch_version = torch.__version__
        except ImportError:
            torch_version = None
    got = entry.get("torch")
    if got and torch_version and got != torch_version:
        return (f"calibration entry {name!r} was measured with torch {got}, this is torch {torch_version}: "
                "not used; run `raydit doctor --calibrate --force` again")
    from raydit.planner.devicemodel import table_for

    table = table_for(name)
    m = entry.get("measured") or {}
    if table is not None and table.priced and entry.get("device") == "cuda":
        checks = []
        if _positive(m.get("matmul_tflops")):
            checks.append(("matmul", float(m["matmul_tflops"]), table.gemm(4096, 4096, 4096).tflops))
        for d, r in _rates_by_dim(m.get("attention_plain_tflops_by_head_dim")).items():
            checks.append((f"attention d{d}", r, table.attention(d, CUDA_ATTENTION_TOKENS).tflops))
        for what, got_r, want in checks:
            if not 1 / DISAGREE_FACTOR <= got_r / want <= DISAGREE_FACTOR:
                return (f"calibration entry {name!r} disagrees with its op table ({table.describe()}) by more than "
                        f"{DISAGREE_FACTOR:g}x: {what} {got_r:.4g} against {want:.4g} TFLOP/s: not used; the table "
                        "prices the step (measure again with `raydit doctor --calibrate --force`)")
    return None


# A calibration and an op table further apart than this (either way) is a measurement gone wrong.
DISAGREE_FACTOR = 2.0


def calibrated_device_type(name: str, path: str | os.PathLike | None = None,
                           notes: list[str] | None = None) -> DeviceType:
    """The table's entry for `name` (or conservative figures for an unknown type) with the
    cached measurements applied; the table's entry unchanged when nothing is cached, or when
    the entry must not be used (entry_problem: the line goes to `notes`)."""
    from raydit.runtime.devices import table_device

    base, _ = table_device(name)
    entry = load_calibration(path).get(base.name)
    if not entry:
        return base
    problem = entry_problem(base.name, entry)
    if problem:
        if notes is not None:
            notes.append(problem)
        return base
    return apply_entry(base, entry)


def calibrated_device_types(path: str | os.PathLike | None = None,
                            notes: list[str] | None = None) -> dict[str, DeviceType]:
    """Every cached device type that may be used, calibrated (for `read_live_cluster`); the
    others' one-line reasons go to `notes`."""
    from raydit.runtime.devices import table_device

    out = {}
    for name, entry in load_calibration(path).items():
        problem = entry_problem(name, entry)
        if problem:
            if notes is not None:
                notes.append(problem)
            continue
        out[name] = apply_entry(table_device(name)[0], entry)
    return out


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _rates_by_dim(table) -> dict[int, float]:
    return {int(d): float(r) for d, r in (table or {}).items() if _positive(r)}


def describe_attention(m: dict) -> list[str]:
    """Per head dim, the attention kernel a calibration chose and why: 'attention d64
    torch-cudnn 585 TFLOP/s (fastest of torch-cudnn 585, torch-flash 352; ring 1: sdpa 590;
    fa3 dropped: ...)'. Entries measured before every kernel was timed name one kernel."""
    chosen = m.get("attention_kernel_by_head_dim") or {}
    rates = m.get("attention_tflops_by_head_dim") or {}
    if not chosen:
        attn = ", ".join(f"d{d} {r:.3g}" for d, r in sorted(rates.items(), key=lambda dr: int(dr[0])))
        return [f"attention ({m.get('attention_kernel', '?')}) {attn}"]
    lines = []
    for d in sorted(chosen, key=int):
        table = (m.get("attention_rates_by_head_dim") or {}).get(d) or {}
        why = []
        if len(table) > 1:
            ranked = sorted(table.items(), key=lambda kv: -kv[1])
            why.append("fastest of " + ", ".join(f"{n} {r:.3g}" for n, r in ranked))
        elif table:
            why.append("the only candidate")
        plain = (m.get("attention_plain_tflops_by_head_dim") or {}).get(d)
        if plain:
            why.append(f"ring 1: sdpa {plain:.3g}")
        why += [f"{n} dropped: {w}" for n, w in ((m.get("attention_dropped_by_head_dim") or {}).get(d) or {}).items()]
        rate = f" {rates[d]:.3g} TFLOP/s" if d in rates else ""
        lines.append(f"attention d{d} {chosen[d]}{rate}" + (f" ({'; '.join(why)})" if why else ""))
    return lines


def kernel_rates_for(entries: dict[str, dict], device_name: str) -> dict[int, dict[str, float]]:
    """Head dim -> {kernel: TFLOP/s} of the cached entry measured on a GPU named
    `device_name` (torch.cuda.get_device_name); {} when none was."""
    for entry in entries.values():
        if entry.get("device") == "cuda" and entry.get("device_name") == device_name:
            table = (entry.get("measured") or {}).get("attention_rates_by_head_dim") or {}
            return {int(d): {n: float(r) for n, r in rates.items() if _positive(r)}
                    for d, rates in table.items() if rates}
    return {}


def seed_kernel_choices(path=None) -> dict:
    """Let this process's GPU (CUDA device 0) run the attention kernel its calibration found
    fastest, per head dim, in bf16 (the dtype calibration measures): seeds
    raydit.parallel.kernels.use_measured_rates. Returns head dim -> KernelChoice; {} without
    a GPU or a matching entry (kernels are then probed once in this process)."""
    import torch

    from raydit.parallel.kernels import use_measured_rates

    if not torch.cuda.is_available():
        return {}
    try:
        entries = load_calibration(path)
    except ValueError:
        return {}  # doctor reports an unreadable cache; the kernels are probed instead
    return {d: use_measured_rates("cuda", torch.bfloat16, d, rates)
            for d, rates in kernel_rates_for(entries, torch.cuda.get_device_name(0)).items()}


def describe_calibration(path=None) -> list[str]:
    """Lines for `raydit doctor`: one per cached device type, against the table."""
    from raydit.runtime.devices import table_device

    try:
        entries = load_calibration(path)
    except ValueError as exc:
        return [str(exc)]
    lines = []
    for name, e in sorted(entries.items()):
        m = e.get("measured", {})
        base = table_device(name)[0]
        parts = [f"matmul {m.get('matmul_tflops', float('nan')):.3g} TFLOP/s {m.get('matmul_dtype', '')} "
                 f"(table {base.tflops:g})"]
        if "dit_linear_tflops" in m:
            parts.append(f"DiT block linear part {m['dit_linear_tflops']:.3g} TFLOP/s, "
                         + "; ".join(describe_attention(m)))
        if "all_to_all_gb_s" in m:
            parts.append(f"all-to-all {m['all_to_all_gb_s']:.3g} GB/s (table {base.link_gb_s:g}), "
                         f"p2p {m.get('p2p_gb_s', float('nan')):.3g} GB/s, "
                         f"latency {m.get('latency_us', 0):.0f} us")
        if "memory_gb" in m:
            parts.append(f"memory {m['memory_gb']:.1f} GB")
        lines.append(f"{name}: " + "; ".join(parts) + f" [{e.get('host', '?')}, {e.get('when', '?')}]")
        problem = entry_problem(name, e)
        if problem:
            lines.append(f"{name}: {problem}")
        lines += [f"{name}: model {line}" for line in map(describe_model, (e.get("models") or {}).values())]
    return lines


def describe_model(m: dict) -> str:
    """One line of a model calibration: what ran, the step, and the rates the planner uses."""
    r = m.get("request") or {}
    att = m.get("attention") or {}
    return (f"{m.get('model', '?')} ({m.get('key', '?')}): step {m.get('step_seconds', float('nan')):.4g} s at "
            f"{r.get('frames')}x{r.get('height')}x{r.get('width')}, batch {r.get('batch')}, {m.get('dtype', '?')}; "
            f"linear part {m.get('linear_tflops', float('nan')):.4g} TFLOP/s, attention sdpa "
            f"{att.get('plain_tflops') or float('nan'):.4g} / {att.get('kernel', '?')} "
            f"{att.get('lse_tflops') or float('nan'):.4g} TFLOP/s at its shape")



__all__ = ["CACHE_VERSION", "DISAGREE_FACTOR", "apply_entry", "cache_path", "calibrated_device_type",
           "calibrated_device_types", "describe_attention", "describe_calibration", "describe_model",
           "entry_problem", "kernel_rates_for", "load_calibration", "save_calibration", "seed_kernel_choices"]
