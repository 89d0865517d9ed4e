"""Do the ranks of every process group a step uses agree? One small collective per group.

A distributed step is only correct if, in every group it communicates over, every rank
planned the same batches (shapes, owners, partitions, dtypes), applies the same settings to
them (lr, weight decay, momentum, Nesterov, epsilon, lr scaling, Newton–Schulz schedule,
``max_in_flight``, ``split_replicas``, the check schedule itself) and has grads for the same
parameters. When they do not, all-to-alls pair up the wrong pieces (a silently wrong
update), or sizes differ and the collective aborts or hangs.

The check describes, for each group, everything that must agree as seen from this rank,
hashes it (SHA-256, 63 bits) and reduces ``[h, -h, g, -g, r]`` with MAX over the group
(``g``: a hash of which parameters have grads; ``r``: how often this rank would pass a
mismatch on, the group keeping its members' largest): every rank then holds the group's max and min of
each hash, so all of them see the same verdict and raise the same error. Exact: a mismatch
cannot cancel out as in a sum. A rank that shares no group with the ranks that differ
(HSDP's 2x2 mesh: ranks 0 and 3) must stop too, or it waits in an all-to-all for a peer that
raised: the verdict is passed on over every group once per further kind of group
(:func:`spread_rounds`; a 1-element MAX all-reduce per group and round; none where one
group kind covers the job: a 1-D mesh, FSDP over TP's flattened group), and such a rank
raises saying that others found a difference.

The groups are those of the shard dims (the all-to-alls) and of the replicate dims (where
``split_replicas`` broadcasts; where HSDP replicas must stay identical), visited in sorted
order of their ranks, so two ranks that share groups call their collectives in the same
order. Fields that legitimately differ between members (which shard group a replica sits
in) are described by size and pieces only, and the order of the step's collectives lists
only those issued over the group described: its members legitimately issue different
collectives over the other groups each of them belongs to (a replica whose shard group
also exchanges an expert stack its peer replica's group does not hold).

When the hashes differ (and only then), the members gather each other's descriptions — all
of them saw the same verdict, so all join — and the error names the first item and field
that differ, with each rank's value (:func:`first_difference`).

That full check runs on the first step and after a plan change. Every later step starts
with :func:`check_live_agreement`: a digest of the live settings (the optimizer's agreed
settings and every group's hyperparameters, read as they are, before anything validates
them) reduced over the groups of the last plan the ranks agreed on. Every rank issues it at
every step whatever it changed, so a setting edited on some ranks only (a scheduler stepped
once more, a typo, a planned setting that rebuilt one rank's plan) raises the same error on
every rank: never a divergence, an abort, or a collective only one rank started.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.groups import ShardGroup
from shardmuon.planning.placements import SinkhornLayout
from shardmuon.planning.plan import SinkhornChunk

__all__ = [
    "agreement_groups",
    "check_live_agreement",
    "check_plan_agreement",
    "collective_order",
    "first_difference",
    "live_settings",
    "spread_rounds",
]

# Keys of a group that change the update of its parameters.
UPDATE_KEYS = ("lr", "weight_decay", "mu", "nesterov", "epsilon", "adjust_lr", "flatten")
ADAMW_KEYS = ("lr", "beta1", "beta2", "weight_decay", "epsilon")
SINKHORN_KEYS = (
    "lr", "mu", "sinkhorn_iters", "sinkhorn_tau", "sinkhorn_eps", "sinkhorn_lr_scale",
)  # fmt: skip
# The groups every rank's description holds whole (their parameters' updates must agree
# wherever they are stepped), with the keys that change that update.
WHOLE_GROUP_KEYS = {"adamw": ADAMW_KEYS, "sinkhorn": SINKHORN_KEYS}
# Keys of a group compared at every step: the update's and AdamW's, what the plan reads
# (algorithm, partitions), the step count (bias correction) and torch's momentum alias.
LIVE_GROUP_KEYS = (
    "algorithm", "lr", "mu", "beta1", "beta2", "weight_decay", "epsilon", "nesterov",
    "adjust_lr", "flatten", "step", "split_sizes", "num_heads", "momentum",
    "sinkhorn_iters", "sinkhorn_tau", "sinkhorn_eps", "sinkhorn_lr_scale",
)  # fmt: skip


def agreement_groups(
    batches: Iterable[MuonBatch], sinkhorn: Iterable[SinkhornChunk] = ()
) -> list[ShardGroup]:
    """Every group the batches communicate over or replicate across, and every group a
    Sinkhorn parameter is summed or replicated over, sorted by ranks."""
    groups: dict[tuple[int, ...], ShardGroup] = {}
    candidates = [g for b in batches for g in (b.layout.group, b.layout.replicas)]
    candidates += [g for chunk in sinkhorn for g in sinkhorn_groups(chunk.layout)]
    for group in candidates:
        if group is not None and group.size > 1:
            groups.setdefault(group.ranks, group)
    return [groups[ranks] for ranks in sorted(groups)]


def sinkhorn_groups(layout: SinkhornLayout) -> tuple[ShardGroup, ...]:
    """The groups a Sinkhorn parameter's sums run over, then those that replicate it."""
    return (*layout.row_groups, *layout.col_groups, *layout.replicas)


def _shard_group_seen_by_replicas(layout) -> tuple[int, int, int]:
    """A replica's shard group as its peer replicas see it: its size, this rank's piece and
    the pieces by group coordinates (the same on every replica, even where a permuted mesh
    numbers the members of each replica's group differently)."""
    return layout.group.size, hash(layout.local_piece), hash(layout.grid_pieces)


def _value(setting) -> object:
    return _plain(setting)


# One described item: a label (what it is, for the message) and its named fields.
Entry = tuple[str, tuple[tuple[str, object], ...]]


def _settings_entry(settings: Mapping[str, object]) -> Entry:
    return "the optimizer's settings", tuple(settings.items())


def _whole_group_entries(param_groups: Sequence[dict]) -> list[Entry]:
    """AdamW and Sinkhorn groups: their shards are updated by every member alike, so their
    settings, step (AdamW's bias correction) and parameters must agree too."""
    entries = []
    for index, group in enumerate(param_groups):
        keys = WHOLE_GROUP_KEYS.get(group.get("algorithm"))
        if keys is None:
            continue
        shapes = tuple(tuple(p.shape) for p in group["params"])
        entries.append(
            (
                f"{_ALGORITHM_NAMES[group['algorithm']]} param group {index}",
                (
                    *((key, _value(group[key])) for key in keys),
                    ("step", group["step"]),
                    ("parameters (count, shapes)", (len(shapes), hash(shapes))),
                ),
            )
        )
    return entries


_ALGORITHM_NAMES = {"adamw": "AdamW", "sinkhorn": "Sinkhorn"}


def _sinkhorn_entries(
    ranks: tuple[int, ...], sinkhorn: Sequence[SinkhornChunk], param_groups: Sequence[dict]
) -> tuple[list[Entry], list[bool], list[tuple[int, ...]]]:
    """The Sinkhorn parameters summed or replicated over group ``ranks``, in plan order
    (the order their all-reduces run in, before any batch): what each is to the group, and
    whether it has a grad (its sums run on all members or none)."""
    entries: list[Entry] = []
    flags: list[bool] = []
    missing: list[tuple[int, ...]] = []
    for chunk in sinkhorn:
        layout = chunk.layout
        roles = tuple(
            role
            for role, groups in (
                ("rows split", layout.row_groups),
                ("columns split", layout.col_groups),
                ("replicated", layout.replicas),
            )
            if any(g.ranks == ranks for g in groups)
        )
        if not roles:
            continue
        param = param_groups[chunk.group_index]["params"][chunk.param_index]
        entries.append(
            (
                f"Sinkhorn parameter {len(flags)} over this group",
                (
                    ("shape", (layout.rows, layout.cols)),
                    ("dtype", str(param.dtype)),
                    ("split over", roles),
                    ("sums over (rows, columns)", (len(layout.row_groups), len(layout.col_groups))),
                ),
            )
        )
        present = param.grad is not None
        flags.append(present)
        if not present:
            missing.append(tuple(param.shape))
    return entries, flags, missing


def _batch_entry(batch: MuonBatch, position: int, as_shard: bool) -> Entry:
    layout = batch.layout
    label = (
        f"batch {position} ({layout.rows}x{layout.cols} matrices, "
        f"as {'its shard group' if as_shard else 'a replica'})"
    )
    return label, (
        ("matrix shape", (layout.rows, layout.cols)),
        # Python's hash of ints and tuples is the same in every process; the repr of a
        # 1024-rank group's pieces would be 50 kB per batch. Replicas see their shard
        # groups through mesh positions (below), not group numbering.
        (
            "pieces (how each matrix is cut among the group)",
            hash(layout.pieces) if as_shard else None,
        ),
        ("matrices in the batch", batch.num_matrices),
        ("owners", batch.owners if as_shard else None),
        ("matrix_partitions", batch.partitions),
        ("epsilon", batch.eps),
        ("computing replica", batch.replica),
        # A replica's shard group differs from its peers' only by its ranks.
        (
            "shard group (size, mesh position, pieces)",
            None if as_shard or layout.group is None else _shard_group_seen_by_replicas(layout),
        ),
        ("local matrix shape", (layout.local_rows, layout.local_cols) if not as_shard else None),
        ("replicas", layout.replicas.size if layout.replicas is not None else None),
    )


def batches_over(
    ranks: tuple[int, ...], batches: Sequence[MuonBatch]
) -> Iterator[tuple[MuonBatch, bool]]:
    """The batches that group ``ranks`` exchanges (``True``: as their shard group) or
    replicates (``False``), in plan order."""
    for batch in batches:
        layout = batch.layout
        as_shard = layout.group is not None and layout.group.ranks == ranks
        as_replica = layout.replicas is not None and layout.replicas.ranks == ranks
        if as_shard or as_replica:
            yield batch, as_shard


def describe(
    ranks: tuple[int, ...],
    batches: Sequence[MuonBatch],
    params: Sequence[Tensor],
    group_of: Sequence[int],
    param_groups: Sequence[dict],
    settings: Mapping[str, object],
    ops: Sequence[tuple[str, int]] = (),
    sinkhorn: Sequence[SinkhornChunk] = (),
) -> tuple[list[Entry], list[bool], list[tuple[int, ...]]]:
    """What the members of group ``ranks`` must agree on, seen from this rank.

    ``ops``: the step's schedule; its collectives on this group enter the description.
    Returns the description (labelled entries of named fields, so that a mismatch can be
    named), the grad-presence flags of the described segments, and the shapes of this rank's
    described parameters that have no grad (for the message).
    """
    described: list[Entry] = [_settings_entry(settings), *_whole_group_entries(param_groups)]
    described_sinkhorn, flags, missing = _sinkhorn_entries(ranks, sinkhorn, param_groups)
    described += described_sinkhorn
    position: dict[int, int] = {}  # batch index -> its position among the described ones
    for batch, as_shard in batches_over(ranks, batches):
        position[batch.index] = len(position)
        described.append(_batch_entry(batch, position[batch.index], as_shard))
        for segment in batch.segments:
            param = params[segment.param_index]
            group = param_groups[group_of[segment.param_index]]
            described.append(
                (
                    f"a parameter of batch {position[batch.index]}",
                    (
                        ("dtype", str(param.dtype)),
                        ("matrices", segment.count),
                        *((key, _value(group[key])) for key in UPDATE_KEYS),
                        (
                            "values and grad (plain parameters taken as DDP replicas: the "
                            "same on every rank)",
                            _replica_fingerprint(param)
                            if _plain_replica(batch, as_shard) and not isinstance(param, DTensor)
                            else None,
                        ),
                    ),
                )
            )
            present = param.grad is not None
            flags.append(present)
            if not present:
                missing.append(tuple(param.shape))
    order = collective_order(ops, batches, position, ranks)
    described.append(("the order of the step's collectives", (("order", tuple(order)),)))
    return described, flags, missing


def _plain_replica(batch: MuonBatch, as_shard: bool) -> bool:
    """A batch described over the group its parameters are replicas over, with no shard
    group (plain parameters under DDP, or ``Replicate()`` DTensors: the caller tells them
    apart)."""
    return not as_shard and batch.layout.group is None and batch.layout.replicas is not None


def _replica_fingerprint(param: Tensor) -> tuple[str, ...]:
    """What plain replicas must share, in one host read: per tensor (the value, then the
    grad), the fp64 sum, sum of squares and a position-weighted sum of its finite entries
    (a permutation changes the last) and its count of NaN and inf entries. Exact values:
    replicas hold the same bits, so they compute the same sums."""
    tensors = [param.detach()] + ([param.grad.detach()] if param.grad is not None else [])
    rows = []
    for t in tensors:
        flat = t.reshape(-1)
        finite = torch.isfinite(flat)
        x = torch.where(finite, flat, 0).to(torch.float64)
        weights = torch.linspace(1.0, 2.0, x.numel(), dtype=torch.float64, device=x.device)
        rows.append(
            torch.stack([x.sum(), (x * x).sum(), (x * weights).sum(), (~finite).sum().double()])
        )
    return tuple(float(v).hex() for v in torch.cat(rows).tolist())


def _by_value(values: Sequence[object], ranks: Sequence[int], limit: int = 4) -> str:
    """``"rank 0, 1: a; rank 2: b"``, at most ``limit`` distinct values."""
    groups: dict[str, list[int]] = {}
    for value, rank in zip(values, ranks):
        groups.setdefault(repr(value), []).append(rank)
    shown = [
        f"rank{'s' if len(members) > 1 else ''} {_rank_list(members)}: {value}"
        for value, members in list(groups.items())[:limit]
    ]
    if len(groups) > limit:
        shown.append(f"{len(groups) - limit} more values")
    return "; ".join(shown)


def _rank_list(ranks: Sequence[int], limit: int = 8) -> str:
    text = ", ".join(map(str, ranks[:limit]))
    return text + (f", … ({len(ranks)} ranks)" if len(ranks) > limit else "")


def first_difference(descriptions: Sequence[Sequence[Entry]], ranks: Sequence[int]) -> str:
    """Name the first item on which the members' descriptions differ, field by field.

    ``descriptions[i]``: what global rank ``ranks[i]`` described (:func:`describe`).
    """
    for i in range(min(map(len, descriptions))):
        entries = [d[i] for d in descriptions]
        if all(e == entries[0] for e in entries):
            continue
        labels = [label for label, _ in entries]
        names = [tuple(name for name, _ in fields) for _, fields in entries]
        if len(set(labels)) > 1 or len(set(names)) > 1:
            return f"item {i} of the step: {_by_value(labels, ranks)}"
        differing = []
        for k, name in enumerate(names[0]):
            values = [fields[k][1] for _, fields in entries]
            if any(v != values[0] for v in values):
                differing.append(f"{name} ({_by_value(values, ranks)})")
        return f"{labels[0]}: {'; '.join(differing)}"
    counts = [sum(label.startswith("batch ") for label, _ in d) for d in descriptions]
    return f"the number of batches ({_by_value(counts, ranks)})"


def collective_order(
    ops: Sequence[tuple[str, int]],
    batches: Sequence[MuonBatch],
    position: dict[int, int],
    ranks: tuple[int, ...] | None = None,
) -> list[tuple[str, int]]:
    """The step's collectives over group ``ranks`` among the batches of ``position``, in the
    order this rank issues them: ``("gather"|"return"|"broadcast", position)``
    (``ranks=None``: over every group).

    Collectives over one group must be issued in the same order by all its members; the
    order follows from the schedule (:func:`shardmuon.planning.workspace.step_schedule`), so equal
    descriptions prove it pairs up, whatever made two ranks' schedules differ. Those over
    other groups are left out: how a replica's exchanges interleave with its broadcasts
    depends on what else its own shard group holds, which its peers need not share.
    """
    order = []
    for phase, i in ops:
        if i not in position:
            continue
        layout = batches[i].layout
        exchanges_here = layout.exchanged and (ranks is None or layout.group.ranks == ranks)
        if exchanges_here and phase in ("prepare", "compute"):
            order.append(("gather" if phase == "prepare" else "return", position[i]))
        broadcasts_here = ranks is None or (
            layout.replicas is not None and layout.replicas.ranks == ranks
        )
        if batches[i].replica is not None and broadcasts_here and phase == "finish":
            order.append(("broadcast", position[i]))
    return order


def _plain(value: object) -> object:
    """A live setting as a comparable value, whatever it holds (it is not validated yet):
    a number is a float (``0``, ``0.0`` and ``numpy.float64(0)`` are one value; a bool
    stays a bool), a 1-element tensor its number, a larger one its shape."""
    if isinstance(value, Tensor):
        return _plain(value.item()) if value.numel() == 1 else ("tensor", tuple(value.shape))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value) + 0.0  # -0.0 is 0.0
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


# Keys whose type decides whether a rank accepts them (``sinkhorn_iters=11.0`` is refused
# where ``11`` is taken): compared with their type, so a rank that will refuse one differs.
TYPED_KEYS = ("sinkhorn_iters",)


def _live_value(key: str, value: object) -> object:
    plain = _plain(value)
    return (type(value).__name__, plain) if key in TYPED_KEYS else plain


def live_settings(
    settings: Mapping[str, object], param_groups: Sequence[dict], plan_rebuilt: object
) -> tuple[list[Entry], list[tuple]]:
    """What every rank reads at every step, before anything validates it: the entries all
    groups compare (``settings``, the optimizer's agreed settings, one spelling per value;
    each AdamW group's :data:`LIVE_GROUP_KEYS`, as the full check compares AdamW groups;
    ``plan_rebuilt``: whether this rank's plan changed since the ranks last agreed, so that
    a change on some ranks only is refused before one rank checks a new plan alone) and
    each param group's :data:`LIVE_GROUP_KEYS` as named fields (read once: a tensor lr is
    read once per group)."""
    values = [
        tuple((key, _live_value(key, group.get(key, "(not set)"))) for key in LIVE_GROUP_KEYS)
        for group in param_groups
    ]
    common: list[Entry] = [
        _settings_entry({name: _plain(value) for name, value in settings.items()}),
        *(
            (f"{_ALGORITHM_NAMES[group['algorithm']]} param group {index}", values[index])
            for index, group in enumerate(param_groups)
            if group.get("algorithm") in WHOLE_GROUP_KEYS
        ),
        # Last: a setting that differs is named before the plan it rebuilt.
        ("the plan", (("rebuilt since the last check", plan_rebuilt),)),
    ]
    return common, values


def live_description(
    ranks: tuple[int, ...],
    batches: Sequence[MuonBatch],
    group_of: Sequence[int],
    common: Sequence[Entry],
    values: Sequence[tuple],
) -> list[Entry]:
    """What the members of group ``ranks`` must hold alike at this step: ``common`` and the
    live settings of each segment's param group, for the batches (of the plan the ranks
    last agreed on) over this group, as :func:`describe` lists them; ``common``'s last
    entry (whether the plan was rebuilt) last."""
    described = list(common[:-1])
    for position, (batch, _) in enumerate(batches_over(ranks, batches)):
        for segment in batch.segments:
            label = f"a parameter of batch {position}"
            described.append((label, values[group_of[segment.param_index]]))
    return [*described, common[-1]]


def spread_rounds(
    params: Iterable[Tensor], summed: Iterable[Tensor] = (), plain_replicated: bool = False
) -> int:
    """How many times a failure found in one group must be passed on over every group so
    that every rank of the job hears of it (HSDP's 2x2: rank 3 shares no group with rank 0,
    yet would wait in its all-to-all for a peer that raised). Two ranks are at most as many
    groups apart as there are kinds of group: one per mesh and set of mesh dims a
    parameter is split over (its exchange group; a split of batch dims counted with it, an
    upper bound) and one per mesh dim it is replicated over. Read from the placements of
    ``params`` (the Muon parameters): the same on every rank that planned alike; plain
    parameters replicated over a process group (DDP) are one kind more."""
    kinds: set = {("plain", "replicated")} if plain_replicated else set()
    for p in summed:  # Sinkhorn parameters: a group per mesh dim that splits them
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            where = (tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()))
            for d in range(mesh.ndim):
                if mesh.size(d) > 1:
                    replicated = isinstance(p.placements[d], Replicate)
                    kinds.add(
                        (where, "replicated", d) if replicated else (where, "split", frozenset({d}))
                    )
    for p in params:
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        where = (tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()))
        dims = [d for d in range(mesh.ndim) if mesh.size(d) > 1]
        replicated = [d for d in dims if isinstance(p.placements[d], Replicate)]
        split = frozenset(d for d in dims if d not in replicated)
        if split:
            kinds.add((where, "split", split))
        kinds.update((where, "replicated", d) for d in replicated)
    return max(len(kinds) - 1, 0)


def _spread(found: Tensor, groups: Sequence[ShardGroup], rounds: Sequence[int]) -> Tensor:
    """``found`` (``[1]`` int64, 1 where this rank found a mismatch) reduced with MAX over
    each group ``rounds[i]`` times (the group's agreed count: its members do the same number
    of reductions on it), groups in order within each round: then 1 on every rank of the
    job if on any (no host sync)."""
    for r in range(max(rounds, default=0)):
        for group, count in zip(groups, rounds):
            if r < count:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group.process_group)
    return found


ELSEWHERE = (
    "the ranks of this job disagree on the Muon step: ranks this one shares no process group "
    "with found a difference (their error names it); every rank stops here so that none "
    "waits for a peer that stopped"
)


def check_live_agreement(
    groups: Sequence[ShardGroup],
    plan,
    live: tuple[list[Entry], list[tuple]],
    device: torch.device,
    rounds: Sequence[int] = (),
) -> None:
    """Raise on every rank of the job when the ranks of a group hold different live
    settings (:func:`live_settings`, described per group by :func:`live_description` over
    ``plan``, the plan the ranks last agreed on).

    One 2-element all-reduce (MAX of ``[h, -h]``) per group, the verdict passed on over
    group ``i`` ``rounds[i]`` times (agreed by :func:`check_agreement`), then one host sync;
    a further collective (naming what differs) only where the digests differ.
    """
    if not groups:
        return
    rounds = list(rounds) or [0] * len(groups)
    common, values = live
    described = [
        live_description(g.ranks, plan.batches, plan.group_of, common, values) for g in groups
    ]
    reduced = []
    for group, entries in zip(groups, described):
        digest = _hash63(entries)
        local = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group.process_group)
        reduced.append(local)
    stacked = torch.stack(reduced)
    found = (stacked[:, 0] != -stacked[:, 1]).any().to(torch.int64).reshape(1)
    *flat, anywhere = torch.cat([stacked.flatten(), _spread(found, groups, rounds)]).tolist()
    verdicts = [flat[i : i + 2] for i in range(0, len(flat), 2)]
    errors = []
    for group, entries, (high, low) in zip(groups, described, verdicts):
        if high == -low:
            continue
        gathered: list = [None] * group.size
        dist.all_gather_object(gathered, entries, group=group.process_group)
        errors.append(
            f"the ranks of process group {list(group.ranks)} disagree on the Muon step: "
            f"{first_difference(gathered, group.ranks)}. A setting changed on some ranks "
            "only since the last step (an lr scheduler stepped a different number of times, "
            "an edit made on one rank): change settings alike on every rank"
        )
    if errors:
        raise ValueError(errors[0])
    if anywhere:
        raise ValueError(ELSEWHERE)


def _hash63(value: object) -> int:
    digest = hashlib.sha256(repr(value).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def check_agreement(
    groups: Sequence[ShardGroup],
    batches: Sequence[MuonBatch],
    params: Sequence[Tensor],
    group_of: Sequence[int],
    param_groups: Sequence[dict],
    settings: Mapping[str, object],
    device: torch.device,
    ops: Sequence[tuple[str, int]] = (),
    compare_grads: bool = True,
    rounds: int = 0,
    sinkhorn: Sequence[SinkhornChunk] = (),
) -> list[int]:
    """Raise on every rank of the job when the ranks of a group disagree (see the module
    docstring). ``compare_grads=False`` (``check_grads="never"``): the grad flags are left
    out. ``rounds``: this rank's count of how often a mismatch must be passed on
    (:func:`spread_rounds`); each group agrees on its members' largest (reduced with the
    hashes), so that ranks sharing no group with the one that differs stop too. Returns
    each group's agreed count, for :func:`check_live_agreement`.

    Every group's reduction runs before anything raises, so a rank that finds a mismatch in
    one group still joins its later groups and no peer is left waiting.
    """
    errors: list[str] = []
    reduced: list[tuple[ShardGroup, list, list, Tensor]] = []
    for group in groups:
        described, flags, missing = describe(
            group.ranks, batches, params, group_of, param_groups, settings, ops, sinkhorn
        )
        plan_hash = _hash63(described)
        grads_hash = _hash63(flags if compare_grads else ())
        local = torch.tensor(
            [plan_hash, -plan_hash, grads_hash, -grads_hash, rounds],
            dtype=torch.int64,
            device=device,
        )
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group.process_group)
        reduced.append((group, described, missing, local))
    if not reduced:
        return []
    rows = torch.stack([local for *_, local in reduced]).tolist()
    agreed = [row[4] for row in rows]
    found = any(row[0] != -row[1] or row[2] != -row[3] for row in rows)
    anywhere = found
    if max(agreed) > 0:
        flag = torch.tensor([int(found)], dtype=torch.int64, device=device)
        anywhere = bool(_spread(flag, groups, agreed).item())
    for (group, described, missing, _), row in zip(reduced, rows):
        high_plan, low_plan, high_grads, low_grads = row[:4]
        if high_plan != -low_plan:
            # Every member saw the same verdict, so all of them join this gather: a second
            # collective on the failure path only, to name what differs.
            gathered: list = [None] * group.size
            dist.all_gather_object(gathered, described, group=group.process_group)
            # The same text on every rank: it names what differs, by rank.
            difference = first_difference(gathered, group.ranks)
            if "workspace_bytes" in difference:
                difference += (
                    " (workspace_bytes='auto' follows each GPU's memory: on GPUs of "
                    "different sizes pass the same int on every rank)"
                )
            errors.append(
                f"the ranks of process group {list(group.ranks)} disagree on the Muon step: "
                f"{difference}. Every rank must build and "
                "configure the optimizer the same way: the same parameters (shapes, "
                "placements, order) and settings, and local shards laid out as their "
                "placements say (an uneven _StridedShard made by distribute_tensor instead of "
                "FSDP2 is not)"
            )
        elif high_grads != -low_grads:
            everyone: list = [None] * group.size
            dist.all_gather_object(everyone, missing, group=group.process_group)
            without = "; ".join(
                f"rank {rank} has none for shapes {shapes}"
                for rank, shapes in zip(group.ranks, everyone)
                if shapes
            )
            errors.append(
                f"the ranks of process group {list(group.ranks)} disagree on which Muon "
                f"parameters have a grad ({without}); a sharded or replicated parameter's "
                "grad must exist on all ranks of its groups or on none (FSDP2 guarantees "
                "this: check for parameters used on some ranks only)"
            )
    if errors:
        raise ValueError(errors[0])
    if anywhere:
        raise ValueError(ELSEWHERE)
    return agreed


def check_plan_agreement(
    plan,
    param_groups: Sequence[dict],
    settings: Mapping[str, object],
    device: torch.device,
    ops: Sequence[tuple[str, int]],
    compare_grads: bool = True,
) -> list[int]:
    """:func:`check_agreement` over every group a plan (``planning.plan.Plan``) uses, in
    the order of :func:`agreement_groups`; returns each group's agreed spread count."""
    sinkhorn_params = [param_groups[c.group_index]["params"][c.param_index] for c in plan.sinkhorn]
    rounds = spread_rounds(plan.params, sinkhorn_params, plan.plain_replicas is not None)
    return check_agreement(
        agreement_groups(plan.batches, plan.sinkhorn), plan.batches, plan.params,
        plan.group_of, param_groups, settings, device, ops, compare_grads=compare_grads,
        rounds=rounds, sinkhorn=plan.sinkhorn,
    )  # fmt: skip
