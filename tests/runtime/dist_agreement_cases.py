"""Ranks that disagree: each case makes the ranks of a gloo world inconsistent on purpose.

Every case expects a clear error on every rank that shares the inconsistency (no abort, no
hang: the harness's collective timeout turns a hang into a failure), no all-to-all before
it, and nothing changed (parameters, momentum, step counters). Kept apart from
``dist_cases`` (own registry, own worlds) so that a regression here cannot take the layout
cases down with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from dist_cases import counting_all_reduce, expect_raises
from dist_checks import (
    S0,
    S1,
    Context,
    R,
    Spec,
    counting_all_to_all,
    fail_on,
    full,
    make_context,
    make_optimizer,
    place,
    random_tensors,
    set_placed_constant_grads,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from shardmuon import Muon
from shardmuon.planning.placements import local_tensor

__all__ = ["CASES", "make_context"]

CASES: dict[str, Callable[[Context], None]] = {}
WORLDS: dict[str, tuple[int, ...]] = {}
DISAGREE = "disagree on the Muon step"
GRADS_DISAGREE = "disagree on which Muon parameters have a grad"


def case(name: str, worlds: tuple[int, ...] = (2, 3)):
    def register(fn):
        CASES[name] = fn
        WORLDS[name] = worlds
        return fn

    return register


def cases_for(world_size: int) -> list[str]:
    return [name for name, worlds in WORLDS.items() if world_size in worlds]


def _build(ctx: Context, specs: list[Spec], seed: int = 0, **kwargs):
    init = random_tensors([s.shape for s in specs], seed)
    params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    return params, make_optimizer(params, specs, **kwargs)


def _expect_refused(ctx: Context, opt: Muon, params, fragments: list[str]) -> list[str]:
    """``opt.step()`` raises ValueError with ``fragments`` before any all-to-all; no change.

    Compares local shards (no collective: ranks that disagree on placements must not be
    asked to all-gather together).
    """
    before = [local_tensor(p).clone() for p in params]
    momenta = [local_tensor(opt.state[p]["momentum"]).clone() for p in params]
    steps = [g["step"] for g in opt.param_groups]
    with counting_all_to_all() as calls:
        problems = expect_raises(ValueError, fragments, opt.step)
    if calls:
        problems.append(f"{len(calls)} all-to-alls ran before the error")
    if any(not torch.equal(local_tensor(p), b) for p, b in zip(params, before)):
        problems.append("parameters changed by a refused step")
    if any(
        not torch.equal(local_tensor(opt.state[p]["momentum"]), m) for p, m in zip(params, momenta)
    ):
        problems.append("momentum changed by a refused step")
    if [g["step"] for g in opt.param_groups] != steps:
        problems.append("step counters advanced by a refused step")
    return problems


def _last(ctx: Context) -> bool:
    return ctx.rank == ctx.world_size - 1


@case("replicated_split_extra_weight")
def _replicated_extra(ctx: Context) -> None:
    specs = [Spec((8, 6), (R,))] * 2 + [Spec((6, 6), (R,))] * _last(ctx)
    params, opt = _build(ctx, specs, split_replicas=True)
    set_placed_constant_grads(ctx, params, specs)
    fail_on(_expect_refused(ctx, opt, params, [DISAGREE]))


@case("replicated_split_different_shapes")
def _replicated_shapes(ctx: Context) -> None:
    specs = [Spec((8, 6), (R,)), Spec((7, 6) if _last(ctx) else (6, 6), (R,))]
    params, opt = _build(ctx, specs, split_replicas=True)
    set_placed_constant_grads(ctx, params, specs)
    fail_on(_expect_refused(ctx, opt, params, [DISAGREE, "7x6 matrices", "6x6 matrices"]))


@case("replicated_split_grad_missing_on_one_rank")
def _replicated_grad(ctx: Context) -> None:
    specs = [Spec((8, 6), (R,))] * 3
    params, opt = _build(ctx, specs, split_replicas=True)
    set_placed_constant_grads(ctx, params, specs, skip={1} if ctx.rank == 0 else set())
    fail_on(_expect_refused(ctx, opt, params, [GRADS_DISAGREE]))


@case("hsdp_split_grads_on_one_replica_only", (4,))
def _hsdp_one_replica(ctx: Context) -> None:
    specs = [Spec((8, 6), (R, S0), "2d")] * 2
    params, opt = _build(ctx, specs, split_replicas=True)
    first_replica = ctx.rank < 2
    set_placed_constant_grads(ctx, params, specs, skip=set() if first_replica else {0, 1})
    fail_on(_expect_refused(ctx, opt, params, [GRADS_DISAGREE]))


def _setting_case(name: str, named: str, **per_rank) -> None:
    """The last rank builds its optimizer with ``per_rank`` settings, the others default; the
    error names the setting (``named``) and the last rank's value."""

    @case(name)
    def run(ctx: Context) -> None:
        specs = [Spec((8, 6), (S0,)), Spec((10, 6), (S0,))]
        kwargs = per_rank if _last(ctx) else {}
        params, opt = _build(ctx, specs, **kwargs)
        set_placed_constant_grads(ctx, params, specs)
        last = ctx.world_size - 1
        fail_on(_expect_refused(ctx, opt, params, [DISAGREE, f"{named} (", f"rank {last}: "]))


_setting_case("per_rank_lr", "lr", lr=0.02)
_setting_case("per_rank_epsilon", "epsilon", epsilon=1e-7)
_setting_case("per_rank_weight_decay", "weight_decay", weight_decay=0.1)
_setting_case("per_rank_nesterov", "nesterov", nesterov=True)
_setting_case("per_rank_adjust_lr", "adjust_lr", adjust_lr="rms_norm")
_setting_case("per_rank_update_rms", "update_rms", adjust_lr="rms_norm", update_rms=0.3)
_setting_case("per_rank_max_in_flight", "max_in_flight", max_in_flight=1)
_setting_case("per_rank_coefficients", "coefficients", newton_schulz_coefficients="keller")
_setting_case("per_rank_check_grads", "check_grads", check_grads="always")
_setting_case("per_rank_overlap", "overlap", overlap="forward")


@case("per_rank_matrix_partitions")
def _per_rank_partitions(ctx: Context) -> None:
    specs = [Spec((8, 6), (S0,), partitions=(4, 4) if _last(ctx) else None)]
    params, opt = _build(ctx, specs)
    set_placed_constant_grads(ctx, params, specs)
    fail_on(_expect_refused(ctx, opt, params, [DISAGREE, "matrix_partitions ("]))


@case("replicate_on_one_rank_shard_on_others")
def _replicate_vs_shard(ctx: Context) -> None:
    specs = [Spec((8, 6), (R,) if ctx.rank == 0 else (S0,))]
    params, opt = _build(ctx, specs)
    set_placed_constant_grads(ctx, params, specs)
    fail_on(_expect_refused(ctx, opt, params, [DISAGREE]))


@case("add_param_group_differs_after_step_1")
def _add_group_later(ctx: Context) -> None:
    specs = [Spec((8, 6), (S0,))]
    params, opt = _build(ctx, specs)
    set_placed_constant_grads(ctx, params, specs)
    opt.step()
    extra_spec = Spec((9, 6) if _last(ctx) else (5, 6), (S0,))
    extra = nn.Parameter(place(ctx, extra_spec, torch.zeros(extra_spec.shape)))
    opt.add_param_group({"params": [extra], "algorithm": "muon"})
    set_placed_constant_grads(ctx, [*params, extra], [*specs, extra_spec])
    fail_on(_expect_refused(ctx, opt, [*params, extra], [DISAGREE]))


@case("grad_missing_after_step_1_with_check_always")
def _grad_later(ctx: Context) -> None:
    specs = [Spec((8, 6), (S0,)), Spec((10, 6), (S0,))]
    params, opt = _build(ctx, specs, check_grads="always")
    set_placed_constant_grads(ctx, params, specs)
    opt.step()
    set_placed_constant_grads(ctx, params, specs, skip={1} if ctx.rank == 0 else set())
    fail_on(_expect_refused(ctx, opt, params, [GRADS_DISAGREE]))


@case("check_cost_one_all_reduce_per_group_then_two_elements")
def _check_cost(ctx: Context) -> None:
    """First step: one 5-element all-reduce per group (the full check); later steps (default):
    one 2-element all-reduce per group (the live settings' digest)."""
    specs = [Spec((8, 6), (S0,)), Spec((10, 6), (S0,))]
    params, opt = _build(ctx, specs)
    set_placed_constant_grads(ctx, params, specs)
    with counting_all_reduce() as first:
        opt.step()
    with counting_all_reduce() as second:
        opt.step()
    problems = []
    if first != [5]:
        problems.append(f"first step all-reduces {first}, expected one of 5 elements")
    if second != [2]:
        problems.append(f"second step all-reduces {second}, expected one of 2 elements")
    fail_on(problems)


def _edited_case(name: str, named: str, edit: Callable[[Muon], None], **kwargs) -> None:
    """After ``steps`` agreed steps the last rank alone applies ``edit``: the next step raises
    the agreement error naming ``named`` on every rank, before any all-to-all, changing
    nothing (never a divergence, an abort or a wait until the timeout)."""

    for steps in (1, 2):

        @case(f"{name}_after_step_{steps}")
        def run(ctx: Context, steps: int = steps) -> None:
            specs = [Spec((8, 6), (S0,)), Spec((10, 6), (S0,)), Spec((6,), (S0,))]
            init = random_tensors([s.shape for s in specs], 0)
            params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
            groups = [
                {"params": params[:2], "algorithm": "muon"},
                {"params": params[2:], "algorithm": "adamw", "lr": 0.001},
            ]
            fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            opt = Muon(groups, **{"lr": 0.02, **fresh})
            set_placed_constant_grads(ctx, params, specs)
            for _ in range(steps):
                opt.step()
            if _last(ctx):
                edit(opt)
            fail_on(_expect_refused(ctx, opt, params, [DISAGREE, f"{named} ("]))


def _set_group(index: int, key: str, value) -> Callable[[Muon], None]:
    return lambda opt: opt.param_groups[index].__setitem__(key, value)


def _set_attribute(name: str, value) -> Callable[[Muon], None]:
    return lambda opt: setattr(opt, name, value)


_edited_case("edited_lr_on_one_rank", "lr", _set_group(0, "lr", 0.03))
_edited_case("edited_adamw_lr_on_one_rank", "lr", _set_group(1, "lr", 0.002))
_edited_case("edited_beta2_on_one_rank", "beta2", _set_group(1, "beta2", 0.9))
_edited_case("edited_invalid_lr_on_one_rank", "lr", _set_group(0, "lr", -1.0))
_edited_case("edited_adjust_lr_on_one_rank", "adjust_lr", _set_group(0, "adjust_lr", "rms_norm"))
_edited_case("edited_momentum_alias_on_one_rank", "momentum", _set_group(0, "momentum", 0.5))
_edited_case(
    "edited_tensor_lr_on_one_rank",
    "lr",
    lambda opt: opt.param_groups[0]["lr"].fill_(0.05),
    lr=torch.tensor(0.02),
)
_edited_case(
    "edited_impl_on_one_rank", "newton_schulz_impl", _set_attribute("newton_schulz_impl", "gram")
)
_edited_case("edited_budget_on_one_rank", "workspace_bytes", _set_attribute("workspace_bytes", 64))
_edited_case("edited_rotation_on_one_rank", "rotate_owners", _set_attribute("rotate_owners", False))
_edited_case(
    "edited_check_grads_on_one_rank", "check_grads", _set_attribute("check_grads", "never")
)
_edited_case("edited_overlap_on_one_rank", "overlap", _set_attribute("overlap", "forward"))
_edited_case("edited_in_flight_on_one_rank", "max_in_flight", _set_attribute("max_in_flight", 1))
# (An invalid value, 7, is refused at the assignment, on the rank that makes it.)
_edited_case(
    "edited_ns_dtype_on_one_rank",
    "newton_schulz_dtype",
    _set_attribute("newton_schulz_dtype", torch.float32),
)


@case("edited_mid_round_on_one_rank_applies_at_the_next_round")
def _mid_round(ctx: Context) -> None:
    """The last rank edits lr (and a planned key) between two communicating chunks of a
    step_chunk round: the round finishes with the settings it opened with on every rank
    (bitwise the reference step), and the next round raises the agreement error on all."""
    specs = [Spec((8, 6), (S0,)), Spec((10, 6), (S0,))]
    params, opt = _build(ctx, specs)
    reference_params, reference = _build(ctx, specs)
    set_placed_constant_grads(ctx, params, specs)
    set_placed_constant_grads(ctx, reference_params, specs)
    chunks = opt.chunks()
    opt.step_chunk(chunks[0])
    if _last(ctx):
        opt.param_groups[0]["lr"] = 0.5
        opt.param_groups[0]["adjust_lr"] = "rms_norm"
    for chunk in opt.chunks()[1:]:
        opt.step_chunk(chunk)
    reference.step()
    problems = [
        f"param {i} differs from the reference step"
        for i, (p, q) in enumerate(zip(params, reference_params))
        if not torch.equal(full(p), full(q))
    ]
    with counting_all_to_all() as calls:
        problems += expect_raises(ValueError, [DISAGREE, "lr ("], lambda: opt.step_chunk(chunks[0]))
    if calls:
        problems.append(f"{len(calls)} all-to-alls ran before the error")
    fail_on(problems)


@case("hsdp_edit_on_one_rank_stops_every_rank", (4,))
def _hsdp_every_rank(ctx: Context) -> None:
    """HSDP 2x2: rank 0 differs (from the start, then after step 1); rank 3 shares no
    process group with it, yet stops too instead of waiting in its all-to-all for rank 2."""
    specs = [Spec((8, 6), (R, S0), "2d"), Spec((10, 6), (R, S0), "2d")]
    problems = []
    for when in ("first step", "after step 1"):
        lr = 0.05 if ctx.rank == 0 and when == "first step" else 0.02
        params, opt = _build(ctx, specs, lr=lr)
        set_placed_constant_grads(ctx, params, specs)
        if when == "after step 1":
            opt.step()
            if ctx.rank == 0:
                opt.param_groups[0]["lr"] = 0.05
        expected = [DISAGREE] if ctx.rank != 3 else ["ranks this one shares no process group"]
        problems += [f"{when}: {p}" for p in _expect_refused(ctx, opt, params, expected)]
    fail_on(problems)


@case("the_same_values_held_differently_are_not_a_disagreement")
def _same_values(ctx: Context) -> None:
    """After step 1 the last rank holds the same settings as other types (0 for 0.0, a
    numpy float, the preset's name for its triples), and every rank holds a plain tensor of
    its own shape (rank-local experts): later steps pass, bitwise the reference."""
    import numpy as np

    specs = [Spec((8, 6), (S0,)), Spec((10, 6), (S0,))]

    def build(seed: int):
        params, _ = _build(ctx, specs, seed=seed)
        own = nn.Parameter(torch.ones(ctx.rank + 1, 4, 4))
        opt = Muon([*params, own], lr=0.02, weight_decay=0.0)
        set_placed_constant_grads(ctx, params, specs)
        own.grad = torch.ones_like(own)
        return [*params, own], opt

    params, opt = build(0)
    reference_params, reference = build(0)
    problems = []
    opt.step()
    reference.step()
    if _last(ctx):
        opt.param_groups[0]["weight_decay"] = -0.0
        opt.param_groups[0]["lr"] = np.float64(0.02)
        opt.coefficients = "dion"
    for _ in range(2):
        try:
            opt.step()
        except ValueError as err:
            problems.append(f"refused: {err}")
            break
        reference.step()
    differ = [
        i
        for i, (p, q) in enumerate(zip(params, reference_params))
        if not torch.equal(
            full(p) if isinstance(p, DTensor) else p, full(q) if isinstance(q, DTensor) else q
        )
    ]
    if differ:
        problems.append(f"params {differ} differ from the reference")
    fail_on(problems)


@case("stages_holding_other_kinds_of_group_step_together", (4,))
def _stages(ctx: Context) -> None:
    """Every rank holds Q on the world mesh; ranks 0-1 also hold a sharded and a replicated
    parameter on mesh [0, 1], ranks 2-3 a sharded one on [2, 3]: their own counts of how
    often to pass a verdict on differ, the world group agrees on one. Three steps, Q bitwise
    one process (before, every rank waited in the check until the timeout)."""
    from torch.distributed.tensor import Replicate

    world = DeviceMesh("cpu", torch.arange(4))
    first, second = DeviceMesh("cpu", torch.tensor([0, 1])), DeviceMesh("cpu", torch.tensor([2, 3]))
    gen = torch.Generator().manual_seed(0)
    q_full, p_full, r_full = (torch.randn(8, 8, generator=gen) for _ in range(3))
    q = nn.Parameter(distribute_tensor(q_full, world, [S0]))
    if ctx.rank < 2:
        mine = [
            nn.Parameter(distribute_tensor(p_full, first, [S0])),
            nn.Parameter(distribute_tensor(p_full[:6], first, [Replicate()])),
        ]
    else:
        mine = [nn.Parameter(distribute_tensor(r_full, second, [S0]))]
    opt = Muon([q, *mine], lr=0.02, newton_schulz_impl="per-matrix")
    reference = nn.Parameter(q_full.clone())
    reference_opt = Muon([reference], lr=0.02, newton_schulz_impl="per-matrix")
    problems = []
    for step in range(3):
        gen = torch.Generator().manual_seed(10 + step)
        grad = torch.randn(8, 8, generator=gen)
        q.grad, reference.grad = distribute_tensor(grad, world, [S0]), grad.clone()
        for p in mine:
            p.grad = distribute_tensor(
                torch.randn(p.shape, generator=gen), p.device_mesh, p.placements
            )
        opt.step()
        reference_opt.step()
        if not torch.equal(full(q), reference.detach()):
            problems.append(f"step {step + 1}: Q differs from one process")
    fail_on(problems)


@case("a_backend_without_collectives_for_the_device_is_refused_at_construction", (2,))
def _backend(ctx: Context) -> None:
    """CPU shards exchanged over an NCCL-only group (FSDP2's CPU offload on a GPU job) would
    fail inside the step's all-to-all: refused on every rank when the optimizer is built,
    naming the group and the backend. A backend per device, or gloo, is accepted."""
    import shardmuon.runtime.exchange as exchange

    specs = [Spec((8, 6), (S0,))]
    original = exchange.dist.get_backend
    problems = []
    try:
        exchange.dist.get_backend = lambda group=None: "nccl"
        problems += expect_raises(
            ValueError,
            ["process group [0, 1]", "backend 'nccl' has no cpu collectives"],
            lambda: _build(ctx, specs),
        )
        exchange.dist.get_backend = lambda group=None: "cpu:gloo,cuda:nccl"
        _build(ctx, specs)
    finally:
        exchange.dist.get_backend = original
    params, opt = _build(ctx, specs)
    set_placed_constant_grads(ctx, params, specs)
    opt.step()
    fail_on(problems)


@case("same_edit_on_every_rank_steps_as_built_so")
def _same_edit(ctx: Context) -> None:
    """Planned and live settings changed alike on every rank after step 1: no error, and the
    next steps are bitwise those of an optimizer built with the new settings' state."""
    specs = [Spec((8, 6), (S0,)), Spec((10, 6), (S0,))]
    params, opt = _build(ctx, specs)
    reference_params, reference = _build(ctx, specs)
    for p, q in ((params, opt), (reference_params, reference)):
        set_placed_constant_grads(ctx, p, specs)
        q.step()
    opt.workspace_bytes, opt.newton_schulz_impl = 1024, "per-matrix"
    opt.param_groups[0]["lr"] = 0.03
    reference.workspace_bytes, reference.newton_schulz_impl = 1024, "per-matrix"
    reference.param_groups[0]["lr"] = 0.03
    for _ in range(2):
        opt.step()
        reference.step()
    differ = [
        i
        for i, (p, q) in enumerate(zip(params, reference_params))
        if not torch.equal(full(p), full(q))
    ]
    fail_on([f"params {differ} differ from the reference"] if differ else [])


@case("step_chunk_out_of_order_raises_before_any_collective")
def _chunk_order(ctx: Context) -> None:
    specs = [Spec((8, 6), (S0,)), Spec((10, 6), (S0,)), Spec((12, 6), (S0,))]
    params, opt = _build(ctx, specs)
    reference_params, reference = _build(ctx, specs)
    set_placed_constant_grads(ctx, params, specs)
    set_placed_constant_grads(ctx, reference_params, specs)
    chunks = opt.chunks()
    problems = []
    if ctx.rank == 0:  # only rank 0 tries the wrong order; it must refuse locally
        with counting_all_to_all() as calls:
            problems += expect_raises(
                RuntimeError,
                ["must be stepped in the order of chunks()"],
                lambda: opt.step_chunk(chunks[-1]),
            )
        if calls:
            problems.append(f"{len(calls)} all-to-alls ran before the error")
    for chunk in chunks:  # then every rank steps in order: the collectives pair up
        opt.step_chunk(chunk)
    reference.step()
    if any(not torch.equal(full(p), full(q)) for p, q in zip(params, reference_params)):
        problems.append("chunked round after the refused call differs from step()")
    fail_on(problems)


@case("param_on_a_sub_mesh_without_this_rank", (3,))
def _sub_mesh(ctx: Context) -> None:
    sub = DeviceMesh("cpu", torch.tensor([0, 1]))
    weight = nn.Parameter(distribute_tensor(torch.zeros(4, 4), sub, [S0], src_data_rank=None))
    problems = []
    if ctx.rank == 2:
        problems += expect_raises(
            ValueError,
            ["does not include this rank (2)", "group 0 param 0"],
            lambda: Muon([{"params": [weight], "algorithm": "muon"}]),
        )
    dist.barrier()
    fail_on(problems)


@case("warmup_covers_replicate_groups", (4,))
def _warmup(ctx: Context) -> None:
    specs = [Spec((8, 6), (R, S0), "2d")]
    _, opt = _build(ctx, specs)
    with counting_all_to_all() as calls:
        opt.warmup()
    groups = sorted({c.ranks for c in calls})
    mine = [g for g in ((0, 1), (2, 3), (0, 2), (1, 3)) if ctx.rank in g]
    fail_on([] if groups == sorted(mine) else [f"warmup ran on {groups}, expected {mine}"])


# ------------------------------------------------------------- bitwise claims


def _distributed_vs_single(ctx: Context, shape, placements, dtype, count: int = 3):
    """Two steps of the same Muon on DTensors and on plain tensors; the full results."""
    init = [t.to(dtype) for t in random_tensors([shape] * count, 11)]
    grads = [t.to(dtype) for t in random_tensors([shape] * count, 12)]
    spec = Spec(shape, placements)
    sharded = [nn.Parameter(place(ctx, spec, t)) for t in init]
    plain = [nn.Parameter(t.clone()) for t in init]
    opts = [Muon(sharded, lr=0.02, weight_decay=0.1), Muon(plain, lr=0.02, weight_decay=0.1)]
    for _ in range(2):
        for p, g in zip(sharded, grads):
            p.grad = place(ctx, spec, g)
        for p, g in zip(plain, grads):
            p.grad = g.clone()
        for opt in opts:
            opt.step()
    return [full(p) for p in sharded], [p.detach() for p in plain], init


@case("bitwise_bf16_weights_shard1", (3,))
def _bitwise_bf16(ctx: Context) -> None:
    """bf16 (5, 16) weights sharded on dim 1 over 3 ranks (local lengths 6, 6, 4)."""
    sharded, plain, _ = _distributed_vs_single(ctx, (5, 16), (S1,), torch.bfloat16)
    differ = [i for i, (a, b) in enumerate(zip(sharded, plain)) if not torch.equal(a, b)]
    fail_on([f"bf16 params {differ} differ from one process"] if differ else [])


# With more than one thread per rank a matrix computed alone (``mm`` on its owner) and inside
# a stack (``bmm`` in one process) may round differently: not bitwise, but within bf16 noise.
TWO_THREADS_UPDATE_RTOL = 0.02


@case("two_threads_per_rank_within_bf16_noise", (2,))
def _two_threads(ctx: Context) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sharded, plain, init = _distributed_vs_single(ctx, (96, 1024), (S0,), torch.float32)
    finally:
        torch.set_num_threads(threads)
    problems = []
    for i, (a, b, x0) in enumerate(zip(sharded, plain, init)):
        update = (b - x0).norm()
        distance = (a - b).norm() / update
        if distance > TWO_THREADS_UPDATE_RTOL:
            problems.append(
                f"param {i}: update differs by {distance:.4f} (> {TWO_THREADS_UPDATE_RTOL})"
            )
    fail_on(problems)
