"""Which shard a rank holds when its mesh does not list the ranks of a dim in ascending order.

torch numbers the process group of each mesh dim by ascending global rank, whatever order
the mesh lists them in (``new_group`` and ``split_group`` sort), and what moves a DTensor's
data counts in that numbering: ``distribute_tensor`` scatters shard ``i`` to group rank
``i``, ``full_tensor()`` and ``redistribute`` gather in group-rank order, and FSDP2 shards by
``DeviceMesh.get_local_rank``, the group rank. Only DTensor's size and offset arithmetic
reads the mesh coordinate. Measured on torch 2.13 with a mesh built from ``[[1, 0], [3, 2]]``
and ``(Replicate(), Shard(0))``: ``distribute_tensor`` and ``fully_shard`` give rank 0
(coordinate 1) rows 0-3 of 8, and ``full_tensor()`` puts them first. The matrix a model
trains on such a mesh is therefore the one whose shard ``i`` lies on group rank ``i``, and
shards are read by **group coordinates**: a rank's group rank along each mesh dim (its mesh
coordinate wherever the mesh ascends, so ascending meshes read as before).

The two readings contradict each other, and no layout satisfies both, where

* they size some rank's shard differently (a dim that does not split evenly over a
  permuted mesh dim: ``distribute_tensor`` then loses rows and ``full_tensor()`` does not
  round-trip), or
* the group coordinates do not form a grid along the mesh's groups: along a mesh dim
  that shards the parameter, and along a replicate dim that comes after a shard dim
  (``distribute_tensor`` broadcasts it from group rank 0), the group coordinates of the
  other shard dims must not change, or a group's members hold pieces of different tensors.

Such parameters are refused (so are meshes where the ranks holding pieces of the same
matrices are not one at each piece). The verdict depends on the mesh, the placements and
the global shape alone, so every rank of the mesh reaches the same one.

Where both readings are possible, a shard cannot say which one placed it:
``distribute_tensor(..., src_data_rank=None)`` (each rank slices its own piece, no scatter)
gives a rank the piece of its mesh coordinate, as DTensor's offsets (distributed
checkpoints) say; the scatter and FSDP2 give it that of its group rank
(``DeviceMesh.get_local_rank``). The plan follows the group ranks, so a tensor placed by
coordinate reaches it with its pieces permuted. Newton–Schulz commutes with a permutation
of rows and of columns, and each matrix is updated on its own, so the update is the same
under both readings unless the permutation moves rows across a block of the partitions
(reported: 12 rows on ``[3, 2, 1, 0]``, partitions ``[5, 7]``, every rank off by 0.024 in
an update of 0.039), or ranks that the plan pairs (an exchange group; replicas under
``split_replicas``) hold pieces of different matrices by coordinate.
:func:`reading_problem` refuses exactly those, from the mesh, placements, shape,
partitions and ``split_replicas`` alone.

Also from the mesh alone: which ranks share what (:func:`holders`: the exchange groups and
replica groups, which on a permuted mesh are not always the mesh's own), and the most
matrices any rank holds of a parameter (:func:`most_matrices`), so that every rank can plan
as many exchanged batches as the rank holding the most.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardmuon.planning.pieces import Range, extent_of, shard_ranges

__all__ = [
    "MeshOrder",
    "holders",
    "mesh_order",
    "most_matrices",
    "order_problem",
    "reading_problem",
]


@dataclass(frozen=True, eq=False)
class MeshOrder:
    """A mesh's ranks by coordinate, and each rank's group coordinates.

    ``grid[x]``: the global rank at mesh coordinate ``x``; ``group_grid[d][x]``: that rank's
    group rank in its process group along mesh dim ``d`` (its position among the dim's
    ranks sorted ascending). ``permuted``: the two differ somewhere.
    """

    grid: torch.Tensor
    group_grid: tuple[torch.Tensor, ...]
    permuted: bool

    @functools.cached_property
    def _where(self) -> dict[int, tuple[int, ...]]:
        shape = tuple(self.grid.shape)
        return {rank: unravel(i, shape) for i, rank in enumerate(self.ranks())}

    @functools.cached_property
    def _group_where(self) -> dict[int, tuple[int, ...]]:
        columns = [g.flatten().tolist() for g in self.group_grid]
        return {rank: tuple(c[i] for c in columns) for i, rank in enumerate(self.ranks())}

    def coordinate_of(self, rank: int) -> tuple[int, ...]:
        return self._where[rank]

    def group_coordinate_of(self, rank: int) -> tuple[int, ...]:
        return self._group_where[rank]

    def grid_index(self, rank: int, dims: Sequence[int]) -> int:
        """The row-major position of ``rank``'s group coordinates on the mesh dims ``dims``."""
        index, at = 0, self._group_where[rank]
        for d in dims:
            index = index * self.grid.shape[d] + at[d]
        return index

    def ranks(self) -> list[int]:
        return self.grid.flatten().tolist()


def mesh_order(mesh) -> MeshOrder:
    """The :class:`MeshOrder` of a ``DeviceMesh`` (cached by its rank tensor)."""
    grid = mesh.mesh.to(torch.int64).cpu()
    return _order(tuple(grid.flatten().tolist()), tuple(grid.shape))


@functools.lru_cache(maxsize=256)
def _order(ranks: tuple[int, ...], shape: tuple[int, ...]) -> MeshOrder:
    grid = torch.tensor(ranks, dtype=torch.int64).reshape(shape)
    group_grid = tuple(grid.argsort(dim=d).argsort(dim=d) for d in range(grid.ndim))
    coordinates = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    permuted = any(not torch.equal(g, c) for g, c in zip(group_grid, coordinates))
    return MeshOrder(grid, group_grid, permuted)


def unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of ``index`` in a grid of ``shape``."""
    coordinate = []
    for size in reversed(shape):
        index, c = divmod(index, size)
        coordinate.append(c)
    return tuple(reversed(coordinate))


def holders(
    order: MeshOrder, same_coordinate: Sequence[int], same_group: Sequence[int]
) -> frozenset[tuple[int, ...]]:
    """The mesh's ranks by what they share: the same mesh coordinates on the dims
    ``same_coordinate`` and the same group coordinates on the dims ``same_group``. A
    partition of the mesh's ranks, each part sorted (the same on every rank)."""
    return _holders(order, tuple(same_coordinate), tuple(same_group))


@functools.lru_cache(maxsize=4096)
def _holders(order: MeshOrder, same_coordinate: tuple, same_group: tuple) -> frozenset:
    parts: dict[tuple, list[int]] = {}
    for r in order.ranks():
        parts.setdefault(_key(order, r, same_coordinate, same_group), []).append(r)
    return frozenset(tuple(sorted(part)) for part in parts.values())


def _key(order: MeshOrder, rank: int, same_coordinate: tuple, same_group: tuple) -> tuple:
    x, g = order.coordinate_of(rank), order.group_coordinate_of(rank)
    return tuple(x[d] for d in same_coordinate) + tuple(g[d] for d in same_group)


def order_problem(
    order: MeshOrder,
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    exchange_dims: tuple[int, ...],
) -> str | None:
    """Why no layout of a tensor of global ``shape`` with these placements on this mesh is
    what both DTensor's coordinates and its group ranks say, or ``None`` (see the module
    docstring). ``exchange_dims``: the mesh dims that shard its matrices. Always ``None``
    on a mesh that ascends along every dim."""
    if not order.permuted:
        return None
    return _problem(order, tuple(shape), tuple(placements), tuple(exchange_dims))


@functools.lru_cache(maxsize=1024)
def _problem(
    order: MeshOrder, shape: tuple[int, ...], placements: tuple, exchange_dims: tuple
) -> str | None:
    sizes = tuple(order.grid.shape)
    sharding = [
        d for d, p in enumerate(placements) if sizes[d] > 1 and not isinstance(p, Replicate)
    ]
    replicate = [d for d, p in enumerate(placements) if sizes[d] > 1 and isinstance(p, Replicate)]
    for d in range(len(sizes)):
        # distribute_tensor works through the mesh dims in order, each from the group rank 0
        # of its groups: a later dim's groups must agree on the shards of every earlier one.
        for other in sharding:
            line = _mixed_line(order, d, other) if other < d and sizes[d] > 1 else None
            if line is not None:
                return (
                    f"the ranks {line[0]} of one process group along mesh dim {d} sit at "
                    f"different group ranks {line[1]} along mesh dim {other}, which shards it "
                    "before (torch numbers every mesh dim's groups by ascending rank, and "
                    "distribute_tensor gives each of them the shard of its group rank 0 "
                    "there); full_tensor() cannot round-trip such a tensor"
                )
    for dim, size in enumerate(shape):
        splits = [
            (d, sizes[d], int(p.split_factor) if isinstance(p, _StridedShard) else 1)
            for d, p in enumerate(placements)
            if d in sharding and p.dim % len(shape) == dim
        ]
        problem = _size_problem(order, dim, size, splits) if splits else None
        if problem is not None:
            return problem
    if exchange_dims:
        others = [d for d in sharding if d not in exchange_dims]
        problem = _one_piece_each(order, replicate, others, exchange_dims, "shard")
        if problem is not None:
            return problem
    if len(replicate) == 1:
        rest = [d for d in range(len(sizes)) if d != replicate[0]]
        return _one_piece_each(order, [], rest, tuple(replicate), "replicate")
    return None


def _one_piece_each(
    order: MeshOrder, same_coordinate: list, same_group: list, dims: tuple, what: str
) -> str | None:
    """Do the ranks that hold pieces of the same matrices (same coordinates on
    ``same_coordinate``, same group ranks on ``same_group``) cover the grid of ``dims``
    once each, by group rank (shard dims) or by coordinate (a replicate dim)?"""
    want = sorted(itertools.product(*(range(order.grid.shape[d]) for d in dims)))
    for members in sorted(holders(order, same_coordinate, same_group)):
        read = order.group_coordinate_of if what == "shard" else order.coordinate_of
        held = [tuple(read(r)[d] for d in dims) for r in members]
        if sorted(held) != want:
            return (
                f"the ranks {members}, which hold pieces of the same matrices, sit at "
                f"{'group ranks' if what == 'shard' else 'coordinates'} {held} along "
                f"{what} mesh dim(s) {list(dims)}: not one piece at each"
            )
    return None


def _mixed_line(order: MeshOrder, d: int, other: int) -> tuple[list[int], list[int]] | None:
    """A process group along mesh dim ``d`` whose members differ in their group rank along
    mesh dim ``other``: its ranks and those group ranks, or ``None``."""
    held = order.group_grid[other]
    if torch.equal(held.amax(dim=d), held.amin(dim=d)):
        return None
    lines = order.grid.movedim(d, -1).reshape(-1, order.grid.shape[d])
    values = held.movedim(d, -1).reshape(-1, order.grid.shape[d])
    for ranks, line in zip(lines.tolist(), values.tolist()):
        if len(set(line)) > 1:
            return ranks, line
    return None


def _size_problem(
    order: MeshOrder, dim: int, size: int, splits: list[tuple[int, int, int]]
) -> str | None:
    """Does some rank's shard of tensor dim ``dim`` differ in size between its coordinates
    and its group coordinates? ``splits``: ``(mesh dim, chunks, split factor)``."""
    for rank in order.ranks():
        by_mesh = order.coordinate_of(rank)
        by_group = order.group_coordinate_of(rank)
        if all(by_mesh[d] == by_group[d] for d, _, _ in splits):
            continue
        mesh_size = extent_of(shard_ranges(size, [(n, by_mesh[d], sf) for d, n, sf in splits]))
        group_size = extent_of(shard_ranges(size, [(n, by_group[d], sf) for d, n, sf in splits]))
        if mesh_size != group_size:
            return (
                f"its dim {dim} ({size}) does not split evenly over mesh dim(s) "
                f"{[d for d, _, _ in splits]}, whose ranks are not in ascending order: rank "
                f"{rank} holds {mesh_size} of it by its mesh coordinate (DTensor's shapes) "
                f"but {group_size} by its group ranks (what distribute_tensor, full_tensor() "
                "and FSDP2 use, since torch numbers every mesh dim's groups by ascending "
                "rank); full_tensor() cannot round-trip such a tensor"
            )
    return None


def most_matrices(
    order: MeshOrder, shape: tuple[int, ...], placements: tuple, batch_dims: tuple[int, ...]
) -> int:
    """The most matrices any rank of the mesh holds of a tensor of global ``shape``: the
    product of its shares of the tensor dims ``batch_dims`` (an expert dim sharded unevenly,
    or over more ranks than it has experts, leaves some ranks fewer)."""
    return _most(order, tuple(shape), tuple(placements), tuple(batch_dims))


@functools.lru_cache(maxsize=1024)
def _most(order: MeshOrder, shape: tuple, placements: tuple, batch_dims: tuple) -> int:
    sizes = tuple(order.grid.shape)
    splits = {
        t: [
            (d, sizes[d], int(p.split_factor) if isinstance(p, _StridedShard) else 1)
            for d, p in enumerate(placements)
            if sizes[d] > 1 and not isinstance(p, Replicate) and p.dim % len(shape) == t
        ]
        for t in batch_dims
    }
    most = 0
    for rank in order.ranks():
        at = order.group_coordinate_of(rank)
        count = 1
        for t in batch_dims:
            count *= extent_of(shard_ranges(shape[t], [(n, at[d], sf) for d, n, sf in splits[t]]))
        most = max(most, count)
    return most


def reading_problem(
    order: MeshOrder,
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    matrix_dims: tuple[int, ...],
    partitions: tuple[int, ...] | None = None,
    split_replicas: bool = False,
) -> str | None:
    """Why this parameter's update would depend on whether its shards were placed by group
    rank or by mesh coordinate (see the module docstring), or ``None``. ``matrix_dims``: the
    tensor dims of its matrices, rows first (partitions cut the rows). Call it for layouts
    :func:`order_problem` accepts. Always ``None`` on a mesh that ascends along every dim."""
    if not order.permuted:
        return None
    sizes = _partition_sizes(partitions)
    return _reading(
        order, tuple(shape), tuple(placements), tuple(matrix_dims), sizes, split_replicas
    )


def _partition_sizes(partitions) -> tuple[int, ...] | None:
    return tuple(partitions) if partitions is not None and len(partitions) > 1 else None


@functools.lru_cache(maxsize=1024)
def _reading(
    order: MeshOrder,
    shape: tuple[int, ...],
    placements: tuple,
    matrix_dims: tuple[int, ...],
    partitions: tuple[int, ...] | None,
    split_replicas: bool,
) -> str | None:
    sizes = tuple(order.grid.shape)
    splits: dict[int, list[tuple[int, int, int]]] = {}  # tensor dim -> (mesh dim, chunks, sf)
    replicate, batch = [], []
    for d, p in enumerate(placements):
        if sizes[d] == 1:
            continue
        if isinstance(p, Replicate):
            replicate.append(d)
        elif isinstance(p, (Shard, _StridedShard)):
            t = p.dim % len(shape)
            sf = int(p.split_factor) if isinstance(p, _StridedShard) else 1
            splits.setdefault(t, []).append((d, sizes[d], sf))
            if t not in matrix_dims:
                batch.append(d)
    # Replicas hand each other results only under split_replicas (one replicate dim).
    broadcast = split_replicas and len(replicate) == 1
    if not broadcast and not any(t in matrix_dims for t in splits):
        return None  # whole matrices, each updated where it lies: any reading is right
    # The ranks whose pieces the plan combines: an exchange group, or with broadcasts all
    # replicas of it (what groups.exchange_group and groups.replica_group take).
    parts = holders(order, () if broadcast else replicate, batch)
    seen = set()
    for members in sorted(parts):
        for t, dim_splits in sorted(splits.items()):
            readings = frozenset(_readings_of(order, r, dim_splits) for r in members)
            if (t, readings) in seen:
                continue
            seen.add((t, readings))
            blocks = partitions if t == matrix_dims[0] else None
            problem = _dim_reading(order, members, t, shape[t], dim_splits, blocks)
            if problem is not None:
                return problem
    return None


def _readings_of(order: MeshOrder, rank: int, dim_splits: list) -> tuple[tuple, tuple]:
    """``rank``'s group coordinates and mesh coordinates on the mesh dims of ``dim_splits``."""
    g, x = order.group_coordinate_of(rank), order.coordinate_of(rank)
    return tuple(g[d] for d, _, _ in dim_splits), tuple(x[d] for d, _, _ in dim_splits)


def _dim_reading(
    order: MeshOrder,
    members: tuple[int, ...],
    dim: int,
    extent: int,
    dim_splits: list[tuple[int, int, int]],
    partitions: tuple[int, ...] | None,
) -> str | None:
    """Is reading tensor dim ``dim`` by mesh coordinate, across ``members``, one permutation
    of what the plan reads by group rank (the same index wherever the plan reads the same
    one), and does it map every partition block onto a block?"""
    what = "rows" if partitions is not None else f"indices of dim {dim}"
    # to_true[i]: the index the plan's index i holds by coordinate; by_rank[i]: who says so.
    to_true = torch.full((extent,), -1, dtype=torch.int64)
    to_plan = torch.full((extent,), -1, dtype=torch.int64)
    by_rank = torch.full((extent,), -1, dtype=torch.int64)
    held: dict[int, tuple[tuple[Range, ...], tuple[Range, ...]]] = {}
    for rank in members:
        g, x = _readings_of(order, rank, dim_splits)
        plan = shard_ranges(extent, [(n, c, sf) for (_, n, sf), c in zip(dim_splits, g)])
        true = shard_ranges(extent, [(n, c, sf) for (_, n, sf), c in zip(dim_splits, x)])
        held[rank] = plan, true
        p, q = _indices(plan), _indices(true)
        if p.numel() != q.numel():
            return (
                f"rank {rank} holds {p.numel()} {what} by its group ranks but {q.numel()} by "
                "its mesh coordinates"
            )
        clash = ((to_true[p] >= 0) & (to_true[p] != q)) | ((to_plan[q] >= 0) & (to_plan[q] != p))
        if bool(clash.any()):
            i = int(clash.nonzero()[0])
            other = int(by_rank[p[i]]) if int(to_true[p[i]]) >= 0 else int(by_rank[to_plan[q[i]]])
            return (
                f"the ranks {other} and {rank}, which the plan gives pieces of the same "
                f"matrices (an exchange group, or replicas under split_replicas), hold {what}: "
                f"{_spans(held[other][0])} and {_spans(plan)} by their group ranks but "
                f"{_spans(held[other][1])} and {_spans(true)} by their mesh coordinates: "
                "not one permutation of the same tensor"
            )
        to_true[p], to_plan[q], by_rank[p] = q, p, rank
    if partitions is None:
        return None
    block_of = torch.repeat_interleave(torch.arange(len(partitions)), torch.tensor(partitions))
    start = 0
    for size in partitions:
        stop = start + size
        moved = to_true[start:stop]
        if bool((moved < 0).any()):  # rows no member holds: not a group of one matrix
            return f"no rank holds some of its {what} {start}-{stop - 1}"
        blocks = block_of[moved]
        if bool((blocks != blocks[0]).any()) or partitions[int(blocks[0])] != size:
            rank = next(r for r in members if held[r][0] != held[r][1])
            return (
                f"rank {rank} holds rows {_spans(held[rank][0])} by its group ranks "
                "(distribute_tensor's scatter, full_tensor(), FSDP2) but rows "
                f"{_spans(held[rank][1])} by its mesh coordinates "
                "(distribute_tensor(src_data_rank=None), DTensor's offsets), and the rows "
                f"{start}-{stop - 1}, one block of its partitions {list(partitions)} "
                "(matrix_partitions, or dion's split_sizes/num_heads), by the first reading "
                f"are rows {_spans(_ranges(moved.tolist()))} by the second, not one block: "
                "the update depends on which reading placed the shards, and no shard can "
                "tell. Partitions whose blocks the two readings map onto blocks (equal "
                "blocks of whole shards, for instance) are accepted"
            )
        start = stop
    return None


def _indices(ranges: tuple[Range, ...]) -> torch.Tensor:
    if not ranges:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def _ranges(indices: list[int]) -> tuple[Range, ...]:
    """Sorted ``indices`` as ``(start, stop)`` ranges."""
    out: list[Range] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


def _spans(ranges: tuple[Range, ...]) -> str:
    """Ranges as inclusive spans: ``0-2, 6-8``."""
    return ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in ranges) or "none"
