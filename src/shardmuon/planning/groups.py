"""The process groups a matrix is exchanged and replicated over, as :class:`ShardGroup`.

The mesh's own groups wherever they hold exactly the ranks that must talk (one mesh dim;
several flattened by the user with ``mesh[...]._flatten()``), else groups of exactly those
ranks, made once by those ranks only. A group is identified by its global ranks; its rank
numbering (ascending global ranks, what collectives count in) can differ from the mesh's
order, which :class:`ShardGroup` keeps beside it (:mod:`shardmuon.planning.mesh_order`).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardmuon.planning.mesh_order import MeshOrder, holders, mesh_order

__all__ = [
    "ShardGroup",
    "exchange_group",
    "group_of_ranks",
    "made_in_this_world",
    "mesh_dim_group",
    "replica_group",
]


@dataclass(frozen=True)
class ShardGroup:
    """The process group a matrix is exchanged (or replicated) over, identified by its global
    ranks (not by identity); several mesh dims flattened when the matrix is sharded over
    several. ``ranks[i]`` is the global rank of group rank ``i`` (the numbering collectives
    use: ascending global ranks, whatever order the mesh lists them in) and ``rank_index``
    this rank's group rank."""

    ranks: tuple[int, ...]
    rank_index: int
    process_group: dist.ProcessGroup = field(compare=False, hash=False, repr=False)
    # The members in row-major mesh order (DTensor's coordinates; for replicas, by
    # coordinate along the replicate dim), where it differs from ``ranks``; empty when the
    # two agree.
    mesh_ranks: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @property
    def mesh_index(self) -> int:
        """This rank's position in mesh order (its coordinate along a single mesh dim)."""
        if not self.mesh_ranks:
            return self.rank_index
        return self.mesh_ranks.index(self.ranks[self.rank_index])

    def global_rank_at(self, mesh_index: int) -> int:
        """The global rank at position ``mesh_index`` in mesh order."""
        return (self.mesh_ranks or self.ranks)[mesh_index]

    @property
    def size(self) -> int:
        return len(self.ranks)


def _group_of(process_group: dist.ProcessGroup, mesh_ranks: tuple[int, ...]) -> ShardGroup:
    """``process_group`` as a :class:`ShardGroup`: its members in its own rank numbering, and
    ``mesh_ranks`` (the same members in mesh order)."""
    ranks = tuple(dist.get_global_rank(process_group, i) for i in range(process_group.size()))
    if sorted(ranks) != sorted(mesh_ranks):
        raise RuntimeError(
            f"the process group of ranks {list(ranks)} is not the mesh's group of ranks "
            f"{list(mesh_ranks)}"
        )
    in_mesh_order = () if mesh_ranks == ranks else mesh_ranks
    return ShardGroup(ranks, process_group.rank(), process_group, in_mesh_order)


def replicas_of_plain_params(ranks: tuple[int, ...] | None) -> ShardGroup | None:
    """The group over which plain (non-DTensor) parameters are replicas (DDP): ``ranks``
    (sorted global ranks, this rank among them), the whole world when they are the world's,
    else a group of them made by its members. ``None`` for ``None`` or a single rank."""
    if ranks is None or len(ranks) < 2:
        return None
    rank = dist.get_rank()
    if rank not in ranks:
        raise ValueError(
            f"rank {rank} is not in the process group given as distributed_mesh (ranks "
            f"{list(ranks)}): every rank that steps this optimizer must be"
        )
    if len(ranks) == dist.get_world_size():
        process_group = dist.group.WORLD
    else:
        made = made_in_this_world(_FLATTENED_GROUPS)
        if ranks not in made:
            made[ranks] = group_of_ranks(ranks)
        process_group = made[ranks]
    return ShardGroup(ranks, ranks.index(rank), process_group)


def _mesh_ranks(mesh, mesh_dims: Sequence[int]) -> tuple[int, ...]:
    """The global ranks along ``mesh_dims`` (row-major; other dims at this rank's coordinate)."""
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if d in mesh_dims else c for d, c in enumerate(coordinate))
    return tuple(mesh.mesh[index].flatten().tolist())


def mesh_dim_group(mesh, mesh_dim: int) -> ShardGroup:
    """The process group along ``mesh_dim`` that holds this rank."""
    return _group_of(mesh.get_group(mesh_dim), _mesh_ranks(mesh, (mesh_dim,)))


def exchange_group(
    mesh, order: MeshOrder, mesh_dims: tuple[int, ...], replicate_dims: list, batch_dims: list
) -> ShardGroup:
    """The ranks holding the pieces of this rank's matrices, in this replica: those at its
    coordinates on the replicate dims and at its group coordinates on the batch dims.

    The mesh's own groups over ``mesh_dims`` (flattened if several), unless a permuted mesh
    lists a later batch dim (experts) in different orders along them: then groups of
    exactly these ranks (:func:`_part_group`).
    """
    parts = holders(order, replicate_dims, batch_dims)
    others = [d for d in range(order.grid.ndim) if d not in mesh_dims]
    if parts == holders(order, others, ()):
        return _shard_group(mesh, mesh_dims)[0]
    members = _part_of(parts)
    return _group_of(_part_group(parts, members), members)


def replica_group(mesh, order: MeshOrder, mesh_dim: int) -> ShardGroup:
    """The ranks holding this rank's shards, one at each coordinate of replicate dim
    ``mesh_dim``: those at the same group coordinates on every other mesh dim.

    The mesh's own groups along ``mesh_dim``, unless a permuted mesh lists the later dims
    in other orders at other coordinates of it (a leading replicate dim is broadcast before
    DTensor scatters): then groups of exactly these ranks (:func:`_part_group`).
    """
    others = [d for d in range(order.grid.ndim) if d != mesh_dim]
    parts = holders(order, (), others)
    if parts == holders(order, others, ()):
        return mesh_dim_group(mesh, mesh_dim)
    members = _part_of(parts)
    in_mesh_order = tuple(sorted(members, key=lambda r: order.coordinate_of(r)[mesh_dim]))
    return _group_of(_part_group(parts, members), in_mesh_order)


def _part_of(parts: frozenset[tuple[int, ...]]) -> tuple[int, ...]:
    """The part holding this rank."""
    me = dist.get_rank()
    return next(part for part in parts if me in part)


# Groups this module made (flattened mesh dims, groups off the mesh's own), by their sorted
# global ranks, and the partitions of a mesh's ranks made into such groups; emptied when the
# world is made anew (:func:`made_in_this_world`).
_FLATTENED_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_MADE_PARTITIONS: set[frozenset[tuple[int, ...]]] = set()
# How many groups of each rank set :func:`group_of_ranks` made (their names count them).
_MADE_PER_RANKS: dict[tuple[int, ...], int] = {}
_REGISTRIES: list = [_FLATTENED_GROUPS, _MADE_PARTITIONS, _MADE_PER_RANKS]
_REGISTRY_WORLD: list = [None]  # the world group the registries hold groups of


def made_in_this_world(registry):
    """``registry`` (a dict or set of things made over the current world's process groups),
    emptied first if the world was destroyed and made anew since (``destroy_process_group``
    then ``init_process_group``): its groups are gone with the world that made them. Every
    registry of groups in the package is kept through this."""
    if not any(each is registry for each in _REGISTRIES):  # by identity: {} == {}
        _REGISTRIES.append(registry)
    world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if world is not _REGISTRY_WORLD[0]:
        _REGISTRY_WORLD[0] = world  # held: a new world cannot reuse a dead one's identity
        for each in _REGISTRIES:
            each.clear()
    return registry


def _part_group(parts: frozenset[tuple[int, ...]], members: tuple[int, ...]) -> dist.ProcessGroup:
    """The group of ``members`` (sorted), one part of ``parts`` (a partition of a mesh's ranks
    that all its ranks compute alike), made by those ranks only (:func:`group_of_ranks`):
    ranks off the mesh, such as other pipeline stages, need not take part. Every rank of the
    mesh makes its part's group the first time the partition is needed."""
    made = made_in_this_world(_MADE_PARTITIONS)
    if parts not in made:
        made_in_this_world(_FLATTENED_GROUPS)[members] = group_of_ranks(members)
        made.add(parts)
    return _FLATTENED_GROUPS[members]


_MAKING = threading.RLock()


def group_of_ranks(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A new process group of ``ranks`` (sorted global ranks), made by those ranks only, on
    the job's timeout (:func:`job_timeout`). Its members must make it together, in the same
    order among the groups of these ranks this function makes.

    torch names a group made by its members only (``use_local_synchronization``) by its
    ranks and by how many groups the calling process has, which differs between members as
    soon as the job made a group some of them are not in (``new_group([0, 1])`` on a world
    of 4): they would wait for each other under different names. Here the name counts only
    the groups of these same ranks made here, which every member has made alike; and the
    group is never split from a world bound to a device (:func:`_not_split_from_the_world`).
    """
    with _MAKING:
        made = made_in_this_world(_MADE_PER_RANKS)
        count = made.get(ranks, 0)
        made[ranks] = count + 1
        label = f"shardmuon|{','.join(map(str, ranks))}|{count}"
        name = "shardmuon-" + hashlib.sha1(label.encode(), usedforsecurity=False).hexdigest()
        c10d = dist.distributed_c10d
        original = getattr(c10d, "_process_group_name", None)
        if original is not None:
            c10d._process_group_name = lambda *_args, **_kwargs: name
        try:
            with _not_split_from_the_world():
                return dist.new_group(
                    list(ranks), timeout=job_timeout(), use_local_synchronization=True
                )
        finally:
            if original is not None:
                c10d._process_group_name = original


@contextlib.contextmanager
def _not_split_from_the_world() -> Iterator[None]:
    """Make a group of some ranks only, even where the world group is bound to a device.

    With ``init_process_group(device_id=...)`` (eager NCCL init) torch makes every new group
    by splitting the world's communicator (``ncclCommSplit``), which every rank of the world
    must call: a group made by its members only (another pipeline stage plans other groups,
    or none) would wait forever. Inside this block the world group reads as unbound, so the
    group gets a communicator of its own, set up by its members at its first collective
    (what an unbound world does for every group). Its members still make it together. One
    thread at a time (a lock around the whole block): no other thread sees the binding
    restored while it is inside."""
    with _MAKING:
        world = dist.distributed_c10d._get_default_group()
        bound = getattr(world, "bound_device_id", None)
        if bound is None:
            yield
            return
        world.bound_device_id = None
        try:
            yield
        finally:
            world.bound_device_id = bound


def job_timeout():
    """The timeout the job gave ``init_process_group``, for the groups this package makes
    (``new_group`` would otherwise take the backend's default: 10 minutes for NCCL, 30 for
    gloo), so that a peer's failure surfaces when the job expects. ``None`` (the backend's
    default) where the backend does not say."""
    group = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def _shard_group(mesh, mesh_dims: tuple[int, ...]) -> tuple[ShardGroup, tuple[int, ...]]:
    """The group over ``mesh_dims`` that holds this rank, and its members in row-major mesh
    order.

    One mesh dim: its own group. Several: a flattened mesh over the same ranks the user made
    (``mesh[...]._flatten()``) if there is one, else a group of exactly these ranks
    (:func:`_part_group`).
    """
    mesh_ranks = _mesh_ranks(mesh, mesh_dims)
    if len(mesh_dims) == 1:
        return mesh_dim_group(mesh, mesh_dims[0]), mesh_ranks
    members = tuple(sorted(mesh_ranks))
    process_group = _existing_flattened_group(mesh, members)
    if process_group is None:
        order = mesh_order(mesh)
        others = [d for d in range(order.grid.ndim) if d not in mesh_dims]
        process_group = _part_group(holders(order, others, ()), members)
    return _group_of(process_group, mesh_ranks), mesh_ranks


def _existing_flattened_group(mesh, members: tuple[int, ...]) -> dist.ProcessGroup | None:
    """The group of a flattened 1-D mesh over exactly ``members`` (sorted), if one was made."""
    try:
        flattened = mesh._get_root_mesh()._flatten_mapping.values()
    except AttributeError:  # a DeviceMesh without flattening support
        return None
    for flat in flattened:
        if tuple(sorted(flat.mesh.flatten().tolist())) == members:
            return flat.get_group(0)
    return None
