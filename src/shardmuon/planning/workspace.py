"""The step's transient memory: what each batch holds in flight, and the schedule that caps it.

Pure arithmetic on the plan (no tensors are touched), so the same figures serve the
optimizer (which batches may be in flight together), ``shardmuon bench plan`` (the
workspace peak of a model at any scale, without running it) and the tests (the measured
transient stays under the budget).

A batch between its *prepare* and its *finish* holds buffers (``held``): an exchanged batch
its bf16 send buffer and the received results (``n`` pieces each) and, on the owner, the
whole gathered matrix and its result; a local batch its bf16 stack and the results.
While a phase runs it also needs temporaries (``peak``): fp32 directions (Nesterov),
Newton–Schulz's buffers (two ``X`` and two Gram matrices, or the fp32 reduction of the
norm), the fp32 update. The step admits the next batch only while the held bytes of the
batches in flight plus the next batch's held and peak bytes fit the budget (one batch is
always admitted), so the estimated transient never exceeds the budget unless a single
batch does on its own. Local (no-communication) stacks are cut so that one batch fits.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shardmuon.ops.orthogonalizer import DEFAULT_COST, EngineCost
from shardmuon.planning.batches import MuonBatch

__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "WORKSPACE_GRANULE",
    "BatchBytes",
    "ScheduleCache",
    "batch_bytes",
    "device_workspace_bytes",
    "forward_schedule",
    "local_batch_size",
    "newton_schulz_bytes",
    "peak_of_schedule",
    "schedule",
    "schedule_bytes",
    "step_schedule",
    "workspace_peak_bytes",
]

# 512 MiB: a few of the largest dense matrices of a 30B-class model in flight (a
# [4096, 2048] bf16 piece set is 16 MiB), and local expert stacks of a few hundred MiB.
# The budget on a CPU, and the least ``"auto"`` gives on an accelerator.
DEFAULT_WORKSPACE_BYTES = 512 * 2**20
# ``workspace_bytes="auto"`` (the default) is rounded down to whole steps of this size.
WORKSPACE_GRANULE = 256 * 2**20


def device_workspace_bytes(total: int) -> int:
    """``workspace_bytes="auto"`` on an accelerator with ``total`` bytes of memory: a
    sixteenth of it, rounded down to whole ``WORKSPACE_GRANULE`` steps, and never below
    ``DEFAULT_WORKSPACE_BYTES``. A property of the GPU, so every rank of a job on one kind
    of GPU gets the same (what is free differs from rank to rank, and a budget from it would
    differ wherever it crosses a step).

    An H200 (141 GB) gets 8 GiB and an 80 GB H100 4.5 GiB: a call batches a whole expert
    stack of a 30B-class MoE where 512 MiB cut it into pieces."""
    budget = total // 16 // WORKSPACE_GRANULE * WORKSPACE_GRANULE
    return max(DEFAULT_WORKSPACE_BYTES, budget)


BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class BatchBytes:
    """Bytes one batch needs on this rank: ``held`` from prepare to finish, ``peak`` on top
    of it while one of its phases runs."""

    held: int
    peak: int


def newton_schulz_bytes(count: int, rows: int, cols: int, cost: EngineCost = DEFAULT_COST) -> int:
    """Peak bytes one Newton–Schulz call allocates for a bf16 ``[count, rows, cols]`` input
    (the input excluded, its bf16 output included), by the engine ``cost`` describes (the
    default: folded bf16). The phases and their bytes are the engine table's
    (:meth:`shardmuon.ops.orthogonalizer.EngineCost.call_bytes`)."""
    return cost.call_bytes(count, rows, cols)


def _block_rows(rows: int, partitions: tuple[int, ...] | None) -> tuple[int, ...]:
    return partitions if partitions else (rows,)


def _orthogonalize_bytes(
    count: int, rows: int, cols: int, partitions, cost: EngineCost = DEFAULT_COST
) -> int:
    """Peak bytes of orthogonalizing ``count`` matrices (input excluded, output included),
    partition blocks one size at a time, by the engine ``cost`` describes."""
    blocks = _block_rows(rows, partitions)
    by_size: dict[int, int] = {}
    for size in blocks:
        by_size[size] = by_size.get(size, 0) + 1
    if len(blocks) == 1:
        return cost.call_bytes(count, rows, cols)
    # Blocks of one size are stacked (a copy), orthogonalized, and written into the output.
    worst = max(
        2 * BF16 * count * n * size * cols + cost.call_bytes(count * n, size, cols)
        for size, n in by_size.items()
    )
    return BF16 * count * rows * cols + worst


def batch_bytes(batch: MuonBatch, cost: EngineCost = DEFAULT_COST) -> BatchBytes:
    """What ``batch`` needs on this rank (see the module docstring); every matrix assumed
    active; Newton–Schulz by the engine ``cost`` describes."""
    layout = batch.layout
    if layout.exchanged:
        me = layout.group.rank_index
        return _exchanged_bytes(batch, layout.piece_numel(me), me in batch.owners, cost)
    return _local_bytes(batch, cost)


def schedule_bytes(batch: MuonBatch, cost: EngineCost = DEFAULT_COST) -> BatchBytes:
    """What ``batch`` needs on the member of its group that needs the most: an upper bound of
    :func:`batch_bytes` on every rank, computed from what every rank knows alike.

    The schedule is built from these, never from a rank's own role (owner or not, its own
    piece's size): ranks that derived different schedules from one budget would issue
    their all-to-alls in different orders, and the collectives would pair up wrongly.
    """
    layout = batch.layout
    if layout.exchanged:
        # As planned: a batch this rank holds fewer matrices of is as large elsewhere.
        count = batch.planned_matrices
        return _exchanged_bytes(batch, layout.largest_piece_numel, count > 0, cost, count)
    return _local_bytes(batch, cost)


def _exchanged_bytes(
    batch: MuonBatch, piece: int, owned: bool, cost: EngineCost, count: int | None = None
) -> BatchBytes:
    layout = batch.layout
    own = (batch.num_matrices if count is None else count) * piece
    whole = layout.rows * layout.cols if owned else 0
    held = 2 * BF16 * own + 2 * BF16 * whole
    compute = (
        _orthogonalize_bytes(1, layout.rows, layout.cols, batch.partitions, cost) if owned else 0
    )
    # The prepare phase's fp32 directions, the finish phase's fp32 update (and the fp32
    # copy of a low-precision weight): one segment at a time, at most the batch.
    element_wise = 2 * FP32 * own
    return BatchBytes(held=held, peak=max(compute, element_wise))


def _local_bytes(batch: MuonBatch, cost: EngineCost) -> BatchBytes:
    layout = batch.layout
    numel = batch.num_matrices * layout.local_rows * layout.local_cols
    held = 2 * BF16 * numel
    compute = _orthogonalize_bytes(
        batch.num_matrices, layout.local_rows, layout.local_cols, batch.partitions, cost
    )
    return BatchBytes(held=held, peak=max(compute, 2 * FP32 * numel))


def local_batch_size(
    local_rows: int,
    local_cols: int,
    partitions: tuple[int, ...] | None,
    budget: int,
    cost: EngineCost = DEFAULT_COST,
) -> int:
    """The most matrices of one local shape a batch may stack within ``budget`` (at least 1)."""
    one = 2 * BF16 * local_rows * local_cols + max(
        _orthogonalize_bytes(1, local_rows, local_cols, partitions, cost),
        2 * FP32 * local_rows * local_cols,
    )
    size = max(1, budget // max(1, one))
    # Per-call bytes are not linear in the count (one matrix's rare-path copies, the guard's
    # recompute): shrink until the whole stack fits.
    while (
        size > 1
        and 2 * BF16 * size * local_rows * local_cols
        + max(
            _orthogonalize_bytes(size, local_rows, local_cols, partitions, cost),
            2 * FP32 * size * local_rows * local_cols,
        )
        > budget
    ):
        size = max(1, size * 3 // 4)
    return size


def schedule(sizes: Sequence[BatchBytes], budget: int, max_in_flight: int) -> list[tuple[str, int]]:
    """The order of phases for batches of these sizes: ``("prepare", i)``, ``("compute", i)``,
    ``("finish", i)``.

    Batch ``i`` is prepared once fewer than ``max_in_flight`` batches wait for their compute
    and the bytes held by every batch not yet finished, plus batch ``i``'s held bytes, plus
    the largest peak among them and batch ``i`` (each still has a phase to run), fit
    ``budget`` (or nothing else is held). A batch is finished after the next one
    has been computed (its return traffic overlaps that compute), or earlier when the
    budget needs its bytes back. Every rank of a group derives the same schedule from the
    same plan, so collectives pair up.
    """
    ops: list[tuple[str, int]] = []
    waiting: deque[int] = deque()  # prepared, not computed
    returning: deque[int] = deque()  # computed, not finished
    held = 0

    def compute_next() -> None:
        i = waiting.popleft()
        ops.append(("compute", i))
        returning.append(i)

    def finish_next() -> None:
        nonlocal held
        i = returning.popleft()
        ops.append(("finish", i))
        held -= sizes[i].held

    for i, size in enumerate(sizes):
        while waiting or returning:
            # Every unfinished batch still has a phase to run (with its peak) while batch
            # i is held: the largest of those peaks must fit on top of all held bytes.
            worst = max([size.peak, *(sizes[j].peak for j in (*waiting, *returning))])
            fits = held + size.held + worst <= budget
            if fits and len(waiting) < max_in_flight:
                break
            if returning and (not fits or len(returning) > 1 or not waiting):
                finish_next()
            else:
                compute_next()
                while len(returning) > 1:
                    finish_next()
        ops.append(("prepare", i))
        held += size.held
        waiting.append(i)
        if len(waiting) >= max_in_flight:
            compute_next()
            while len(returning) > 1:
                finish_next()
    while waiting:
        compute_next()
        while len(returning) > 1:
            finish_next()
    while returning:
        finish_next()
    return ops


def step_schedule(
    batches: Sequence[MuonBatch],
    budget: int,
    max_in_flight: int,
    cost: EngineCost = DEFAULT_COST,
) -> list[tuple[str, int]]:
    """The order of the step's phases: :func:`schedule` of the batches' :func:`schedule_bytes`
    (the same on every rank that plans the same batches)."""
    return schedule([schedule_bytes(b, cost) for b in batches], budget, max_in_flight)


def forward_schedule(
    batches: Sequence[MuonBatch],
    order: Sequence[int],
    budget: int,
    max_in_flight: int,
    cost: EngineCost = DEFAULT_COST,
) -> list[tuple[str, int]]:
    """The schedule of ``batches`` taken in ``order`` (the forward's, for the overlapped step).

    The exchanged batches are scheduled alone (:func:`schedule`), in ``order``: their
    collectives then follow from what every rank of their group plans alike. A local
    batch's size is this rank's own (an expert stack split unevenly holds fewer matrices,
    or none, here), so a local batch that talks to nobody runs whole (prepare, compute,
    finish) as soon as every exchanged batch before it in ``order`` is finished and its
    bytes fit beside those the exchanged batches in flight hold: the batches are done in
    the forward's order, and a local batch moves no collective. Local
    batches that broadcast to their replicas (``split_replicas``) keep the sequential
    step's place: after the exchanged ones, in ``order``. ``(phase, index into batches)``.
    """
    exchanged = [i for i in order if batches[i].layout.exchanged]
    silent = deque(
        i for i in order if not batches[i].layout.exchanged and batches[i].replica is None
    )
    replicated = [
        i for i in order if not batches[i].layout.exchanged and batches[i].replica is not None
    ]
    position = {i: k for k, i in enumerate(order)}
    exchanged_positions = [position[i] for i in exchanged]  # ascending
    sizes = {i: schedule_bytes(batches[i], cost) for i in exchanged}
    ops: list[tuple[str, int]] = []
    held = finished = 0

    def run_silent() -> None:
        while silent:
            i = silent[0]
            if bisect.bisect_left(exchanged_positions, position[i]) > finished:
                return  # an exchanged batch before it in the forward's order is not done
            size = batch_bytes(batches[i], cost)
            if held and held + size.held + size.peak > budget:
                return  # after the exchanged batches in flight give their bytes back
            silent.popleft()
            ops.extend((("prepare", i), ("compute", i), ("finish", i)))

    run_silent()
    for phase, j in schedule([sizes[i] for i in exchanged], budget, max_in_flight):
        i = exchanged[j]
        ops.append((phase, i))
        if phase == "prepare":
            held += sizes[i].held
        elif phase == "finish":
            held -= sizes[i].held
            finished += 1  # in the order prepared: the forward's
            run_silent()
    run_silent()
    tail = schedule([schedule_bytes(batches[i], cost) for i in replicated], budget, max_in_flight)
    return ops + [(phase, replicated[j]) for phase, j in tail]


def peak_of_schedule(ops: Sequence[tuple[str, int]], sizes: Sequence[BatchBytes]) -> int:
    """The largest ``held + peak`` while running ``ops`` with this rank's ``sizes``."""
    peak = held = 0
    for phase, i in ops:
        if phase == "prepare":
            held += sizes[i].held
        peak = max(peak, held + sizes[i].peak)
        if phase == "finish":
            held -= sizes[i].held
    return peak


def workspace_peak_bytes(
    batches: Sequence[MuonBatch],
    budget: int,
    max_in_flight: int,
    cost: EngineCost = DEFAULT_COST,
) -> int:
    """The estimated peak transient bytes of one step's Muon batches on this rank."""
    ops = step_schedule(batches, budget, max_in_flight, cost)
    return peak_of_schedule(ops, [batch_bytes(b, cost) for b in batches])


class ScheduleCache:
    """One optimizer's step schedule, recomputed only when the plan, the budget or
    ``max_in_flight`` changed (the agreement check and the step read the same one)."""

    def __init__(self) -> None:
        self._source: tuple | None = None
        self._plan = None  # held, not only its id(): a new plan may reuse a freed one's
        self._ops: list[tuple[str, int]] = []

    def get(
        self, plan, budget: int, max_in_flight: int, order: Sequence[int] | None = None
    ) -> list[tuple[str, int]]:
        """The schedule of ``plan``'s batches taken in ``order`` (a permutation of their
        indices; ``None``: as planned), in the plan's batch indices."""
        source = (budget, max_in_flight, None if order is None else tuple(order))
        if plan is not self._plan or source != self._source:
            if order is None:
                self._ops = step_schedule(plan.batches, budget, max_in_flight, plan.ns_cost)
            else:
                self._ops = forward_schedule(
                    plan.batches, order, budget, max_in_flight, plan.ns_cost
                )
            self._source, self._plan = source, plan
        return self._ops
