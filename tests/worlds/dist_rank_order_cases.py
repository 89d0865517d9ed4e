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
"""

from __future__ import annotations

import itertools
import random

import torch
from dist_checks import S0, S1, S2, R, fail_on
from dist_harness import WorkerContext, case_registry
from dist_roundtrip import Param, check_layouts
from torch.distributed.device_mesh import DeviceMesh

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
    problems = []
    for k, order in enumerate(itertools.permutations(range(4))):
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
