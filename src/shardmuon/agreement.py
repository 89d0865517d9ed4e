"""Do the ranks of every process group a step uses agree? One small collective per group.

A distributed step is only correct if, in every group it communicates over, every rank
planned the same batches (shapes, owners, partitions, dtypes), applies the same settings to
them (lr, weight decay, momentum, Nesterov, epsilon, lr scaling, Newton–Schulz schedule,
``max_in_flight``, ``split_replicas``, the check schedule itself) and has grads for the same
parameters. When they do not, all-to-alls pair up the wrong pieces (a silently wrong
update), or sizes differ and the collective aborts or hangs.

The check describes, for each group, everything that must agree as seen from this rank,
hashes it (SHA-256, 63 bits) and reduces ``[h, -h, g, -g]`` with MAX over the group (``g``:
a hash of which parameters have grads): every rank then holds the group's max and min of
each hash, so all of them see the same verdict and raise the same error, with no second
collective. Exact: a mismatch cannot cancel out as in a sum.

The groups are those of the shard dims (the all-to-alls) and of the replicate dims (where
``split_replicas`` broadcasts; where HSDP replicas must stay identical), visited in sorted
order of their ranks, so two ranks that share groups call their collectives in the same
order. Fields that legitimately differ between members (which shard group a replica sits
in) are described by size and position only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from shardmuon.layout import MuonBatch
from shardmuon.placements import ShardGroup

__all__ = ["AgreementSettings", "agreement_groups", "check_agreement", "collective_order"]

# Keys of a group that change the update of its parameters.
UPDATE_KEYS = ("lr", "weight_decay", "mu", "nesterov", "epsilon", "adjust_lr", "flatten")


@dataclass(frozen=True)
class AgreementSettings:
    """Optimizer-wide settings that must be equal on every rank of a group."""

    update_rms: float
    coefficients: tuple
    newton_schulz_impl: str
    max_in_flight: int
    workspace_bytes: int
    split_replicas: bool
    rotate_owners: bool
    check_grads: str


def agreement_groups(batches: Iterable[MuonBatch]) -> list[ShardGroup]:
    """Every group the batches communicate over or replicate across, sorted by ranks."""
    groups: dict[tuple[int, ...], ShardGroup] = {}
    for batch in batches:
        for group in (batch.layout.group, batch.layout.replicas):
            if group is not None and group.size > 1:
                groups.setdefault(group.ranks, group)
    return [groups[ranks] for ranks in sorted(groups)]


def _shard_group_seen_by_replicas(layout) -> tuple[int, int, int]:
    """A replica's shard group as its peer replicas see it: its size, this rank's mesh
    position in it and its pieces by mesh position (the same on every replica, even where a
    permuted mesh numbers the members of each replica's group differently)."""
    return layout.group.size, layout.group.mesh_index, hash(layout.mesh_pieces)


def _value(setting) -> object:
    return setting.item() if isinstance(setting, Tensor) else setting


def describe(
    ranks: tuple[int, ...],
    batches: Sequence[MuonBatch],
    params: Sequence[Tensor],
    group_of: Sequence[int],
    param_groups: Sequence[dict],
    settings: AgreementSettings,
    ops: Sequence[tuple[str, int]] = (),
) -> tuple[list, list[bool], list[tuple[int, ...]]]:
    """What the members of group ``ranks`` must agree on, seen from this rank.

    ``ops``: the step's schedule; its collectives on this group enter the description.
    Returns the description, the grad-presence flags of the described segments, and the
    shapes of this rank's described parameters that have no grad (for the message).
    """
    described: list = [settings]
    flags: list[bool] = []
    missing: list[tuple[int, ...]] = []
    position: dict[int, int] = {}  # batch index -> its position among the described ones
    for batch in batches:
        layout = batch.layout
        as_shard = layout.group is not None and layout.group.ranks == ranks
        as_replica = layout.replicas is not None and layout.replicas.ranks == ranks
        if not (as_shard or as_replica):
            continue
        position[batch.index] = len(position)
        described.append(
            (
                "shard" if as_shard else "replica",
                layout.rows,
                layout.cols,
                # Python's hash of ints and tuples is the same in every process; the repr
                # of a 1024-rank group's pieces would be 50 kB per batch. Replicas see
                # their shard groups through mesh positions (below), not group numbering.
                hash(layout.pieces) if as_shard else None,
                batch.num_matrices,
                batch.owners if as_shard else None,
                batch.partitions,
                batch.eps,
                batch.replica,
                # A replica's shard group differs from its peers' only by its ranks.
                None if as_shard or layout.group is None else _shard_group_seen_by_replicas(layout),
                (layout.local_rows, layout.local_cols) if as_replica else None,
                layout.replicas.size if layout.replicas is not None else None,
            )
        )
        for segment in batch.segments:
            param = params[segment.param_index]
            group = param_groups[group_of[segment.param_index]]
            described.append(
                (
                    str(param.dtype),
                    segment.count,
                    tuple(_value(group[key]) for key in UPDATE_KEYS),
                )
            )
            present = param.grad is not None
            flags.append(present)
            if not present:
                missing.append(tuple(param.shape))
    described.append(collective_order(ops, batches, position))
    return described, flags, missing


def collective_order(
    ops: Sequence[tuple[str, int]], batches: Sequence[MuonBatch], position: dict[int, int]
) -> list[tuple[str, int]]:
    """The step's collectives among the batches of ``position``, in the order this rank
    issues them: ``("gather"|"return"|"broadcast", position)``.

    Collectives over one group must be issued in the same order by all its members; the
    order follows from the schedule (:func:`shardmuon.workspace.step_schedule`), so equal
    descriptions prove it pairs up, whatever made two ranks' schedules differ.
    """
    order = []
    for phase, i in ops:
        if i not in position:
            continue
        batch = batches[i]
        if batch.layout.exchanged and phase in ("prepare", "compute"):
            order.append(("gather" if phase == "prepare" else "return", position[i]))
        if batch.replica is not None and phase == "finish":
            order.append(("broadcast", position[i]))
    return order


def _hash63(value: object) -> int:
    digest = hashlib.sha256(repr(value).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def check_agreement(
    groups: Sequence[ShardGroup],
    batches: Sequence[MuonBatch],
    params: Sequence[Tensor],
    group_of: Sequence[int],
    param_groups: Sequence[dict],
    settings: AgreementSettings,
    device: torch.device,
    ops: Sequence[tuple[str, int]] = (),
) -> None:
    """Raise on every rank of a group whose ranks disagree (see the module docstring).

    Every group's reduction runs before anything raises, so a rank that finds a mismatch in
    one group still joins its later groups and no peer is left waiting.
    """
    errors: list[str] = []
    for group in groups:
        described, flags, missing = describe(
            group.ranks, batches, params, group_of, param_groups, settings, ops
        )
        plan_hash = _hash63(described)
        grads_hash = _hash63(flags)
        local = torch.tensor(
            [plan_hash, -plan_hash, grads_hash, -grads_hash], dtype=torch.int64, device=device
        )
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group.process_group)
        high_plan, low_plan, high_grads, low_grads = local.tolist()
        if high_plan != -low_plan:
            shapes = sorted({(b.layout.rows, b.layout.cols) for b in batches})
            errors.append(
                f"the ranks of process group {list(group.ranks)} disagree on the Muon step: "
                "they hold different parameters (shapes, placements, order), or different "
                "settings (lr, weight_decay, mu, nesterov, epsilon, adjust_lr, update_rms, "
                "Newton–Schulz coefficients, matrix_partitions, max_in_flight, workspace_bytes, "
                "split_replicas, check_grads), or an order of collectives that differs (the "
                "schedule of the step), or local shards laid out other than their "
                "placements say (an uneven _StridedShard made by distribute_tensor instead of "
                f"FSDP2). This rank's matrix shapes: {shapes}. Every rank must build and "
                "configure the optimizer the same way"
            )
        elif high_grads != -low_grads:
            errors.append(
                f"the ranks of process group {list(group.ranks)} disagree on which Muon "
                f"parameters have a grad (this rank has none for shapes {missing}); a sharded "
                "or replicated parameter's grad must exist on all ranks of its groups or on "
                "none (FSDP2 guarantees this: check for parameters used on some ranks only)"
            )
    if errors:
        raise ValueError(errors[0])
