"""Range arithmetic on one matrix dim or one matrix: which global rows and columns a rank
holds, from chunk counts and coordinates alone (no tensors, no process groups).

A rank's holding of a dim is a tuple of ``(start, stop)`` ranges in its local order: one for
``Shard`` (``torch.chunk``: ceil-sized chunks, the last ones shorter or empty), several for a
``_StridedShard``. Exact for uneven and empty shards, so nothing is ever padded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Piece", "Range", "chunk_sizes", "extent_of", "shard_ranges"]

Range = tuple[int, int]


@dataclass(frozen=True)
class Piece:
    """What one rank holds of a ``[rows, cols]`` matrix: the global rows and columns, as
    ``(start, stop)`` ranges in its local order (a strided shard holds several)."""

    rows: tuple[Range, ...]
    cols: tuple[Range, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return extent_of(self.rows), extent_of(self.cols)

    @property
    def numel(self) -> int:
        rows, cols = self.shape
        return rows * cols

    def blocks(self) -> list[tuple[Range, Range, Range, Range]]:
        """``(global_rows, global_cols, local_rows, local_cols)`` of each contiguous block."""
        out = []
        local_row = 0
        for r0, r1 in self.rows:
            local_col = 0
            for c0, c1 in self.cols:
                out.append(
                    (
                        (r0, r1),
                        (c0, c1),
                        (local_row, local_row + r1 - r0),
                        (local_col, local_col + c1 - c0),
                    )
                )
                local_col += c1 - c0
            local_row += r1 - r0
        return out


def extent_of(ranges: tuple[Range, ...]) -> int:
    return sum(stop - start for start, stop in ranges)


def chunk_sizes(n: int, k: int) -> tuple[int, ...]:
    """Sizes of ``Shard`` chunks of ``n`` over ``k`` ranks (``torch.chunk``: ceil(n/k) each)."""
    whole = ((0, n),) if n else ()
    return tuple(extent_of(_chunk(whole, k, j)) for j in range(k))


def shard_ranges(
    extent: int, splits: Sequence[tuple[int, int, int]], fsdp_order: bool = True
) -> tuple[Range, ...]:
    """The global index ranges, in local order, that one rank holds of a dim of size ``extent``.

    ``splits``: the shards of this dim in mesh-dim order, each ``(num_chunks, coordinate,
    split_factor)``. ``Shard`` (``split_factor == 1``) keeps chunk ``coordinate`` of
    ``torch.chunk`` (ceil-sized chunks, the last ones shorter or empty) of what the shards
    before it left. A ``_StridedShard`` whose ``split_factor`` is the product of the chunk
    counts of the later shards of this dim records a shard made *after* them (FSDP2
    sharding a tensor-parallel weight): they are applied first, then it chunks what they
    left. That is what FSDP2 holds and what DTensor's ``full_tensor()`` reassembles, uneven
    sizes included (``_StridedShard._split_tensor`` agrees only when sizes divide evenly).
    Any other ``_StridedShard`` is read as ``_split_tensor`` does: ``split_factor`` parts,
    each cut into ``num_chunks``, chunk ``coordinate`` of every part; ``fsdp_order=False``
    reads every ``_StridedShard`` that way (``distribute_tensor``'s layout). Adjacent
    ranges merge.
    """
    ranges = _apply_shards(((0, extent),) if extent else (), list(splits), fsdp_order)
    merged: list[Range] = []
    for start, stop in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)


def _apply_shards(
    ranges: tuple[Range, ...], splits: list[tuple[int, int, int]], fsdp_order: bool
) -> tuple[Range, ...]:
    if not splits:
        return ranges
    (num_chunks, coordinate, split_factor), later = splits[0], splits[1:]
    if split_factor == 1:
        return _apply_shards(_chunk(ranges, num_chunks, coordinate), later, fsdp_order)
    if fsdp_order and split_factor == math.prod(n for n, _, _ in later):
        return _chunk(_apply_shards(ranges, later, fsdp_order), num_chunks, coordinate)
    parts = [_chunk(ranges, split_factor, j) for j in range(split_factor)]
    kept = tuple(r for part in parts for r in _chunk(part, num_chunks, coordinate))
    return _apply_shards(kept, later, fsdp_order)


def _chunk(ranges: tuple[Range, ...], num_chunks: int, index: int) -> tuple[Range, ...]:
    """Chunk ``index`` of ``num_chunks`` (``torch.chunk``) of the positions ``ranges`` list."""
    length = extent_of(ranges)
    size = -(-length // num_chunks)
    first, last = index * size, min((index + 1) * size, length)
    out = []
    position = 0
    for start, stop in ranges:
        lo = max(first, position)
        hi = min(last, position + stop - start)
        if hi > lo:
            out.append((start + lo - position, start + hi - position))
        position += stop - start
    return tuple(out)
