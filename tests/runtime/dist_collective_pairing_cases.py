"""Collective pairing on gloo: the collectives each rank issues must pair up across the
members of every group, and every case is compared with an independent reference (the same
optimizer on one process, bitwise). The cases are escapes found by attacking the optimizer
(issue #19).

* Meshes whose ranks are not in ascending row-major order (a permuted rank tensor, a
  reversed 1-D mesh, transposed and permuted 2-D and 3-D meshes, flattened or not).
* Random layouts and ``workspace_bytes`` budgets (many of them between what an owner and a
  non-owner of a batch need): every rank issues the same sequence of collectives.

Run by ``test_collective_pairing.py``.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from dist_checks import (
    S0,
    S1,
    S2,
    Context,
    R,
    Spec,
    compare_with_single,
    fail_on,
    make_context,
)
from dist_roundtrip import Param, one_tensor_by_coordinate, round_trips
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CASES", "cases_for", "make_context"]

CASES: dict[str, Callable[[Context], None]] = {}
WORLDS: dict[str, tuple[int, ...]] = {}


def case(name: str, worlds: tuple[int, ...]):
    """Register ``fn(ctx)`` as case ``name`` for the given world sizes."""

    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        CASES[name], WORLDS[name] = fn, worlds
        return fn

    return register


def cases_for(world_size: int) -> list[str]:
    return [name for name in CASES if world_size in WORLDS[name]]


# ------------------------------------------------------------------ collectives


@dataclass(frozen=True)
class Issued:
    """One collective as this rank issued it, in its group's numbering."""

    op: str
    group: tuple[int, ...]  # global ranks by group rank
    send: tuple[int, ...] = ()  # all-to-all: elements to each group rank
    recv: tuple[int, ...] = ()  # all-to-all: elements from each group rank
    numel: int = 0
    root: int = -1


def _ranks(group) -> tuple[int, ...]:
    group = group if group is not None else dist.group.WORLD
    return tuple(dist.get_global_rank(group, i) for i in range(group.size()))


@contextlib.contextmanager
def issued_collectives() -> Iterator[list[Issued]]:
    """Record every all-to-all, broadcast and all-reduce issued through ``torch.distributed``."""
    calls: list[Issued] = []
    originals = dist.all_to_all_single, dist.broadcast, dist.all_reduce

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, **kwargs):  # fmt: skip
        size = len(_ranks(group))
        even_out = [output.numel() // size] * size
        even_in = [input.numel() // size] * size
        calls.append(
            Issued(
                "all_to_all",
                _ranks(group),
                send=tuple(input_split_sizes or even_in),
                recv=tuple(output_split_sizes or even_out),
            )
        )
        return originals[0](output, input, output_split_sizes, input_split_sizes, group, **kwargs)

    def broadcast(tensor, src=None, group=None, **kwargs):
        calls.append(Issued("broadcast", _ranks(group), numel=tensor.numel(), root=src))
        return originals[1](tensor, src, group, **kwargs)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, **kwargs):
        calls.append(Issued("all_reduce", _ranks(group), numel=tensor.numel()))
        return originals[2](tensor, op, group, **kwargs)

    dist.all_to_all_single, dist.broadcast, dist.all_reduce = (
        all_to_all_single,
        broadcast,
        all_reduce,
    )
    try:
        yield calls
    finally:
        dist.all_to_all_single, dist.broadcast, dist.all_reduce = originals


def pairing_problems(calls: list[Issued], label: str) -> list[str]:
    """Do the collectives of every rank pair up? (Collective over the world.)

    For every group, each member's collectives on it, in issue order, must be the same ops,
    and each all-to-all's split to a peer must be that peer's split from it.
    """
    everyone: list[list[Issued] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, calls)
    me = dist.get_rank()
    problems = []
    groups = {c.group for c in calls}
    for group in sorted(groups):
        mine = [c for c in calls if c.group == group]
        for peer in group:
            theirs = [c for c in everyone[peer] if c.group == group]
            if [c.op for c in theirs] != [c.op for c in mine]:
                problems.append(
                    f"{label}: group {group}: rank {me} issued {[c.op for c in mine]}, rank "
                    f"{peer} {[c.op for c in theirs]}"
                )
                continue
            i, j = group.index(me), group.index(peer)
            for k, (a, b) in enumerate(zip(mine, theirs)):
                if a.op == "all_to_all" and a.send[j] != b.recv[i]:
                    problems.append(
                        f"{label}: group {group}, collective {k}: rank {me} sends {a.send[j]} "
                        f"elements to rank {peer}, which expects {b.recv[i]}"
                    )
                if a.op != "all_to_all" and (a.numel, a.root) != (b.numel, b.root):
                    problems.append(
                        f"{label}: group {group}, collective {k} ({a.op}): rank {me} "
                        f"{(a.numel, a.root)}, rank {peer} {(b.numel, b.root)}"
                    )
    return problems


def compare(ctx: Context, specs: list[Spec], label: str, **kwargs) -> list[str]:
    """Bitwise against one process (``compare_with_single``), and the collectives pair up.

    ``newton_schulz_impl="per-matrix"``: the batched GEMMs may round a matrix differently in
    another batch size; one matrix at a time, every bit is the layout's doing.
    """
    kwargs.setdefault("newton_schulz_impl", "per-matrix")
    with issued_collectives() as calls:
        _, problems = compare_with_single(ctx, specs, check_traffic=False, **kwargs)
    problems = [f"{label}: {p}" for p in problems]
    return problems + pairing_problems(calls, label)


# ------------------------------------------------------------------ meshes


def permuted_context(ctx: Context, order: list[int], order_2d: list[int] | None = None) -> Context:
    """``ctx`` with its 1-D mesh (and 2x2 mesh) built from permuted rank tensors."""
    mesh = DeviceMesh("cpu", torch.tensor(order), mesh_dim_names=("w",))
    mesh_2d = None
    if order_2d is not None:
        grid = torch.tensor(order_2d).reshape(2, 2)
        mesh_2d = DeviceMesh("cpu", grid, mesh_dim_names=("replicate", "shard"))
    return replace(ctx, mesh=mesh, mesh_2d=mesh_2d)


def _orders(world: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    orders = [list(reversed(range(world)))]
    while len(orders) < count:
        order = list(range(world))
        rng.shuffle(order)
        if order != sorted(order) and order not in orders:
            orders.append(order)
        if world <= 2:
            break
    return orders


def representable(ctx: Context, specs: list[Spec]) -> list[Spec]:
    """The specs torch lays out and reads back on ``ctx``'s meshes (``full_tensor()`` of
    ``distribute_tensor`` round-trips). On a mesh that lists a dim's ranks out of order the
    others (uneven shards there, group ranks that form no grid) are refused, on every rank:
    ``dist_rank_order_cases`` checks that."""
    return [
        s
        for s in specs
        if s.placements is None or round_trips(Param(s.shape, s.placements, ctx.mesh_for(s.mesh)))
    ]


def replicas_agree(ctx: Context, specs: list[Spec]) -> list[Spec]:
    """The specs whose replicas hold the same pieces however torch placed them (by group
    rank or by mesh coordinate): under ``split_replicas`` they hand each other results, and
    the others are refused (``dist_rank_order_cases`` checks that)."""
    return [
        s
        for s in specs
        if s.placements is None
        or one_tensor_by_coordinate(Param(s.shape, s.placements, ctx.mesh_for(s.mesh)))
    ]


# Uneven rows and columns, short batches (fewer matrices than ranks), stacks.
ONE_DIM_SPECS = [
    Spec((13, 6), (S0,)),
    Spec((13, 6), (S0,)),
    Spec((7, 11), (S1,)),
    Spec((3, 9, 5), (S1,)),  # a stack sharded on dim 1: rows of each matrix
    Spec((2, 6, 10), (S2,)),
    Spec((5, 8), (S0,)),
    Spec((9, 4)),
]

# On permuted meshes: sharded dims that split evenly over 2, 3 and 4 ranks; short batches,
# stacks.
PERMUTED_ONE_DIM_SPECS = [
    Spec((12, 6), (S0,)),
    Spec((12, 6), (S0,)),
    Spec((7, 12), (S1,)),
    Spec((3, 12, 5), (S1,)),  # a stack sharded on dim 1: rows of each matrix
    Spec((2, 6, 12), (S2,)),
    Spec((24, 8), (S0,)),
    Spec((9, 4)),
]


@case("permuted_1d_meshes_bitwise", (2, 3, 4))
def _permuted_1d(ctx: Context) -> None:
    problems = []
    for k, order in enumerate(_orders(ctx.world_size, 3, seed=1)):
        permuted = permuted_context(ctx, order)
        specs = representable(permuted, PERMUTED_ONE_DIM_SPECS)
        problems += compare(permuted, specs, f"mesh {order}", seed=k)
        problems += compare(
            permuted, specs, f"mesh {order}, workspace 4 KiB", seed=k,
            workspace_bytes=4096, chunked=k == 1,
        )  # fmt: skip
    fail_on(problems)


# Sharded dims that split evenly over the mesh dims.
TWO_DIM_SPECS = [
    Spec((8, 6), (S0, S1), "2d"),
    Spec((6, 10), (S1, S0), "2d"),
    Spec((12, 4), (S0, S0), "2d"),
    Spec((6, 5), (R, S0), "2d"),
    Spec((5, 8), (R, S1), "2d"),
    Spec((2, 6, 5), (S0, S1), "2d"),  # experts over one dim, rows over the other
    Spec((8, 3), (R, R), "2d"),
]

GRIDS_2X2 = [[0, 2, 1, 3], [3, 1, 2, 0], [1, 0, 3, 2], [2, 3, 0, 1]]


@case("permuted_2d_meshes_bitwise", (4,))
def _permuted_2d(ctx: Context) -> None:
    problems = []
    for k, grid in enumerate(GRIDS_2X2):
        permuted = permuted_context(ctx, list(range(4)), grid)
        if k % 2:  # the user flattened the mesh first (torchtitan does, for its loss)
            permuted.mesh_2d["replicate", "shard"]._flatten()
        label = f"2x2 mesh {grid}{' flattened' if k % 2 else ''}"
        specs = representable(permuted, TWO_DIM_SPECS)
        problems += compare(permuted, specs, label, seed=k)
        problems += compare(
            permuted,
            replicas_agree(permuted, specs),
            f"{label}, split_replicas",
            seed=k,
            split_replicas=True,
        )
        problems += compare(
            permuted, specs, f"{label}, workspace 3 KiB", seed=k, workspace_bytes=3072
        )
    fail_on(problems)


@case("permuted_3d_mesh_hsdp_tp_bitwise", (8,))
def _permuted_3d(ctx: Context) -> None:
    rng = random.Random(3)
    problems = []
    for k in range(2):
        order = list(range(8))
        rng.shuffle(order)
        mesh = DeviceMesh(
            "cpu", torch.tensor(order).reshape(2, 2, 2), mesh_dim_names=("rep", "dp", "tp")
        )
        if k:
            mesh["dp", "tp"]._flatten()
        permuted = replace(ctx, mesh_2d=mesh)
        specs = [
            Spec((8, 6), (R, S0, S1), "2d"),
            Spec((6, 10), (R, S1, S0), "2d"),
            Spec((12, 4), (R, S0, S0), "2d"),
            Spec((6, 5), (R, R, S0), "2d"),
        ]
        specs = representable(permuted, specs)
        label = f"2x2x2 mesh {order}{' flattened' if k else ''}"
        problems += compare(permuted, specs, label, seed=k)
        split = replicas_agree(permuted, specs)
        if split:
            problems += compare(permuted, split, f"{label}, split", seed=k, split_replicas=True)
    fail_on(problems)


# ------------------------------------------------------------------ random layouts, budgets

PLACEMENTS_1D = [(S0,), (S1,), None, (R,)]
PLACEMENTS_2D = [(S0, S1), (S1, S0), (R, S0), (R, S1), (S0, S0), (S0, R)]


def random_specs(rng: random.Random, two_dims: bool) -> list[Spec]:
    specs = []
    for _ in range(rng.randint(3, 7)):
        shape = (rng.randint(1, 24), rng.randint(1, 24))
        if rng.random() < 0.2:
            shape = (rng.randint(1, 3), *shape)
        if two_dims and rng.random() < 0.6:
            specs.append(Spec(shape, rng.choice(PLACEMENTS_2D), "2d"))
        else:
            specs.append(Spec(shape, rng.choice(PLACEMENTS_1D)))
    return specs


@case("same_collective_order_random_layouts_and_budgets", (2, 3, 4))
def _random_budgets(ctx: Context) -> None:
    rng = random.Random(19 + ctx.world_size)  # the same draws on every rank
    problems = []
    for trial in range(6):
        specs = random_specs(rng, two_dims=ctx.mesh_2d is not None)
        for budget in sorted({rng.randint(200, 6000) for _ in range(4)}):
            label = f"trial {trial}, budget {budget}, specs {specs}"
            problems += compare(
                ctx, specs, label, seed=trial, steps=2, workspace_bytes=budget,
                max_in_flight=rng.randint(1, 4), split_replicas=rng.random() < 0.3,
            )  # fmt: skip
    fail_on(problems)


# ------------------------------------------------------------------ step_chunk retry (3)


@case("step_chunk_failed_after_its_exchange_is_refused_on_every_rank", (2,))
def _unreplayable(ctx: Context) -> None:
    """Newton–Schulz raises on every owner of an exchanged batch, after the gather: the
    retry is refused on every rank (before: ``AttributeError`` and a peer left hanging);
    a restored checkpoint steps again, bitwise like an optimizer that never failed."""
    from dist_cases import expect_raises
    from dist_checks import make_optimizer, place, random_tensors
    from torch import nn

    from shardmuon.runtime.phases import StepContext

    specs = [Spec((8, 4), (S0,)), Spec((8, 4), (S0,)), Spec((6, 5))]
    problems = []
    for offload in (None, "state"):
        init = random_tensors([s.shape for s in specs], 0)
        params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
        twin = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
        opt = make_optimizer(params, specs, lr=0.02, offload=offload)
        ref = make_optimizer(twin, specs, lr=0.02, offload=offload)
        saved = copy.deepcopy(opt.state_dict())  # state_dict() holds the live tensors
        grads = random_tensors([s.shape for s in specs], 1)
        for s, p, q, g in zip(specs, params, twin, grads):
            p.grad, q.grad = place(ctx, s, g), place(ctx, s, g)
        exchanged = next(c for c in opt.chunks() if getattr(c, "layout", None).exchanged)
        original = StepContext.orthogonalize

        def failing(self, U, batch):
            raise MemoryError("out of memory in Newton-Schulz (injected)")

        StepContext.orthogonalize = failing
        try:
            problems += expect_raises(
                MemoryError, ["injected"], lambda opt=opt, c=exchanged: opt.step_chunk(c)
            )
        finally:
            StepContext.orthogonalize = original
        fragments = ["chunk 0", "cannot be replayed", "load_state_dict"]
        problems += expect_raises(
            RuntimeError, fragments, lambda opt=opt, c=exchanged: opt.step_chunk(c)
        )
        problems += expect_raises(RuntimeError, fragments, opt.step)
        opt.load_state_dict(saved)
        for p, q in zip(params, twin):  # the failed round updated nothing else of note
            p.data.copy_(q.data)
        with issued_collectives() as calls:
            for chunk in opt.chunks():
                opt.step_chunk(chunk)
            ref.step()
        problems += pairing_problems(calls, f"offload={offload}")
        for k, (p, q) in enumerate(zip(params, twin)):
            a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (p, q))
            if not torch.equal(a, b):
                problems.append(f"offload={offload}: param {k} differs after the restore")
    fail_on(problems)


# ------------------------------------------------------------------ empty expert stacks (5)

# Expert stacks with fewer experts than the mesh dim that shards them: some replicas (or some
# shard ranks) hold none, beside weights replicated over the same dims.
EMPTY_STACK_SPECS_2X2 = [
    [Spec((1, 6, 5), (S0, S1), "2d"), Spec((6, 5), (R, S0), "2d")],
    [Spec((1, 6, 5), (S0, R), "2d"), Spec((6, 5), (R, S0), "2d"), Spec((4, 7), (R, S1), "2d")],
    [Spec((1, 6, 5), (S0, S0), "2d"), Spec((6, 5), (R, S0), "2d"), Spec((5, 5), (R, R), "2d")],
    [Spec((1, 6, 5), (R, S0), "2d"), Spec((6, 5), (R, S0), "2d")],
    # Replicated over different mesh dims, local batches: split_replicas must give each
    # replica group its own balance (one shared by size differed between ranks).
    [Spec((1, 6, 5), (S0, R), "2d"), Spec((2, 6, 5), (R, S0), "2d"), Spec((3, 4), (R, R), "2d")],
    [Spec((3, 6, 5), (S0, S0), "2d"), Spec((6, 5), (R, S1), "2d"), Spec((1, 4, 4), (S1, S0), "2d")],
]


@case("expert_stacks_empty_on_some_replicas_at_8_bitwise", (8,))
@case("expert_stacks_empty_on_some_replicas_bitwise", (4,))
def _empty_stacks(ctx: Context) -> None:
    """Before: refused as "ranks disagree" (a replica's digest described its shard group by
    ranks), or a crash planning an empty stack with ``split_replicas``; now bitwise like one
    process, and the collectives pair up."""
    problems = []
    if ctx.world_size == 8:  # 2 replicas x 4 shards: 3 experts leave one shard rank empty
        mesh = DeviceMesh("cpu", torch.arange(8).reshape(2, 4), mesh_dim_names=("rep", "shard"))
        ctx = replace(ctx, mesh_2d=mesh)
        layouts = [
            [Spec((3, 6, 5), (R, S0), "2d"), Spec((6, 5), (R, S0), "2d")],
            [Spec((1, 6, 5), (S0, S0), "2d"), Spec((9, 5), (R, S1), "2d")],
            [Spec((2, 6, 5), (S0, S1), "2d"), Spec((6, 5), (R, R), "2d")],
        ]
    else:
        layouts = EMPTY_STACK_SPECS_2X2
    for k, specs in enumerate(layouts):
        for kwargs in ({}, {"split_replicas": True}, {"workspace_bytes": 1000}):
            problems += compare(ctx, specs, f"layout {k} {specs} {kwargs}", seed=k, **kwargs)
    fail_on(problems)


# ------------------------------------------------------------------ Newton–Schulz engines


@case("gram_and_fp16_iterations_bitwise_with_one_process", (2, 3))
def _engines(ctx: Context) -> None:
    """Each engine on both sides (the owner runs it): bitwise like one process, and the
    collectives pair up. A one-byte budget makes every Newton–Schulz call one matrix on
    both sides (local stacks are cut to one; an owner gets one matrix of each batch), so the
    batched kernels are the same; the guard's verdicts are per matrix."""
    problems = []
    for label, kwargs in (
        ("gram", {"newton_schulz_impl": "gram"}),
        ("gram fp16", {"newton_schulz_impl": "gram", "newton_schulz_dtype": "float16"}),
        ("folded fp32, guarded", {"newton_schulz_impl": "folded",
                                  "newton_schulz_dtype": "float32", "newton_schulz_guard": True}),
    ):  # fmt: skip
        problems += compare(ctx, ONE_DIM_SPECS, label, steps=2, workspace_bytes=1, **kwargs)
    fail_on(problems)
