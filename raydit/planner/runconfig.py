"""One run's modes, typed and frozen: `RunConfig` is built and checked once where the Engine
is made, is constant for the Engine's life, and goes unchanged to the pool, every worker and
every Runner. The plan changes at each regroup and travels beside it (`form(plan)`); what
depends on both (sharded weights only over 2+ ranks, idle weights in host memory, the audio
split) is `GroupModes`, derived from the two by `RunConfig.for_group`.

Pure Python (the planner's layer): the device's own checks (FP8 GEMMs on this GPU) stay with
the Runner, which knows its device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raydit.planner.devicemodel import DEFAULT_STEPS, Mode, run_mode

from raydit.planner.modes import ATTENTION_MODES as ATTENTION_CHOICES
from raydit.planner.modes import DEFAULT_ATTENTION_MODE, DEFAULT_FP8_GRANULARITY, FP8_GRANULARITIES
from raydit.planner.modes import QUANTIZE_MODES as QUANTIZE_CHOICES


@dataclass(frozen=True)
class RunConfig:
    """How every step of an Engine's run goes, whatever the plan.

    compile: regional torch.compile of the transformer blocks (raydit.models.compile).
    quantize: None ("none" is taken for it), "fp8" or "fp8-sim": the blocks' linears as FP8
    GEMMs, or their numbers emulated on any device (raydit.models.quantize); `fp8_granularity`
    their scales per "row" or per "tensor".
    attention: the attention kernels' mode ("bf16", "auto", "int8", "fp8").
    full_precision_steps: N; the first and last N steps of a request without the quantized
    modes (a quantized run then keeps its linears' unquantized weights, so never sharded).
    shard_weights: True: each rank keeps 1/N of every block's weights (raydit.models.sharded);
    False: never; None: where the plan needs it to fit (Plan.shard_weights)."""

    compile: bool = False
    quantize: str | None = None
    attention: str = "bf16"
    full_precision_steps: int = 0
    shard_weights: bool | None = None
    fp8_granularity: str = DEFAULT_FP8_GRANULARITY

    def __post_init__(self):
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile {self.compile!r} must be True or False")
        quantize = None if self.quantize in (None, "none") else self.quantize
        if quantize is not None and (not isinstance(quantize, str) or quantize not in QUANTIZE_CHOICES):
            raise ValueError(f"quantize {self.quantize!r} is not a mode; use one of: {', '.join(QUANTIZE_CHOICES)} "
                             "(fp8-sim: FP8 numerics emulated on any device, no speed)")
        object.__setattr__(self, "quantize", quantize)
        attention = DEFAULT_ATTENTION_MODE if self.attention is None else self.attention
        if not isinstance(attention, str) or attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention {self.attention!r} is not a mode; use one of: {', '.join(ATTENTION_CHOICES)} "
                             "(default bf16)")
        object.__setattr__(self, "attention", attention)
        if self.fp8_granularity not in FP8_GRANULARITIES:
            raise ValueError(f"fp8_granularity {self.fp8_granularity!r} is not one of: {', '.join(FP8_GRANULARITIES)}")
        if self.shard_weights not in (None, True, False):
            raise ValueError(f"shard_weights {self.shard_weights!r} must be True, False or None (the planner's choice)")
        steps = 0 if self.full_precision_steps is None else self.full_precision_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"full_precision_steps {steps!r} must be a whole number >= 0 (the first and last N steps "
                             "of a request run without the quantized modes)")
        if steps and quantize is None and attention == "bf16":
            raise ValueError(f"full_precision_steps {steps} needs a quantized mode to leave (quantize fp8 / fp8-sim, or "
                             "attention auto / int8 / fp8); every step already runs in full precision: drop it")
        if steps and quantize is not None and self.shard_weights:
            raise ValueError(f"full_precision_steps {steps} keeps every FP8 linear's unquantized weight on its rank, "
                             "which sharded weights do not hold; drop full_precision_steps or shard_weights")
        object.__setattr__(self, "full_precision_steps", steps)
        if steps and quantize is not None:
            object.__setattr__(self, "shard_weights", False)  # the kept weights are whole on every rank

    def mode(self, steps: int = DEFAULT_STEPS) -> Mode:
        """How the planner prices a step of this run, for requests of `steps` steps."""
        return run_mode(self.quantize, self.attention, self.compile, self.full_precision_steps, steps=steps)

    def for_group(self, plan: Any, world: int) -> "GroupModes":
        """The modes of a group of `world` ranks running `plan` (a raydit.planner Plan)."""
        chosen = getattr(plan, "shard_weights", False) if self.shard_weights is None else self.shard_weights
        split = getattr(plan, "audio_split_tokens", None)
        return GroupModes(shard_weights=bool(chosen) and world > 1,
                          offload_idle=getattr(plan, "offload_idle_gb", 0.0) > 0,
                          parallel_options={"audio_split_tokens": split} if world > 1 else None)


@dataclass(frozen=True)
class GroupModes:
    """What a Runner takes from its group's plan: `shard_weights` (only over 2+ ranks),
    `offload_idle` (the plan keeps idle weights in host memory: Plan.offload_idle_gb) and
    `parallel_options` for the model's adapter (e.g. audio_split_tokens: Plan)."""

    shard_weights: bool = False
    offload_idle: bool = False
    parallel_options: dict | None = field(default=None, hash=False)
