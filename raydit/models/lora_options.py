"""LoRA options of a run as the command line and a job config give them: `--lora PATH
[--lora-scale S] [--lora-target NAME]` (repeatable) and `loras:` entries, resolved to the Engine's table of files
and the request's scales. Checks names, scales and files (raydit.models.lora) without
importing torch or peft."""

from __future__ import annotations

from raydit.models.lora import TARGETS, check_name, check_scale, default_name, lora_file


def lora_options(o: dict) -> tuple[dict, dict]:
    """--lora PATH [--lora-scale S] [--lora-target NAME] (repeatable) and the config's `loras:` (paths, or mappings
    {path, scale, name, target}) -> ({name: {"path", "target"}} for the Engine, {name: scale}
    for the request). Files and scales are checked here; the LoRAs against the model in the
    Engine, before Ray starts. Shared by `raydit generate` and `raydit serve`."""
    paths, scales = list(o.get("lora") or []), list(o.get("lora_scale") or [])
    targets = list(o.get("lora_target") or [])
    for flag, given in (("--lora-scale", scales), ("--lora-target", targets)):
        if len(given) > len(paths):
            raise ValueError(f"{flag} is given {len(given)} times but --lora {len(paths)} times; "
                             f"give one {flag.removeprefix('--lora-')} per --lora, in the same order")
    entries = [{"path": p, "scale": scales[i] if i < len(scales) else 1.0,
                "target": targets[i] if i < len(targets) else "transformer"} for i, p in enumerate(paths)]
    for entry in o.get("loras") or []:
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict) or "path" not in entry or set(entry) - {"path", "scale", "name", "target"}:
            raise ValueError(f"loras: entry {entry!r} must be a path or a mapping with path and optionally "
                             "scale, name, target")
        entries.append(entry)
    table, choice = {}, {}
    for entry in entries:
        name = check_name(entry.get("name") or default_name(entry["path"]))
        if name in table:
            raise ValueError(f"two LoRAs are named {name!r}; give one a name (loras: - {{path: ..., name: ...}})"
                             if entry.get("name") else f"--lora {entry['path']!r}: a LoRA named {name!r} is "
                             "already given; rename the file or directory, or name it in a --config loras: entry")
        target = entry.get("target", "transformer")
        if target not in TARGETS:
            raise ValueError(f"LoRA {name!r}: target {target!r} is not one of {', '.join(TARGETS)} (--lora-target, "
                             "in --lora's order)")
        table[name] = {"path": str(lora_file(entry["path"])), "target": target}
        choice[name] = check_scale(entry.get("scale", 1.0), name)
    return table, choice
