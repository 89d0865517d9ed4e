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
        expected.append(tuple((cursor + i) % 4 for i in range(n)))
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
