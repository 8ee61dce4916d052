"""8-bit attention (raydit.parallel.kernels.lowbit): its lse, its float64 check, its choice, and every
sequence-parallel layout against one process under the same mode.

Rules used: the torch implementations are the 8-bit scheme itself, so where two runs feed the
kernel the same keys (one process, Ulysses) they agree to float rounding (float32: 2e-5;
bf16: the dtype's own noise, measured in the same test). A ring feeds each block its own
keys, so each block is smoothed and scaled on its own: there the layout is held to the
mode's own error against float64 (measured in the same test), which a ring that merged
blocks with a wrong lse misses by far.
"""

from __future__ import annotations

import math

import pytest
import torch

from raydit.parallel import kernels
from raydit.parallel.kernels import lowbit
from raydit.parallel.attention import merge_attention, sp_attention
from raydit.parallel.kernels import _exact
from raydit.parallel.mesh import build_mesh, gather_sequence, with_attention
from raydit.parallel.sharding import SeqLayout
from raydit.parallel.testing import run_distributed

PARTS = (97, 131)  # uneven: pad tokens on some ranks
HEADS, HEAD_DIM = 4, 32


def qkv(seed: int, tokens: int, dtype=torch.float32, heads=HEADS, head_dim=HEAD_DIM, offset=0.5):
    """q, k, v (1, H, S, D); keys share a common offset, as a DiT's do."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, tokens, head_dim, generator=g) * 2.0
    k = torch.randn(1, heads, tokens, head_dim, generator=g) + offset * torch.randn(1, heads, 1, head_dim, generator=g).sign()
    v = torch.randn(1, heads, tokens, head_dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("mode", lowbit.MODES)
def test_lse_puts_back_what_smoothing_took_out(mode):
    # A constant added to every key shifts every score of a query row by scale * q . c:
    # smoothing makes out and the quantized values identical, and the lse must move by exactly that.
    q, k, v = qkv(0, 150)
    c = torch.randn(1, HEADS, 1, HEAD_DIM) * 3.0
    scale = HEAD_DIM ** -0.5
    out_a, lse_a = lowbit.attention_torch(q, k, v, scale, mode)
    out_b, lse_b = lowbit.attention_torch(q, k + c, v, scale, mode)
    # float32 rounding of k + c can move a value across a rounding boundary of the 8-bit grid.
    assert lowbit.relative_l2(out_b, out_a) < 1e-4
    shift = (q @ c.transpose(-1, -2)).squeeze(-1) * scale
    torch.testing.assert_close(lse_b - lse_a, shift, atol=1e-3, rtol=1e-5)
    assert float(shift.abs().max()) > 1.0  # the shift is large: a missing correction fails


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", lowbit.MODES)
def test_blocks_merged_by_lse_equal_the_whole_within_the_modes_error(mode, dtype):
    # Two key blocks with different means (as ring blocks are), merged by their lse.
    q, k, v = qkv(1, 200, dtype)
    k[:, :, 100:] += 2.0
    scale = HEAD_DIM ** -0.5
    ref_out, ref_lse = _exact(q, k, v, scale)
    whole, whole_lse = lowbit.attention_torch(q, k, v, scale, mode)
    out, lse = None, None
    for keys in (slice(0, 100), slice(100, 200)):
        o, l = lowbit.attention_torch(q, k[:, :, keys], v[:, :, keys], scale, mode)
        out, lse = merge_attention(out, lse, o, l)
    own = lowbit.relative_l2(whole, ref_out)
    merged = lowbit.relative_l2(out, ref_out)
    assert 0 < own < lowbit.CHECK_TOLERANCE[mode][0]
    assert merged < 1.5 * own + 2e-3, (merged, own)
    assert float((lse.double() - ref_lse).abs().max()) < lowbit.CHECK_TOLERANCE[mode][1]


@pytest.mark.parametrize("mode", lowbit.MODES)
def test_the_8bit_error_is_stated_and_larger_than_bf16s(mode):
    # The trade, on the check's inputs: each mode's relative L2 error against float64, beside bf16's.
    q, k, v, scale = lowbit.check_inputs(torch.device("cpu"), torch.bfloat16, 64)
    ref_out, _ = _exact(q, k, v, scale)
    bf16 = lowbit.relative_l2(kernels.KERNELS["torch-cpu"](q, k, v, scale)[0], ref_out)
    err = lowbit.relative_l2(lowbit.attention_torch(q, k, v, scale, mode)[0], ref_out)
    low, high = {"int8": (0.005, 0.03), "fp8": (0.03, 0.1)}[mode]
    assert bf16 < 0.005 and low < err < high, (bf16, err)


def test_modes_choose_their_kernels_and_unknown_modes_are_refused():
    kernels.forget_choices()
    assert kernels.kernel_choice("cpu", torch.float32, 64, "bf16").name == "torch-cpu"
    assert kernels.kernel_choice("cpu", torch.float32, 64, "auto").name == "torch-cpu"  # emulations are never fast
    assert kernels.kernel_choice("cpu", torch.bfloat16, 64, "int8").name == "int8-torch"
    assert kernels.kernel_choice("cpu", torch.bfloat16, 64, "fp8").name == "fp8-torch"
    with pytest.raises(ValueError, match=r"attention mode 'int4' is unknown; choose one of bf16, auto, int8, fp8"):
        kernels.kernel_choice("cpu", torch.float32, 64, "int4")
    with pytest.raises(ValueError, match="unknown"):
        with_attention(None, "fp4")


def test_a_kernel_that_fails_its_check_is_never_chosen(monkeypatch):
    # An 8-bit kernel whose lse is in base 2 (a classic slip) fails the float64 check; the
    # mode then has no kernel, which is one line naming the fix, not the slow fallback.
    def base2_lse(q, k, v, scale):
        out, lse = lowbit.attention_torch(q, k, v, scale, "int8")
        return out, lse / lowbit.LN2

    monkeypatch.setitem(kernels.KERNELS, "int8-torch", base2_lse)
    kernels.forget_choices()
    try:
        assert kernels.check_kernel("int8-torch", "cpu", torch.float32, 64) is not None
        with pytest.raises(ValueError) as info:
            kernels.kernel_choice("cpu", torch.float32, 64, "int8")
        message = str(info.value)
        assert "\n" not in message and "int8-torch: lse off by" in message and "--attention bf16" in message
    finally:
        kernels.forget_choices()


def layout_worker(rank, world, dtype_name):
    """sp_attention under every 8-bit mode on the layouts of `world` ranks; the output per layout."""
    dtype = getattr(torch, dtype_name)
    results = {}
    tokens = sum(PARTS)
    q, k, v = qkv(7, tokens, dtype)
    for U, R in ((world, 1), (1, world), (2, world // 2)):
        if U * R != world or (U, R) in results:
            continue
        base = build_mesh(U, R)
        for mode in lowbit.MODES:
            mesh = with_attention(base, mode)
            layout = SeqLayout(PARTS, world)
            # (1, H, S, D) per part -> this rank's shard of the concatenated sequence.
            parts = [torch.stack([t.split(list(PARTS), dim=2)[p] for t in (q, k, v)]) for p in range(len(PARTS))]
            local = layout.shard_parts(parts, mesh.sp_index, dim=3)
            out = sp_attention(local[0], local[1], local[2], mesh, layout)
            results[(U, R, mode)] = torch.cat([gather_sequence(out, mesh, layout, p, dim=2) for p in range(len(PARTS))], 2)
    return results


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_every_layout_equals_one_process_under_the_same_mode(dtype_name):
    dtype = getattr(torch, dtype_name)
    q, k, v = qkv(7, sum(PARTS), dtype)
    scale = HEAD_DIM ** -0.5
    ref_out, _ = _exact(q, k, v, scale)
    exact_bf16 = lowbit.relative_l2(kernels.KERNELS["torch-cpu"](q, k, v, scale)[0], ref_out)
    for world in (2, 4):
        results = run_distributed(layout_worker, world, dtype_name, timeout=300)[0]
        for (U, R, mode), out in results.items():
            one, _ = lowbit.attention_torch(q, k, v, scale, mode)
            own = lowbit.relative_l2(one, ref_out)
            if R == 1:  # the same keys reach the kernel: float rounding only
                tol = 2e-5 if dtype == torch.float32 else 2 * exact_bf16 + 1e-3
                assert lowbit.relative_l2(out, one) < tol, (world, U, R, mode)
            else:
                assert lowbit.relative_l2(out, ref_out) < 1.5 * own + 2e-3, (world, U, R, mode, own)
                assert lowbit.relative_l2(out, one) < 2 * own, (world, U, R, mode, own)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels)")
@pytest.mark.parametrize("head_dim", lowbit.TRITON_HEAD_DIMS)
@pytest.mark.parametrize("mode", lowbit.MODES)
def test_triton_kernels_compute_the_torch_scheme(mode, head_dim):
    if mode == "fp8" and not lowbit.fp8_capable("cuda"):
        pytest.skip("FP8 needs compute capability 8.9+")
    q, k, v = (t.cuda() for t in qkv(3, 1000, torch.bfloat16, heads=3, head_dim=head_dim))
    scale = head_dim ** -0.5
    out, lse = lowbit.attention_triton(q, k, v, scale, mode)
    ref, ref_lse = lowbit.attention_torch(q, k, v, scale, mode)
    exact, _ = _exact(q.cpu(), k.cpu(), v.cpu(), scale)
    own = lowbit.relative_l2(ref.cpu(), exact)
    # The same scheme: a value on a rounding edge of the 8-bit grid may round the other way
    # (fused vs unfused float math), and P is rounded against running maxima; both far below
    # the mode's own error.
    assert lowbit.relative_l2(out, ref) < 0.25 * own
    assert float((lse - ref_lse).abs().max()) < 0.25 * lowbit.CHECK_TOLERANCE[mode][1]
    assert kernels.check_kernel(f"{mode}-triton", "cuda", torch.bfloat16, head_dim) is None
