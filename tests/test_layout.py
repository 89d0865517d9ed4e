"""Pure planning logic of ``shardmuon.layout`` (no process groups needed)."""

from __future__ import annotations

import pytest
import torch

from shardmuon.layout import _OwnerPicker, chunk_sizes, newton_schulz_cost


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
    from shardmuon.layout import MatrixLayout, MuonBatch, Segment, ShardGroup

    group = ShardGroup(ranks=(0, 1, 2, 3), rank_index=1, process_group=None)
    layout = MatrixLayout(30, 16, 1, 8, 16, False, 0, group, (8, 8, 8, 6))
    batches = [
        MuonBatch(0, layout, [Segment(i, 0, 1) for i in range(4)], owners=(0, 1, 2, 3)),
        MuonBatch(1, layout, [Segment(4, 0, 1)], owners=(0,)),
    ]
    assert padded_scheme_bytes(batches) == 2 * 3 * 2 * (8 * 16) * 2
