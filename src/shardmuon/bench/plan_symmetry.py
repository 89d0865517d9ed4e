"""``bench plan``, every other rank: which ranks plan alike (classes), derived from rank 0's
meshes and placements without laying them out, and a class representative's batches
re-indexed to each rank's own position in its groups (see :mod:`shardmuon.bench.plan`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from torch import Tensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardmuon.bench.plan_rank import RankPlan
from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.pieces import chunk_sizes, shard_ranges
from shardmuon.planning.placements import MatrixLayout, ShardGroup, local_tensor

__all__ = ["Symmetry"]


@dataclass(frozen=True, eq=False)
class _Kind:
    """Muon params that lie alike on every rank: one mesh, placements and global shape."""

    mesh: Tensor | None  # the mesh's rank grid (DeviceMesh.mesh), None for a plain tensor
    placements: tuple
    shape: tuple[int, ...]
    shard_dim: int | None  # the mesh dim the matrices are exchanged over
    replicate_dim: int | None  # the mesh dim of the replicas (HSDP), if any


_NO_LAYOUT = MatrixLayout(rows=0, cols=0, num_matrices=0, local_rows=0, local_cols=0, flatten=False)


def _param_layouts(plan: RankPlan) -> dict[int, MatrixLayout]:
    """Each Muon param's layout, from the batches (a param with no matrices here is absent)."""
    return {seg.param_index: b.layout for b in plan.batches for seg in b.segments}


class Symmetry:
    """Every rank's local shapes and groups, computed from rank 0's meshes and placements.

    ``supported`` is false when a placement is neither ``Shard`` nor ``Replicate`` (the
    chunking below would not be DTensor's) or a matrix is sharded over several mesh dims;
    then every rank must be laid out.
    """

    def __init__(self, plan0: RankPlan) -> None:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self._shard_type, self._replicate_type = Shard, Replicate
        self.supported = True
        self._groups: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        self._group_ids: dict[tuple[int, ...], int] = {}
        self.group_ranks: list[tuple[int, ...]] = []
        self._coords: dict[int, dict[int, tuple[int, ...]]] = {}
        self._chunks: dict[tuple[int, int], tuple[int, ...]] = {}
        meshes: dict[object, Tensor] = {}
        layouts = _param_layouts(plan0)
        kinds: dict[tuple, int] = {}
        self.kinds: list[_Kind] = []
        self.kind_of: list[int] = []
        for index, p in enumerate(plan0.params):
            if isinstance(p, DTensor):
                if not all(_symmetric_placement(pl, p.dim()) for pl in p.placements):
                    self.supported = False
                    return
                # DeviceMesh.mesh may build a new tensor per access: keep one per mesh.
                mesh = meshes.setdefault(p.device_mesh, p.device_mesh.mesh)
                key = (id(mesh), tuple(p.placements), tuple(p.shape))
            else:
                mesh, key = None, (None, (), tuple(p.shape))
            if key not in kinds:
                # A param without matrices on this rank is in no batch: local, no groups.
                layout = layouts.get(index, _NO_LAYOUT)
                try:
                    shard_dim = self._dim_of(mesh, key[1], layout.group, Shard, plan0.rank)
                except RuntimeError:
                    # Sharded over several mesh dims (FSDP over TP): lay out every rank.
                    self.supported = False
                    return
                kinds[key] = len(self.kinds)
                self.kinds.append(
                    _Kind(
                        mesh=mesh,
                        placements=key[1],
                        shape=key[2],
                        shard_dim=shard_dim,
                        replicate_dim=self._dim_of(
                            mesh, key[1], layout.replicas, Replicate, plan0.rank
                        ),
                    )
                )
            self.kind_of.append(kinds[key])
        self.exchanged = [k for k, kind in enumerate(self.kinds) if kind.shard_dim is not None]
        self.local = [k for k, kind in enumerate(self.kinds) if kind.shard_dim is None]
        self._local_shapes: dict[tuple[int, int], tuple[int, ...]] = {}
        self._signatures: dict[tuple[int, int], int] = {}
        self._signature_ids: dict[tuple, int] = {}

    def _dim_of(self, mesh, placements, group: ShardGroup | None, kind, rank: int) -> int | None:
        """The mesh dim whose group (through ``rank``) is ``group``, among dims of type ``kind``."""
        if group is None or mesh is None:
            return None
        for dim, placement in enumerate(placements):
            if isinstance(placement, kind) and mesh.size(dim) > 1:
                gid, _ = self._group(mesh, dim, rank)
                if self.group_ranks[gid] == group.ranks:
                    return dim
        raise RuntimeError(f"no mesh dim of {tuple(mesh.shape)} holds the group {group.ranks}")

    def _group(self, mesh: Tensor, dim: int, rank: int) -> tuple[int, int]:
        """``(group id, index)`` of ``rank`` in the group along ``dim`` of ``mesh``."""
        key = (id(mesh), dim)
        if key not in self._groups:
            table: dict[int, tuple[int, int]] = {}
            for row in mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist():
                ranks = tuple(row)
                gid = self._group_ids.setdefault(ranks, len(self.group_ranks))
                if gid == len(self.group_ranks):
                    self.group_ranks.append(ranks)
                table.update((r, (gid, i)) for i, r in enumerate(ranks))
            self._groups[key] = table
        return self._groups[key][rank]

    def _coord(self, mesh: Tensor, rank: int) -> tuple[int, ...]:
        key = id(mesh)
        if key not in self._coords:
            flat = mesh.reshape(-1).tolist()
            coords = itertools.product(*(range(n) for n in mesh.shape))
            self._coords[key] = dict(zip(flat, coords))
        return self._coords[key][rank]

    def local_shape(self, kind: int, rank: int) -> tuple[int, ...]:
        """The local shape of kind ``kind`` on ``rank``: DTensor's ``Shard`` chunking."""
        key = (kind, rank)
        if key not in self._local_shapes:
            spec = self.kinds[kind]
            shape = list(spec.shape)
            if spec.mesh is not None:
                coord = self._coord(spec.mesh, rank)
                strided = [pl for pl in spec.placements if isinstance(pl, _StridedShard)]
                for dim, placement in enumerate(spec.placements):
                    if isinstance(placement, self._shard_type) and not strided:
                        d = placement.dim % len(shape)
                        split = (shape[d], spec.mesh.size(dim))
                        if split not in self._chunks:
                            self._chunks[split] = chunk_sizes(*split)
                        shape[d] = self._chunks[split][coord[dim]]
                if strided:  # FSDP2 over expert parallel: the optimizer's own reading
                    shape = list(_strided_local_shape(spec, coord))
            self._local_shapes[key] = tuple(shape)
        return self._local_shapes[key]

    def shard_group(self, kind: int, rank: int) -> tuple[int, int]:
        spec = self.kinds[kind]
        return self._group(spec.mesh, spec.shard_dim, rank)

    def _replica_group(self, kind: int, rank: int) -> int | None:
        spec = self.kinds[kind]
        if spec.replicate_dim is None:
            return None
        return self._group(spec.mesh, spec.replicate_dim, rank)[0]

    def _signature(self, kind: int, rank: int) -> int:
        """Which batches the shard group of ``kind`` through ``rank`` plans (an interned id).

        The kinds exchanged in that group, and member by member their local shapes.
        """
        gid, _ = self.shard_group(kind, rank)
        key = (kind, gid)
        if key not in self._signatures:
            members = self.group_ranks[gid]
            in_group = tuple(k for k in self.exchanged if self.shard_group(k, rank)[0] == gid)
            value = (
                in_group,
                tuple(tuple(self.local_shape(k, m) for k in in_group) for m in members),
            )
            self._signatures[key] = self._signature_ids.setdefault(value, len(self._signature_ids))
        return self._signatures[key]

    def class_of(self, rank: int) -> tuple:
        """Ranks with equal classes have the same plan up to their positions in their groups."""
        local = tuple(self.local_shape(k, rank) for k in self.local)
        groups = tuple(self._signature(k, rank) for k in self.exchanged)
        shard = [self.shard_group(k, rank)[0] for k in self.exchanged]
        replicas = [self._replica_group(k, rank) for k in range(len(self.kinds))]
        # Which kinds share a shard group, and which share a replica group (batch keys).
        pattern = (
            tuple(shard.index(g) for g in shard),
            tuple(replicas.index(g) for g in replicas),
        )
        return local, groups, pattern

    def check(self, plan: RankPlan) -> None:
        """The computed local shapes and groups of ``plan.rank`` equal its real ones."""
        layouts = _param_layouts(plan)
        for index, p in enumerate(plan.params):
            kind = self.kind_of[index]
            actual = tuple(local_tensor(p).shape)
            expected = self.local_shape(kind, plan.rank)
            group = layouts.get(index, _NO_LAYOUT).group
            problem = None
            if actual != expected:
                problem = f"local shape {actual}, computed {expected}"
            elif group is not None:
                gid, position = self.shard_group(kind, plan.rank)
                if (group.ranks, group.rank_index) != (self.group_ranks[gid], position):
                    problem = f"group {group.ranks} at index {group.rank_index}, computed other"
            if problem:
                raise RuntimeError(
                    f"bench plan: rank {plan.rank}, {plan.names[index]}: {problem}; the ranks "
                    "cannot be derived from one another here: rerun with --all-ranks"
                )

    def reindex(self, batches: list[MuonBatch], rank: int) -> list[MuonBatch]:
        """The batches of a rank of the same class, as ``rank`` holds them."""
        out = []
        for batch in batches:
            layout = batch.layout
            if not layout.exchanged:
                out.append(batch)
                continue
            gid, position = self.shard_group(self.kind_of[batch.segments[0].param_index], rank)
            local_rows, local_cols = layout.piece_shape(position)
            layout = replace(
                layout,
                group=ShardGroup(self.group_ranks[gid], position, layout.group.process_group),
                local_rows=local_rows,
                local_cols=local_cols,
            )
            out.append(replace(batch, layout=layout))
        return out


def _symmetric_placement(placement, ndim: int) -> bool:
    """Placements the symmetry model reads: ``Shard``/``Replicate``, and the
    ``_StridedShard`` FSDP2 puts on the expert dim of a stack already split by expert
    parallelism (never on a matrix dim: FSDP over TP is laid out rank by rank)."""
    from torch.distributed.tensor import Replicate

    if type(placement) in (Shard, Replicate):
        return True
    return isinstance(placement, _StridedShard) and placement.dim % ndim < ndim - 2


def _strided_local_shape(spec, coord: tuple[int, ...]) -> tuple[int, ...]:
    """A local shape under placements with ``_StridedShard``: each dim's shards applied in
    FSDP2's order (:func:`shardmuon.planning.pieces.shard_ranges`)."""
    shape = list(spec.shape)
    for d in range(len(shape)):
        splits = [
            (spec.mesh.size(m), coord[m], getattr(pl, "split_factor", 1))
            for m, pl in enumerate(spec.placements)
            if isinstance(pl, (Shard, _StridedShard)) and pl.dim % len(shape) == d
        ]
        if splits:
            shape[d] = sum(stop - start for start, stop in shard_ranges(shape[d], splits))
    return tuple(shape)
