"""Mixed layouts that are valid must step (issue #28, item 3), on gloo worlds of 2-4 ranks.

Random parameters (matrices and expert stacks, random shapes, each mesh dim placed
``Replicate``, ``Shard(0)``, ``Shard(1)`` or ``Shard(2)``, some fused with partitions),
side by side on random meshes (ascending and permuted, 1-D and 2-D), random budgets,
``max_in_flight`` and ``split_replicas``. Judged by DTensor's own round trip
(``dist_roundtrip``): what round-trips must step bitwise like one process, never be refused;
the rest must be refused alone. Also the layout the issue found refused: an expert stack
that one dp group's ranks hold none of, beside HSDP weights. Run by ``test_mixed_layouts.py``.
"""

from __future__ import annotations

import random

import torch
from dist_checks import S0, S1, S2, R, fail_on
from dist_harness import WorkerContext, case_registry
from dist_roundtrip import Param, check_layouts
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CASES", "cases_for"]

CASES, case, cases_for = case_registry()


def _mesh(order: list[int], shape: tuple[int, ...]) -> DeviceMesh:
    names = ("w",) if len(shape) == 1 else ("a", "b")
    return DeviceMesh("cpu", torch.tensor(order).reshape(shape), mesh_dim_names=names)


def random_meshes(world: int, rng: random.Random) -> list[DeviceMesh]:
    """Ascending and permuted meshes over the world: 1-D, and 2-D where the world factors."""
    ascending = list(range(world))
    shuffled = []
    for _ in range(2):
        order = ascending[:]
        rng.shuffle(order)
        shuffled.append(order)
    shapes = [(world,), (1, world), (world, 1)]
    if world == 4:
        shapes.append((2, 2))
    meshes = [_mesh(ascending, shape) for shape in shapes]
    meshes += [_mesh(order, shapes[-1]) for order in shuffled]
    meshes.append(_mesh(list(reversed(ascending)), (world,)))
    return meshes


def random_partitions(rows: int, rng: random.Random) -> tuple[int, ...] | None:
    if rows < 2 or rng.random() > 0.3:
        return None
    cuts = sorted(rng.sample(range(1, rows), k=min(rows - 1, rng.randint(1, 2))))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows]))


def random_param(meshes: list[DeviceMesh], rng: random.Random) -> Param:
    shape = (rng.randint(1, 16), rng.randint(1, 16))
    if rng.random() < 0.3:
        shape = (rng.randint(1, 3), *shape)
    partitions = random_partitions(shape[-2], rng)
    if rng.random() < 0.1:
        return Param(shape, partitions=partitions)
    mesh = rng.choice(meshes)
    choices = [R, S0, S1] + ([S2] if len(shape) == 3 else [])
    placements = tuple(rng.choice(choices) for _ in range(mesh.ndim))
    return Param(shape, placements, mesh, partitions)


def _random_trials(ctx: WorkerContext, trials: range) -> None:
    """The ``trials`` of one stream of draws (the earlier ones drawn, not run)."""
    rng = random.Random(2800 + ctx.world_size)  # the same draws on every rank
    meshes = random_meshes(ctx.world_size, rng)
    problems = []
    for trial in range(trials.stop):
        params = [random_param(meshes, rng) for _ in range(rng.randint(3, 7))]
        kwargs = {
            "split_replicas": rng.random() < 0.5,
            "max_in_flight": rng.randint(1, 4),
            "workspace_bytes": rng.choice([1 << 26, rng.randint(200, 6000)]),
        }
        if trial in trials:
            label = f"trial {trial} {params} {kwargs}"
            problems += check_layouts(label, params, seed=trial, **kwargs)
    fail_on(problems)


@case("random_mixed_layouts_step_or_are_refused_for_cause", (2, 3, 4))
def _random(ctx: WorkerContext) -> None:
    _random_trials(ctx, range(10))  # a sample; the next 10 under the exhaustive marker


@case("more_random_mixed_layouts", (2, 3, 4))
def _more_random(ctx: WorkerContext) -> None:
    _random_trials(ctx, range(10, 20))


def _expert_mix(mesh: DeviceMesh, rng: random.Random) -> list[Param]:
    """The issue's mix: a ``[1, 16, 7]`` expert stack placed ``(Shard(0), Shard(2))`` on a
    2x2 mesh (the ranks of the second dp group hold no expert) beside a ``(7, 7)`` weight
    ``(Replicate(), Shard(1))``, and four random parameters on the same mesh."""
    params = [Param((1, 16, 7), (S0, S2), mesh), Param((7, 7), (R, S1), mesh)]
    while len(params) < 6:
        shape = (rng.randint(1, 16), rng.randint(1, 16))
        if rng.random() < 0.5:  # stacks, most of one expert: some ranks hold none
            shape = (rng.choice([1, 1, 2, 3]), *shape)
        choices = [R, S0, S1] + ([S2] if len(shape) == 3 else [])
        placements = (rng.choice(choices), rng.choice(choices))
        params.append(Param(shape, placements, mesh, random_partitions(shape[-2], rng)))
    return params


@case("random_layouts_beside_an_expert_stack_one_dp_group_lacks", (4,))
def _beside_empty_stack(ctx: WorkerContext) -> None:
    """Ranks of one replicate group sit in shard groups that exchange different batches
    (only the first dp group exchanges the experts): they issue different collectives over
    those groups, and the same over their own. Before: refused as disagreeing on the order
    of the step's collectives (the digest listed the collectives over every group), or the
    all-to-alls of a group spanning both dp groups issued in different orders (each rank
    scheduled only the batches it holds)."""
    rng = random.Random(28)
    mesh = _mesh([0, 1, 2, 3], (2, 2))
    problems = []
    for trial in range(20):
        params = _expert_mix(mesh, rng)
        kwargs = {
            "split_replicas": rng.random() < 0.5,
            "max_in_flight": rng.randint(1, 4),
            "workspace_bytes": rng.choice([1 << 26, rng.randint(200, 6000)]),
        }
        problems += check_layouts(f"trial {trial} {params} {kwargs}", params, seed=trial, **kwargs)
    fail_on(problems)


@case("the_issues_expert_stack_layouts", (4,))
def _issue_layouts(ctx: WorkerContext) -> None:
    """Two mixes found refused: over replicate group ``[0, 1]`` (a replica's collectives
    over its column groups counted), and over the group of all four ranks (its all-to-alls
    in different orders on the two dp groups)."""
    mesh = _mesh([0, 1, 2, 3], (2, 2))
    stack, weight = Param((1, 16, 7), (S0, S2), mesh), Param((7, 7), (R, S1), mesh)
    mixes = [
        (
            [
                Param((1, 3, 16), (S2, S0), mesh),
                Param((9, 2), (R, R), mesh),
                Param((7, 10), (R, R), mesh),
                Param((14, 11), (S1, R), mesh),
            ],
            {"max_in_flight": 2},
        ),
        (
            [
                Param((1, 6, 7), (S2, S1), mesh),
                Param((12, 9), (R, S1), mesh),
                Param((1, 12, 10), (S0, S1), mesh),
                Param((12, 5), (S1, S1), mesh),
            ],
            {"max_in_flight": 3, "split_replicas": True},
        ),
    ]
    problems = []
    for k, (more, kwargs) in enumerate(mixes):
        params = [stack, weight, *more]
        # The empty batches the second dp group plans for the experts it lacks go through
        # every way of stepping: pipelined, chunk by chunk, with the state offloaded.
        for extra in ({}, {"workspace_bytes": 2500}, {"chunked": True}, {"offload": "state"}):
            label = f"mix {k}, {extra}"
            problems += check_layouts(label, params, seed=k, **kwargs, **extra)
    fail_on(problems)


@case("batches_planned_for_experts_held_elsewhere_move_nothing", (4,))
def _planned_batches_traffic(ctx: WorkerContext) -> None:
    """The second dp group plans empty batches for the experts only the first holds (so
    that both schedule the same exchanged batches): they exchange nothing, and every rank's
    all-to-all bytes are the minimum its shards and owners imply, each matrix is
    orthogonalized once (``compare_with_single``'s traffic checks), bitwise like one process."""
    from dist_checks import Spec, check_against_single, make_context

    checks = make_context(ctx.rank, ctx.world_size)
    layouts = [
        [Spec((1, 6, 5), (S0, S1), "2d"), Spec((6, 5), (R, S0), "2d")],
        [Spec((5, 6, 4), (S0, S1), "2d"), Spec((6, 4), (R, S0), "2d")],  # 3 and 2 experts
        [  # the second mix of the_issues_expert_stack_layouts
            Spec((1, 16, 7), (S0, S2), "2d"),
            Spec((7, 7), (R, S1), "2d"),
            Spec((1, 6, 7), (S2, S1), "2d"),
            Spec((12, 9), (R, S1), "2d"),
            Spec((1, 12, 10), (S0, S1), "2d"),
            Spec((12, 5), (S1, S1), "2d"),
        ],
    ]
    for specs in layouts:
        for kwargs in ({}, {"chunked": True}, {"workspace_bytes": 2000, "max_in_flight": 3}):
            check_against_single(checks, specs, newton_schulz_impl="per-matrix", **kwargs)
