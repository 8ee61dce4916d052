"""The sequence layout every layer shares: pad each part, cut it into sp chunks (pure).

Legend: B batch, S sequence (along `dim`), L a part's real length, P its padded length,
C its chunk length (P / sp).

docs/design.md: every part is zero-padded at its end to a multiple of `sp` and cut into
`sp` equal contiguous chunks; rank `s` holds chunk `s` of every part, concatenated in part
order. Nothing here communicates: every rank derives the same layout from the same lengths,
which is what lets attention know which keys are padding without exchanging masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SeqLayout:
    """Padding and chunking of a sequence made of parts (CogVideoX: text, then video)."""

    part_lengths: tuple[int, ...]
    sp: int

    def __post_init__(self) -> None:
        lengths = tuple(self.part_lengths)
        object.__setattr__(self, "part_lengths", lengths)
        if isinstance(self.sp, bool) or not isinstance(self.sp, int) or self.sp < 1:
            raise ValueError(f"sp {self.sp!r} must be an integer >= 1 (ulysses_degree x ring_degree)")
        if not lengths:
            raise ValueError("part_lengths () is empty; give the real length of each sequence part, e.g. (226, 17550)")
        for length in lengths:
            if isinstance(length, bool) or not isinstance(length, int) or length < 0:
                raise ValueError(f"part length {length!r} in {lengths} must be an integer >= 0")
        if sum(lengths) == 0:
            raise ValueError(f"part_lengths {lengths} hold no token; at least one part must be non-empty")

    # -- derived sizes -------------------------------------------------------------------
    @property
    def num_parts(self) -> int:
        return len(self.part_lengths)

    @property
    def chunk_lengths(self) -> tuple[int, ...]:
        """Per part, the tokens one rank holds: ceil(L / sp)."""
        return tuple(-(-length // self.sp) for length in self.part_lengths)

    @property
    def padded_lengths(self) -> tuple[int, ...]:
        return tuple(chunk * self.sp for chunk in self.chunk_lengths)

    @property
    def local_len(self) -> int:
        """Length of the local sequence of every rank: [chunk of part 0 | chunk of part 1 | ...]."""
        return sum(self.chunk_lengths)

    @property
    def pad_tokens(self) -> int:
        """Pad tokens over the whole (all-rank) sequence."""
        return sum(self.padded_lengths) - sum(self.part_lengths)

    @property
    def total_len(self) -> int:
        return sum(self.part_lengths)

    def part_offset(self, part: int) -> int:
        """Where part `part` starts inside a rank's local sequence."""
        self._check_part(part)
        return sum(self.chunk_lengths[:part])

    def valid_counts(self, sp_index: int) -> tuple[int, ...]:
        """Per part, how many of the chunk tokens of rank `sp_index` are real (a prefix of the chunk)."""
        self._check_index(sp_index)
        return tuple(
            max(0, min(chunk, length - sp_index * chunk))
            for length, chunk in zip(self.part_lengths, self.chunk_lengths)
        )

    # -- tensors -------------------------------------------------------------------------
    def shard(self, x: Tensor, part: int, sp_index: int, dim: int = 1) -> Tensor:
        """Full part (L along `dim`) -> chunk `sp_index` (C along `dim`), zero-padded at its end."""
        self._check_part(part)
        self._check_index(sp_index)
        length, chunk = self.part_lengths[part], self.chunk_lengths[part]
        if x.size(dim) != length:
            raise ValueError(
                f"part {part} has {x.size(dim)} tokens along dim {dim}, but the layout says {length}; "
                f"build the SeqLayout from the real part lengths"
            )
        start = sp_index * chunk
        real = x.narrow(dim, min(start, length), self.valid_counts(sp_index)[part])
        if real.size(dim) == chunk:
            return real
        pad_shape = list(x.shape)
        pad_shape[dim] = chunk - real.size(dim)
        return torch.cat([real, x.new_zeros(pad_shape)], dim=dim)

    def shard_parts(self, parts: list[Tensor] | tuple[Tensor, ...], sp_index: int, dim: int = 1) -> Tensor:
        """Full parts -> the local sequence of rank `sp_index` (local_len along `dim`)."""
        if len(parts) != self.num_parts:
            raise ValueError(f"got {len(parts)} parts, the layout has {self.num_parts}")
        return torch.cat([self.shard(x, p, sp_index, dim) for p, x in enumerate(parts)], dim=dim)

    def split_local(self, x_local: Tensor, dim: int = 1) -> list[Tensor]:
        """Local sequence (local_len along `dim`) -> its per-part chunks (views)."""
        if x_local.size(dim) != self.local_len:
            raise ValueError(
                f"local sequence has {x_local.size(dim)} tokens along dim {dim}; the layout expects {self.local_len}"
            )
        return list(torch.split(x_local, list(self.chunk_lengths), dim=dim))

    def unshard(self, chunks: list[Tensor] | tuple[Tensor, ...], part: int, dim: int = 1) -> Tensor:
        """Chunks of part `part` from all sp ranks, in sp order -> the full part, padding removed."""
        self._check_part(part)
        if len(chunks) != self.sp:
            raise ValueError(f"got {len(chunks)} chunks of part {part}, the layout has sp={self.sp}")
        chunk = self.chunk_lengths[part]
        for c in chunks:
            if c.size(dim) != chunk:
                raise ValueError(f"a chunk of part {part} has {c.size(dim)} tokens along dim {dim}, expected {chunk}")
        return torch.cat(list(chunks), dim=dim).narrow(dim, 0, self.part_lengths[part])

    # -- key validity --------------------------------------------------------------------
    def key_valid(self, sp_index: int) -> torch.BoolTensor | None:
        """Validity of the local_len tokens of rank `sp_index`; None when all are real."""
        counts = self.valid_counts(sp_index)
        if counts == self.chunk_lengths:
            return None
        mask = torch.zeros(self.local_len, dtype=torch.bool)
        offset = 0
        for count, chunk in zip(counts, self.chunk_lengths):
            mask[offset : offset + count] = True
            offset += chunk
        return mask

    def key_ranges(self, sp_indices: list[int] | tuple[int, ...] | range) -> tuple[tuple[int, int], ...]:
        """Real-token [start, stop) ranges of the concatenated local sequences of `sp_indices`.

        After the Ulysses all-to-all a rank holds the local sequences of its Ulysses group,
        concatenated in Ulysses order; a ring block is that for one ring rank. Real tokens are
        a prefix of every part chunk, so they form a few ranges; touching ranges are merged,
        so a block without padding is the single range (0, len(sp_indices) * local_len).
        """
        ranges: list[list[int]] = []
        base = 0
        for sp_index in sp_indices:
            offset = base
            for count, chunk in zip(self.valid_counts(sp_index), self.chunk_lengths):
                if count:
                    if ranges and ranges[-1][1] == offset:
                        ranges[-1][1] = offset + count
                    else:
                        ranges.append([offset, offset + count])
                offset += chunk
            base += self.local_len
        return tuple((start, stop) for start, stop in ranges)

    # -- validation helpers --------------------------------------------------------------
    def _check_part(self, part: int) -> None:
        if not 0 <= part < self.num_parts:
            raise ValueError(f"part {part} out of range; the layout has {self.num_parts} parts")

    def _check_index(self, sp_index: int) -> None:
        if not 0 <= sp_index < self.sp:
            raise ValueError(f"sp_index {sp_index} out of range for sp={self.sp}")


def select_ranges(x: Tensor, ranges: tuple[tuple[int, int], ...], dim: int) -> Tensor:
    """Keep the [start, stop) ranges of `x` along `dim`; one range is a view, no copy."""
    if len(ranges) == 1:
        start, stop = ranges[0]
        return x.narrow(dim, start, stop - start)
    return torch.cat([x.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)


def shard_rotary(rotary_emb, layout: SeqLayout, sp_index: int, part: int, dim: int, name: str = "video"):
    """A rotary table (cos, sin) of all of `part`'s tokens along `dim` -> rank `sp_index`'s
    chunk of it, as `layout.shard` cuts the part: zero rows for pad tokens (pad queries are
    dropped at the gather and pad keys are never attended, so their rotation does not matter).
    Each family's table has its own shape ([L, D], [B, L, C], [1, L, 1, D] ...): `dim` is its
    sequence dim; `name` names the part in the error."""
    cos, sin = rotary_emb
    if cos.shape[dim] != layout.part_lengths[part]:
        raise ValueError(
            f"rotary table has {cos.shape[dim]} rows but the {name} has {layout.part_lengths[part]} tokens; "
            "the table must come from the same latents the blocks see"
        )
    return layout.shard(cos, part, sp_index, dim=dim), layout.shard(sin, part, sp_index, dim=dim)
