"""From DTensor placements to a plan: which matrices travel, to whom, in which batch.

Computed once, at construction, from each parameter alone (no mesh is passed in):

* A plain tensor, or a DTensor whose matrix dims are whole on this rank (replicated, or
  sharded only on batch dims such as the expert dim of a ``[E, out, in]`` stack under
  expert parallelism), is **local**: its matrices are orthogonalized where they are, with
  no communication.
* A DTensor sharded on exactly one matrix dim (the last two; FSDP2's ``Shard(0)`` on a
  2-D weight, ``Shard(1)``, or dim -2/-1 of a stack) over a mesh dim of size ``k`` is
  **exchanged** over that mesh dim's process group. Other mesh dims (HSDP's
  ``Replicate``, an expert ``Shard(0)``) only select which group a rank belongs to.
* Two matrix-dim shards (FSDP + TP on one weight) are not supported yet.

Exchanged matrices with the same layout (global matrix shape, shard axis, group, dtype,
partitions, eps) are cut into batches of ``k`` matrices. Within a batch each matrix has
one owner rank that receives all its shards; owners continue round-robin from one batch
to the next, so the short last batch of a layout does not always land on rank 0, and
where matrices of different sizes leave ranks unevenly loaded, a short batch goes to the
least-loaded ranks (by Newton–Schulz FLOPs).
Shard sizes follow DTensor's chunking (``ceil(n / k)`` rows per rank, the last ranks
shorter or empty), so uneven and empty shards need no padding: each piece travels with
its exact size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial

__all__ = [
    "MatrixLayout",
    "MuonBatch",
    "Segment",
    "ShardGroup",
    "chunk_sizes",
    "local_tensor",
    "matrix_layout",
    "plan_batches",
]


@dataclass(frozen=True)
class ShardGroup:
    """The process group along one mesh dim, identified by its global ranks (not by identity)."""

    ranks: tuple[int, ...]
    rank_index: int
    process_group: dist.ProcessGroup = field(compare=False, hash=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class MatrixLayout:
    """How one parameter's matrices lie on this rank.

    ``rows``/``cols``: the global matrix dims (after ``flatten``); ``local_rows``/``local_cols``
    and ``num_matrices``: this rank's shard, seen as ``[num_matrices, local_rows, local_cols]``.
    ``shard_axis`` is 0 (rows) or 1 (cols) for exchanged params and ``None`` for local ones;
    ``piece_sizes[j]`` is the extent of rank ``j``'s piece along that axis. ``replicas`` is
    the group along the one ``Replicate`` mesh dim of size > 1 (HSDP's replicate dim), if any:
    ranks that hold identical shards.
    """

    rows: int
    cols: int
    num_matrices: int
    local_rows: int
    local_cols: int
    flatten: bool
    shard_axis: int | None = None
    group: ShardGroup | None = None
    piece_sizes: tuple[int, ...] = ()
    replicas: ShardGroup | None = None

    @property
    def exchanged(self) -> bool:
        return self.group is not None

    @property
    def local_row_start(self) -> int:
        """The global index of this rank's first row (0 unless rows are sharded)."""
        if self.shard_axis != 0:
            return 0
        return sum(self.piece_sizes[: self.group.rank_index])

    def piece_numel(self, rank_index: int) -> int:
        """Elements of rank ``rank_index``'s piece of one matrix."""
        other = self.cols if self.shard_axis == 0 else self.rows
        return self.piece_sizes[rank_index] * other

    def piece_shape(self, rank_index: int) -> tuple[int, int]:
        if self.shard_axis == 0:
            return (self.piece_sizes[rank_index], self.cols)
        return (self.rows, self.piece_sizes[rank_index])


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
    the index (within ``layout.replicas``) of the replica that orthogonalizes this batch for
    all replicas, or ``None`` when every replica does it itself.
    """

    index: int
    layout: MatrixLayout
    segments: list[Segment]
    owners: tuple[int, ...] = ()
    partitions: tuple[int, ...] | None = None
    eps: float = 1e-8
    replica: int | None = None

    @property
    def num_matrices(self) -> int:
        return sum(s.count for s in self.segments)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's local tensor of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def chunk_sizes(n: int, k: int) -> tuple[int, ...]:
    """Sizes of ``Shard`` chunks of ``n`` over ``k`` ranks (``torch.chunk``: ceil(n/k) each)."""
    step = -(-n // k) if n else 0
    return tuple(max(0, min(step, n - j * step)) for j in range(k))


def _describe(name: str, param: DTensor) -> str:
    return f"{name} (global shape {tuple(param.shape)}, placements {tuple(param.placements)})"


def _matrix_dims(ndim: int, flatten: bool) -> tuple[int, ...]:
    """Tensor dims that belong to the matrix: the last two, or all of them with ``flatten``."""
    return tuple(range(ndim)) if flatten else (ndim - 2, ndim - 1)


def _global_matrix(shape: torch.Size, flatten: bool) -> tuple[int, int]:
    if flatten:
        return shape[0], math.prod(shape[1:])
    return shape[-2], shape[-1]


def _local_view_shape(shape: torch.Size, flatten: bool) -> tuple[int, int, int]:
    if flatten:
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def matrix_layout(name: str, param: Tensor, flatten: bool) -> MatrixLayout:
    """Read one Muon parameter's layout from its placements (plain tensors are local).

    Raises ``NotImplementedError`` for two matrix-dim shards or a strided shard on a matrix
    dim, and ``ValueError`` for ``Partial`` placements on a parameter.
    """
    if isinstance(param, DTensor) and param.device_mesh.get_coordinate() is None:
        mesh = param.device_mesh
        raise ValueError(
            f"parameter {_describe(name, param)} lives on a device mesh of ranks "
            f"{mesh.mesh.flatten().tolist()} that does not include this rank "
            f"({dist.get_rank()}); give the optimizer only the parameters this rank holds"
        )
    rows, cols = _global_matrix(param.shape, flatten)
    local = local_tensor(param)
    num, local_rows, local_cols = _local_view_shape(local.shape, flatten)
    base = dict(
        rows=rows,
        cols=cols,
        num_matrices=num,
        local_rows=local_rows,
        local_cols=local_cols,
        flatten=flatten,
    )
    if not isinstance(param, DTensor):
        return MatrixLayout(**base)
    mesh = param.device_mesh
    matrix_dims = _matrix_dims(param.ndim, flatten)
    matrix_shards = []
    replicate_dims = []
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Partial):
            raise ValueError(
                f"parameter {_describe(name, param)} has a Partial placement; parameters must "
                "be Replicate or Shard"
            )
        if mesh.size(mesh_dim) == 1:
            continue
        if isinstance(placement, Replicate):
            replicate_dims.append(mesh_dim)
            continue
        dim = placement.dim % param.ndim
        if dim not in matrix_dims:
            continue
        if flatten and dim != 0:
            raise NotImplementedError(
                f"parameter {_describe(name, param)}: with flatten=True only a shard on dim 0 "
                "(the rows of the flattened matrix) is supported"
            )
        if type(placement) is not Shard:
            raise NotImplementedError(
                f"parameter {_describe(name, param)}: {placement} on a matrix dim is not "
                "supported; only plain Shard placements can be exchanged"
            )
        matrix_shards.append((mesh_dim, dim))
    if len(replicate_dims) == 1:
        base["replicas"] = _mesh_group(mesh, replicate_dims[0])
    if not matrix_shards:
        return MatrixLayout(**base)
    if len(matrix_shards) > 1:
        raise NotImplementedError(
            f"parameter {_describe(name, param)} is sharded on two matrix dims; shardmuon "
            "exchanges one matrix-dim shard per parameter (FSDP + TP on one weight is not "
            "supported yet)"
        )
    mesh_dim, dim = matrix_shards[0]
    shard_axis = 0 if dim == (0 if flatten else param.ndim - 2) else 1
    group = _mesh_group(mesh, mesh_dim)
    pieces = chunk_sizes(rows if shard_axis == 0 else cols, group.size)
    own = local_rows if shard_axis == 0 else local_cols
    if own != pieces[group.rank_index]:
        raise RuntimeError(
            f"parameter {_describe(name, param)}: local extent {own} on the sharded dim differs "
            f"from DTensor's chunking {list(pieces)} at index {group.rank_index}"
        )
    return MatrixLayout(**base, shard_axis=shard_axis, group=group, piece_sizes=pieces)


def _mesh_group(mesh, mesh_dim: int) -> ShardGroup:
    """The process group along ``mesh_dim`` that holds this rank."""
    process_group = mesh.get_group(mesh_dim)
    return ShardGroup(
        ranks=tuple(dist.get_process_group_ranks(process_group)),
        rank_index=mesh.get_local_rank(mesh_dim),
        process_group=process_group,
    )


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
        layout.shard_axis,
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
) -> list[MuonBatch]:
    """Group parameters into batches; exchanged batches first (their traffic starts early).

    Deterministic in the order of ``entries``, which every rank of a group sees the same
    way, so all ranks agree on batches and owners without communicating. With
    ``rotate_owners=False`` every batch's owners are ranks ``0..len-1`` (a baseline). With
    ``split_replicas``, each batch of a parameter with a replicate dim is given to one replica
    (the least loaded so far, ties round-robin), which orthogonalizes it for all.
    ``local_batch_size(layout, partitions)`` caps how many matrices one local batch stacks
    (the workspace budget decides it; default: all of a shape in one batch).
    """
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
            cost = newton_schulz_cost(layout.rows, layout.cols, first.partitions)
            for start in range(0, len(units), k):
                chunk = units[start : start + k]
                if rotate_owners:
                    owners = picker.pick(len(chunk), cost)
                else:
                    owners = tuple(range(len(chunk)))
                exchanged.append(MuonBatch(0, segments=_segments(chunk), owners=owners, **common))
        else:
            size = (
                len(units)
                if local_batch_size is None
                else local_batch_size(layout, first.partitions)
            )
            size = max(1, size)
            if split_replicas and layout.replicas is not None:
                # Enough batches that every replica gets a share of this shape's matrices.
                size = min(size, -(-len(units) // layout.replicas.size))
            for start in range(0, len(units), size):
                chunk = units[start : start + size]
                local.append(MuonBatch(0, segments=_segments(chunk), **common))
    batches = exchanged + local
    replica_pickers: dict[int, _OwnerPicker] = {}
    for i, batch in enumerate(batches):
        batch.index = i
        replicas = batch.layout.replicas
        if split_replicas and replicas is not None:
            picker = replica_pickers.setdefault(replicas.size, _OwnerPicker(replicas.size))
            cost = batch.num_matrices * newton_schulz_cost(
                batch.layout.rows, batch.layout.cols, batch.partitions
            )
            (batch.replica,) = picker.pick(1, cost)
    return batches
