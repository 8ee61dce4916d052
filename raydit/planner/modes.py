"""The run modes' choices, listed once: the attention kernels' modes and the quantize modes.

The planner prices them (raydit.planner.devicemodel), the parallel layer runs them
(raydit.parallel.kernels, raydit.parallel.lowbit), the command line and the options table offer
them (raydit.runtime.options, `raydit plan`). Pure Python: no torch, no Ray.
"""

from __future__ import annotations

# The attention kernels' modes (`--attention`): "bf16" the run's own dtype (bf16 on GPUs, the
# exact kernels), "auto" the fastest kernel of any mode that passed its float64 check on this
# (device, dtype, head dim), "int8" 8-bit QK^T with the PV product in the run's dtype, "fp8" FP8
# QK^T and PV.
ATTENTION_MODES = ("bf16", "auto", "int8", "fp8")
DEFAULT_ATTENTION_MODE = "bf16"
EIGHT_BIT_ATTENTION_MODES = ("int8", "fp8")  # raydit.parallel.lowbit's kernels
# What the planner prices: the 8-bit modes at their own rates, the others ("auto" included:
# on the measured H100 cuDNN's bf16 kernel is the fastest that passes its check) as bf16.
PRICED_ATTENTION_MODES = (DEFAULT_ATTENTION_MODE, *EIGHT_BIT_ATTENTION_MODES)

# The transformer blocks' linear layers (`--quantize`): "none" the run's dtype, "fp8" FP8 GEMMs
# (torchao), "fp8-sim" the same numbers emulated in the run's dtype (numerics only, no speed).
QUANTIZE_MODES = ("none", "fp8", "fp8-sim")
DEFAULT_QUANTIZE_MODE = "none"
FP8_PRICED_QUANTIZE_MODES = ("fp8",)  # one-byte weights at FP8 GEMM rates; fp8-sim: bf16's
PRICED_QUANTIZE_MODES = (DEFAULT_QUANTIZE_MODE, *FP8_PRICED_QUANTIZE_MODES)

# FP8 scales' granularity: "row" one per output row of a weight and one per token of an
# activation (the default: a token's quantization is then the same on any split of the
# sequence, so every plan quantizes as one rank does); "tensor" one per tensor (an activation's
# scale then depends on the rank's share of the sequence).
FP8_GRANULARITIES = ("row", "tensor")
DEFAULT_FP8_GRANULARITY = "row"

assert set(EIGHT_BIT_ATTENTION_MODES) <= set(ATTENTION_MODES) and DEFAULT_ATTENTION_MODE in ATTENTION_MODES
assert set(PRICED_QUANTIZE_MODES) <= set(QUANTIZE_MODES)
