"""Warming up the step's process groups: communicators and their connections set up before
the step needs them, each with the collective and the message size the step will use.

NCCL sets a communicator up at its first collective, and the connections of each algorithm
(the all-to-all's peer-to-peer channels, a broadcast's ring) at the first collective that
uses them, sized by the message. In the step that first collective would run in the middle
of other traffic (with ``overlap="forward"``, on a background thread while the forward's
FSDP2 collectives run: concurrent communicator set-up, which NCCL's documentation warns can
deadlock). Warming runs, on the calling thread and with nothing else in flight, what each
group will run: an all-to-all whose per-peer message is the plan's largest piece over that
group (capped), and a broadcast of the largest result a replica shares.

A group is warmed once per process, identified by the group object itself (two groups of the
same ranks, such as a mesh's group and the overlapped step's own, are two communicators), and
again only when a later plan needs larger messages over it. Every member of a group warms it
together, groups in ascending order of their ranks on every rank (no two ranks wait on each
other in opposite orders).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.groups import ShardGroup, made_in_this_world
from shardmuon.planning.plan import SinkhornChunk
from shardmuon.runtime.exchange import backend_serving

__all__ = [
    "GroupWarmup",
    "plan_groups",
    "wants_warmup",
    "warm_up",
    "warmup_sizes",
]

# The most memory a group's warm-up buffers take (send and receive, bf16): the message size
# that opens the same channels as the step's, without a second workspace.
WARMUP_CAP_BYTES = 64 * 2**20
_BF16 = 2


@dataclass(frozen=True)
class GroupWarmup:
    """What the step runs over one group: ``piece``, the largest per-peer message of its
    all-to-alls (elements; 0: none), ``broadcast``, the largest result a replica shares
    over it (elements; 0: none), and ``reduce``, the largest vector a Sinkhorn parameter's
    sums all-reduce over it (fp32 elements; 0: none)."""

    piece: int = 0
    broadcast: int = 0
    reduce: int = 0

    def covers(self, other: GroupWarmup) -> bool:
        return (
            self.piece >= other.piece
            and self.broadcast >= other.broadcast
            and self.reduce >= other.reduce
        )

    def union(self, other: GroupWarmup) -> GroupWarmup:
        return GroupWarmup(
            max(self.piece, other.piece),
            max(self.broadcast, other.broadcast),
            max(self.reduce, other.reduce),
        )


def warmup_sizes(
    batches: Iterable[MuonBatch], sinkhorn: Iterable[SinkhornChunk] = ()
) -> dict[tuple[int, ...], GroupWarmup]:
    """Sorted global ranks -> :class:`GroupWarmup`, for every group of more than one rank the
    batches exchange over (the largest piece of any member: the same on every member) or
    share results over (``split_replicas``: a stack of this shard's pieces), and every group
    a Sinkhorn parameter's sums run over (a column's sums over the groups splitting its rows:
    ``cols`` values; a row's over those splitting its columns: at most ``rows``)."""
    out: dict[tuple[int, ...], GroupWarmup] = {}

    def add(group: ShardGroup, need: GroupWarmup) -> None:
        if group.size > 1:
            ranks = tuple(sorted(group.ranks))
            out[ranks] = out.get(ranks, GroupWarmup()).union(need)

    for batch in batches:
        layout = batch.layout
        if layout.exchanged:
            largest = max(layout.piece_numel(j) for j in range(layout.group.size))
            add(layout.group, GroupWarmup(piece=largest))
        if batch.replica is not None:
            shared = batch.planned_matrices * layout.local_rows * layout.local_cols
            add(layout.replicas, GroupWarmup(broadcast=shared))
    for chunk in sinkhorn:
        layout = chunk.layout
        for group in layout.row_groups:
            add(group, GroupWarmup(reduce=layout.cols))
        for group in layout.col_groups:
            add(group, GroupWarmup(reduce=layout.rows))
    return out


def plan_groups(
    batches: Iterable[MuonBatch], sinkhorn: Iterable[SinkhornChunk] = ()
) -> dict[tuple[int, ...], list[dist.ProcessGroup]]:
    """Sorted global ranks -> every distinct process group object of those ranks the batches
    exchange or replicate over and the Sinkhorn parameters sum over (two meshes over the
    same ranks are two communicators), in plan order (the same on every member)."""
    out: dict[tuple[int, ...], list[dist.ProcessGroup]] = {}
    candidates = [g for b in batches for g in (b.layout.group, b.layout.replicas)]
    candidates += [g for c in sinkhorn for g in (*c.layout.row_groups, *c.layout.col_groups)]
    for group in candidates:
        if group is not None and group.size > 1:
            same = out.setdefault(tuple(sorted(group.ranks)), [])
            if not any(g is group.process_group for g in same):
                same.append(group.process_group)
    return out


def wants_warmup(setting: bool | None, group: dist.ProcessGroup, device) -> bool:
    """Whether ``warmup=setting`` warms ``group``: ``True``/``False`` as given; ``None`` (the
    default): where the parameters are on a GPU and the group's collectives for it run on
    NCCL (gloo and the CPU set connections up cheaply and need none). Decided per group,
    from what every member shares (its backend; the device and the setting are agreed)."""
    if setting is not None:
        return bool(setting)
    if torch.device(device).type != "cuda" or not dist.is_initialized():
        return False
    return backend_serving(group, "cuda") == "nccl"


# Groups warmed in this process: id(group) -> (the group, held so that its id is not reused;
# what it was warmed for). Emptied with the world (made_in_this_world).
_WARMED: dict[int, tuple[dist.ProcessGroup, GroupWarmup]] = {}


def warm_up(
    groups: Mapping[tuple[int, ...], Sequence[dist.ProcessGroup]],
    sizes: Mapping[tuple[int, ...], GroupWarmup],
    device: torch.device,
    setting: bool | None = True,
) -> int:
    """Run each group's warm-up (see the module) where ``setting`` asks for it
    (:func:`wants_warmup`) unless it was warmed for at least these sizes; ``groups``: sorted
    global ranks -> the distinct process groups of those ranks, in an order every member
    shares. Collective over each group, in ascending order of ranks. Returns how many groups
    it warmed."""
    warmed = made_in_this_world(_WARMED)
    count = 0
    for ranks in sorted(groups):
        need = sizes.get(ranks, GroupWarmup())
        for group in groups[ranks]:
            if not wants_warmup(setting, group, device):
                continue
            done = warmed.get(id(group))
            if done is not None and done[1].covers(need):
                continue
            wanted = need if done is None else need.union(done[1])
            _run(group, ranks, wanted, device)
            warmed[id(group)] = (group, wanted)
            count += 1
    return count


def _run(group: dist.ProcessGroup, ranks: tuple[int, ...], need: GroupWarmup, device) -> None:
    size = len(ranks)
    cap = WARMUP_CAP_BYTES // _BF16
    # At least one element per peer: a group whose pieces are all empty still sets its
    # communicator up here rather than in the step.
    piece = max(1, min(need.piece, cap // (2 * size)))
    send = torch.zeros(piece * size, dtype=torch.bfloat16, device=device)
    dist.all_to_all_single(torch.empty_like(send), send, group=group)
    if need.broadcast:
        shared = torch.zeros(min(need.broadcast, cap), dtype=torch.bfloat16, device=device)
        dist.broadcast(shared, src=ranks[0], group=group)
    if need.reduce:
        summed = torch.zeros(min(need.reduce, cap // 2), dtype=torch.float32, device=device)
        dist.all_reduce(summed, group=group)
