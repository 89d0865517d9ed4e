"""Meshes whose ranks are not in ascending order (issue #28, item 2), on gloo.

On a ``DeviceMesh`` built from a permuted rank tensor, torch numbers each mesh dim's
process group by ascending rank and scatters, gathers and shards (FSDP2) by that group rank,
while DTensor sizes shards by the mesh coordinate. Each case builds every rank order of a
2x2 mesh (a seeded sample of 2x2x2 orders, every or sampled 1-D order), lays parameters out
with torch's ``distribute_tensor`` and judges each layout with torch's own round trip
(``dist_roundtrip``): the layouts that round-trip must step bitwise like one process (with
and without ``split_replicas``), fused matrices whose partitions cross the shard boundary
included, and each layout that does not must be refused alone, on every rank, naming the
parameter. Run by ``test_rank_orders.py``.

The last cases place the same tensors a second way, as ``distribute_tensor(...,
src_data_rank=None)`` does: each rank slices the piece of its mesh coordinate, where the
scatter gives it the piece of its group rank, and no shard says which happened. Before, the
optimizer read such a tensor by group rank: on ``[3, 2, 1, 0]`` a 12-row weight with
partitions ``[5, 7]`` got a wrong update on every rank (0.024 off in 0.039), silently. Now a
layout whose update depends on the placement is refused on every rank, and every other one
is stepped right under both placements (a table of verdicts, each checked after one and
two steps).
"""

from __future__ import annotations

import itertools
import random

import torch
from dist_checks import S0, S1, S2, R, fail_on
from dist_harness import WorkerContext, case_registry
from dist_roundtrip import (
    COORDINATE_TOL,
    REFUSAL,
    Outcome,
    Param,
    check_layouts,
    run_against_single,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor

__all__ = ["CASES", "cases_for"]

CASES, case, cases_for = case_registry()


def _mesh(order: list[int], shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    return DeviceMesh("cpu", torch.tensor(order).reshape(shape), mesh_dim_names=names)


def hsdp_2x2(mesh: DeviceMesh) -> list[Param]:
    """HSDP and 2-D layouts on a 2x2 mesh: dion's four (even, uneven, aligned and crossing
    partitions), 2-D shards, a replicate dim after a shard dim, an expert stack."""
    return [
        Param((8, 4), (R, S0), mesh, partitions=(6, 2)),  # each piece crosses a block edge
        Param((8, 16), (R, S0), mesh),
        Param((8, 16), (R, S0), mesh, partitions=(4, 4)),  # blocks are the pieces
        Param((7, 16), (R, S0), mesh),  # uneven: round-trips only where dim 1 ascends
        Param((8, 6), (S0, S1), mesh),
        Param((6, 8), (R, S1), mesh, partitions=(2, 4)),
        Param((8, 6), (S1, R), mesh, partitions=(5, 3)),
        Param((2, 8, 4), (S0, S1), mesh, partitions=(6, 2)),  # experts over dim 0
        Param((2, 8, 4), (S1, S0), mesh),  # experts over dim 1, rows over dim 0
        Param((7, 6), (S1, S0), mesh),
        Param((5, 6), (S0, R), mesh),
        Param((4, 6), (R, R), mesh),
        Param((3, 5)),
    ]


@case("every_2x2_rank_order", (4,))
def _every_2x2(ctx: WorkerContext) -> None:
    _check_2x2_orders(list(itertools.permutations(range(4))))


@case("sampled_2x2_rank_orders", (4,))
def _sampled_2x2(ctx: WorkerContext) -> None:
    """The default run's sample of the 24: ascending, reversed, and 4 drawn with a fixed
    seed (``every_2x2_rank_order``, marked exhaustive, runs them all)."""
    orders = list(itertools.permutations(range(4)))
    _check_2x2_orders([orders[0], orders[-1], *random.Random(24).sample(orders[1:-1], 4)])


def _check_2x2_orders(orders: list[tuple[int, ...]]) -> None:
    problems = []
    for k, order in enumerate(orders):
        mesh = _mesh(list(order), (2, 2), ("rep", "shard"))
        for split in (False, True):
            label = f"2x2 mesh {mesh.mesh.tolist()}, split_replicas={split}"
            problems += check_layouts(label, hsdp_2x2(mesh), seed=k, split_replicas=split)
    fail_on(problems)


def hsdp_tp_2x2x2(mesh: DeviceMesh) -> list[Param]:
    return [
        Param((8, 4), (R, S0, S1), mesh, partitions=(6, 2)),
        Param((8, 8), (R, S1, S0), mesh),
        Param((8, 4), (R, S0, R), mesh, partitions=(6, 2)),
        Param((8, 6), (R, R, S0), mesh),
        Param((7, 8), (R, S0, S1), mesh),
        Param((2, 8, 4), (R, S0, S1), mesh, partitions=(3, 5)),  # experts over dp
        Param((8, 8), (S0, R, S1), mesh, partitions=(2, 6)),
    ]


@case("sampled_2x2x2_rank_orders", (8,))
def _sampled_2x2x2(ctx: WorkerContext) -> None:
    rng = random.Random(28)  # the same draws on every rank
    orders = [list(reversed(range(8)))]
    while len(orders) < 6:
        order = list(range(8))
        rng.shuffle(order)
        orders.append(order)
    problems = []
    for k, order in enumerate(orders):
        mesh = _mesh(order, (2, 2, 2), ("rep", "dp", "tp"))
        for split in (False, True):
            label = f"2x2x2 mesh {order}, split_replicas={split}"
            problems += check_layouts(label, hsdp_tp_2x2x2(mesh), seed=k, split_replicas=split)
    fail_on(problems)


def fsdp_1d(mesh: DeviceMesh, world: int) -> list[Param]:
    rows = 4 * world
    return [
        Param((rows, 4), (S0,), mesh, partitions=(rows - world, world)),
        Param((rows, rows), (S1,), mesh),
        Param((rows - 1, 8), (S0,), mesh),  # uneven
        Param((world, 8, 6), (S0,), mesh),  # one expert each: local
        Param((3, rows, 6), (S1,), mesh, partitions=(3 * world, world)),
        Param((2, 6, rows), (S2,), mesh),
    ]


@case("one_dim_rank_orders", (2, 3, 4))
def _one_dim(ctx: WorkerContext) -> None:
    orders = [list(p) for p in itertools.permutations(range(ctx.world_size))]
    if len(orders) > 6:
        orders = [orders[0], orders[-1], *random.Random(7).sample(orders[1:-1], 4)]
    problems = []
    for k, order in enumerate(orders):
        mesh = _mesh(order, (ctx.world_size,), ("w",))
        label = f"1-D mesh {order}"
        problems += check_layouts(label, fsdp_1d(mesh, ctx.world_size), seed=k)
    fail_on(problems)


# ------------------------------------------------------------ two placements, one verdict

STEP = None  # the verdict of a layout that must step right under both placements


def _by_placement(label: str, params: list[Param], refusal: str | None, **kwargs) -> list[str]:
    """Step ``params`` placed by scatter and by coordinate: both right, or (``refusal``: a
    fragment the message must hold) both refused, naming the parameter and the mesh."""
    problems = []
    for by_coordinate in (False, True):
        where = f"{label}, {params}, {'by coordinate' if by_coordinate else 'by scatter'}"
        outcome = run_against_single(params, by_coordinate=by_coordinate, **kwargs)
        if refusal is None:
            if outcome.refused is not None:
                problems.append(f"{where}: refused: {outcome.refused}")
            problems += [f"{where}: {m}" for m in outcome.problems]
        else:
            mesh = str(params[0].mesh.mesh.tolist())
            problems += [f"{where}: {m}" for m in _refusal(outcome, (*REFUSAL, mesh, refusal))]
    return problems


def _refusal(outcome: Outcome, fragments: tuple[str, ...]) -> list[str]:
    if outcome.refused is None:
        wrong = f" ({outcome.problems[0]})" if outcome.problems else ""
        return [f"stepped, expected a refusal{wrong}"]
    return [
        f"message lacks {f!r}: {outcome.refused}" for f in fragments if f not in outcome.refused
    ]


def _verdicts(table: list[tuple[Param, str | None]], label: str, **kwargs) -> list[str]:
    """The layouts expected to step, together; each one expected to be refused, alone."""
    steps = [p for p, verdict in table if verdict is STEP]
    problems = _by_placement(label, steps, None, **kwargs) if steps else []
    for p, verdict in table:
        if verdict is not STEP:
            problems += _by_placement(label, [p], verdict, **kwargs)
    return problems


def _one_dim_verdicts(order: list[int]) -> list[tuple[Param, str | None]]:
    mesh = _mesh(order, (4,), ("w",))
    crossing = "one block of its partitions"
    uneven = "does not split evenly"
    table = {
        # The attack: partitions [5, 7] cut the pieces (3 rows each) that the mesh permutes.
        (3, 2, 1, 0): [
            (Param((12, 8), (S0,), mesh, partitions=(5, 7)), crossing),
            (Param((12, 8), (S0,), mesh), STEP),
            (Param((12, 8), (S0,), mesh, partitions=(6, 6)), STEP),  # blocks onto blocks
            (Param((12, 8), (S0,), mesh, partitions=(4, 4, 4)), crossing),
            (Param((8, 12), (S1,), mesh, partitions=(5, 3)), STEP),  # columns permuted
            (Param((2, 12, 8), (S1,), mesh, partitions=(5, 7)), crossing),
            (Param((4, 6, 8), (S0,), mesh, partitions=(2, 4)), STEP),  # whole experts
            (Param((10, 8), (S0,), mesh), uneven),  # 3, 3, 3, 1 rows
            (Param((10, 8), (S0,), mesh, partitions=(5, 5)), uneven),
            (Param((3, 8), (S0,), mesh), uneven),  # rank 0 empty by coordinate, not by group
        ],
        (1, 0, 3, 2): [
            (Param((12, 8), (S0,), mesh, partitions=(5, 7)), crossing),
            (Param((12, 8), (S0,), mesh, partitions=(6, 6)), STEP),
            (Param((12, 8), (S0,), mesh, partitions=(3, 3, 3, 3)), STEP),
            (Param((8, 10), (S1,), mesh), uneven),
            (Param((3, 8), (S0,), mesh), uneven),
        ],
        (2, 0, 3, 1): [
            (Param((12, 8), (S0,), mesh, partitions=(6, 6)), crossing),
            (Param((12, 8), (S0,), mesh), STEP),
            (Param((8, 12), (S1,), mesh, partitions=(5, 3)), STEP),
        ],
        # Ranks 0 and 1 swap pieces of equal size: uneven rows are readable, and stepped.
        (1, 0, 2, 3): [
            (Param((10, 8), (S0,), mesh), STEP),
            (Param((10, 8), (S0,), mesh, partitions=(5, 5)), crossing),
        ],
    }
    return table[tuple(order)]


@case("coordinate_placed_1d_meshes_refused_or_right", (4,))
def _coordinate_1d(ctx: WorkerContext) -> None:
    problems = []
    for k, order in enumerate(([3, 2, 1, 0], [1, 0, 3, 2], [2, 0, 3, 1], [1, 0, 2, 3])):
        problems += _verdicts(_one_dim_verdicts(order), f"1-D mesh {order}", seed=k)
    fail_on(problems)


def _two_dim_verdicts(order: list[int], split: bool) -> list[tuple[Param, str | None]]:
    mesh = _mesh(order, (2, 2), ("rep", "shard"))
    crossing = "one block of its partitions"
    table = {
        # The shard dim reversed in both rows.
        (1, 0, 3, 2): [
            (Param((8, 4), (R, S0), mesh, partitions=(6, 2)), crossing),
            (Param((8, 4), (R, S0), mesh), STEP),
            (Param((8, 4), (S0, S1), mesh, partitions=(6, 2)), STEP),  # rows over dim 0
            (Param((8, 4), (S1, S0), mesh, partitions=(6, 2)), crossing),
            (Param((8, 4), (S1, S0), mesh, partitions=(4, 4)), STEP),
        ],
        # The replicate dim reversed.
        (2, 3, 0, 1): [
            (Param((8, 4), (R, S0), mesh, partitions=(6, 2)), STEP),
            (Param((8, 4), (S0, S1), mesh, partitions=(6, 2)), crossing),
            (Param((8, 6), (S1, R), mesh, partitions=(5, 3)), STEP),
        ],
        # Only the second row reversed: replicas pair the ranks 0 and 2 (group rank 0 on the
        # shard dim), which hold different rows by coordinate; fine unless they hand each
        # other results.
        (0, 1, 3, 2): [
            (Param((8, 4), (R, S0), mesh), "split_replicas" if split else STEP),
            (Param((2, 8, 4), (R, S0), mesh), "split_replicas" if split else STEP),
            (Param((8, 4), (S0, R), mesh), STEP),
        ],
    }
    return table[tuple(order)]


@case("coordinate_placed_2x2_meshes_refused_or_right", (4,))
def _coordinate_2x2(ctx: WorkerContext) -> None:
    problems = []
    for k, order in enumerate(([1, 0, 3, 2], [2, 3, 0, 1], [0, 1, 3, 2])):
        for split in (False, True):
            label = f"2x2 mesh {order}, split_replicas={split}"
            table = _two_dim_verdicts(order, split)
            problems += _verdicts(table, label, seed=k, split_replicas=split)
    fail_on(problems)


@case("refused_group_leaves_the_optimizer_as_it_was", (4,))
def _refused_group(ctx: WorkerContext) -> None:
    """A group whose dion ``split_sizes`` cross the permuted pieces is refused by
    ``add_param_group`` on every rank, before any collective, and the optimizer steps on as
    if it had not been offered."""
    from torch import nn

    from shardmuon import Muon

    mesh = _mesh([3, 2, 1, 0], (4,), ("w",))
    generator = torch.Generator().manual_seed(5)
    full, grad = torch.randn(12, 8, generator=generator), torch.randn(12, 8, generator=generator)
    kept = nn.Parameter(distribute_tensor(full.clone(), mesh, [S0], src_data_rank=None))
    ref = nn.Parameter(full.clone())
    opt = Muon([kept], lr=0.02, newton_schulz_impl="per-matrix")
    single = Muon([ref], lr=0.02, newton_schulz_impl="per-matrix")
    offered = nn.Parameter(distribute_tensor(full.clone(), mesh, [S0], src_data_rank=None))
    problems = []
    try:
        opt.add_param_group({"params": [offered], "algorithm": "muon", "split_sizes": (5, 7)})
        problems.append("add_param_group accepted split_sizes (5, 7) across permuted pieces")
    except ValueError as error:
        fragments = ("group 1 param 0", "[3, 2, 1, 0]", "ascending order")
        problems += [f"message lacks {f!r}: {error}" for f in fragments if f not in str(error)]
    if len(opt.param_groups) != 1 or offered in opt.state:
        problems.append("the refused group was left in the optimizer")
    kept.grad = distribute_tensor(grad, mesh, [S0], src_data_rank=None)
    ref.grad = grad.clone()
    opt.step()
    single.step()
    want = distribute_tensor(ref.detach(), mesh, [S0], src_data_rank=None).to_local()
    update = (ref.detach() - full).abs().max().item()
    diff = (kept.detach().to_local() - want).abs().max().item()
    if diff > COORDINATE_TOL * update:
        problems.append(f"after the refusal: max |diff| {diff:.3g} for an update of {update:.3g}")
    fail_on(problems)
