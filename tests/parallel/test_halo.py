"""raydit.parallel.halo: row splits (pure), and halo exchange, group norm and gathers on gloo
processes against the same operation on the whole tensor in one process.

Tolerance: halo exchange and gathers move data and must be exact (atol = rtol = 0); group
norm and convolutions on bands differ from the whole-tensor op by summation order only,
float32 atol = rtol = 1e-5.
One group of 4 processes runs everything; sub-groups (new_group, ranks not starting at 0)
check that group ranks are mapped to global ranks.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raydit.parallel.halo import (
    RowSplit,
    all_gather_uneven,
    fix_band_edges,
    gather_rows,
    group_norm,
    halo_exchange,
    start_halo_exchange,
)
from raydit.parallel.testing import run_distributed

TOL = dict(atol=1e-5, rtol=1e-5)
EXACT = dict(atol=0, rtol=0)
WORLD = 4
# (global ranks of the sub-group, rows of the whole tensor): uneven bands, a band of one row.
GROUPS = [((0, 1, 2, 3), 11), ((1, 3), 5), ((0, 2, 3), 3), ((2,), 4)]


@pytest.mark.parametrize(
    "rows, parts, sizes",
    [(60, 8, (8, 8, 8, 8, 7, 7, 7, 7)), (30, 4, (8, 8, 7, 7)), (7, 5, (2, 2, 1, 1, 1)), (5, 5, (1,) * 5), (9, 1, (9,))],
)
def test_even_split(rows, parts, sizes):
    split = RowSplit.even(rows, parts)
    assert split.sizes == sizes and split.rows == rows and split.parts == parts
    assert [split.bounds(i) for i in range(parts)] == [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(parts)]
    assert split.scaled(8).sizes == tuple(8 * s for s in sizes)


def test_split_errors_name_the_values():
    with pytest.raises(ValueError, match="4 rows cannot be split over 5 ranks.*at most 4 ranks"):
        RowSplit.even(4, 5)
    with pytest.raises(ValueError, match="parts 0"):
        RowSplit.even(4, 0)
    with pytest.raises(ValueError, match="band size 0"):
        RowSplit((3, 0))
    with pytest.raises(ValueError, match="has 6 rows along dim -2, the split is for 7"):
        RowSplit((4, 3)).shard(torch.zeros(2, 6, 5), 0)


def test_shard_bands_cover_the_tensor():
    x = torch.arange(7 * 3).reshape(7, 3)
    split = RowSplit.even(7, 3)
    torch.testing.assert_close(torch.cat([split.shard(x, i, dim=0) for i in range(3)]), x, **EXACT)


def _data(rows, seed):
    g = torch.Generator().manual_seed(seed)
    # B C T H W with an offset far from zero: group norm must not cancel (mean >> std).
    return torch.randn(2, 8, 3, rows, 5, generator=g) * 0.5 + 30.0


def _conv_weight(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, 3, 3, generator=g) * 0.1


def halo_worker(rank, world):
    out = {}
    for ranks, rows in GROUPS:
        group = dist.new_group(list(ranks))
        if rank not in ranks:
            continue
        index = dist.get_rank(group)
        split = RowSplit.even(rows, len(ranks))
        x = split.shard(_data(rows, rows), index).contiguous()
        res = {}
        for before, after in ((1, 1), (0, 1), (1, 0)):
            if min(split.sizes) >= max(before, after):
                res[f"halo{before}{after}"] = halo_exchange(x, before, after, group)
        # A 3x3 'same' convolution of every frame: band + 1-row halos, no row padding.
        frames = x.permute(0, 2, 1, 3, 4).reshape(-1, 8, x.shape[-2], 5)
        res["conv"] = F.conv2d(halo_exchange(frames, 1, 1, group), _conv_weight(1), padding=(0, 1))
        # The same convolution with its own zero padding, the edges corrected in place afterwards.
        if min(split.sizes) >= 2:
            pending = start_halo_exchange(frames, 1, 1, group)
            band = F.conv2d(frames, _conv_weight(1), padding=1)
            top, bottom = pending.wait()
            res["conv_fixed"] = fix_band_edges(
                band, frames, top, bottom, lambda slab: F.conv2d(slab, _conv_weight(1), padding=(0, 1)))
        weight, bias = torch.linspace(0.5, 1.5, 8), torch.linspace(-1, 1, 8)
        res["norm"] = group_norm(x, 4, weight, bias, 1e-6, group)
        res["norm_bf16"] = group_norm(x.bfloat16(), 2, None, None, 1e-5, group)
        res["all"] = gather_rows(x, split, group, dst=None)
        res["to_last"] = gather_rows(x, split, group, dst=len(ranks) - 1)
        res["uneven"] = all_gather_uneven(x[..., :1, : index + 1], dim=-1, group=group)
        if min(split.sizes) < 2:
            try:
                halo_exchange(x, 2, 2, group)
            except ValueError as exc:  # every rank of the group checks before any transfer
                res["halo_error"] = str(exc)
        out[(ranks, index)] = res
    return out


@pytest.fixture(scope="module")
def halo_results():
    merged = {}
    for part in run_distributed(halo_worker, WORLD, timeout=180):
        merged.update(part)
    return merged


@pytest.mark.parametrize("ranks, rows", GROUPS)
def test_halo_exchange_matches_zero_padded_slices(halo_results, ranks, rows):
    full = _data(rows, rows)
    split = RowSplit.even(rows, len(ranks))
    padded = F.pad(full, (0, 0, 1, 1))  # one zero row above and below the whole tensor
    for index in range(len(ranks)):
        res = halo_results[(ranks, index)]
        start, stop = split.bounds(index)
        for key, (before, after) in (("halo11", (1, 1)), ("halo01", (0, 1)), ("halo10", (1, 0))):
            if key in res:
                expected = padded[..., start + 1 - before: stop + 1 + after, :]
                torch.testing.assert_close(res[key], expected, **EXACT)


@pytest.mark.parametrize("ranks, rows", GROUPS)
def test_band_convolution_equals_whole_convolution(halo_results, ranks, rows):
    full = _data(rows, rows)
    frames = full.permute(0, 2, 1, 3, 4).reshape(-1, 8, rows, 5)
    expected = F.conv2d(frames, _conv_weight(1), padding=1)
    got = torch.cat([halo_results[(ranks, i)]["conv"] for i in range(len(ranks))], dim=-2)
    torch.testing.assert_close(got, expected, **TOL)
    if "conv_fixed" in halo_results[(ranks, 0)]:
        fixed = torch.cat([halo_results[(ranks, i)]["conv_fixed"] for i in range(len(ranks))], dim=-2)
        torch.testing.assert_close(fixed, expected, **TOL)


@pytest.mark.parametrize("ranks, rows", GROUPS)
def test_group_norm_reduces_over_every_band(halo_results, ranks, rows):
    full = _data(rows, rows)
    expected = F.group_norm(full, 4, torch.linspace(0.5, 1.5, 8), torch.linspace(-1, 1, 8), 1e-6)
    got = torch.cat([halo_results[(ranks, i)]["norm"] for i in range(len(ranks))], dim=-2)
    torch.testing.assert_close(got, expected, **TOL)
    expected16 = F.group_norm(full.bfloat16(), 2, None, None, 1e-5)
    got16 = torch.cat([halo_results[(ranks, i)]["norm_bf16"] for i in range(len(ranks))], dim=-2)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), expected16.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("ranks, rows", GROUPS)
def test_gathers(halo_results, ranks, rows):
    full = _data(rows, rows)
    last = len(ranks) - 1
    for index in range(len(ranks)):
        res = halo_results[(ranks, index)]
        torch.testing.assert_close(res["all"], full, **EXACT)
        if index == last:
            torch.testing.assert_close(res["to_last"], full, **EXACT)
        else:
            assert res["to_last"] is None
        # Group rank j contributed the first row of its band, j + 1 columns: sizes differ along the gathered dim.
        split = RowSplit.even(rows, len(ranks))
        expected = torch.cat([split.shard(full, j)[..., :1, : j + 1] for j in range(len(ranks))], dim=-1)
        torch.testing.assert_close(res["uneven"], expected, **EXACT)


def test_halo_taller_than_a_band_is_a_value_error(halo_results):
    # Bands of one row (3 rows on 3 ranks, 5 rows on 2 is fine) cannot lend 2 rows.
    messages = [halo_results[((0, 2, 3), i)].get("halo_error") for i in range(3)]
    assert all(m and "fewer than the halo of 2" in m and "use fewer ranks" in m for m in messages)
