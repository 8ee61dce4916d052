"""`raydit generate --config job.yaml`: every command-line option, from a file.

Keys are the long option names with dashes or underscores (`save-latents` or
`save_latents`). Unknown keys and wrong types are refused with the key named: nothing a
user wrote is silently ignored. Options given on the command line win over the file.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from raydit.runtime.options import config_types

# key -> the type the command line would parse it to (raydit.runtime.options declares them).
GENERATE_OPTIONS: dict[str, type] = config_types("generate")


def load_job_config(path: str, options: dict[str, type] | None = None) -> dict:
    """Read `path` against `options` (key -> type; default: `raydit generate`'s)."""
    options = GENERATE_OPTIONS if options is None else options
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {path!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ValueError(f"config file {path!r} is not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must be a mapping of option: value, got {type(data).__name__}")
    return check_option_types(data, options, f"config file {path!r}")


def check_option_types(data: dict, options: dict[str, type], where: str, what: str = "key") -> dict:
    """`data` (option: value, keys with dashes or underscores) checked against `options` (key ->
    type): unknown keys, and a value of another type, are a ValueError naming them and `where`
    they come from (a config file, a Serve builder's args). Returns {key: value} with the keys'
    underscores; None values left out (the default), an int made a float where a float is wanted."""
    unknown = [raw_key for raw_key in data if str(raw_key).replace("-", "_") not in options]
    if unknown:
        known = ", ".join(k.replace("_", "-") for k in options)
        raise ValueError(f"{where}: unknown {what}{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; known {what}s: {known}")
    out, seen = {}, {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key in seen:
            raise ValueError(f"{where}: {what} {raw_key!r} is given twice (as {seen[key]!r} too); give it once")
        seen[key] = raw_key
        want = options[key]
        if value is None:
            continue
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if want is not bool and isinstance(value, bool) or not isinstance(value, want):
            raise ValueError(f"{where}: {what} {raw_key!r} must be {want.__name__}, got {value!r}")
        out[key] = value
    return out
