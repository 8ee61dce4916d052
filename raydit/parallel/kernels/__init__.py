"""Local attention kernels, one module per kernel family, and which one runs.

- `dense`: the exact kernels that return the log-sum-exp the ring merges (torch's SDPA
  backends, flash-attn, FlashAttention-3, float64 reference math);
- `lowbit` (+ `lowbit_triton`): 8-bit QK^T (INT8 / FP8) with the lse;
- `choice`: the float64 check every kernel passes before it runs, the measured choice among
  those that passed, and torch's SDPA where no lse is needed.

The names below are the package's interface; import from `raydit.parallel.kernels`.
"""

from raydit.parallel.kernels.choice import (
    ATTENTION_MODES,
    CHECK_SHAPE,
    CHECK_TOLERANCE,
    CPU_PROBE_TOKENS,
    DEFAULT_ATTENTION_MODE,
    DEFAULT_HEAD_DIM,
    HEAD_DIMS,
    KERNELS,
    PROBE_HIDDEN,
    PROBE_ITERS,
    PROBE_TOKENS,
    PROBE_WARMUP,
    KernelChoice,
    PlainFn,
    available_kernels,
    candidate_kernels,
    check_kernel,
    check_mode,
    choose_kernel,
    default_kernel,
    forget_choices,
    kernel_choice,
    measure_kernels,
    plain_kernel,
    select_kernel,
    time_kernels,
    use_measured_rates,
)
from raydit.parallel.kernels.dense import (
    HALF_DTYPES,
    AttentionKernel,
    KernelFn,
    _exact,
    _flash_attn_installed,
    _installed,
    lse_dtype,
)
from raydit.parallel.timing import call_seconds  # the benches time kernels with it from here

__all__ = [
    "ATTENTION_MODES", "CHECK_SHAPE", "CHECK_TOLERANCE", "CPU_PROBE_TOKENS", "DEFAULT_ATTENTION_MODE",
    "DEFAULT_HEAD_DIM", "HALF_DTYPES", "HEAD_DIMS", "KERNELS", "PROBE_HIDDEN", "PROBE_ITERS", "PROBE_TOKENS",
    "PROBE_WARMUP", "AttentionKernel", "KernelChoice", "KernelFn", "PlainFn", "_exact",
    "_flash_attn_installed", "_installed", "available_kernels", "call_seconds", "candidate_kernels",
    "check_kernel", "check_mode", "choose_kernel", "default_kernel", "forget_choices", "kernel_choice",
    "lse_dtype", "measure_kernels", "plain_kernel", "select_kernel", "time_kernels", "use_measured_rates",
]
