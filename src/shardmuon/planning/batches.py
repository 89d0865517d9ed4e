"""From matrix layouts to a plan: which matrices are orthogonalized together, and by whom.

:mod:`shardmuon.planning.placements` reads each parameter's ``MatrixLayout`` (its pieces and group).
Here, exchanged matrices with the same layout (global matrix shape, pieces, group, dtype,
partitions, eps) are cut into batches of ``k`` matrices. Within a batch each matrix has
one owner rank that receives all its pieces; owners continue round-robin from one batch
to the next, so the short last batch of a layout does not always land on rank 0, and
where matrices of different sizes leave ranks unevenly loaded, a short batch goes to the
least-loaded ranks (by Newton–Schulz FLOPs). Local matrices of one shape form stacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardmuon.planning.placements import MatrixLayout

__all__ = [
    "MuonBatch",
    "Segment",
    "plan_batches",
]


@dataclass(frozen=True)
class Segment:
    """Matrices ``[start, stop)`` of Muon parameter ``param_index`` (its local ``[N, r, c]`` view)."""

    param_index: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclass
class MuonBatch:
    """Matrices orthogonalized together: one all-to-all pair, or one local batched call.

    ``owners[i]`` is the rank index (within ``layout.group``) that owns the ``i``-th matrix,
    counting matrices through ``segments`` in order; empty for local batches. ``replica`` is
    the coordinate along the replicate mesh dim (``layout.replicas.mesh_index``: the same
    on every rank of a shard group, whatever the mesh's rank order) of the replica that
    orthogonalizes this batch for all replicas, or ``None`` when every replica does it itself.
    ``planned``: how many matrices the batch has on the ranks that hold the most of its
    parameters (:attr:`MatrixLayout.max_matrices`), where this rank holds fewer (an expert
    stack split unevenly, or not at all, over the ranks of another mesh dim); ``None``:
    ``num_matrices``. ``first_param``: the parameter index of the batch's first matrix on
    those ranks, the same on every rank of its group (``segments`` are this rank's own, and
    a rank holding fewer matrices has other ones or none); ``None``: the first segment's.
    """

    index: int
    layout: MatrixLayout
    segments: list[Segment]
    owners: tuple[int, ...] = ()
    partitions: tuple[int, ...] | None = None
    eps: float = 1e-8
    replica: int | None = None
    planned: int | None = None
    first_param: int | None = None

    @property
    def num_matrices(self) -> int:
        return sum(s.count for s in self.segments)

    @property
    def planned_matrices(self) -> int:
        return self.num_matrices if self.planned is None else self.planned


@dataclass(frozen=True)
class PlanEntry:
    """One Muon parameter as the planner sees it."""

    param_index: int
    layout: MatrixLayout
    dtype: torch.dtype
    partitions: tuple[int, ...] | None
    eps: float


def batch_key(
    layout: MatrixLayout, dtype: torch.dtype, partitions: tuple[int, ...] | None, eps: float
) -> tuple:
    """What matrices must share to be orthogonalized in one batch (the same on every rank)."""
    group_ranks = layout.group.ranks if layout.group else None
    replica_ranks = layout.replicas.ranks if layout.replicas else None
    return (
        group_ranks,
        replica_ranks,
        layout.pieces,
        layout.rows,
        layout.cols,
        dtype,
        partitions,
        eps,
    )


def _batch_key(entry: PlanEntry) -> tuple:
    return batch_key(entry.layout, entry.dtype, entry.partitions, entry.eps)


def _units(entries: list[PlanEntry]) -> list[tuple[int, int]]:
    return [(e.param_index, i) for e in entries for i in range(e.layout.num_matrices)]


def _most_matrices(layout: MatrixLayout) -> int:
    return layout.num_matrices if layout.max_matrices is None else layout.max_matrices


def _segments(units: list[tuple[int, int]]) -> list[Segment]:
    """Merge consecutive matrices of one parameter into ranges."""
    segments: list[Segment] = []
    for param_index, i in units:
        last = segments[-1] if segments else None
        if last and last.param_index == param_index and last.stop == i:
            segments[-1] = Segment(param_index, last.start, i + 1)
        else:
            segments.append(Segment(param_index, i, i + 1))
    return segments


def newton_schulz_cost(rows: int, cols: int, partitions: tuple[int, ...] | None) -> int:
    """FLOPs of one Newton–Schulz iteration on a ``[rows, cols]`` matrix (summed over blocks)."""
    total = 0
    for block_rows in partitions or (rows,):
        small, large = sorted((block_rows, cols))
        total += 4 * small * small * large + 2 * small**3
    return total


class _OwnerPicker:
    """Owners for the batches of one shard group: least-loaded ranks, ties round-robin.

    Loads are the Newton–Schulz FLOPs a rank owns so far. With equal costs this is plain
    round-robin continued from batch to batch (full batches add the same load to every
    rank, and a short batch's owners become the most loaded); with unequal costs the short
    batches go where the least work is.
    """

    def __init__(self, size: int) -> None:
        self.loads = [0] * size
        self.cursor = 0

    def pick(self, count: int, cost: int) -> tuple[int, ...]:
        size = len(self.loads)
        rotation = [(self.cursor + i) % size for i in range(size)]
        chosen = sorted(rotation, key=lambda r: self.loads[r])[:count]
        # Ascending: a rank's send buffer is then its pieces in the matrices' order.
        owners = tuple(sorted(chosen))
        for r in owners:
            self.loads[r] += cost
        self.cursor = (self.cursor + count) % size
        return owners


def plan_batches(
    entries: list[PlanEntry],
    rotate_owners: bool = True,
    split_replicas: bool = False,
    local_batch_size: Callable[[MatrixLayout, tuple[int, ...] | None], int] | None = None,
    matrix_cost: Callable[[int, int, tuple[int, ...] | None], int] | None = None,
) -> list[MuonBatch]:
    """Group parameters into batches; exchanged batches first (their traffic starts early).

    Deterministic in the order of ``entries``, which every rank of a group sees the same
    way, so all ranks agree on batches and owners without communicating. With
    ``rotate_owners=False`` every batch's owners are ranks ``0..len-1`` (a baseline). With
    ``split_replicas``, each batch of a parameter with a replicate dim is given to one replica
    (the least loaded so far, ties round-robin), which orthogonalizes it for all.
    ``local_batch_size(layout, partitions)`` caps how many matrices one local batch stacks
    (the workspace budget decides it; default: all of a shape in one batch).
    ``matrix_cost(rows, cols, partitions)``: the load one matrix adds to its owner (the
    engine's FLOPs; default :func:`newton_schulz_cost`).
    """
    matrix_cost = matrix_cost or newton_schulz_cost
    by_key: dict[tuple, list[PlanEntry]] = {}
    for entry in entries:
        by_key.setdefault(_batch_key(entry), []).append(entry)
    exchanged: list[MuonBatch] = []
    local: list[MuonBatch] = []
    pickers: dict[tuple[int, ...], _OwnerPicker] = {}
    for group_entries in by_key.values():
        first = group_entries[0]
        layout = first.layout
        units = _units(group_entries)
        common = dict(layout=layout, partitions=first.partitions, eps=first.eps)
        if layout.exchanged:
            k = layout.group.size
            picker = pickers.setdefault(layout.group.ranks, _OwnerPicker(k))
            cost = matrix_cost(layout.rows, layout.cols, first.partitions)
            # As many batches, as large, as on the ranks holding the most of these matrices
            # (empty ones included): every rank then schedules the same exchanged batches,
            # so the ranks of a group that spans expert groups issue its all-to-alls in
            # one order (the schedule works through all of a rank's batches at once).
            most = [
                (e.param_index, j) for e in group_entries for j in range(_most_matrices(e.layout))
            ]
            slots = max(len(units), len(most))
            planned_units = most if len(most) == slots else units
            for start in range(0, slots, k):
                chunk = units[start : start + k]
                planned = min(k, slots - start)
                owners = picker.pick(planned, cost) if rotate_owners else tuple(range(planned))
                batch = MuonBatch(
                    0,
                    segments=_segments(chunk),
                    owners=owners[: len(chunk)],
                    first_param=planned_units[start][0],
                    **common,
                )
                if planned != len(chunk):
                    batch.planned = planned
                exchanged.append(batch)
        else:
            size = (
                len(units)
                if local_batch_size is None
                else local_batch_size(layout, first.partitions)
            )
            size = max(1, size)
            if split_replicas and layout.replicas is not None:
                # Enough batches that every replica gets a share of this shape's matrices
                # (none for a stack that is empty here: an expert dim sharded past its size).
                size = max(1, min(size, -(-len(units) // layout.replicas.size)))
            for start in range(0, len(units), size):
                chunk = units[start : start + size]
                local.append(MuonBatch(0, segments=_segments(chunk), **common))
    batches = exchanged + local
    # One picker per replica group: its members all see the same batches over it, while
    # batches over other groups of the same size (an expert stack replicated over another
    # mesh dim, empty on some ranks) differ from rank to rank.
    replica_pickers: dict[tuple[int, ...], _OwnerPicker] = {}
    for i, batch in enumerate(batches):
        batch.index = i
        replicas = batch.layout.replicas
        if split_replicas and replicas is not None:
            picker = replica_pickers.setdefault(replicas.ranks, _OwnerPicker(replicas.size))
            cost = batch.num_matrices * matrix_cost(
                batch.layout.rows, batch.layout.cols, batch.partitions
            )
            (batch.replica,) = picker.pick(1, cost)
    return batches
