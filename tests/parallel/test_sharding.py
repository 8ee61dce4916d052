"""SeqLayout: padding, chunking, unsharding and key validity (pure, no processes)."""

import pytest
import torch

from raydit.parallel.sharding import SeqLayout, select_ranges

LENGTHS = [(1,), (7,), (17,), (226, 1350), (226, 17550), (0, 5), (3, 0, 11), (1, 1)]


@pytest.mark.parametrize(
    "parts, sp, chunks, padded, local_len, pad",
    [
        ((226, 17550), 1, (226, 17550), (226, 17550), 17776, 0),
        ((226, 17550), 4, (57, 4388), (228, 17552), 4445, 4),
        ((226, 17550), 8, (29, 2194), (232, 17552), 2223, 8),
        ((226, 1350), 6, (38, 225), (228, 1350), 263, 2),
        ((1,), 6, (1,), (6,), 1, 5),
        ((0, 7), 3, (0, 3), (0, 9), 3, 2),
    ],
)
def test_sizes(parts, sp, chunks, padded, local_len, pad):
    layout = SeqLayout(parts, sp)
    assert layout.chunk_lengths == chunks
    assert layout.padded_lengths == padded
    assert layout.local_len == local_len
    assert layout.pad_tokens == pad


@pytest.mark.parametrize("parts", LENGTHS)
@pytest.mark.parametrize("sp", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("dim", [1, 2])
def test_shard_unshard_roundtrip(parts, sp, dim):
    layout = SeqLayout(parts, sp)
    full = [torch.randn(2, n, 3) if dim == 1 else torch.randn(2, 3, n) for n in parts]
    for p, x in enumerate(full):
        chunks = [layout.shard(x, p, s, dim) for s in range(sp)]
        assert all(c.size(dim) == layout.chunk_lengths[p] for c in chunks)
        assert torch.equal(layout.unshard(chunks, p, dim), x)
        # Pad sits only at the end of the part: the concatenated chunks are x then zeros.
        cat = torch.cat(chunks, dim)
        assert torch.equal(cat.narrow(dim, 0, parts[p]), x)
        assert not cat.narrow(dim, parts[p], layout.padded_lengths[p] - parts[p]).any()


@pytest.mark.parametrize("parts", LENGTHS)
@pytest.mark.parametrize("sp", [1, 2, 3, 4, 6])
def test_local_sequence_order_and_validity(parts, sp):
    """Rank s holds [chunk s of part 0 | chunk s of part 1 | ...]; key_valid marks the real tokens."""
    layout = SeqLayout(parts, sp)
    ones = [torch.ones(1, n) for n in parts]
    for s in range(sp):
        local = layout.shard_parts(ones, s)
        assert local.shape == (1, layout.local_len)
        expected = local[0].bool()
        valid = layout.key_valid(s)
        if valid is None:
            assert expected.all()
        else:
            assert torch.equal(valid, expected)
        split = layout.split_local(local)
        assert [c.size(1) for c in split] == list(layout.chunk_lengths)
        assert layout.part_offset(len(parts) - 1) == sum(layout.chunk_lengths[:-1])


@pytest.mark.parametrize("parts", LENGTHS)
@pytest.mark.parametrize("sp, group", [(2, 2), (4, 2), (6, 3), (6, 2), (5, 5), (3, 1)])
def test_key_ranges_match_validity(parts, sp, group):
    """Ranges of a block (the local sequences of `group` consecutive ranks) cover exactly the real keys."""
    layout = SeqLayout(parts, sp)
    for first in range(0, sp, group):
        indices = range(first, first + group)
        valid = torch.cat([
            torch.ones(layout.local_len, dtype=torch.bool) if layout.key_valid(s) is None else layout.key_valid(s)
            for s in indices
        ])
        ranges = layout.key_ranges(indices)
        covered = torch.zeros_like(valid)
        for start, stop in ranges:
            assert start < stop
            covered[start:stop] = True
        assert torch.equal(covered, valid)
        # Touching ranges are merged: consecutive ranges are separated by at least one pad key.
        assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))
        if ranges:
            x = torch.arange(len(valid)).view(1, 1, -1)
            assert torch.equal(select_ranges(x, ranges, 2)[0, 0], torch.nonzero(valid).flatten())


def test_no_pad_block_is_one_range():
    layout = SeqLayout((226, 1350), 2)
    assert layout.key_ranges(range(2)) == ((0, 2 * layout.local_len),)


@pytest.mark.parametrize(
    "parts, sp, match",
    [((), 2, "empty"), ((0, 0), 2, "no token"), ((-1,), 2, "-1"), ((5,), 0, "sp 0"), ((5.0,), 1, "5.0")],
)
def test_bad_layout(parts, sp, match):
    with pytest.raises(ValueError, match=match):
        SeqLayout(parts, sp)


def test_shard_wrong_length_and_index():
    layout = SeqLayout((7,), 2)
    with pytest.raises(ValueError, match="6 tokens"):
        layout.shard(torch.zeros(1, 6), 0, 0)
    with pytest.raises(ValueError, match="sp_index 2"):
        layout.shard(torch.zeros(1, 7), 0, 2)
    with pytest.raises(ValueError, match="part 1"):
        layout.shard(torch.zeros(1, 7), 1, 0)
    with pytest.raises(ValueError, match="got 1 chunks"):
        layout.unshard([torch.zeros(1, 4)], 0)
