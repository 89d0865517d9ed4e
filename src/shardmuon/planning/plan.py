"""From param groups to the fixed plan a ``Muon`` steps through (computed once).

For every Muon parameter: its layout (``placements.matrix_layout``), its checked partitions and
the lr scale of each local row range; then the batches (``batches.plan_batches``) and one
chunk per AdamW group; one per Sinkhorn parameter (its layout: ``placements.sinkhorn_layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from shardmuon.ops.orthogonalizer import DEFAULT_COST, EngineCost
from shardmuon.ops.partitions import check_partitions, dion_group_partitions, row_scales
from shardmuon.planning.batches import MuonBatch, PlanEntry, plan_batches
from shardmuon.planning.groups import ShardGroup, replicas_of_plain_params
from shardmuon.planning.placements import (
    MatrixLayout,
    SinkhornLayout,
    matrix_layout,
    sinkhorn_layout,
)
from shardmuon.planning.workspace import DEFAULT_WORKSPACE_BYTES, local_batch_size

__all__ = [
    "AdamWChunk",
    "ChunkInfo",
    "Plan",
    "SinkhornChunk",
    "build_plan",
    "plan_key",
    "setting_float",
]


@dataclass(frozen=True)
class AdamWChunk:
    """The parameters of one AdamW group: all of them, or only the one at ``param_index``
    (``Muon(adamw_chunks="parameter")``)."""

    group_index: int
    param_index: int | None = None

    def params_of(self, param_groups: list[dict]) -> list[Tensor]:
        params = param_groups[self.group_index]["params"]
        return list(params) if self.param_index is None else [params[self.param_index]]


@dataclass(frozen=True)
class SinkhornChunk:
    """One parameter of a Sinkhorn group (``param_index``: its position in the group)."""

    group_index: int
    param_index: int
    layout: SinkhornLayout

    @property
    def communicates(self) -> bool:
        return self.layout.communicates


@dataclass(frozen=True)
class ChunkInfo:
    """What one chunk of ``Muon.chunks()`` holds (for trainers that schedule or offload it).

    ``params``: the parameters it updates, in order. ``matrix_shapes``: for a Muon chunk, the
    global ``(rows, cols)`` of each of its matrices (Sinkhorn: its one matrix; empty for
    AdamW); ``local_shape``: this rank's ``(rows, cols)`` of them. ``state_bytes``: this
    rank's bytes of optimizer state the chunk reads and writes (Muon: the momentum of its
    matrices; Sinkhorn: its fp32 momentum; AdamW: momentum and variance). ``communicates``: stepping it runs a collective (then chunks must be stepped
    in ``chunks()`` order).
    """

    kind: str
    params: tuple[Tensor, ...]
    matrix_shapes: tuple[tuple[int, int], ...]
    local_shape: tuple[int, int] | None
    state_bytes: int
    communicates: bool


@dataclass
class Plan:
    """What the optimizer computed once: Muon parameters, their layouts and scales, the batches."""

    params: list[Tensor]
    group_of: list[int]
    layouts: list[MatrixLayout]
    row_scales: list[list[tuple[int, int, float]]]
    partitions: list[tuple[int, ...] | None]
    batches: list[MuonBatch]
    adamw: list[AdamWChunk]
    # The Newton–Schulz engine's cost model the batches were cut and balanced with.
    ns_cost: EngineCost = DEFAULT_COST
    sinkhorn: list[SinkhornChunk] = field(default_factory=list)
    # The group plain (non-DTensor) Muon parameters are replicas over (DDP), if any.
    plain_replicas: ShardGroup | None = None


def plan_key(
    param_groups: list[dict],
    matrix_partitions: dict[Tensor, Sequence[int]],
    update_rms: float,
    rotate_owners: bool,
    split_replicas: bool,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ns_cost: EngineCost = DEFAULT_COST,
    adamw_chunks: str = "group",
    plain_replica_ranks: tuple[int, ...] | None = None,
) -> tuple:
    """Everything a plan is built from, as a comparable value.

    A plan is valid while this value is unchanged; the optimizer compares it before each
    round and rebuilds the plan when a group's membership or one of its planned settings
    (algorithm, adjust_lr, epsilon, flatten, dion's split_sizes/num_heads) changed.
    """
    groups = tuple(
        (
            group["algorithm"],
            group["adjust_lr"],
            setting_float(group["epsilon"]),
            group["flatten"],
            _hashable(group.get("split_sizes")),
            group.get("num_heads"),
            tuple(map(id, group["params"])),
        )
        for group in param_groups
    )
    partitions = tuple((id(p), _hashable(sizes)) for p, sizes in matrix_partitions.items())
    return (
        groups,
        partitions,
        float(update_rms),
        bool(rotate_owners),
        bool(split_replicas),
        int(workspace_bytes),
        ns_cost,
        adamw_chunks,
        plain_replica_ranks,
    )


def setting_float(value) -> float:
    """A group setting as a Python float (a 1-element tensor, e.g. torch's tensor lr, included)."""
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _hashable(sizes):
    return tuple(sizes) if isinstance(sizes, (list, tuple)) else sizes


def build_plan(
    param_groups: list[dict],
    matrix_partitions: dict[Tensor, Sequence[int]],
    update_rms: float,
    rotate_owners: bool,
    split_replicas: bool = False,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ns_cost: EngineCost = DEFAULT_COST,
    adamw_chunks: str = "group",
    plain_replica_ranks: tuple[int, ...] | None = None,
) -> Plan:
    """Read every Muon parameter's layout and partitions and cut the batches (once).

    Local stacks are cut so that one batch fits ``workspace_bytes`` (see ``planning/workspace.py``).
    ``adamw_chunks``: ``"group"`` (one AdamW chunk per group) or ``"parameter"`` (one per
    parameter). ``plain_replica_ranks``: the ranks over which plain (non-DTensor) parameters
    are replicas (DDP); their batches are then split among those ranks as
    ``split_replicas`` splits HSDP replicas (``None``: plain parameters are local).
    """
    plain_replicas = replicas_of_plain_params(plain_replica_ranks)
    split_replicas = split_replicas or plain_replicas is not None
    muon_params: list[tuple[int, Tensor]] = []
    positions: list[int] = []
    for g, group in enumerate(param_groups):
        if group["algorithm"] == "muon":
            muon_params.extend((g, p) for p in group["params"])
            positions.extend(range(len(group["params"])))
    known = {id(p) for _, p in muon_params}
    for p in matrix_partitions:
        if id(p) not in known:
            raise ValueError(
                f"matrix_partitions has a parameter of shape {tuple(p.shape)} that is not "
                "in a 'muon' param group of this optimizer"
            )
    partitions_by_id = {id(p): sizes for p, sizes in matrix_partitions.items()}
    entries, layouts, scales, partitions = [], [], [], []
    for index, (g, p) in enumerate(muon_params):
        group = param_groups[g]
        name = f"group {g} param {positions[index]}"
        sizes = partitions_by_id.get(id(p))
        from_group = dion_group_partitions(f"param group {g}", group, p)
        if from_group is not None:
            if sizes is not None and tuple(sizes) != from_group:
                raise ValueError(
                    f"{name}: matrix_partitions gives {list(sizes)} but the group's "
                    f"split_sizes/num_heads give {list(from_group)}; give one"
                )
            sizes = from_group
        if sizes is not None:
            if group["flatten"]:
                raise ValueError(
                    f"matrix_partitions[{name}]: partitions need flatten=False (they split "
                    "dim -2 of each matrix)"
                )
            sizes = check_partitions(name, sizes, p.shape[-2])
        # After the partitions: on a permuted mesh, whether a layout can be stepped can
        # depend on them (planning/mesh_order.py).
        layout = matrix_layout(
            name,
            p,
            flatten=group["flatten"],
            partitions=sizes,
            split_replicas=split_replicas,
            plain_replicas=plain_replicas,
        )
        layouts.append(layout)
        partitions.append(sizes)
        scales.append(
            row_scales(
                sizes,
                layout.rows,
                layout.cols,
                layout.local_piece.rows,
                group["adjust_lr"],
                update_rms,
            )
        )
        entries.append(PlanEntry(index, layout, p.dtype, sizes, setting_float(group["epsilon"])))

    def local_size(layout: MatrixLayout, partitions: tuple[int, ...] | None) -> int:
        return local_batch_size(
            layout.local_rows, layout.local_cols, partitions, workspace_bytes, ns_cost
        )

    def matrix_cost(rows: int, cols: int, partitions: tuple[int, ...] | None) -> int:
        return sum(ns_cost.matrix_flops(r, cols) for r in partitions or (rows,))

    batches = plan_batches(entries, rotate_owners, split_replicas, local_size, matrix_cost)
    adamw = [
        AdamWChunk(g, i)
        for g, grp in enumerate(param_groups)
        if grp["algorithm"] == "adamw"
        for i in ([None] if adamw_chunks == "group" else range(len(grp["params"])))
    ]
    sinkhorn = [
        SinkhornChunk(g, i, sinkhorn_layout(f"group {g} param {i} (algorithm 'sinkhorn')", p))
        for g, grp in enumerate(param_groups)
        if grp["algorithm"] == "sinkhorn"
        for i, p in enumerate(grp["params"])
    ]
    return Plan(
        params=[p for _, p in muon_params],
        group_of=[g for g, _ in muon_params],
        layouts=layouts,
        row_scales=scales,
        partitions=partitions,
        batches=batches,
        adamw=adamw,
        ns_cost=ns_cost,
        sinkhorn=sinkhorn,
        plain_replicas=plain_replicas,
    )
