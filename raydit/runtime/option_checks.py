"""The options table's checks: (name, value) -> None, or a one-line ValueError naming both and
the fix; and the small parsers its entries share. Pure Python (raydit.runtime.options)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Callable

from raydit.planner.sparse import SparseConfig, as_sparse_config, sparse_config


# -- checks: (name, value) -> None or ValueError naming both ------------------------------------


def positive_int(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} {value!r} must be a positive integer")


def whole_number(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} {value!r} must be a whole number >= 0")


def finite_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name} {value!r} must be a finite number of seconds >= 0")


def positive_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} {value!r} must be a finite number of seconds > 0")


def true_or_false(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} {value!r} must be True or False")


def one_of(*choices) -> Callable[[str, Any], None]:
    def check(name: str, value) -> None:
        if value not in choices:
            raise ValueError(f"{name} {value!r} is not one of {', '.join(map(str, choices))}")

    return check


def or_none(check: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    """`check`, with None let through (the Engine's choice)."""
    def checked(name: str, value) -> None:
        if value is not None:
            check(name, value)

    return checked


def model_name(name: str, value) -> None:
    if not isinstance(value, os.PathLike) and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"{name} {value!r} must be a built-in model name ('tiny', 'tiny-wan', ...) or the path of a "
                         "local diffusers pipeline directory")


def a_path(name: str, value) -> None:
    if not isinstance(value, (str, os.PathLike)) or not str(os.fspath(value)).strip():
        raise ValueError(f"{name} {value!r} must be a directory path (a string), or None")


def ray_address(name: str, value) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} {value!r} must be a Ray address string such as 'auto' or 'HOST:6379', or None "
                         "($RAY_ADDRESS, else a local Ray)")


def lora_table(name: str, value) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} {value!r} must be a mapping of LoRA name -> path (a .safetensors file or a "
                         "directory holding one), e.g. {'style': '/loras/style.safetensors'}")


def comma_list(text: str) -> list[str]:
    """`--sigmas 1,0.75,0.5` -> its entries as text (checked where the option is resolved)."""
    return [part.strip() for part in str(text).strip().removeprefix("[").removesuffix("]").split(",")]


def sparse_setting(name: str, value) -> None:
    as_sparse_config(value)  # its own one-line ValueError


def sparse_from_options(opts: dict) -> SparseConfig | None:
    """--sparse-attention, --sparse-option (repeatable) and --dense-steps -> a SparseConfig."""
    return sparse_config(opts.get("sparse_attention"), opts.get("sparse_option"), opts.get("dense_steps"))
