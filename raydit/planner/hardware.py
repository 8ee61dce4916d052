"""Device types the planner knows: memory, compute rate and links.

Every figure is a vendor datasheet number (dense, no structured sparsity) or, for the
achievable fractions, a round calibration against published single-GPU CogVideoX timings
(docs in `raydit.planner.cost`). They feed a model that ranks layouts; they are not a
promise of absolute speed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

LINK_KINDS = ("nvlink", "pcie", "shm")


def finite_number(value) -> bool:
    """An int or float (not a bool, not a string) that is neither infinite nor NaN."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class DeviceType:
    """One accelerator type (or `cpu`, one CPU slot as the Ray runtime uses it).

    name: the key users type (`--gpu-type H100`).
    memory_gb: device memory in GB (1e9 bytes) a rank can use, before the planner's reserve.
    tflops: dense bf16 tensor-core peak in TFLOP/s (fp16 where the device has no bf16: T4).
    efficiency: the fraction of `tflops` a DiT forward achieves (large GEMMs plus flash
        attention), 0 < efficiency <= 1; where `attention_efficiency` is measured, the
        fraction the rest of the step (linear layers with their norms and activations) reaches.
    link_gb_s: per-GPU bandwidth to the other GPUs of its node, GB/s in one direction
        (NVLink aggregate for SXM parts, PCIe x16 for PCIe parts, memory copies for cpu).
    link_kind: "nvlink", "pcie" or "shm" (CPU slots talking through shared memory).
    link_latency_us: latency of one collective hop inside the node, microseconds.
    per_node: devices to a node for `--gpus N` without `--per-node` (8; 64 CPU slots).
    activation_bytes: bytes per activation element a rank sends (2: bf16 on GPUs; 4 on a CPU
        slot, which runs float32).
    attention_efficiency: ((head_dim, fraction of `tflops`), ...) the LSE attention kernel
        reaches (the one a ring merges; calibration times every kernel and keeps the fastest
        that passes the float64 check), measured by `raydit doctor --calibrate` at a few head
        dims; empty (the table's entries): attention runs at `efficiency` like the rest.
    plain_attention_efficiency: the same for torch's scaled_dot_product_attention, which
        runs where the ring degree is 1 (no lse to merge; on Hopper it picks cuDNN); empty:
        the LSE kernel's figures.
    model_rates: ((ModelSpec.calibration_key, linear, LSE attention, plain attention
        TFLOP/s), ...): a model's own rates on this type (`raydit doctor --calibrate --model`
        times its step on one device; cost.fit_model_rates): where the planner plans that
        model, they replace `efficiency` and the attention figures (`rates_for`).
    """

    name: str
    memory_gb: float
    tflops: float
    efficiency: float
    link_gb_s: float
    link_kind: str
    link_latency_us: float = 10.0
    per_node: int = 8
    activation_bytes: int = 2
    attention_efficiency: tuple[tuple[int, float], ...] = ()
    plain_attention_efficiency: tuple[tuple[int, float], ...] = ()
    model_rates: tuple[tuple[str, float, float, float], ...] = ()
    use_op_table: bool = True  # price steps with raydit/planner/tables/<name>.json where there is one
    calibrated: str = ""  # when and where `raydit doctor --calibrate` measured it ("": not calibrated)
    # FP8 tensor cores (compute capability 8.9 or newer: quantize fp8 runs there): True / False;
    # None: not known (a custom or unknown type; the runtime checks the GPU itself).
    fp8: bool | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"device type name {self.name!r} must be a non-empty string")
        for attr in ("memory_gb", "tflops", "efficiency", "link_gb_s", "link_latency_us"):
            if not finite_number(getattr(self, attr)):
                raise ValueError(f"device type {self.name!r}: {attr} {getattr(self, attr)!r} must be a finite number")
        if self.memory_gb <= 0 or self.tflops <= 0 or self.link_gb_s <= 0:
            raise ValueError(f"device type {self.name!r}: memory_gb, tflops and link_gb_s must be > 0, got "
                             f"{self.memory_gb!r}, {self.tflops!r}, {self.link_gb_s!r}")
        if self.link_latency_us < 0:
            raise ValueError(f"device type {self.name!r}: link_latency_us {self.link_latency_us!r} must be >= 0")
        if isinstance(self.per_node, bool) or not isinstance(self.per_node, int) or self.per_node < 1:
            raise ValueError(f"device type {self.name!r}: per_node {self.per_node!r} must be a positive integer")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"device type {self.name!r}: efficiency {self.efficiency} not in (0, 1]")
        if self.link_kind not in LINK_KINDS:
            raise ValueError(
                f"device type {self.name!r}: link_kind {self.link_kind!r} is not one of "
                f"{', '.join(LINK_KINDS)}"
            )
        if self.fp8 not in (None, True, False):
            raise ValueError(f"device type {self.name!r}: fp8 {self.fp8!r} must be true, false or left out (not known)")
        if self.activation_bytes not in (1, 2, 4, 8):
            raise ValueError(f"device type {self.name!r}: activation_bytes {self.activation_bytes} is not 1, 2, 4 or 8")
        for attr in ("attention_efficiency", "plain_attention_efficiency"):
            given = getattr(self, attr)
            try:  # a cluster file gives lists: store hashable (head_dim, fraction) pairs
                pairs = tuple((int(d), float(f)) for d, f in given)
            except (TypeError, ValueError):
                raise ValueError(f"device type {self.name!r}: {attr} {given!r} "
                                 "must be a list of [head_dim, fraction] pairs") from None
            object.__setattr__(self, attr, pairs)
            for head_dim, fraction in pairs:
                if head_dim < 1 or not 0 < fraction <= 1:
                    raise ValueError(f"device type {self.name!r}: {attr.replace('_', ' ')} {fraction} at "
                                     f"head dim {head_dim} not in (0, 1]")
        try:
            rates = tuple((str(k), float(a), float(b), float(c)) for k, a, b, c in self.model_rates)
        except (TypeError, ValueError):
            raise ValueError(f"device type {self.name!r}: model_rates {self.model_rates!r} must be a list of "
                             "[model key, linear, lse attention, plain attention TFLOP/s]") from None
        for key, *tf in rates:
            if not all(0 < x < 1e6 for x in tf):
                raise ValueError(f"device type {self.name!r}: model_rates of {key!r} {tf} must be TFLOP/s > 0")
        object.__setattr__(self, "model_rates", rates)

    @property
    def flops_per_second(self) -> float:
        """Achievable FLOP/s: peak times the achievable fraction."""
        return self.tflops * 1e12 * self.efficiency

    def attention_flops_per_second(self, head_dim: int, lse: bool = True) -> float:
        """Achievable FLOP/s of the attention kernel at `head_dim`: the measured fraction at
        the nearest measured head dim (the smaller on a tie), else `flops_per_second`.
        lse False: the kernel of ring degree 1 (`plain_attention_efficiency`, where measured)."""
        table = self.attention_efficiency
        if not lse and self.plain_attention_efficiency:
            table = self.plain_attention_efficiency
        if not table:
            return self.flops_per_second
        _, fraction = min(table, key=lambda df: (abs(df[0] - head_dim), df[0]))
        return self.tflops * 1e12 * fraction

    def rates_for(self, spec, mode=None) -> tuple[float, float, float]:
        """(linear, LSE attention, plain attention) FLOP/s the planner uses for `spec` (a
        ModelSpec) in `mode` (devicemodel.Mode; default bf16, eager): the model's own calibration
        on this type where there is one (`model_rates`, measured in bf16 eager), else the type's
        op table (raydit.planner.devicemodel: the model's step op by op, in `mode`), else the
        type's figures at the model's head dim (`rates_source` says which)."""
        source, table = self._source(spec, mode)
        if source == "calibration":
            key = spec.calibration_key
            for known, linear, lse, plain in self.model_rates:
                if known == key:
                    return linear * 1e12, lse * 1e12, plain * 1e12
        if table is not None:
            from raydit.planner.devicemodel import BF16, model_rates

            return model_rates(table, spec, mode or BF16)
        return (self.flops_per_second, self.attention_flops_per_second(spec.head_dim),
                self.attention_flops_per_second(spec.head_dim, lse=False))

    def _source(self, spec, mode):
        from raydit.planner.devicemodel import BF16, table_for

        mode = mode or BF16
        if mode.prices_as_bf16 and any(known == spec.calibration_key for known, *_ in self.model_rates):
            return "calibration", None
        table = table_for(self.name) if self.use_op_table else None
        return ("table", table) if table is not None and table.priced else ("figures", None)

    def rates_kind(self, spec, mode=None) -> str:
        """Which rates `rates_for` uses: "calibration", "table" or "figures"."""
        return self._source(spec, mode)[0]

    def rates_source(self, spec, mode=None) -> str:
        """Where `rates_for` takes its rates: 'calibration file (...)', 'H200 op table of DATE
        (...)' or 'the device figures (...)'."""
        source, table = self._source(spec, mode)
        if source == "calibration":
            return f"calibration file (`raydit doctor --calibrate --model`) for {spec.calibration_key} on {self.name}"
        if source == "table":
            return table.describe() + (f"; calibration file of {self.calibrated}: links and memory (its compute figures "
                                       "are within 2x of the table, which prices the step)" if self.calibrated else "")
        from raydit.planner.devicemodel import table_for

        unused = table_for(self.name)
        why = (f"its op table is {unused.provenance}, used once bench_opsweep measures this GPU" if unused is not None
               else "no op table")
        if self.calibrated:
            why = f"{why}; calibration file of {self.calibrated} (`raydit doctor --calibrate`)"
        if mode is not None and not mode.prices_as_bf16:
            why += f"; mode {mode.label} not priced here (bf16 eager figures)"
        return (f"{self.name} device figures: {self.tflops:g} TFLOP/s x efficiency {self.efficiency:g}"
                + (" (attention per head dim apart)" if self.attention_efficiency else "") + f"; {why}")


# Calibration of `efficiency` (fits: bench/bench_costmodel.py marks these anchors `fit` and
# never uses them as checks): CogVideoX-2b, 49x480x720, guidance on, is about 2.4e14 FLOP
# per step (see cost.py). H100 ~45 s / 50 steps (incl. VAE) -> 0.285 (refit when the decode,
# text encoding and tail-wave terms joined the model: 0.35 predicted 36.7 s, -18%; H200, by
# analogy, keeps its ~8% over H100: 0.31); A100 ~90 s -> ~0.45;
# xDiT's L40 figure (2.1 s/step on one GPU) -> ~0.6. Others are set by analogy.
#
# Attention at head dim 128 on Hopper (H100, H200): FlashAttention-2, the kernel torch's SDPA
# and flash-attn run in bf16 there, reaches 370 TFLOP/s at head dim 128 against 299 at head
# dim 64 (FlashAttention-3 paper, forward, non-causal, 16k tokens, H100 SXM5; FA3 itself: 648
# against 473). The efficiencies above were fit on CogVideoX-2b, whose heads are 64 wide, so
# they are the head-dim-64 attention rate; head dim 128 gets 370 / 299 of it. A published
# kernel figure, not a fit. Other GPUs: no published ratio at hand, one rate for both.
HOPPER_HEAD_DIM_128_SPEEDUP = 370 / 299


def _hopper(name: str, memory_gb: float, efficiency: float) -> DeviceType:
    return DeviceType(name, memory_gb, 989, efficiency, 450, "nvlink", 8.0, fp8=True, attention_efficiency=(
        (64, efficiency), (128, min(1.0, efficiency * HOPPER_HEAD_DIM_128_SPEEDUP))))


DEVICE_TYPES: Mapping[str, DeviceType] = MappingProxyType({
    d.name: d
    for d in (
        _hopper("H100", 80, 0.285),
        _hopper("H200", 141, 0.31),
        # H20 and B200: datasheet memory, dense bf16 peak and NVLink; efficiency by analogy with
        # H100 (it prices their decode and text encoding; the step comes from their op tables,
        # scaled from the H200's by published specs).
        replace(_hopper("H20", 96, 0.285), tflops=148),
        DeviceType("B200", 180, 2250, 0.285, 900, "nvlink", 8.0, fp8=True),
        DeviceType("A100-80GB", 80, 312, 0.45, 300, "nvlink", 8.0, fp8=False),
        DeviceType("A100-40GB", 40, 312, 0.45, 300, "nvlink", 8.0, fp8=False),
        DeviceType("L40S", 48, 362, 0.45, 25, "pcie", 15.0, fp8=True),
        DeviceType("L40", 48, 181, 0.6, 25, "pcie", 15.0, fp8=True),
        DeviceType("L4", 24, 121, 0.5, 12, "pcie", 15.0, fp8=True),
        # A10G (AWS) runs lower clocks than the A10 datasheet's 125; ~70 is an estimate.
        DeviceType("A10G", 24, 70, 0.5, 12, "pcie", 15.0, fp8=False),
        # Consumer parts have no peer-to-peer: traffic bounces through host memory.
        DeviceType("RTX4090", 24, 165, 0.5, 12, "pcie", 20.0, fp8=True),
        # Turing has no bf16: the figure is fp16 with fp32 accumulate; PCIe gen3.
        DeviceType("T4", 16, 65, 0.4, 8, "pcie", 20.0, fp8=False),
        # One Ray CPU slot (one thread): memory shared with the host; tflops: a typical fp32
        # one-thread matmul rate (0.05-0.21 measured on the development machine, which varies
        # from day to day: `raydit doctor --calibrate` measures it, with the DiT block's parts).
        # efficiency: fit on that machine in CPU time (bench/bench_cpufit.py: a CogVideoX-2b-
        # shaped step reached ~0.9 of the matmul rate). Float32 activations.
        DeviceType("cpu", 16, 0.1, 0.9, 5, "shm", 50.0, per_node=64, activation_bytes=4, fp8=False),
    )
})  # read-only

# Between nodes, per GPU, one direction: 200 Gb/s (a common cloud NIC per GPU or per node).
DEFAULT_NETWORK_GB_S = 25.0
DEFAULT_NETWORK_LATENCY_US = 20.0


# Names Ray reports as `accelerator_type` (and common spellings) for the table's entries.
ALIASES = {"a100": "A100-80GB", "a100-80g": "A100-80GB", "a100-40g": "A100-40GB",
           "h100-sxm": "H100", "h100-80gb": "H100", "h200-141gb": "H200", "4090": "RTX4090",
           "rtx-4090": "RTX4090", "cpu-slot": "cpu"}


def device_type(name: str) -> DeviceType:
    """Look a device type up by name (or alias), case-insensitively; ValueError lists the known."""
    key = ALIASES.get(str(name).lower(), str(name))
    for known, value in DEVICE_TYPES.items():
        if known.lower() == key.lower():
            return value
    raise ValueError(
        f"unknown GPU type {name!r}; known: {', '.join(DEVICE_TYPES)} "
        "(or describe it in a cluster file)"
    )
