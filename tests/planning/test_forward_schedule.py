"""The overlapped step's schedule (``forward_schedule``, issue #32): batches in the forward's
order, with the exchanged batches' collectives independent of this rank's local batches (an
expert stack split unevenly holds other counts, or nothing, on each rank), every batch run
once in phase order, and the transient within the budget whenever each batch fits alone.

Checked on random plans: many ranks' worth of local batches beside one set of exchanged
batches, random orders, budgets and ``max_in_flight``."""

from __future__ import annotations

import random

import pytest
import torch

from shardmuon.planning.batches import MuonBatch, PlanEntry, Segment, plan_batches
from shardmuon.planning.groups import ShardGroup
from shardmuon.planning.pieces import Piece
from shardmuon.planning.placements import MatrixLayout
from shardmuon.planning.workspace import (
    batch_bytes,
    forward_schedule,
    peak_of_schedule,
    schedule,
    schedule_bytes,
)
from shardmuon.runtime.agreement import collective_order
from shardmuon.runtime.overlap import forward_order

PHASES = ("prepare", "compute", "finish")


def _exchanged(rng: random.Random, param: int) -> MuonBatch:
    rows, cols = rng.choice([(16, 8), (24, 16), (40, 24)])
    group = ShardGroup(ranks=(0, 1), rank_index=0, process_group=None)
    half = rows // 2
    pieces = (Piece(((0, half),), ((0, cols),)), Piece(((half, rows),), ((0, cols),)))
    layout = MatrixLayout(rows, cols, 1, half, cols, False, group=group, pieces=pieces)
    count = rng.randint(1, 2)
    segments = [Segment(param + k, 0, 1) for k in range(count)]
    return MuonBatch(0, layout, segments, owners=tuple(range(count)), first_param=param)


def _local(rng: random.Random, param: int, replicated: bool) -> MuonBatch:
    rows, cols = rng.choice([(8, 8), (16, 8), (32, 24)])
    count = rng.randint(0, 4)  # this rank's experts: possibly none
    replicas = ShardGroup(ranks=(0, 2), rank_index=0, process_group=None) if replicated else None
    layout = MatrixLayout(rows, cols, count, rows, cols, False, replicas=replicas)
    segments = [Segment(param, 0, count)] if count else []
    return MuonBatch(0, layout, segments, replica=0 if replicated else None)


def _plan(seed: int) -> tuple[list[MuonBatch], list[int]]:
    """Exchanged batches and local ones (some broadcast to replicas) of random sizes, and
    the forward's order (:func:`forward_order`)."""
    rng = random.Random(seed)
    batches = []
    for param in range(0, 10 * rng.randint(2, 5), 10):
        kind = rng.choice(["exchanged", "exchanged", "local", "replicated"])
        batch = (
            _exchanged(rng, param)
            if kind == "exchanged"
            else _local(rng, param, kind == "replicated")
        )
        batches.append(batch)
    rng.shuffle(batches)  # the plan's order (exchanged first) is not the forward's
    for i, batch in enumerate(batches):
        batch.index = i
    order = sorted(
        range(len(batches)),
        key=lambda i: (
            batches[i].first_param
            if batches[i].first_param is not None
            else (batches[i].segments[0].param_index if batches[i].segments else -1)
        ),
    )
    return batches, order


def _other_rank(batches: list[MuonBatch], seed: int) -> list[MuonBatch]:
    """The same plan on a rank holding other counts of each local (silent) stack."""
    rng = random.Random(seed)
    out = []
    for batch in batches:
        if batch.layout.exchanged or batch.replica is not None:
            out.append(batch)
            continue
        layout = batch.layout
        count = rng.randint(0, 6)
        param = batch.segments[0].param_index if batch.segments else 0
        other = MatrixLayout(layout.rows, layout.cols, count, layout.rows, layout.cols, False)
        segments = [Segment(param, 0, count)] if count else []
        out.append(MuonBatch(batch.index, other, segments))
    return out


CASES = [
    (seed, budget, flight)
    for seed in range(12)
    for budget in (1, 4000, 20000, 10**9)
    for flight in (1, 3)
]


@pytest.mark.parametrize(("seed", "budget", "max_in_flight"), CASES)
def test_every_batch_runs_once_in_phase_order_within_the_budget(seed, budget, max_in_flight):
    batches, order = _plan(seed)
    ops = forward_schedule(batches, order, budget, max_in_flight)
    assert sorted(ops) == sorted((phase, i) for i in range(len(batches)) for phase in PHASES)
    at = {op: k for k, op in enumerate(ops)}
    for i in range(len(batches)):
        assert at[("prepare", i)] < at[("compute", i)] < at[("finish", i)]
    # The bound, with this rank's own bytes (an exchanged batch's are at most the planned).
    sizes = [batch_bytes(b) for b in batches]
    largest = max(s.held + s.peak for s in [*sizes, *map(schedule_bytes, batches)])
    assert peak_of_schedule(ops, sizes) <= max(budget, largest)


@pytest.mark.parametrize(("seed", "budget", "max_in_flight"), CASES)
def test_collectives_do_not_depend_on_this_ranks_local_batches(seed, budget, max_in_flight):
    batches, order = _plan(seed)
    position = {i: i for i in range(len(batches))}
    mine = collective_order(
        forward_schedule(batches, order, budget, max_in_flight), batches, position
    )
    for other_seed in range(5):
        theirs = _other_rank(batches, 100 * seed + other_seed)
        ops = forward_schedule(theirs, order, budget, max_in_flight)
        assert collective_order(ops, theirs, position) == mine
    # The exchanged batches keep the sequential step's schedule, in the forward's order.
    exchanged = [i for i in order if batches[i].layout.exchanged]
    alone = schedule([schedule_bytes(batches[i]) for i in exchanged], budget, max_in_flight)
    ops = forward_schedule(batches, order, budget, max_in_flight)
    assert [op for op in ops if op[1] in exchanged] == [(p, exchanged[j]) for p, j in alone]


def _kinds(batches: list[MuonBatch], order: list[int]) -> tuple[list[int], list[int]]:
    local = [i for i in order if not batches[i].layout.exchanged]
    return [i for i in local if batches[i].replica is None], [
        i for i in local if batches[i].replica is not None
    ]


@pytest.mark.parametrize("seed", [s for s in range(40) if all(_kinds(*_plan(s)))][:6])
def test_batches_are_done_in_the_forward_order_when_they_fit(seed):
    batches, order = _plan(seed)
    ops = forward_schedule(batches, order, 10**9, 3)
    done = [i for phase, i in ops if phase == "finish"]
    _, replicated = _kinds(batches, order)
    assert [i for i in done if i not in replicated] == [i for i in order if i not in replicated]
    assert done[-len(replicated) :] == replicated  # broadcasts keep their place: last


def test_exchanged_batches_are_ordered_alike_on_a_rank_holding_fewer_matrices():
    """Two stacks of one shape in one group; rank B holds none of the first one's matrices
    (an expert dim split past its size over another mesh dim): its batches hold other
    matrices, or none, yet both ranks take them in the same forward order."""

    def plans(counts: tuple[int, int]) -> list[MuonBatch]:
        group = ShardGroup(ranks=(0, 1), rank_index=0, process_group=None)
        pieces = (Piece(((0, 4),), ((0, 8),)), Piece(((4, 8),), ((0, 8),)))
        entries = [
            PlanEntry(
                param, MatrixLayout(8, 8, n, 4, 8, False, group=group, pieces=pieces, max_matrices=2),
                torch.float32, None, 1e-8,
            )
            for param, n in enumerate(counts)
        ]  # fmt: skip
        return plan_batches(entries)

    full, fewer = plans((2, 2)), plans((0, 2))
    assert [b.num_matrices for b in fewer] == [2, 0]  # other matrices, then none
    assert forward_order(full) == forward_order(fewer) == [0, 1]
    assert [b.first_param for b in fewer] == [b.first_param for b in full] == [0, 1]
