"""What `raydit doctor` says of the attention kernels: available, chosen per head dim, and why."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raydit.parallel.kernels import HEAD_DIMS, _flash_attn_installed, _installed, available_kernels, kernel_choice

def describe_kernels(head_dims: Sequence[int] = HEAD_DIMS) -> dict:
    """What is available and what would run, per head dim, and why (for `raydit doctor`).
    On a GPU without a calibration this runs the bounded probe."""
    cuda = torch.cuda.is_available()
    info: dict = {
        "torch": torch.__version__,
        "cuda_available": cuda,
        "flash_attn_installed": _flash_attn_installed(),
        "fa3_installed": _installed("flash_attn_interface"),
    }
    for dev, dtype, label in (("cpu", torch.float32, "cpu"), ("cuda", torch.bfloat16, "cuda")):
        if dev == "cuda" and not cuda:
            continue
        by_dim = {str(d): kernel_choice(dev, dtype, d) for d in head_dims}
        info[label] = {
            "available": available_kernels(dev),
            "dtype": str(dtype).removeprefix("torch."),
            "selected": by_dim[str(head_dims[-1])].name,
            "by_head_dim": {d: {"kernel": c.name, "why": c.why, "rates": dict(c.rates), "dropped": dict(c.dropped),
                                "text": c.describe()} for d, c in by_dim.items()},
        }
    if cuda:
        info["cuda"]["selected_bf16"] = info["cuda"]["selected"]
        info["cuda"]["selected_fp32"] = kernel_choice("cuda", torch.float32, head_dims[-1]).name
    return info
