"""Reading DTensor placements: which piece of each matrix every rank holds, and over which group.

Computed once per parameter, from the parameter alone (no mesh is passed in):

* A plain tensor, or a DTensor whose matrix dims are whole on this rank (replicated, or
  sharded only on batch dims such as the expert dim of a ``[E, out, in]`` stack under
  expert parallelism), is **local**.
* A DTensor sharded on its matrix dims (the last two) over one or more mesh dims is
  **exchanged** over the process group of those mesh dims, flattened (FSDP2's ``Shard(0)``
  over one dim; FSDP2 over tensor parallel, ``(_StridedShard(0, sf), Shard(0))`` or
  ``(Shard(0), Shard(1))``, over two). Other mesh dims (HSDP's ``Replicate``, an expert
  ``Shard(0)``) only select which group a rank belongs to.

Every rank of a group computes every other rank's **piece** of a matrix from the placements
alone (:func:`shardmuon.planning.pieces.shard_ranges`: ``Shard`` is ``torch.chunk``; ``_StridedShard`` is read as
FSDP2 lays it out): the global rows and columns it holds, as ranges in its local order.
Pieces are exact (uneven and empty ones included), so nothing is padded. A rank's shard
along a mesh dim is that of its group rank there, which is its mesh coordinate unless the
mesh lists the dim's ranks out of ascending order (:mod:`shardmuon.planning.mesh_order`,
which also refuses the layouts such a mesh makes contradictory). This is the only module
that reads ``placements``; :mod:`shardmuon.planning.batches` plans batches from its results.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, Placement, _StridedShard

from shardmuon.planning.groups import ShardGroup, exchange_group, mesh_dim_group, replica_group
from shardmuon.planning.mesh_order import (
    MeshOrder,
    mesh_order,
    most_matrices,
    order_problem,
    reading_problem,
    unravel,
)
from shardmuon.planning.pieces import Piece, shard_ranges

__all__ = [
    "MatrixLayout",
    "SinkhornLayout",
    "local_indices",
    "local_slice",
    "local_tensor",
    "matrix_layout",
    "placed_ambiguously",
    "sinkhorn_layout",
]


@dataclass(frozen=True)
class MatrixLayout:
    """How one parameter's matrices lie on this rank.

    ``rows``/``cols``: the global matrix dims (after ``flatten``); ``local_rows``/``local_cols``
    and ``num_matrices``: this rank's shard, seen as ``[num_matrices, local_rows, local_cols]``.
    For exchanged params ``group`` is the group of ranks holding pieces of the same matrices
    and ``pieces[j]`` is rank index ``j``'s piece (the same on every rank of the group);
    local params have neither. ``replicas`` is the group along the one ``Replicate`` mesh
    dim of size > 1 (HSDP's replicate dim), if any: ranks that hold identical shards, one
    at each coordinate of that dim (on a permuted mesh not always the mesh's own group).
    """

    rows: int
    cols: int
    num_matrices: int
    local_rows: int
    local_cols: int
    flatten: bool
    group: ShardGroup | None = None
    pieces: tuple[Piece, ...] = ()
    replicas: ShardGroup | None = None
    # The pieces by row-major group coordinates: the same for every shard group of a
    # parameter (every replica of an HSDP mesh), however each numbers its members.
    grid_pieces: tuple[Piece, ...] = field(default=(), compare=False)
    # The most matrices any rank of the mesh holds (``None``: ``num_matrices``).
    max_matrices: int | None = field(default=None, compare=False)

    @property
    def exchanged(self) -> bool:
        return self.group is not None

    @property
    def local_piece(self) -> Piece:
        """This rank's piece of each of its matrices (the whole matrix when local)."""
        if self.group is None:
            return Piece(((0, self.rows),), ((0, self.cols),))
        return self.pieces[self.group.rank_index]

    @functools.cached_property
    def rows_in_rank_order(self) -> bool:
        """Whether the pieces, laid end to end in rank order, are the matrix itself: each
        holds whole rows of one range, ascending (FSDP's ``Shard(0)``). The owner's receive
        buffer is then the matrix, and its result the return's send buffer."""
        start = 0
        for piece in self.pieces:
            if piece.numel == 0:
                continue
            if len(piece.rows) != 1 or piece.cols != ((0, self.cols),):
                return False
            if piece.rows[0][0] != start:
                return False
            start = piece.rows[0][1]
        return start == self.rows

    @functools.cached_property
    def largest_piece_numel(self) -> int:
        """Elements of the largest piece of one matrix held by any member of the group (what
        every member can compute alike, unlike its own piece's size)."""
        return max((piece.numel for piece in self.pieces), default=self.rows * self.cols)

    def piece_numel(self, rank_index: int) -> int:
        """Elements of rank ``rank_index``'s piece of one matrix."""
        return self.pieces[rank_index].numel

    def piece_shape(self, rank_index: int) -> tuple[int, int]:
        return self.pieces[rank_index].shape


def local_tensor(t: Tensor) -> Tensor:
    """This rank's local tensor of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_indices(like: DTensor, dim: int, size: int | None = None) -> list[int] | None:
    """The global indices along ``dim`` of this rank's local tensor of ``like``, in local
    order, or ``None`` when ``dim`` is whole here.

    Reads the placements as :func:`shardmuon.planning.pieces.shard_ranges` does, so for
    FSDP2 over TP it is what FSDP2 holds, uneven sizes included (``distribute_tensor``
    would cut some of those differently). ``size``: the global size of ``dim`` (default
    ``like``'s). ``Partial`` is not a layout of data and is refused.
    """
    # Group ranks, as FSDP2 and distribute_tensor place shards (see mesh_order).
    coordinate = mesh_order(like.device_mesh).group_coordinate_of(dist.get_rank())
    return _indices_at(like, dim, size, coordinate)


def _indices_at(
    like: DTensor, dim: int, size: int | None, coordinate: Sequence[int]
) -> list[int] | None:
    """:func:`local_indices` of the rank at ``coordinate`` along each mesh dim."""
    mesh = like.device_mesh
    ndim = like.ndim
    size = like.shape[dim] if size is None else size
    dim_splits: list[tuple[int, int, int]] = []
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Partial):
            raise ValueError(f"{tuple(like.placements)} has a Partial placement")
        if isinstance(placement, Replicate) or mesh.size(mesh_dim) == 1:
            continue
        if placement.dim % ndim != dim % ndim:
            continue
        factor = int(placement.split_factor) if isinstance(placement, _StridedShard) else 1
        dim_splits.append((mesh.size(mesh_dim), coordinate[mesh_dim], factor))
    if not dim_splits:
        return None
    return [i for start, stop in shard_ranges(size, dim_splits) for i in range(start, stop)]


def placed_ambiguously(like: DTensor, dim: int) -> bool:
    """Whether some rank of ``like``'s mesh holds other indices along ``dim`` when its shard
    was placed by mesh coordinate (``distribute_tensor(..., src_data_rank=None)``) than by
    group rank (FSDP2, ``distribute_tensor``'s scatter): a mesh that does not list the ranks
    of a dim sharding ``dim`` in ascending order. No rank can tell which placement made its
    shard. The same answer on every rank (read from the mesh alone)."""
    order = mesh_order(like.device_mesh)
    if not order.permuted:
        return False
    return any(
        _indices_at(like, dim, None, order.group_coordinate_of(rank))
        != _indices_at(like, dim, None, order.coordinate_of(rank))
        for rank in order.ranks()
    )


def local_slice(full: Tensor, like: DTensor) -> Tensor:
    """This rank's local tensor of ``full`` (the global tensor) laid out as ``like`` is
    (:func:`local_indices` along every dim)."""
    local = full
    for dim in range(full.ndim):
        try:
            index = local_indices(like, dim, full.shape[dim])
        except ValueError as err:
            raise ValueError(f"local_slice: {err}") from None
        if index is not None:
            local = local.index_select(
                dim, torch.tensor(index, dtype=torch.long, device=full.device)
            )
    return local.contiguous()


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


def _refuse_partial(name: str, param: DTensor, placement: Placement) -> None:
    if isinstance(placement, Partial):
        raise ValueError(
            f"parameter {_describe(name, param)} has a Partial placement; parameters must "
            "be Replicate or Shard"
        )


def _refuse_foreign_mesh(name: str, param: DTensor) -> None:
    """Refuse a parameter on a mesh without this rank (before any group is made)."""
    mesh = param.device_mesh
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"parameter {_describe(name, param)} lives on a device mesh of ranks "
            f"{mesh.mesh.flatten().tolist()} that does not include this rank "
            f"({dist.get_rank()}); give the optimizer only the parameters this rank holds"
        )


def _split_factor(name: str, param: DTensor, placement: Placement) -> int:
    """1 for ``Shard``, ``sf`` for ``_StridedShard``; other shard kinds are refused."""
    if type(placement) is Shard:
        return 1
    if isinstance(placement, _StridedShard):
        return int(placement.split_factor)
    raise NotImplementedError(
        f"parameter {_describe(name, param)}: {placement} on a matrix dim is not supported; "
        "accepted on matrix dims: Shard and _StridedShard"
    )


def matrix_layout(
    name: str,
    param: Tensor,
    flatten: bool,
    *,
    partitions: tuple[int, ...] | None = None,
    split_replicas: bool = False,
    plain_replicas: ShardGroup | None = None,
) -> MatrixLayout:
    """Read one Muon parameter's layout from its placements (plain tensors are local, or
    replicas over ``plain_replicas``: DDP).

    Raises ``NotImplementedError`` for shard kinds other than ``Shard``/``_StridedShard`` on
    a matrix dim (or, with ``flatten``, a shard on a dim other than 0), ``ValueError`` for
    ``Partial`` placements and for layouts a permuted mesh makes contradictory or ambiguous
    (``partitions``: the checked row blocks; ``split_replicas``: replicas hand each other
    results; see :mod:`shardmuon.planning.mesh_order`), and ``RuntimeError`` when the local
    tensor is not the piece the placements describe. Refusals come before any process group
    is made.
    """
    if isinstance(param, DTensor):
        _refuse_foreign_mesh(name, param)
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
        return MatrixLayout(**base, replicas=plain_replicas)
    mesh = param.device_mesh
    matrix_dims = _matrix_dims(param.ndim, flatten)
    row_dim = 0 if flatten else param.ndim - 2
    # (mesh dim, matrix axis, split factor) of every shard of a matrix dim, in mesh order.
    shards: list[tuple[int, int, int]] = []
    replicate_dims = []
    batch_shard_dims = []  # mesh dims that shard only batch dims (experts)
    for mesh_dim, placement in enumerate(param.placements):
        _refuse_partial(name, param, placement)
        if mesh.size(mesh_dim) == 1:
            continue
        if isinstance(placement, Replicate):
            replicate_dims.append(mesh_dim)
            continue
        dim = placement.dim % param.ndim
        if dim not in matrix_dims:
            batch_shard_dims.append(mesh_dim)
            continue
        if flatten and dim != 0:
            raise NotImplementedError(
                f"parameter {_describe(name, param)}: with flatten=True only shards of dim 0 "
                "(the rows of the flattened matrix) are supported"
            )
        axis = 0 if dim == row_dim else 1
        shards.append((mesh_dim, axis, _split_factor(name, param, placement)))
    mesh_dims = tuple(m for m, _, _ in shards)
    order = mesh_order(mesh)
    problem = order_problem(order, tuple(param.shape), tuple(param.placements), mesh_dims)
    if problem is None:
        problem = reading_problem(
            order,
            tuple(param.shape),
            tuple(param.placements),
            matrix_dims,
            partitions,
            split_replicas,
        )
    if problem is not None:
        # Decided from the mesh, placements, shape and partitions alone: every rank of the
        # mesh raises alike, before any collective.
        raise ValueError(
            f"parameter {_describe(name, param)} on a device mesh of ranks "
            f"{mesh.mesh.tolist()}: {problem}. Build the mesh with the ranks of every dim "
            "in ascending order (init_device_mesh does)"
        )
    if len(replicate_dims) == 1:
        base["replicas"] = replica_group(mesh, order, replicate_dims[0])
    if not shards:
        return MatrixLayout(**base)
    group = exchange_group(mesh, order, mesh_dims, replicate_dims, batch_shard_dims)
    # One mesh dim holds one placement: each shard is its own dim of the group's grid.
    spec = tuple((mesh.size(m), axis, sf) for m, axis, sf in shards)
    grid_pieces = group_pieces(rows, cols, spec)
    pieces = _in_group_order(grid_pieces, order, mesh_dims, group)
    own = pieces[group.rank_index].shape
    if own != (local_rows, local_cols) and any(sf > 1 for _, _, sf in shards):
        # Laid out by _StridedShard._split_tensor (distribute_tensor), not by FSDP2: where
        # the two differ only some ranks can see it. Those take the other reading, so the
        # group's pieces disagree and the first step's agreement check raises on every
        # rank, instead of this rank raising alone and its peers hanging.
        other_grid = group_pieces(rows, cols, spec, fsdp_order=False)
        other = _in_group_order(other_grid, order, mesh_dims, group)
        if other[group.rank_index].shape == (local_rows, local_cols):
            pieces, grid_pieces, own = other, other_grid, (local_rows, local_cols)
    if own != (local_rows, local_cols):
        raise RuntimeError(
            f"parameter {_describe(name, param)}: local matrix shape {(local_rows, local_cols)} "
            f"on rank {dist.get_rank()} differs from the piece {own} its placements give "
            f"(rows {list(pieces[group.rank_index].rows)}, cols "
            f"{list(pieces[group.rank_index].cols)})"
        )
    batch_dims = () if flatten else tuple(range(param.ndim - 2))
    most = most_matrices(order, tuple(param.shape), tuple(param.placements), batch_dims)
    return MatrixLayout(
        **base, group=group, pieces=pieces, grid_pieces=grid_pieces, max_matrices=most
    )


@functools.lru_cache(maxsize=4096)
def group_pieces(
    rows: int, cols: int, spec: tuple[tuple[int, int, int], ...], fsdp_order: bool = True
) -> tuple[Piece, ...]:
    """Every rank's piece of a ``[rows, cols]`` matrix, by rank index in the flattened group.

    ``spec``: the matrix-dim shards in mesh-dim order, each ``(mesh dim size, axis,
    split_factor)`` with axis 0 for rows and 1 for columns; rank index ``j`` is the
    row-major position of its group coordinates on those mesh dims. Pure and cached (parameters
    of one shape and layout share the result; a group of 1024 ranks takes milliseconds).
    """
    sizes = [size for size, _, _ in spec]
    pieces = []
    for index in range(math.prod(sizes)):
        coordinate = unravel(index, sizes)
        splits = [
            [(size, c, sf) for (size, a, sf), c in zip(spec, coordinate) if a == axis]
            for axis in (0, 1)
        ]
        row_ranges = shard_ranges(rows, splits[0], fsdp_order)
        pieces.append(Piece(row_ranges, shard_ranges(cols, splits[1], fsdp_order)))
    return tuple(pieces)


def _in_group_order(
    grid: tuple[Piece, ...], order: MeshOrder, mesh_dims: tuple[int, ...], group: ShardGroup
) -> tuple[Piece, ...]:
    """``grid`` (by row-major group coordinates on ``mesh_dims``: what each rank holds, see
    :mod:`shardmuon.planning.mesh_order`) by rank index in ``group``, the numbering
    all-to-all splits and owners count in."""
    return tuple(grid[order.grid_index(rank, mesh_dims)] for rank in group.ranks)


@dataclass(frozen=True)
class SinkhornLayout:
    """How one Sinkhorn parameter (a 2-D ``[rows, cols]`` matrix) lies on this rank.

    The Sinkhorn update needs only sums over rows and over columns, so no rank needs to know
    which rows or columns another holds: ``row_groups`` are the groups of the mesh dims that
    split the rows (a column statistic is summed over them, one after another),
    ``col_groups`` those that split the columns (a row statistic is summed over them).
    ``replicas``: the groups of the mesh dims that replicate it (HSDP), whose members
    compute the same update and must agree on it.
    """

    rows: int
    cols: int
    local_rows: int
    local_cols: int
    row_groups: tuple[ShardGroup, ...] = ()
    col_groups: tuple[ShardGroup, ...] = ()
    replicas: tuple[ShardGroup, ...] = ()

    @property
    def communicates(self) -> bool:
        return bool(self.row_groups or self.col_groups)


def sinkhorn_layout(name: str, param: Tensor) -> SinkhornLayout:
    """Read a Sinkhorn parameter's layout from its placements (plain tensors are whole).

    ``Shard``/``_StridedShard`` of dim 0 or 1 and ``Replicate`` are accepted on any mesh
    dims; ``Partial`` is refused (``ValueError``), as is a mesh that lists its ranks out of
    ascending order when both rows and columns are split (which columns a rank holds then
    depends on how its shard was placed, so rows could be summed with other columns').
    """
    if param.ndim != 2:
        raise ValueError(
            f"parameter {name} has shape {tuple(param.shape)}; the Sinkhorn update needs a "
            "2-D matrix (an embedding table or an output head)"
        )
    if isinstance(param, DTensor):
        _refuse_foreign_mesh(name, param)
    local = local_tensor(param)
    base = dict(
        rows=param.shape[0],
        cols=param.shape[1],
        local_rows=local.shape[0],
        local_cols=local.shape[1],
    )
    if not isinstance(param, DTensor):
        return SinkhornLayout(**base)
    mesh = param.device_mesh
    split: tuple[list[int], list[int]] = ([], [])
    replicated = []
    for mesh_dim, placement in enumerate(param.placements):
        _refuse_partial(name, param, placement)
        if mesh.size(mesh_dim) == 1:
            continue
        if isinstance(placement, Replicate):
            replicated.append(mesh_dim)
            continue
        _split_factor(name, param, placement)  # Shard or _StridedShard, else refused
        split[placement.dim % 2].append(mesh_dim)
    rows_split, cols_split = split
    if rows_split and cols_split and mesh_order(mesh).permuted:
        raise ValueError(
            f"parameter {_describe(name, param)} on a device mesh of ranks "
            f"{mesh.mesh.tolist()}: rows and columns are both split over a mesh that lists "
            "ranks out of ascending order, so which columns a rank holds depends on how its "
            "shard was placed. Build the mesh with the ranks of every dim in ascending order "
            "(init_device_mesh does)"
        )
    return SinkhornLayout(
        **base,
        row_groups=tuple(mesh_dim_group(mesh, d) for d in rows_split),
        col_groups=tuple(mesh_dim_group(mesh, d) for d in cols_split),
        replicas=tuple(mesh_dim_group(mesh, d) for d in replicated),
    )
