"""Step-cache options of a request (method and threshold): what a request may ask for,
checked where the request is made (raydit.models.requests.GenerationRequest, the CLI, the
service) without importing the cache itself (raydit.models.cache)."""

from __future__ import annotations

import math

# method -> default threshold
METHODS: dict[str, float] = {"fbcache": 0.05, "teacache": 0.1}


def check_cache(method, threshold) -> None:
    """Raise ValueError (one line naming the value and the fix) for a bad method or threshold."""
    if method is None:
        if threshold is not None:
            raise ValueError(f"cache_threshold {threshold!r} needs a cache method; add --cache "
                             f"{' or --cache '.join(METHODS)}, or drop the threshold")
        return
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"cache {method!r} is not a step-cache method; use one of: {', '.join(METHODS)} "
                         "(or leave it out to run every step)")
    if threshold is None:
        return
    if (isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold)
            or threshold <= 0):
        raise ValueError(f"cache_threshold {threshold!r} must be a finite number > 0 (a relative L1 change; "
                         f"{method}'s default is {METHODS[method]})")


def cache_threshold(method: str, threshold: float | None) -> float:
    return METHODS[method] if threshold is None else float(threshold)
