r"""A device model built from measurements of the ops a DiT step runs: a roofline per op class.

Every op of a step is priced on the roofline of its class,

    t_op = max(FLOP / rate, bytes / bandwidth)

plus, once per layer and transformer call, its kernels' launches x t_launch (`launch_us`): the
GEMMs, the attention kernels and the family's counted elementwise launches
(ModelSpec.elementwise_launches); a model that batches its guidance branches makes one call a
step (ModelSpec.batched_branches), the others one per branch.

with the class's own rate (`Roofline`):

    gemm         rate by shape class: the measured (m, n, k) nearest the op's in log space,
                 per dtype (bf16; fp8 where `Mode.quantize` is "fp8": `torch._scaled_mm`)
    attention    rate by head dim (the nearest measured, the smaller on a tie), then length
                 (the log-nearest measured token count), then heads x batch, per kernel: "bf16"
                 (torch's SDPA, ring 1), "bf16-lse" (the LSE kernel a ring merges), "int8" /
                 "fp8" (8-bit attention), "bf16-masked" (a boolean mask on one device:
                 ModelSpec.masked_attention; MASKED_STAND_IN where not measured)
    elementwise  norms, modulation, rotary, residuals, activations: bytes moved at the measured
                 elementwise bandwidth (what a DiT block's eager chain of such ops reached, its
                 bytes counted as the families' are: bench_opsweep); `compile` fuses them
                 (`compiled_fraction` of the bytes and launches remain)
    all_to_all, p2p   by message size: latency + bytes / bandwidth at the nearest measured size

A table (raydit/planner/tables/<gpu>.json, loaded as data) holds the figures with their
provenance: the GPU, the date and the torch version they were measured with (bench/bench_opsweep.py
writes it), and per figure its `source` ("measured ...", "published ...", "scaled from ...", "fit
..."). Where a figure was not measured the table says what stands in for it.

One device's step (`step_seconds`): per layer the GEMMs of the block (q, k, v, out; the FFN; with
cross-attention its q, out and the prompt's k, v), the self-attention kernel, the cross-attention
kernel, the elementwise bytes (`ModelSpec.elementwise_bytes`: bytes per token and channel a layer's
non-GEMM ops move in eager mode, counted on diffusers' blocks; DEFAULT_ELEMENTWISE_BYTES where not
counted), and the audio stream (LTX-2) at the GEMM rate; fp8 adds the activations' quantization
(read bf16, write fp8: 3 bytes per GEMM input element) unless compiled (fused into the producer).
`model_rates` turns that step into the linear and attention rates of the cost model
(cost.fit_model_rates), which carries it to every layout, with the links and the waves.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from raydit.planner.model import ModelSpec, VideoGeometry

from raydit.planner.modes import PRICED_ATTENTION_MODES as ATTENTION_MODES  # noqa: E402  (the priced ones)
from raydit.planner.modes import PRICED_QUANTIZE_MODES as QUANTIZE_MODES  # noqa: E402
from raydit.planner.modes import DEFAULT_ATTENTION_MODE, EIGHT_BIT_ATTENTION_MODES, FP8_PRICED_QUANTIZE_MODES
TABLE_DIR = Path(__file__).with_name("tables")
TABLE_VERSION = 1
# Bytes per token and channel one layer's non-GEMM, non-attention ops move in eager mode where
# the model's own count is missing: HunyuanVideo's (the middle of the three counted: CogVideoX
# 84, HunyuanVideo 238, Wan 419; each family's Family.elementwise_bytes).
DEFAULT_ELEMENTWISE_BYTES = 238.0
# Elementwise kernel launches per layer and transformer call in eager mode where the model's own
# count is missing (counted with the bytes: CogVideoX 33, HunyuanVideo 48 single / 81 dual, Wan
# 83); the middle one.
ELEMENTWISE_LAUNCHES = 81
GEMM_LAUNCHES = 6  # q, k, v, out, FFN in and out; cross-attention adds CROSS_LAUNCHES
CROSS_LAUNCHES = 5  # its q, k, v, out GEMMs and its attention kernel
ATTENTION_LAUNCHES = 1  # the self-attention kernel
# An attention call with a boolean mask (ModelSpec.masked_attention) where the table has no measured
# "bf16-masked" rows: FlashAttention-2's rows (aten's flash kernel, measured beside cuDNN by bench_gpu
# and bench_opsweep: 349-359 TFLOP/s at head dim 128 on the H200 and H100). A stated stand-in, not a
# fit: the unmasked rate belongs to cuDNN's fastest engine, and no masked call was timed. Where torch
# puts cuDNN first (sdp_utils.cpp's check_prefer_cudnn_attention) the masked call goes to cuDNN as an
# additive bias (its constraints take a mask: check_attn_mask_shape), at a rate not measured here:
# bench_opsweep should time it and the table carry it as "bf16-masked". On the H200 the stand-in
# brings HunyuanVideo's step from -24% to -5.5% of the measured (tests/planner/test_measured_steps.py).
# One device only: sharded, raydit's processor attends to the valid text without a mask (judge).
MASKED_STAND_IN = "fa2"
FP8_QUANT_BYTES = 3  # quantizing one bf16 activation element outside the GEMM: read 2, write 1
# The steps of a request a plan prices full-precision steps over where it is not told: raydit's
# default request (`--steps`, raydit.runtime.options) and diffusers' for most video pipelines.
DEFAULT_STEPS = 50


@dataclass(frozen=True)
class Mode:
    """How a step runs: `quantize` the GEMMs ("none": bf16, "fp8"), the `attention` kernel
    ("bf16", "int8", "fp8") and whether the transformer is `compile`d (fusion). `keep_bf16`:
    the quantized blocks' linears keep their bf16 weights beside the quantized ones (a run's
    full-precision steps, Runner(full_precision_steps=N)): priced as memory, never sharded.
    `full_precision_steps` N of a request's `steps`: its first and last N steps run in bf16
    GEMMs and attention (compiled as the rest), so a step is priced as the request's mean step,
    `full_precision_share` of it at the `unquantized` mode's rates (`step_ops`)."""

    quantize: str = "none"
    attention: str = "bf16"
    compile: bool = False
    keep_bf16: bool = False
    full_precision_steps: int = 0
    steps: int = DEFAULT_STEPS
    # Sparse attention (raydit.planner.sparse.attention_work): the mean step's self-attention
    # work as a share of dense attention's; 1.0: dense.
    attention_work: float = 1.0

    def __post_init__(self):
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize {self.quantize!r} is not one of {', '.join(QUANTIZE_MODES)}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention {self.attention!r} is not one of {', '.join(ATTENTION_MODES)}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if not isinstance(self.keep_bf16, bool):
            raise ValueError(f"keep_bf16 must be True or False, got {self.keep_bf16!r}")
        work = self.attention_work
        if isinstance(work, bool) or not isinstance(work, (int, float)) or not 0.0 < work <= 1.0:
            raise ValueError(f"attention_work must be a share in (0, 1], got {work!r}")
        for name, least in (("full_precision_steps", 0), ("steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")

    @property
    def prices_as_bf16(self) -> bool:
        """Its steps run at bf16 eager rates (kept weights and full-precision steps aside)."""
        return self.quantize == "none" and self.attention == "bf16" and not self.compile

    @property
    def unquantized(self) -> "Mode":
        """The mode of a full-precision step: bf16 GEMMs and attention, compiled as this one."""
        return Mode(compile=self.compile)

    @property
    def full_precision_share(self) -> float:
        """The share of a request's steps that run in the `unquantized` mode: 2N of `steps`
        (all of them where 2N >= steps); 0 where this mode runs nothing quantized."""
        if not self.full_precision_steps or (self.quantize == "none" and self.attention == "bf16"):
            return 0.0
        return min(1.0, 2 * self.full_precision_steps / self.steps)

    @property
    def label(self) -> str:
        """'bf16', 'fp8 GEMMs + int8 attention, compiled', ..."""
        parts = ["fp8 GEMMs" if self.quantize == "fp8" else "bf16"]
        if self.attention != "bf16":
            parts.append(f"{self.attention} attention")
        text = " + ".join(parts) + (", compiled" if self.compile else "")
        text += ", bf16 weights kept" if self.keep_bf16 else ""
        if self.attention_work < 1.0:
            text += f", sparse attention ({self.attention_work:.2f} of dense attention's work)"
        if self.full_precision_share:
            text += (f", first and last {self.full_precision_steps} of {self.steps} steps in bf16 "
                     "(the mean step priced)")
        return text


BF16 = Mode()


def run_mode(quantize: str | None, attention: str | None, compile: bool | None, full_precision_steps: int = 0,
             steps: int = DEFAULT_STEPS) -> Mode:
    """How the planner prices a run given raydit's own option values (the Engine's, `raydit
    plan`'s, `raydit serve`'s early check): "fp8" keeps the blocks' linears in FP8 (weights one
    byte each, FP8 GEMM rates); "fp8-sim" emulates the numbers in the run's dtype, so bf16 bytes
    and rates; attention "auto" is chosen on the device by raydit.parallel.kernels, priced as
    bf16 (on the measured H100 cuDNN's bf16 kernel is the fastest that passes its check);
    "int8" / "fp8" at their own rates. With full-precision steps a quantized run keeps the
    linears' bf16 weights too (Mode.keep_bf16), and a step is priced as the mean step of a
    request of `steps` steps, its first and last N at bf16 rates (Mode.full_precision_share)."""
    return Mode(quantize="fp8" if quantize in FP8_PRICED_QUANTIZE_MODES else "none",
                attention=attention if attention in EIGHT_BIT_ATTENTION_MODES else DEFAULT_ATTENTION_MODE,
                compile=bool(compile),
                keep_bf16=bool(full_precision_steps) and quantize not in (None, "none"),
                full_precision_steps=int(full_precision_steps or 0), steps=steps)


@dataclass(frozen=True)
class Roofline:
    """One op class: `tflops` (TFLOP/s), `gb_s` (GB/s) and `launch_us` per kernel launch."""

    tflops: float
    gb_s: float
    launch_us: float = 0.0

    def seconds(self, flop: float, nbytes: float, launches: float = 1.0) -> float:
        compute = flop / (self.tflops * 1e12) if flop else 0.0
        memory = nbytes / (self.gb_s * 1e9) if nbytes else 0.0
        return max(compute, memory) + launches * self.launch_us * 1e-6


def _value(entry, what: str) -> float:
    value = entry.get("value") if isinstance(entry, dict) else entry
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"device table: {what} {value!r} must be a number >= 0")
    return float(value)


def _log_distance(a: float, b: float) -> float:
    return abs(math.log(max(a, 1.0) / max(b, 1.0)))


@dataclass(frozen=True)
class DeviceTable:
    """The op rates of one GPU type with their provenance (module docstring); `data` is the
    table file's JSON object."""

    data: dict

    def __post_init__(self):
        d = self.data
        for key in ("device_type", "gpu", "date", "torch", "provenance"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise ValueError(f"device table: {key!r} must be a non-empty string (provenance), got {d.get(key)!r}")
        if d.get("version") != TABLE_VERSION:
            raise ValueError(f"device table {d['device_type']}: version {d.get('version')!r}, expected {TABLE_VERSION}")
        if not self.gemm_rows("bf16"):
            raise ValueError(f"device table {d['device_type']}: no bf16 GEMM rate")
        if not self.attention_rows("bf16"):
            raise ValueError(f"device table {d['device_type']}: no bf16 attention rate")
        for section in ("hbm_gb_s", "elementwise_gb_s", "launch_us", "compiled_fraction"):
            _value(d.get(section), section)
        for section in ("hbm_gb_s", "elementwise_gb_s"):
            if not _value(d.get(section), section) > 0:
                raise ValueError(f"device table {d['device_type']}: {section} must be > 0")

    def __hash__(self):
        return hash((self.name, self.date, self.torch, self.provenance))

    @property
    def name(self) -> str:
        return self.data["device_type"]

    @property
    def date(self) -> str:
        return self.data["date"]

    @property
    def torch(self) -> str:
        return self.data["torch"]

    @property
    def gpu(self) -> str:
        return self.data["gpu"]

    @property
    def provenance(self) -> str:
        return self.data["provenance"]

    @property
    def priced(self) -> bool:
        """Whether the planner prices steps with this table: a measured table, or a scaled one
        for a type without fit figures of its own (`replaces_figures`: H20, B200). A scaled table
        of a type with fit figures (H100 until bench_opsweep runs there, A100, L40S, L4) is data
        beside them, not used."""
        return self.provenance.startswith("measured") or bool(self.data.get("replaces_figures"))

    def describe(self) -> str:
        """'H200 op table of 2026-11-26 (measured; NVIDIA H200, torch 2.11.0+cu130): elementwise
        3499 GB/s (carried from ...), launch 10.5 us (...), compiled 0.186 of the elementwise
        work'. The Engine's start-up plan table and `raydit plan` print it: the rates a prediction
        used, with where the figures that were not measured on this type came from."""
        notes = []
        for key, label in (("elementwise_gb_s", "elementwise {:g} GB/s"), ("launch_us", "launch {:g} us"),
                           ("compiled_fraction", "compiled {:g} of the elementwise work")):
            entry = self.data.get(key)
            text = label.format(self._figure(key))
            source = entry.get("source", "") if isinstance(entry, dict) else ""
            if source and not source.startswith("measured"):
                text += f" ({source.split(' (')[0].split(':')[0]})"
            notes.append(text)
        if not self.attention_rows("bf16-masked") and self.attention_rows(MASKED_STAND_IN):
            notes.append(f"masked attention at its {MASKED_STAND_IN} rows (no masked call measured)")
        return (f"{self.name} op table of {self.date} ({self.provenance}; {self.gpu}, torch {self.torch}): "
                + ", ".join(notes))

    def _figure(self, key: str) -> float:
        return _value(self.data.get(key), key)

    @property
    def launch_us(self) -> float:
        return self._figure("launch_us")

    def gemm_rows(self, dtype: str) -> list[dict]:
        return [r for r in (self.data.get("gemm") or {}).get(dtype) or [] if _value(r.get("tflops"), "tflops") > 0]

    def attention_rows(self, kernel: str) -> list[dict]:
        return [r for r in (self.data.get("attention") or {}).get(kernel) or [] if _value(r.get("tflops"), "tflops") > 0]

    # -- op classes -------------------------------------------------------------------------

    def gemm(self, m: float, n: float, k: float, dtype: str = "bf16") -> Roofline:
        """The GEMM roofline at shape (m, n, k): the rate of the measured shape nearest in log
        space (m, n and k alike); fp8 without fp8 rows: the bf16 rate."""
        rows = self.gemm_rows(dtype) or self.gemm_rows("bf16")
        row = min(rows, key=lambda r: (_log_distance(m, r["m"]) + _log_distance(n, r["n"])
                                       + _log_distance(k, r["k"]), r["m"]))
        return Roofline(float(row["tflops"]), self._figure("hbm_gb_s"), self.launch_us)

    def attention(self, head_dim: int, tokens: float, kernel: str = "bf16", lanes: float = 0.0) -> Roofline:
        """The attention roofline for `kernel` at `head_dim` and `tokens` (module docstring); an
        8-bit kernel the table lacks: the bf16 kernel's rate. Rows measured at the same length
        are told apart by `lanes` (heads x batch, where given): on the H100 (1, 12) and (1, 40)
        heads at 32760 tokens ran at 632 and 572 TFLOP/s."""
        rows = self.attention_rows(kernel) or (kernel == "bf16-masked" and self.attention_rows(MASKED_STAND_IN)) \
            or self.attention_rows("bf16-lse" if kernel == "bf16-lse" else "bf16") or self.attention_rows("bf16")
        dim = min({int(r["head_dim"]) for r in rows}, key=lambda d: (abs(d - head_dim), d))
        at_dim = [r for r in rows if int(r["head_dim"]) == dim]

        def row_lanes(r):
            return float(r.get("heads") or 1) * float(r.get("batch") or 1)

        row = min(at_dim, key=lambda r: (round(_log_distance(tokens, r["tokens"]), 9),
                                         _log_distance(lanes, row_lanes(r)) if lanes else 0.0, r["tokens"]))
        return Roofline(float(row["tflops"]), self._figure("hbm_gb_s"), self.launch_us)

    def elementwise(self) -> Roofline:
        """Norms, modulation, rotary, residuals: bytes at the elementwise bandwidth (compiled, the
        same bandwidth: `step_ops` scales the bytes and launches by `compiled_fraction`)."""
        return Roofline(1e9, self._figure("elementwise_gb_s"), self.launch_us)

    @property
    def compiled_fraction(self) -> float:
        """Of the eager elementwise bytes and launches, the fraction left after compile's fusion."""
        return self._figure("compiled_fraction")

    def collective(self, kind: str, nbytes: float) -> float:
        """Seconds of one `kind` ("all_to_all", "p2p") of `nbytes` leaving a rank: latency +
        bytes / bandwidth at the nearest measured message size."""
        rows = self.data.get(kind) or []
        if not rows:
            raise ValueError(f"device table {self.name}: no {kind} figures")
        row = min(rows, key=lambda r: (_log_distance(nbytes, r["bytes"]), r["bytes"]))
        return _value(row.get("latency_us"), "latency_us") * 1e-6 + nbytes / (_value(row["gb_s"], "gb_s") * 1e9)


def load_table(path: str | Path) -> DeviceTable:
    """A device table from a JSON file; ValueError naming the file when it does not parse."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"device table {str(p)!r} is unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"device table {str(p)!r} is not a JSON object")
    try:
        return DeviceTable(data)
    except ValueError as exc:
        raise ValueError(f"{p.name}: {exc}") from None


@lru_cache(maxsize=None)
def builtin_tables() -> dict[str, DeviceTable]:
    """Device type name -> its table, from raydit/planner/tables/*.json."""
    tables = {}
    for f in sorted(TABLE_DIR.glob("*.json")):
        t = load_table(f)
        tables[t.name] = t
    return tables


def table_for(name: str) -> DeviceTable | None:
    return builtin_tables().get(name)


def device_elementwise_gb_s(device_name: str) -> float:
    """The elementwise bandwidth of a device type's op table, or the decode's
    DEFAULT_ELEMENTWISE_GB_S for a type without one (cpu): what a decode's other ops run at."""
    from raydit.planner.decode import DEFAULT_ELEMENTWISE_GB_S

    table = table_for(device_name)
    return table.data["elementwise_gb_s"]["value"] if table is not None else DEFAULT_ELEMENTWISE_GB_S


# -- one device's step, op by op ---------------------------------------------------------------


@dataclass(frozen=True)
class StepOps:
    """One device's step (ulysses = ring = 1), seconds per part."""

    gemm: float
    attention: float  # self-attention kernels, all layers
    cross_attention: float
    elementwise: float
    quantize: float  # fp8: the activations' quantization outside the GEMMs
    audio: float
    launches: float  # every kernel launch of the step, launch_us each: per layer and transformer call
    attention_per_layer: float  # one layer's self-attention (the kernel that runs at ring 1)
    attention_lse_per_layer: float  # the same with the LSE kernel a ring runs

    @property
    def total(self) -> float:
        return (self.gemm + self.attention + self.cross_attention + self.elementwise + self.quantize + self.audio
                + self.launches)

    def to_dict(self) -> dict:
        d = {k: round(v, 6) for k, v in self.__dict__.items()}
        d["total"] = round(self.total, 6)
        return d


def elementwise_bytes(spec: ModelSpec) -> float:
    """Bytes per token and channel one layer's elementwise ops move in eager mode."""
    return spec.elementwise_bytes or DEFAULT_ELEMENTWISE_BYTES


def elementwise_launches(spec: ModelSpec) -> int:
    """Kernels one layer's elementwise ops launch per transformer call in eager mode."""
    return spec.elementwise_launches or ELEMENTWISE_LAUNCHES


def step_ops(table: DeviceTable, spec: ModelSpec, geo: VideoGeometry, batch: int, mode: Mode = BF16) -> StepOps:
    """One device's denoising step of `batch` samples, op by op (module docstring); with
    full-precision steps (`Mode.full_precision_share` s) the request's mean step: each part
    (1 - s) x the mode's + s x the unquantized mode's."""
    share = mode.full_precision_share
    if share:
        quantized = _step_ops(table, spec, geo, batch, mode)
        plain = _step_ops(table, spec, geo, batch, mode.unquantized)
        return StepOps(*((1.0 - share) * getattr(quantized, f.name) + share * getattr(plain, f.name)
                         for f in dataclasses.fields(StepOps)))
    return _step_ops(table, spec, geo, batch, mode)


def _step_ops(table: DeviceTable, spec: ModelSpec, geo: VideoGeometry, batch: int, mode: Mode) -> StepOps:
    b, L, h, f = batch, spec.layers, spec.hidden, spec.ffn_hidden
    S, X = geo.sequence_tokens, geo.cross_text_tokens
    m = b * S
    dtype = "fp8" if mode.quantize == "fp8" else "bf16"
    e_in = 1 if dtype == "fp8" else 2

    def gemm(rows, n, k):
        if not rows:
            return 0.0
        return table.gemm(rows, n, k, dtype).seconds(2 * rows * n * k, (rows * k + k * n) * e_in + rows * n * 2, 0)

    f_in = 2 * f if spec.gated_ffn else f  # a gated FFN projects to value and gate
    layer = 4 * gemm(m, h, h) + gemm(m, f_in, h) + gemm(m, h, f)
    quant_elems = 3 * m * h + m * f  # inputs of q/k/v (one read), out, FFN in and out
    launches = GEMM_LAUNCHES + ATTENTION_LAUNCHES
    cross = 0.0
    if X:
        layer += 2 * gemm(m, h, h) + 2 * gemm(b * X, h, h)
        quant_elems += 2 * m * h + b * X * h
        launches += CROSS_LAUNCHES
        cross = L * table.attention(spec.head_dim, X, "bf16").seconds(4 * m * X * h, 0.0, 0)
    kernel = ("bf16-masked" if spec.masked_attention else "bf16") if mode.attention == "bf16" else mode.attention
    attn_flop = 4 * b * S * S * h
    per_layer = table.attention(spec.head_dim, S, kernel, b * spec.heads).seconds(attn_flop, 0.0, 0)
    # Sharded (the LSE kernel's layouts) raydit attends to the valid text without a mask.
    lse_kernel = "bf16-lse" if mode.attention == "bf16" else mode.attention
    per_layer_lse = table.attention(spec.head_dim, S, lse_kernel, b * spec.heads).seconds(attn_flop, 0.0, 0)
    keep = table.compiled_fraction if mode.compile else 1.0
    ew = table.elementwise().seconds(0.0, keep * elementwise_bytes(spec) * m * h * L, 0)
    launches += keep * elementwise_launches(spec)
    quant = 0.0
    if dtype == "fp8" and not mode.compile:
        quant = table.elementwise().seconds(0.0, FP8_QUANT_BYTES * quant_elems * L, 0)
        launches += 5
    audio = 0.0
    if spec.audio_hidden and geo.audio_tokens:
        from raydit.planner.cost import audio_work

        whole, split = audio_work(spec, geo, 1, 1, batch, 0.0, 0)
        ha = spec.audio_hidden
        audio = (whole + split) / (table.gemm(b * geo.audio_tokens, ha, ha, dtype).tflops * 1e12)
    # Every launch of a layer happens once per transformer call: a batched model (CogVideoX) runs
    # its guidance branches as one call, the others one call per branch.
    calls = 1 if spec.batched_branches else b
    return StepOps(L * layer, L * per_layer, cross, ew, quant, audio, calls * L * launches * table.launch_us * 1e-6,
                   per_layer, per_layer_lse)


def model_rates(table: DeviceTable, spec: ModelSpec, mode: Mode = BF16, geo: VideoGeometry | None = None,
                batch: int | None = None) -> tuple[float, float, float]:
    """(linear, LSE attention, plain attention) FLOP/s with which the cost model gives back
    `step_ops` of the model's default request (guidance on: `cfg_branches` samples) on one
    device (cost.fit_model_rates), for `mode`."""
    from raydit.planner.cost import fit_model_rates

    geo = geo if geo is not None else spec.geometry()
    batch = batch if batch is not None else spec.cfg_branches
    ops = step_ops(table, spec, geo, batch, mode)
    r = fit_model_rates(spec, geo, batch, ops.total, ops.attention_per_layer, ops.attention_lse_per_layer)
    return r.linear, r.lse_attention, r.plain_attention
