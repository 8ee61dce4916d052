"""Sparse attention masks over the video tokens, pure Python: which query attends which key.

The video tokens after patching form a (frame, row, column) grid of F x Hp x Wp tokens,
flattened in raster order (frame-major, then row, then column), as the families flatten
them: token index = (f * Hp + r) * Wp + c. Text tokens (joint-attention families) are
never masked: the kernel keeps their rows and columns whole.

Methods (`SparseConfig.method`):
- "sta", Sliding Tile Attention (FastVideo, arXiv 2502.04507). Tiles of tile = (Tt, Th, Tw)
  tokens, each dividing its axis. On an axis with n tiles, the query in tile q attends the
  key tiles [s, s + W) with s = clamp(q - W // 2, 0, max(n - W, 0)) (window W in tiles; a
  W >= n is the whole axis). The window keeps its full size at the borders (NATTEN's and
  STA's rule). A query attends a key when that holds on all three axes, so the density is
        prod over axes of min(W, n) / n.
- "radial", Radial Attention's static mask (mit-han-lab radial-attention, arXiv
  2506.19852), written here at token level: frames f_q, f_k at distance d = |f_q - f_k|
  with P tokens a frame, in-frame indices i, j. Key frame 0 is an attention sink (whole).
  Otherwise, with g = bit_length(d) and L = 2 ** bit_length(P) / 2 ** g:
        split kept when L >= B, or d % floor(B / L) == 0 (far frames: one in every B / L;
              B the published block size 128)
        band  w = P                   d < near (Wan 1, HunyuanVideo 2)
              w = P // 2              d = 1 with near 1 (Wan)
              w = max(L * decay, B)   otherwise
        allowed  split kept and |i - j| <= w.
  The published kernel then coarsens this mask to 128-token blocks with a heuristic
  (shrinkMaskStrict); raydit applies the token mask itself, so every block it skips is
  one the token rule leaves empty. Density: `density()` counts the pairs exactly.
The dense steps (`dense_steps`, or `dense_fraction` of the request's steps) and the dense
layers (radial's `dense_layers`: the first N transformer blocks) run full attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

METHODS = ("sta", "radial")
# STA's published tile (FastVideo's kernels take 6 x 8 x 8 tokens, 384 a tile).
STA_TILE = (6, 8, 8)
# STA's published grids: latent (frames, rows, columns) after patching of Wan 2.1 14B at
# 69 x 768 x 1280 (VAE stride 4, 8, 8; patch 1, 2, 2 -> 18 x 48 x 80; FastVideo pads the
# frames to 18) and HunyuanVideo at 117 x 768 x 1280 (-> 30 x 48 x 80).
# The per-layer, per-head windows FastVideo searched (assets/mask_strategy_*.json) are not in
# the reference corpus this was written from; the one window below is the uniform window its
# kernel documentation and paper quote for these grids (3 x 3 x 3 tiles of the 3 x 6 x 10 /
# 5 x 6 x 10 tile grid); give `window=` to use another.
STA_DEFAULT_WINDOW = (3, 3, 3)
STA_PUBLISHED_GRIDS = ((18, 48, 80), (30, 48, 80))  # the two grids above, in that order
# Radial attention's published options: block size 128, decay factor 1 (its Wan and
# HunyuanVideo scripts), dense first layers 1 (Wan 2.1 14B: 1; HunyuanVideo: 0), dense
# first steps 12 of 50 (HunyuanVideo) / 12 of 50 (Wan 2.1 14B), i.e. a fraction 0.24.
RADIAL_BLOCK = 128
RADIAL_NEAR_CHOICES = (1, 2)  # half a band at frame distance 1 (its Wan scripts) or two (HunyuanVideo's)
STA_DENSE_FRACTION = 0.3  # STA's "skip_time_steps" 15 of 50 (its HunyuanVideo script)
RADIAL_DENSE_FRACTION = 0.24


def _triple(name: str, value) -> tuple[int, int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * 3
    try:
        out = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"sparse option {name}={value!r} must be three integers t,h,w") from None
    if len(out) != 3 or any(v < 1 for v in out) or any(isinstance(v, bool) for v in value):
        raise ValueError(f"sparse option {name}={value!r} must be three integers >= 1 (t,h,w)")
    return out  # type: ignore[return-value]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SparseConfig:
    """One sparse-attention setting, checked where it is built.

    method: "sta" or "radial". tile, window: STA's (Tt, Th, Tw) tokens and (Wt, Wh, Ww)
    tiles. near: radial's frames at full band (1 Wan-style with a half band at distance 1,
    2 HunyuanVideo-style); decay: its decay factor; block: its block size in tokens.
    dense_layers: the first N transformer blocks run dense. dense_steps: the first N
    scheduler steps run dense; None: dense_fraction of the request's steps (rounded down).
    """

    method: str
    tile: tuple[int, int, int] = STA_TILE
    window: tuple[int, int, int] = STA_DEFAULT_WINDOW
    near: int = 1
    decay: float = 1.0
    block: int = RADIAL_BLOCK
    dense_layers: int = 0
    dense_steps: int | None = None
    dense_fraction: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"sparse attention method {self.method!r} is unknown; choose one of {', '.join(METHODS)}")
        object.__setattr__(self, "tile", _triple("tile", self.tile))
        object.__setattr__(self, "window", _triple("window", self.window))
        if self.near not in (1, 2):
            raise ValueError(f"sparse option near={self.near!r} must be 1 (Wan) or 2 (HunyuanVideo)")
        if not (isinstance(self.decay, (int, float)) and math.isfinite(self.decay) and self.decay > 0):
            raise ValueError(f"sparse option decay={self.decay!r} must be a number > 0")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"sparse option block={self.block!r} must be an integer >= 1")
        if isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise ValueError(f"sparse option dense_layers={self.dense_layers!r} must be an integer >= 0")
        if self.dense_steps is not None and (isinstance(self.dense_steps, bool) or not isinstance(self.dense_steps, int)
                                             or self.dense_steps < 0):
            raise ValueError(f"dense steps {self.dense_steps!r} must be an integer >= 0")
        fraction = self.dense_fraction
        if fraction == -1.0:
            fraction = STA_DENSE_FRACTION if self.method == "sta" else RADIAL_DENSE_FRACTION
        if not (isinstance(fraction, (int, float)) and 0.0 <= fraction <= 1.0):
            raise ValueError(f"sparse option dense_fraction={fraction!r} must be a number in [0, 1]")
        object.__setattr__(self, "dense_fraction", float(fraction))

    def dense_step_count(self, steps: int) -> int:
        """How many of a request's `steps` scheduler steps run dense (a step counts once,
        whatever number of transformer calls CFG makes in it). An explicit dense_steps above
        `steps` is refused; the fraction scales to any step count (never a refusal)."""
        if self.dense_steps is not None:
            if self.dense_steps > steps:
                raise ValueError(f"dense steps {self.dense_steps} is above the request's {steps} steps; "
                                 f"give 0..{steps}")
            return self.dense_steps
        return int(math.floor(self.dense_fraction * steps))

    def check_grid(self, grid: tuple[int, int, int]) -> tuple[int, int, int]:
        """The (frames, rows, columns) token grid, checked against this setting."""
        grid = _triple("grid", grid)
        if self.method == "sta":
            for axis, n, t in zip("thw", grid, self.tile):
                if n % t:
                    raise ValueError(f"sta tile {t} does not divide the {n} tokens of axis {axis}; tile sizes "
                                     f"that do: {', '.join(map(str, divisors(n)))} (--sparse-option tile=t,h,w)")
        return grid


# -- STA ---------------------------------------------------------------------------------------
def window_start(q: int, window: int, n: int) -> int:
    """First key tile of query tile q on an axis of n tiles: clamp(q - W // 2, 0, max(n - W, 0))."""
    return min(max(q - window // 2, 0), max(n - window, 0))


def sta_axis_tiles(window: int, n: int) -> list[tuple[int, int]]:
    """Per query tile of an n-tile axis, its key tiles [start, stop)."""
    w = min(window, n)
    return [(window_start(q, w, n), window_start(q, w, n) + w) for q in range(n)]


def sta_tile_mask(config: SparseConfig, grid: tuple[int, int, int]) -> list[list[bool]]:
    """The block mask on tiles (tile order: tile index (ft * nh + fh) * nw + fw, each tile's
    tokens a block): [query tile][key tile] -> attends."""
    grid = config.check_grid(grid)
    ns = [n // t for n, t in zip(grid, config.tile)]
    axes = [sta_axis_tiles(w, n) for w, n in zip(config.window, ns)]
    tiles = [(a, b, c) for a in range(ns[0]) for b in range(ns[1]) for c in range(ns[2])]
    return [[all(axes[x][qt[x]][0] <= kt[x] < axes[x][qt[x]][1] for x in range(3)) for kt in tiles] for qt in tiles]


# -- radial ------------------------------------------------------------------------------------
def radial_band(config: SparseConfig, frame_tokens: int, distance: int) -> int | None:
    """Radial's in-frame band half-width between frames `distance` apart (key frame not 0):
    |i - j| <= band, or None where the frame pair is skipped (split)."""
    d, P, B = distance, frame_tokens, config.block
    decay_length = 2 ** P.bit_length() / 2 ** d.bit_length()
    if decay_length < B and d % int(B / decay_length) != 0:
        return None
    if d < config.near:
        return P
    if config.near == 1 and d == 1:
        return P // 2
    return int(max(decay_length * config.decay, B))


def _band_pairs(P: int, band: int) -> int:
    # pairs (i, j) in [0, P)^2 with |i - j| <= band
    w = min(band, P - 1)
    return P + 2 * (w * P - w * (w + 1) // 2)


def density(config: SparseConfig, grid: tuple[int, int, int]) -> float:
    """The fraction of (video query, video key) pairs the mask keeps (1.0 = dense)."""
    F, Hp, Wp = config.check_grid(grid)
    if config.method == "sta":
        d = 1.0
        for n, t, w in zip((F, Hp, Wp), config.tile, config.window):
            tiles = n // t
            d *= min(w, tiles) / tiles
        return d
    P = Hp * Wp
    kept = 0
    for fq in range(F):
        for fk in range(F):
            if fk == 0:
                kept += P * P
                continue
            band = radial_band(config, P, abs(fq - fk))
            if band is not None:
                kept += _band_pairs(P, band)
    return kept / float(F * P) ** 2


def allowed(config: SparseConfig, grid: tuple[int, int, int], q: int, k: int) -> bool:
    """Whether video token q attends video token k (raster indices), one pair at a time:
    the rule itself, for checks and tools (the kernel evaluates it vectorised)."""
    F, Hp, Wp = grid
    fq, rq, cq = q // (Hp * Wp), (q // Wp) % Hp, q % Wp
    fk, rk, ck = k // (Hp * Wp), (k // Wp) % Hp, k % Wp
    if config.method == "sta":
        for a, b, n, t, w in zip((fq, rq, cq), (fk, rk, ck), grid, config.tile, config.window):
            tiles = n // t
            ww = min(w, tiles)
            s = window_start(a // t, ww, tiles)
            if not s <= b // t < s + ww:
                return False
        return True
    if fk == 0:
        return True
    band = radial_band(config, Hp * Wp, abs(fq - fk))
    return band is not None and abs(q % (Hp * Wp) - k % (Hp * Wp)) <= band


# -- a request's setting from its parts (command line, config file, form, Python API) ----------
_INT_OPTIONS = ("near", "block", "dense_layers", "dense_steps")
_FLOAT_OPTIONS = ("decay", "dense_fraction")
_TRIPLE_OPTIONS = ("tile", "window")
OPTION_NAMES = _TRIPLE_OPTIONS + _INT_OPTIONS + _FLOAT_OPTIONS


def _option_value(name: str, value):
    if isinstance(value, str):
        text = value.strip()
        try:
            if name in _TRIPLE_OPTIONS:
                return tuple(int(v) for v in text.split(","))
            if name in _INT_OPTIONS:
                return int(text)
            return float(text)
        except ValueError:
            kind = "t,h,w integers" if name in _TRIPLE_OPTIONS else "an integer" if name in _INT_OPTIONS else "a number"
            raise ValueError(f"sparse option {name}={value!r} must be {kind}") from None
    if name in _TRIPLE_OPTIONS and isinstance(value, list):
        return tuple(value)
    return value


def sparse_config(method, options=None, dense_steps: int | None = None) -> SparseConfig | None:
    """`--sparse-attention METHOD`, `--sparse-option KEY=VALUE` (repeatable: a list of such
    strings, or a {key: value} mapping) and `--dense-steps N` -> the request's SparseConfig;
    None (no method) is dense attention, and then options or dense steps are refused."""
    items: dict = {}
    if isinstance(options, dict):
        items = dict(options)
    else:
        for item in options or ():
            key, sep, text = str(item).partition("=")
            if not sep or not key.strip() or not text.strip():
                raise ValueError(f"--sparse-option {item!r} must be KEY=VALUE, e.g. window=3,3,3")
            if key.strip() in items:
                raise ValueError(f"--sparse-option {key.strip()!r} is given twice")
            items[key.strip()] = text
    if dense_steps is not None:
        if "dense_steps" in items:
            raise ValueError("dense steps are given twice (--dense-steps and --sparse-option dense_steps=); give one")
        items["dense_steps"] = dense_steps
    if method is None:
        if items:
            raise ValueError(f"sparse options {sorted(items)} need a method: add --sparse-attention "
                             f"{' or '.join(METHODS)}")
        return None
    unknown = sorted(set(items) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"sparse option(s) {', '.join(unknown)} unknown; the options are {', '.join(OPTION_NAMES)}")
    return SparseConfig(method=method, **{k: _option_value(k, v) for k, v in items.items()})


def as_sparse_config(value) -> SparseConfig | None:
    """A request's `sparse_attention` as given -> SparseConfig or None: None (or "none", "off":
    dense), a SparseConfig, a method name, or a mapping {"method": ..., option: value} (a
    checkpoint's; a form's as JSON text)."""
    if value is None or isinstance(value, SparseConfig):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "off", "dense"):
            return None
        if text.startswith("{"):  # a form's JSON text
            import json

            try:
                value = json.loads(text)
            except ValueError:
                raise ValueError(f"sparse_attention {text!r} is not valid JSON; give an object such as "
                                 '{"method": "sta", "window": [3, 3, 3]}') from None
        else:
            return sparse_config(text)
    if isinstance(value, dict):
        rest = dict(value)
        method = rest.pop("method", None)
        if method is None:
            raise ValueError(f"sparse_attention {value!r} names no method; give {{'method': 'sta', ...}}")
        return sparse_config(method, rest)
    raise ValueError(f"sparse_attention {value!r} must be a method name ({', '.join(METHODS)}), a mapping "
                     "{'method': ..., option: value} or a SparseConfig")


# -- the planner's price of a sparse step ------------------------------------------------------
# Time of the block-sparse kernel beyond density x dense: the fused calls' shorter query blocks,
# the gathered keys, the masked band edges. Measured on the CPU kernel (docs/benchmarks/
# sparse_kernel.json, 1 core, float32: t / t_dense - d = 0.05 to 0.08 for STA at d 0.04 to 0.33,
# t_dense the same kernel with whole windows, itself within 1.05x of torch's SDPA). Radial's bands
# cost more (0.47 at d 0.79 there: their edges are half kept), which this one figure leaves out.
# No GPU figure yet.
SPARSE_BLOCK_OVERHEAD = 0.05


def attention_work(config: SparseConfig, grid: tuple[int, int, int], steps: int, layers: int | None = None) -> float:
    """The mean step's self-attention work as a share of dense attention's (1.0 = dense):
    sparse steps and layers at min(1, density + SPARSE_BLOCK_OVERHEAD), the dense steps and
    dense layers at 1."""
    sparse = min(1.0, density(config, grid) + SPARSE_BLOCK_OVERHEAD)
    step_share = (steps - config.dense_step_count(steps)) / steps
    layer_share = 1.0 if not layers else max(0, layers - config.dense_layers) / layers
    share = step_share * layer_share
    return share * sparse + (1.0 - share)


__all__ = ["SPARSE_BLOCK_OVERHEAD", "attention_work", "METHODS", "OPTION_NAMES", "SparseConfig", "allowed", "as_sparse_config", "density", "divisors", "radial_band", "sta_axis_tiles",
           "sparse_config", "sta_tile_mask", "window_start"]
