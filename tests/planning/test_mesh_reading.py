"""Which layouts on a permuted mesh are refused because their update would depend on how
torch placed the shards (``mesh_order.reading_problem``; no process groups needed).

On a ``DeviceMesh`` that lists its ranks out of ascending order, ``distribute_tensor``'s
scatter and FSDP2 give a rank the piece of its group rank, ``distribute_tensor(...,
src_data_rank=None)`` the piece of its mesh coordinate, and the optimizer (reading group
ranks) then sees the matrix with its pieces permuted. The oracle here is one process:
``Muon`` on the permuted matrix against the permuted update of the original. The verdict
must be "accepted" exactly where the two agree. The multi-process side (both placements,
every rank refusing alike) is ``dist_rank_order_cases``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from shardmuon import Muon
from shardmuon.planning.mesh_order import _order, reading_problem

S0, S1, R = Shard(0), Shard(1), Replicate()
PARTITIONS = [None, (5, 7), (6, 6), (3, 3, 3, 3), (4, 4, 4), (3, 9), (9, 3)]


def _update(full: torch.Tensor, grad: torch.Tensor, partitions) -> torch.Tensor:
    """One process, one step (``per-matrix``: its bits depend on the matrix alone)."""
    param = nn.Parameter(full.clone())
    opt = Muon(
        [param],
        lr=0.02,
        adjust_lr="rms_norm",
        newton_schulz_impl="per-matrix",
        newton_schulz_dtype="float32",
        matrix_partitions={param: partitions} if partitions else None,
    )
    param.grad = grad.clone()
    opt.step()
    return param.detach()


@pytest.mark.parametrize("partitions", PARTITIONS)
def test_one_dim_verdict_is_whether_the_update_depends_on_the_placement(partitions) -> None:
    """Every order of a 1-D mesh of 4, 12 rows (3 a rank): the rank at coordinate ``c``
    holds rows ``3c..3c+2`` by coordinate but is read as group rank ``order[c]``."""
    generator = torch.Generator().manual_seed(0)
    full, grad = torch.randn(12, 8, generator=generator), torch.randn(12, 8, generator=generator)
    want = _update(full, grad, partitions)
    for order in itertools.permutations(range(4)):
        # The matrix the optimizer assembles: group rank j's rows are coordinate order.index(j)'s.
        rows = torch.cat([torch.arange(3) + 3 * order.index(j) for j in range(4)])
        got = _update(full[rows], grad[rows], partitions)
        depends = not torch.allclose(got, want[rows], rtol=0, atol=1e-5)
        problem = reading_problem(_order(order, (4,)), (12, 8), (S0,), (0, 1), partitions)
        assert (problem is not None) == depends, (order, partitions, problem)
        if problem is not None:
            assert "matrix_partitions" in problem and "rows" in problem


@pytest.mark.parametrize(
    ("ranks", "mesh", "shape", "placements", "partitions", "split", "refused"),
    [
        # Columns may be permuted freely: partitions cut rows.
        ((3, 2, 1, 0), (4,), (8, 12), (S1,), (5, 3), False, None),
        # Whole matrices (experts) are updated where they lie.
        ((3, 2, 1, 0), (4,), (4, 6, 8), (S0,), (2, 4), True, None),
        # Rows of each matrix of a stack.
        ((3, 2, 1, 0), (4,), (2, 12, 8), (S1,), (5, 7), False, "matrix_partitions"),
        # An ascending mesh: never.
        ((0, 1, 2, 3), (4,), (12, 8), (S0,), (5, 7), True, None),
        # 2x2, the shard dim reversed in both rows: one permutation everywhere.
        ((1, 0, 3, 2), (2, 2), (8, 4), (R, S0), None, True, None),
        ((1, 0, 3, 2), (2, 2), (8, 4), (R, S0), (6, 2), False, "matrix_partitions"),
        ((1, 0, 3, 2), (2, 2), (8, 4), (S0, S1), (6, 2), False, None),
        ((1, 0, 3, 2), (2, 2), (8, 4), (S1, S0), (4, 4), False, None),
        # Only the replicate dim reversed.
        ((2, 3, 0, 1), (2, 2), (8, 4), (R, S0), (6, 2), True, None),
        # One row reversed: replicas by group rank hold different rows by coordinate, which
        # matters only where they hand each other results.
        ((0, 1, 3, 2), (2, 2), (8, 4), (R, S0), None, False, None),
        ((0, 1, 3, 2), (2, 2), (8, 4), (R, S0), None, True, "split_replicas"),
        ((0, 1, 3, 2), (2, 2), (2, 8, 4), (R, S0), None, True, "split_replicas"),
        ((0, 1, 3, 2), (2, 2), (2, 8, 4), (R, S0), None, False, None),
    ],
)
def test_verdicts(ranks, mesh, shape, placements, partitions, split, refused) -> None:
    dims = (len(shape) - 2, len(shape) - 1)
    problem = reading_problem(_order(ranks, mesh), shape, placements, dims, partitions, split)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem
