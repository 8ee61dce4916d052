"""Pure pieces of sp_attention: lse merge, Ulysses reshapes, kernels, input checks (no processes)."""

import math

import pytest
import torch

from raydit.parallel import SeqLayout, build_mesh, select_kernel, sp_attention
from raydit.parallel.attention import (
    feasible_ulysses,
    head_chunks_of,
    head_to_seq_recv,
    head_to_seq_send,
    merge_attention,
    seq_to_head_recv,
    seq_to_head_send,
)
from raydit.parallel.kernel_report import describe_kernels
from raydit.parallel.kernels import available_kernels, lse_dtype

# float32 results against float64 math: atol = rtol = 1e-5 unless a test states otherwise.
TOL = dict(atol=1e-5, rtol=1e-5)


def reference_scores(q, k, scale):
    return torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale


def reference_attention(q, k, v, scale):
    s = reference_scores(q, k, scale)
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


# -- kernels -------------------------------------------------------------------------------
CPU_KERNELS = available_kernels("cpu")


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("sq, sk, d", [(1, 1, 64), (7, 17, 64), (33, 129, 128)])
def test_kernel_lse_is_logsumexp_of_scores(name, dtype, tol, sq, sk, d):
    """Every kernel's lse is logsumexp of the scores (a zero lse, as yunchang's torch path returns, fails).

    lse is float32 by contract, float64 for float64 inputs (held to 1e-12: a float64 run stays
    float64 through the ring's merge).
    """
    kernel = select_kernel("cpu", dtype, prefer=name)
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    q, k, v = (torch.randn(2, 3, n, d, generator=g).to(dtype) for n in (sq, sk, sk))
    scale = 0.7 / math.sqrt(d)
    out, lse = kernel(q, k, v, scale)
    ref_out, ref_lse = reference_attention(q, k, v, scale)
    assert lse.dtype == lse_dtype(dtype) and lse.shape == (2, 3, sq)
    assert out.dtype == dtype and out.shape == (2, 3, sq, d)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)


def test_kernel_empty_keys_contribute_nothing():
    kernel = select_kernel("cpu", torch.float32)
    q = torch.randn(1, 2, 3, 8)
    out, lse = kernel(q, torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8), 0.3)
    assert torch.equal(out, torch.zeros(1, 2, 3, 8))
    assert torch.isneginf(lse).all()


def test_select_kernel_choices():
    assert select_kernel("cpu").name == "torch-cpu"
    assert select_kernel("cpu", prefer="reference").name == "reference"
    with pytest.raises(ValueError, match="'nope' is unknown"):
        select_kernel("cpu", prefer="nope")
    with pytest.raises(ValueError, match="cannot run on cpu"):
        select_kernel("cpu", prefer="flash-attn")
    info = describe_kernels()
    assert info["cpu"]["selected"] == "torch-cpu"
    assert "reference" in info["cpu"]["available"]


# -- lse merge -----------------------------------------------------------------------------
@pytest.mark.parametrize("splits", [(5, 7), (1, 1, 10), (12,), (3, 0, 9), (0, 12)])
@pytest.mark.parametrize("offset", [0.0, 80.0])
def test_merge_equals_attention_over_all_keys(splits, offset):
    """Attention over key blocks merged with lse == attention over all keys, in any order."""
    g = torch.Generator().manual_seed(len(splits))
    q = torch.randn(2, 3, 5, 16, generator=g)
    k = torch.randn(2, 3, sum(splits), 16, generator=g)
    v = torch.randn(2, 3, sum(splits), 16, generator=g)
    # A large offset on some scores checks that the merge never overflows exp().
    q = q * (1.0 + offset / 16)
    kernel = select_kernel("cpu", prefer="reference")
    ref_out, ref_lse = reference_attention(q, k, v, 0.25)
    blocks = list(zip(torch.split(k, list(splits), 2), torch.split(v, list(splits), 2)))
    for order in (blocks, blocks[::-1]):
        out = lse = None
        for kb, vb in order:
            out, lse = merge_attention(out, lse, *kernel(q, kb, vb, 0.25))
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref_out, **TOL)
        torch.testing.assert_close(lse.double(), ref_lse, **TOL)


def test_merge_of_float64_blocks_is_float64():
    """float64 partials merge in float64 (a float32 merge would leave ~1e-7 of the ring's
    result: the gap a float64 run of ring 2 showed against one process before, issue 41)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g, dtype=torch.float64) for n in (5, 12, 12))
    kernel = select_kernel("cpu", torch.float64)
    ref_out, ref_lse = reference_attention(q, k, v, 0.25)
    out = lse = None
    for kb, vb in zip(torch.split(k, [5, 7], 2), torch.split(v, [5, 7], 2)):
        out, lse = merge_attention(out, lse, *kernel(q, kb, vb, 0.25))
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-13, atol=1e-13)


def test_merge_with_neg_inf_is_safe():
    out_a, out_b = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    lse_b = torch.tensor([[[0.5, -math.inf, 2.0]]])
    lse_a = torch.tensor([[[-math.inf, -math.inf, 1.0]]])
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out[0, 0, 0], out_b[0, 0, 0])  # a had no key: b alone
    assert torch.equal(out[0, 0, 1], torch.zeros(4)) and torch.isneginf(lse[0, 0, 1])
    w = torch.softmax(torch.tensor([1.0, 2.0]), 0)
    torch.testing.assert_close(out[0, 0, 2], w[0] * out_a[0, 0, 2] + w[1] * out_b[0, 0, 2], **TOL)
    torch.testing.assert_close(lse[0, 0, 2], torch.logsumexp(torch.tensor([1.0, 2.0]), 0), **TOL)


# -- Ulysses all-to-all reshapes -----------------------------------------------------------
def simulate_all_to_all(sends):
    """all_to_all_single over dim 0: rank j receives slice j of every rank's send, in rank order."""
    return [torch.stack([send[j] for send in sends]) for j in range(len(sends))]


@pytest.mark.parametrize("U, H", [(1, 3), (2, 4), (3, 6), (5, 30), (6, 48)])
def test_ulysses_reshapes(U, H):
    N, B, S, D = 3, 2, 4, 5
    xs = [torch.randn(N, B, H, S, D) for _ in range(U)]  # rank r holds sequence chunk r
    h = H // U
    # Inputs of any strides (diffusers hands over (B, S, H, D) memory viewed as (B, H, S, D)).
    sends = [seq_to_head_send([x[n].transpose(1, 2).contiguous().transpose(1, 2) for n in range(N)], U) for x in xs]
    recvs = simulate_all_to_all(sends)
    for j, recv in enumerate(recvs):
        got = seq_to_head_recv(recv)
        # Rank j: heads j*h..(j+1)*h of the whole Ulysses sequence, chunks in rank order.
        expected = torch.cat([x[:, :, j * h : (j + 1) * h] for x in xs], dim=3)
        assert torch.equal(got, expected)
    # And back: each rank's attention output (one head slice, all tokens) -> all heads, own tokens.
    outs = [seq_to_head_recv(r)[0] for r in recvs]
    backs = simulate_all_to_all([head_to_seq_send(o, U) for o in outs])
    for r, back in enumerate(backs):
        assert torch.equal(head_to_seq_recv(back), xs[r][0])


@pytest.mark.parametrize("U, H, chunks", [(2, 30, 4), (3, 6, 2), (5, 30, 6), (2, 4, 1), (6, 48, 3)])
def test_ulysses_reshapes_by_head_chunk(U, H, chunks):
    """Chunked exchanges (what sp_attention pipelines) put every head where the whole one does."""
    N, B, S, D = 3, 2, 4, 5
    xs = [torch.randn(N, B, H, S, D) for _ in range(U)]
    h = H // U
    outs_by_rank = [torch.empty(B, U, h, S, D) for _ in range(U)]
    for start, stop in head_chunks_of(h, chunks):
        recvs = simulate_all_to_all([seq_to_head_send(list(x), U, (start, stop)) for x in xs])
        for j, recv in enumerate(recvs):
            got = seq_to_head_recv(recv)  # (N, B, c, U*S, D)
            expected = torch.cat([x[:, :, j * h + start : j * h + stop] for x in xs], dim=3)
            assert torch.equal(got, expected), (j, start, stop)
        backs = simulate_all_to_all([head_to_seq_send(seq_to_head_recv(r)[0], U) for r in recvs])
        for r, back in enumerate(backs):
            outs_by_rank[r][:, :, start:stop] = back.permute(1, 0, 2, 3, 4)
    for r in range(U):
        assert torch.equal(outs_by_rank[r].view(B, H, S, D), xs[r][0])


@pytest.mark.parametrize("h, chunks, sizes", [(15, 4, [4, 4, 4, 3]), (5, 2, [3, 2]), (3, 8, [1, 1, 1]), (8, 1, [8])])
def test_head_chunks_cover_every_head_once(h, chunks, sizes):
    got = head_chunks_of(h, chunks)
    assert [b - a for a, b in got] == sizes
    assert got[0][0] == 0 and got[-1][1] == h and all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_feasible_ulysses():
    assert feasible_ulysses(30) == [1, 2, 3, 5, 6, 10, 15, 30]


# -- sp_attention on one process -------------------------------------------------------------
def test_single_process_sp_attention_matches_reference():
    mesh = build_mesh(1)
    layout = SeqLayout((5, 19), 1)
    q, k, v = (torch.randn(1, 6, 24, 32) for _ in range(3))
    out = sp_attention(q, k, v, mesh, layout)
    ref, _ = reference_attention(q, k, v, 32**-0.5)
    torch.testing.assert_close(out.double(), ref, **TOL)


def test_sp_attention_input_errors():
    mesh = build_mesh(1)
    q = torch.randn(1, 6, 24, 32)
    with pytest.raises(ValueError, match="SeqLayout sp 2 does not match .* = 1"):
        sp_attention(q, q, q, mesh, SeqLayout((24,), 2))
    with pytest.raises(ValueError, match="q has 24 tokens, but this rank's local sequence is 25"):
        sp_attention(q, q, q, mesh, SeqLayout((25,), 1))
    with pytest.raises(ValueError, match="share one"):
        sp_attention(q, q[:, :3], q, mesh, SeqLayout((24,), 1))
    with pytest.raises(ValueError, match="head_chunks 0 must be an integer >= 1"):
        sp_attention(q, q, q, mesh, SeqLayout((24,), 1), head_chunks=0)
    # One dtype for q, k and v (the Ulysses exchange would cast k and v to q's without a word).
    with pytest.raises(ValueError, match="q, k, v must share one dtype and device; got torch.bfloat16 on cpu, "
                                         "torch.float32 on cpu"):
        sp_attention(q.bfloat16(), q, q.bfloat16(), mesh, SeqLayout((24,), 1))


def test_build_mesh_without_process_group():
    mesh = build_mesh(1)
    assert (mesh.world_size, mesh.rank, mesh.sp_index, mesh.sp_group) == (1, 0, 0, None)
    with pytest.raises(ValueError, match="not initialized"):
        build_mesh(2)
    with pytest.raises(ValueError, match="ring_degree 0"):
        build_mesh(1, 0)
