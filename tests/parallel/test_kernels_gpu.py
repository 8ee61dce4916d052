"""Every CUDA attention kernel against float64 (GPU only). Whether the probe's choice is the
fastest kernel at a DiT's size is a timing, so `bench/bench_gpu.py` measures it (part
"kernels": each kernel's TFLOP/s at real shapes beside the probe's choice), not this file.

About 10-20 s on one H100. Skipped without CUDA.
"""

import math

import pytest
import torch

from raydit.parallel import SeqLayout, build_mesh, sp_attention
from raydit.parallel import kernels
from raydit.parallel.kernels import (
    CHECK_TOLERANCE,
    KERNELS,
    AttentionKernel,
    candidate_kernels,
    kernel_choice,
    plain_kernel,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (B, H, Sq, Sk): neither length a multiple of 128 (nor of 32, the efficient kernel's lse pad)
# in the first three; equal lengths as a DiT runs them in the last two.
SHAPES = [(1, 3, 77, 133), (2, 4, 301, 1000), (1, 2, 1000, 77), (1, 4, 2047, 2047), (2, 2, 4096, 4096)]


def _hopper() -> bool:
    return torch.cuda.get_device_capability(0)[0] == 9


def _must_run(name: str) -> bool:
    """Kernels that may not raise here: torch's own always; cuDNN's, FlashAttention-3 and
    flash-attn on Hopper (where they are the point). Elsewhere a kernel may be unsupported
    (it is then dropped), never wrong."""
    return name in ("torch-flash", "torch-efficient") or _hopper()


@pytest.fixture(autouse=True)
def fresh_choices():
    kernels.forget_choices()
    yield
    kernels.forget_choices()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_cuda_kernel_matches_float64(dtype, head_dim):
    out_tol, lse_tol = CHECK_TOLERANCE[dtype]
    names = candidate_kernels("cuda", dtype) + ["torch-cuda"]
    assert {"torch-flash", "torch-efficient"} <= set(names)
    for B, H, Sq, Sk in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(Sq * 7 + Sk)
        q = (torch.randn(B, H, Sq, head_dim, device="cuda", generator=g) * 2).to(dtype)
        k, v = (torch.randn(B, H, Sk, head_dim, device="cuda", generator=g).to(dtype) for _ in range(2))
        scale = 1 / math.sqrt(head_dim)
        s = (q.double() @ k.double().transpose(-1, -2)) * scale
        ref_lse = torch.logsumexp(s, -1)
        ref_out = torch.softmax(s, -1) @ v.double()
        for name in names:
            try:
                out, lse = AttentionKernel(name, KERNELS[name])(q, k, v, scale)
            except Exception as exc:
                if _must_run(name):
                    raise AssertionError(f"{name} raised on {(B, H, Sq, Sk, head_dim)} {dtype}: {exc}") from exc
                continue
            where = f"{name} {(B, H, Sq, Sk, head_dim)} {dtype}"
            assert out.dtype == dtype and out.shape == (B, H, Sq, head_dim), where
            assert lse.dtype == torch.float32 and lse.shape == (B, H, Sq), where
            torch.testing.assert_close(lse.double(), ref_lse, atol=lse_tol, rtol=lse_tol, msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close(out.double(), ref_out, atol=out_tol, rtol=out_tol, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_check_keeps_the_kernels_that_must_run(dtype, head_dim):
    choice = kernel_choice("cuda", dtype, head_dim)
    assert choice.name != "reference", choice.dropped
    for name in candidate_kernels("cuda", dtype):
        if _must_run(name):
            assert name not in choice.dropped, (name, choice.dropped[name])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_single_gpu_sp_attention_matches_float64(head_dim):
    """Ring 1 on one GPU runs torch's SDPA (it passes the check) and drops pad keys."""
    assert plain_kernel("cuda", torch.bfloat16, head_dim) is not None
    mesh = build_mesh(ulysses=1, ring=1)
    parts = (226, 1350)
    layout = SeqLayout(parts, 1)
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    q, k, v = (torch.randn(1, 8, layout.local_len, head_dim, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    out = sp_attention(q, k, v, mesh, layout)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(head_dim)
    torch.testing.assert_close(out.double(), torch.softmax(s, -1) @ v.double(), atol=2e-2, rtol=2e-2)
