"""Pure planning logic of ``shardmuon.planning.batches`` (no process groups needed)."""

from __future__ import annotations

import math

import pytest
import torch

from shardmuon.planning import pieces
from shardmuon.planning.batches import _OwnerPicker, newton_schulz_cost
from shardmuon.planning.pieces import chunk_sizes


@pytest.mark.parametrize(("n", "k"), [(30, 4), (3, 4), (8, 4), (1, 3), (0, 2), (17, 5), (64, 1)])
def test_chunk_sizes_follow_torch_chunk(n: int, k: int) -> None:
    """DTensor's Shard uses torch.chunk; empty trailing chunks count as size 0."""
    expected = [c.size(0) for c in torch.arange(n).chunk(k)] if n else []
    expected += [0] * (k - len(expected))
    assert list(chunk_sizes(n, k)) == expected


def test_equal_costs_give_round_robin_across_batches() -> None:
    picker = _OwnerPicker(4)
    owners = [picker.pick(n, cost=1) for n in (4, 3, 4, 2, 1, 3)]
    cursor, expected = 0, []
    for n in (4, 3, 4, 2, 1, 3):
        expected.append(tuple(sorted((cursor + i) % 4 for i in range(n))))
        cursor = (cursor + n) % 4
    assert owners == expected


def test_short_batch_goes_to_least_loaded_rank() -> None:
    picker = _OwnerPicker(2)
    assert picker.pick(1, cost=1000) == (0,)  # a big matrix alone: rank 0
    assert picker.pick(1, cost=10) == (1,)
    assert picker.pick(1, cost=10) == (1,)  # rank 1 is still far less loaded
    assert picker.loads == [1000, 20]


def test_newton_schulz_cost_sums_partition_blocks() -> None:
    assert newton_schulz_cost(8, 16, None) == 4 * 8 * 8 * 16 + 2 * 8**3
    assert newton_schulz_cost(16, 8, None) == newton_schulz_cost(8, 16, None)
    assert newton_schulz_cost(12, 8, (4, 8)) == newton_schulz_cost(4, 8, None) + (
        newton_schulz_cost(8, 8, None)
    )


def test_padded_scheme_volume() -> None:
    """dion's scheme for 5 matrices of 30x16 rows-sharded over 4 ranks: 2 padded pieces of 8 rows
    to each of 3 peers, there and back, in bf16."""
    from shardmuon.bench.volume import padded_scheme_bytes
    from shardmuon.planning.batches import MuonBatch, Segment
    from shardmuon.planning.groups import ShardGroup
    from shardmuon.planning.pieces import Piece
    from shardmuon.planning.placements import MatrixLayout

    group = ShardGroup(ranks=(0, 1, 2, 3), rank_index=1, process_group=None)
    rows = ((0, 8), (8, 16), (16, 24), (24, 30))
    pieces = tuple(Piece(rows=(r,), cols=((0, 16),)) for r in rows)
    matrix = MatrixLayout(30, 16, 1, 8, 16, False, group=group, pieces=pieces)
    batches = [
        MuonBatch(0, matrix, [Segment(i, 0, 1) for i in range(4)], owners=(0, 1, 2, 3)),
        MuonBatch(1, matrix, [Segment(4, 0, 1)], owners=(0,)),
    ]
    assert padded_scheme_bytes(batches) == 2 * 3 * 2 * (8 * 16) * 2


# ------------------------------------------------------------------ shard_ranges


def _split(placement_split: tuple[int, int, int], t: torch.Tensor) -> torch.Tensor:
    """torch's own split of ``t`` (dim 0) for one ``(num_chunks, coordinate, split_factor)``."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    num_chunks, coordinate, split_factor = placement_split
    placement = Shard(0) if split_factor == 1 else _StridedShard(0, split_factor=split_factor)
    chunks, _ = placement._split_tensor(t, num_chunks, with_padding=False)
    assert len(chunks) == num_chunks  # empty chunks are filled in, as DTensor does
    return chunks[coordinate]


def _chunk_of(t: torch.Tensor, num_chunks: int, coordinate: int) -> torch.Tensor:
    chunks = list(t.chunk(num_chunks))
    chunks += [t[:0]] * (num_chunks - len(chunks))
    return chunks[coordinate]


def _fsdp_order(splits) -> bool:
    """Whether a _StridedShard in ``splits`` records FSDP2 sharding after the later shards
    (its split factor is the product of their chunk counts)."""
    return any(
        sf > 1 and sf == math.prod(n for n, _, _ in splits[i + 1 :])
        for i, (_, _, sf) in enumerate(splits)
    )


def _nested_indices(t: torch.Tensor, splits) -> torch.Tensor:
    """FSDP2's order on data: later shards first where a split factor says so (torch.chunk)."""
    if not splits:
        return t
    (n, c, sf), later = splits[0], list(splits[1:])
    if sf == 1:
        return _nested_indices(_chunk_of(t, n, c), later)
    if sf == math.prod(m for m, _, _ in later):
        return _chunk_of(_nested_indices(t, later), n, c)
    return _nested_indices(_split((n, c, sf), t), later)


def _reference_indices(extent: int, splits) -> list[int]:
    """The global indices one rank holds, in local order: torch's splits in sequence, or,
    where a split factor records FSDP2 over later shards, those shards first."""
    t = torch.arange(extent)
    if _fsdp_order(splits):
        return _nested_indices(t, list(splits)).tolist()
    for s in splits:
        t = _split(s, t)
    return t.tolist()


def _expanded(ranges) -> list[int]:
    return [i for start, stop in ranges for i in range(start, stop)]


def _check_ranges(extent: int, splits) -> None:
    ranges = pieces.shard_ranges(extent, splits)
    want = _reference_indices(extent, splits)
    where = f"extent {extent}, splits {splits}"
    assert isinstance(ranges, tuple), where
    assert all(isinstance(r, tuple) and len(r) == 2 for r in ranges), (where, ranges)
    assert all(start < stop for start, stop in ranges), f"{where}: empty range in {ranges}"
    assert _expanded(ranges) == want, f"{where}: {ranges} != indices {want}"


def _one_splits():
    for num_chunks in (1, 2, 3, 4):
        for split_factor in (1, 2, 3, 4):
            for coordinate in range(num_chunks):
                yield (num_chunks, coordinate, split_factor)


EXTENTS = list(range(41))


@pytest.mark.parametrize("extent", EXTENTS)
def test_shard_ranges_one_split_matches_torch(extent: int) -> None:
    for s in _one_splits():
        _check_ranges(extent, [s])


@pytest.mark.parametrize("extent", EXTENTS)
def test_shard_ranges_two_splits_match_torch(extent: int) -> None:
    """Every pair of splits (Shard or _StridedShard, 1-4 chunks, split factors 1-4)."""
    singles = list(_one_splits())
    for first in singles:
        for second in singles:
            _check_ranges(extent, (first, second))


@pytest.mark.parametrize("seed", range(8))
def test_shard_ranges_three_splits_match_torch(seed: int) -> None:
    """Chains of three splits, sampled (the full product is too large), on every extent."""
    import random

    rng = random.Random(seed)
    singles = list(_one_splits())
    for extent in EXTENTS:
        for _ in range(25):
            _check_ranges(extent, [rng.choice(singles) for _ in range(3)])


def test_shard_ranges_without_splits_is_the_whole_dim() -> None:
    assert pieces.shard_ranges(7, ()) == ((0, 7),)
    assert pieces.shard_ranges(0, ()) == ()


def test_shard_ranges_fsdp_over_tp_example() -> None:
    """torch's _StridedShard docstring: 8 rows, mesh (dp, tp) = 2x2, placements
    (_StridedShard(0, sf=2), Shard(0)): ranks (0,0), (0,1), (1,0), (1,1) hold rows 0-1,
    4-5, 2-3, 6-7 (tp first, then dp: the right-to-left order FSDP2 over TP produces)."""
    held = {
        (dp, tp): pieces.shard_ranges(8, [(2, dp, 2), (2, tp, 1)]) for dp in (0, 1) for tp in (0, 1)
    }
    assert held == {
        (0, 0): ((0, 2),),
        (0, 1): ((4, 6),),
        (1, 0): ((2, 4),),
        (1, 1): ((6, 8),),
    }
    # The strided shard alone: each dp rank holds two separate row blocks.
    assert _expanded(pieces.shard_ranges(8, [(2, 0, 2)])) == [0, 1, 4, 5]
    assert len(pieces.shard_ranges(8, [(2, 0, 2)])) == 2


def test_shard_ranges_uneven_and_empty() -> None:
    # 3 rows, Shard(0) twice over 2x2: 2/1 then 1/1 and 1/0 (the last rank holds nothing).
    assert [pieces.shard_ranges(3, [(2, a, 1), (2, b, 1)]) for a in (0, 1) for b in (0, 1)] == [
        ((0, 1),),
        ((1, 2),),
        ((2, 3),),
        (),
    ]
    # A lone _StridedShard(0, sf=2) is read as torch's _split_tensor: pieces [0, 1] | [2];
    # dp 0 gets rows 0 and 2 (not adjacent), dp 1 gets row 1.
    assert _expanded(pieces.shard_ranges(3, [(2, 0, 2)])) == [0, 2]
    assert _expanded(pieces.shard_ranges(3, [(2, 1, 2)])) == [1]
    # _StridedShard(0, sf=2) then Shard(0) over 2x2 is FSDP2 over TP: tp first ([0, 1] | [2]),
    # then dp: (dp, tp) = (0, 0) row 0, (0, 1) row 2, (1, 0) row 1, (1, 1) nothing.
    held = [pieces.shard_ranges(3, [(2, dp, 2), (2, tp, 1)]) for dp in (0, 1) for tp in (0, 1)]
    assert held == [((0, 1),), ((2, 3),), ((1, 2),), ()]


@pytest.mark.parametrize("extent", EXTENTS)
def test_shard_ranges_fsdp_over_tp_is_tp_then_fsdp(extent: int) -> None:
    """(_StridedShard(0, sf=tp), Shard(0)) on a (dp, tp) mesh holds chunk ``dp`` of chunk
    ``tp`` (torch.chunk twice: what FSDP2 keeps of a TP shard), uneven sizes included; with
    sizes that divide evenly it is also torch's own _split_tensor reading."""
    for dp_size in (1, 2, 3, 4):
        for tp_size in (2, 3, 4):
            for dp in range(dp_size):
                for tp in range(tp_size):
                    splits = [(dp_size, dp, tp_size), (tp_size, tp, 1)]
                    got = _expanded(pieces.shard_ranges(extent, splits))
                    tp_local = _chunk_of(torch.arange(extent), tp_size, tp)
                    assert got == _chunk_of(tp_local, dp_size, dp).tolist(), (extent, splits)
                    if extent % (dp_size * tp_size) == 0:
                        t = _split(splits[1], _split(splits[0], torch.arange(extent)))
                        assert got == t.tolist(), (extent, splits)


def test_shard_ranges_fsdp_differs_from_split_tensor_where_uneven() -> None:
    """9 rows on a 4x2 (dp, tp) mesh: FSDP2 leaves (dp=3, tp=0) empty and gives row 8 to
    (dp=3, tp=1); _split_tensor's reading would swap them (and DTensor cannot reassemble that)."""
    assert pieces.shard_ranges(9, [(4, 3, 2), (2, 0, 1)]) == ()
    assert pieces.shard_ranges(9, [(4, 3, 2), (2, 1, 1)]) == ((8, 9),)
    left_to_right = _split((2, 0, 1), _split((4, 3, 2), torch.arange(9)))
    assert left_to_right.tolist() == [8]


def test_piece_shape_and_numel() -> None:
    piece = pieces.Piece(rows=((0, 2), (4, 6)), cols=((3, 8),))
    assert piece.shape == (4, 5)
    assert piece.numel == 20
    empty = pieces.Piece(rows=(), cols=((0, 3),))
    assert empty.shape == (0, 3)
    assert empty.numel == 0
