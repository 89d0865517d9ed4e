"""Edge cases of warm-up, the groups this package makes and the overlapped step's waits,
in gloo worlds (run by ``tests/runtime/test_groups_and_warmup.py``).

Every case compares with something independent of what it attacks: the sequential
(non-overlapped) step of a twin model, or the same ``Muon`` on plain single-process tensors.
A case that may leave its world out of step (a hang, a collective that pairs with another
rank's different one) is ``RISKY`` and runs in a world of its own with a short collective
timeout, so that a hang fails the case instead of the suite.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_checks import (
    S0,
    S1,
    Context,
    Spec,
    assert_same_local_optimizers,
    compare_with_single,
    fail_on,
    make_context,
    make_optimizer,
    place,
    random_tensors,
    set_placed_random_grads,
)
from dist_overlap_cases import PauseAfterEachChunk, _optimizer, _train
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate

from shardmuon import Muon

R2 = Replicate()

__all__ = ["CALLABLES", "CASES", "RISKY", "make_context"]

# name -> (case, world size). CASES share one world; each RISKY case gets its own.
CASES: dict[str, tuple[Callable[[Context], None], int]] = {}
RISKY: dict[str, tuple[Callable[[Context], None], int]] = {}


def case(name: str, size: int, risky: bool = False):
    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        (RISKY if risky else CASES)[name] = (fn, size)
        return fn

    return register


# ------------------------------------------------- FSDP2: one unit over several modules


def _grouped_unit_model() -> nn.Module:
    """Four bias-free layers of four shapes (four batches, in this order); layers 1 and 3
    will be one FSDP2 unit (``fully_shard([model[1], model[3]])``)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 24, bias=False),
        nn.Linear(24, 20, bias=False),
        nn.Tanh(),
        nn.Linear(20, 24, bias=False),
        nn.Linear(24, 4, bias=False),
    )


def _shard_grouped(mesh) -> Callable[[nn.Module], nn.Module]:
    def wrap(model: nn.Module) -> nn.Module:
        fully_shard(model[0], mesh=mesh)
        fully_shard([model[1], model[3]], mesh=mesh)  # one unit, one all-gather
        fully_shard(model[4], mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return wrap


@case("grouped_fsdp2_unit_waits_for_all_its_modules", 2)
def grouped_fsdp2_unit_waits_for_all_its_modules(ctx: Context) -> None:
    """``fully_shard([a, b])`` (FSDP2's grouping, what it asks for tied weights) makes one
    unit whose first module's pre-forward all-gathers the parameters of both. The overlap's
    hook on ``a`` waits only for ``a``'s own parameters (``ReadMap.own``), so the all-gather
    reads ``b``'s shard before the background step has written it: the forward computes with
    ``b``'s old weights. Right: every forward sees the updated weights (losses bitwise those
    of the sequential step); the hook on any module of a grouped unit waits for the
    parameters of every module of that unit (``state._modules``)."""
    wrap = _shard_grouped(ctx.mesh)
    plain, overlapped = wrap(_grouped_unit_model()), wrap(_grouped_unit_model())
    a = Muon(list(plain.parameters()), lr=0.02, weight_decay=0.1)
    b = Muon(list(overlapped.parameters()), lr=0.02, weight_decay=0.1, overlap="forward")
    b.overlap_with(overlapped)
    losses_a = _train(ctx, plain, a, range(4))
    with PauseAfterEachChunk(0.05):
        losses_b = _train(ctx, overlapped, b, range(4))
    b.synchronize()
    problems = []
    if losses_a != losses_b:
        problems.append(f"losses differ from the sequential step:\n  {losses_a}\n  {losses_b}")
    try:
        assert_same_local_optimizers(a, list(plain.parameters()), b, list(overlapped.parameters()))
    except AssertionError as err:
        problems.append(f"final state differs: {err}")
    fail_on(problems)


# ------------------------------------------------- pipeline stages and the world gather


@case("overlap_with_a_stage_that_talks_to_nobody", 3, risky=True)
def overlap_with_a_stage_that_talks_to_nobody(ctx: Context) -> None:
    """Two pipeline stages: ranks 0 and 1 shard theirs with FSDP2 over their own group,
    rank 2 holds its stage whole (plain tensors, as DDP or a one-rank stage does); every
    stage's optimizer is overlapped. ``step_process_groups`` gathers every rank's groups
    over the WORLD at a communicating plan's first step, but a plan that talks to nobody
    returns before that gather: ranks 0 and 1 wait in ``all_gather_object`` for rank 2,
    which never comes (the step hangs until the job's collective timeout). Right: each
    stage steps as its sequential twin; no stage-local step waits on another stage."""
    pair = dist.new_group([0, 1])  # every rank calls new_group
    if ctx.rank < 2:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(pair, "cpu")

        def wrap(model: nn.Module) -> nn.Module:
            for block in model:
                fully_shard(block, mesh=mesh)
            return fully_shard(model, mesh=mesh)

    else:

        def wrap(model: nn.Module) -> nn.Module:
            return model

    from dist_overlap_cases import _layers

    plain, overlapped = wrap(_layers()), wrap(_layers())
    a = _optimizer(plain)
    b = _optimizer(overlapped, overlap="forward")
    b.overlap_with(overlapped)
    losses_a = _train(ctx, plain, a, range(3))
    losses_b = _train(ctx, overlapped, b, range(3))
    b.synchronize()
    assert losses_a == losses_b
    assert_same_local_optimizers(a, list(plain.parameters()), b, list(overlapped.parameters()))


@case("overlap_with_one_stage_replanning", 4, risky=True)
def overlap_with_one_stage_replanning(ctx: Context) -> None:
    """2 stages x 2 ranks (``("pp", "dp")``), FSDP2 over each stage's ``dp``, both stages
    overlapped. After two steps stage 0 changes a planned setting of its own optimizer
    (``workspace_bytes``: agreed only among stage 0's ranks, a legitimate per-stage edit);
    stage 1 does not. A new plan makes ``ForwardOverlap.prepare`` call
    ``step_process_groups`` again, a gather over the WORLD, even though the new plan needs no
    new group: stage 0 waits for stage 1, which never joins. Right: stage 0 replans on its
    own (a world collective only when a group is really missing, or none at all), both
    stages keep matching their sequential twins."""
    from dist_overlap_cases import _fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, dp_mesh = mesh.get_local_rank("pp"), mesh["dp"]
    width = 24 if stage == 0 else 16

    def stage_layers() -> nn.Module:
        torch.manual_seed(stage)
        blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(2)]
        return nn.Sequential(nn.Linear(8, width), *blocks, nn.Linear(width, 4))

    wrap = _fully_shard(dp_mesh)
    plain, overlapped = wrap(stage_layers()), wrap(stage_layers())
    a, b = _optimizer(plain), _optimizer(overlapped, overlap="forward")
    b.overlap_with(overlapped)
    losses_a = _train(ctx, plain, a, range(2))
    losses_b = _train(ctx, overlapped, b, range(2))
    if stage == 0:
        for opt in (a, b):
            opt.synchronize()
            opt.workspace_bytes = 1 << 20  # a smaller budget: a new plan
    losses_a += _train(ctx, plain, a, range(2, 4))
    losses_b += _train(ctx, overlapped, b, range(2, 4))
    b.synchronize()
    assert losses_a == losses_b, f"stage {stage}"
    assert_same_local_optimizers(a, list(plain.parameters()), b, list(overlapped.parameters()))


# ------------------------------------------------- warm-up decided per rank


_WARM_SPECS = [Spec((40, 24), (S0,)), Spec((40, 24), (S0,)), Spec((24, 36), (S1,))]


def _warm_pair(ctx: Context, **kwargs) -> tuple[list, Muon, list, Muon]:
    init = random_tensors([s.shape for s in _WARM_SPECS], seed=5)
    twin = [nn.Parameter(place(ctx, s, t)) for s, t in zip(_WARM_SPECS, init)]
    subject = [nn.Parameter(place(ctx, s, t)) for s, t in zip(_WARM_SPECS, init)]
    ref = make_optimizer(twin, _WARM_SPECS, lr=0.02)
    opt = make_optimizer(subject, _WARM_SPECS, lr=0.02, **kwargs)
    return twin, ref, subject, opt


def _same_error_everywhere_or_same_result(ctx, twin, ref, subject, opt, step: int) -> None:
    """Step both; the subject must either raise the same ValueError on every rank or match
    the twin bitwise."""
    set_placed_random_grads(ctx, twin, _WARM_SPECS, 100 + step)
    set_placed_random_grads(ctx, subject, _WARM_SPECS, 100 + step)
    ref.step()
    try:
        opt.step()
        error = None
    except Exception as err:  # any failure is the finding
        error = f"{type(err).__name__}: {err}"
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, error)
    if any(gathered):
        if len(set(gathered)) != 1 or not str(gathered[0]).startswith("ValueError"):
            raise AssertionError(f"the ranks did not refuse alike: {gathered}")
        return
    assert_same_local_optimizers(ref, twin, opt, subject, f"step {step}")


@case("warmup_setting_changed_on_one_rank", 2, risky=True)
def warmup_setting_changed_on_one_rank(ctx: Context) -> None:
    """``warmup_setting`` (what ``Muon(warmup=...)`` stores, and copies keep) is not among
    the agreed settings, and ``_begin_round`` decides per rank whether to warm a new plan's
    groups. Rank 0 turns it on after step 1; then both ranks shrink the budget (a new plan).
    Rank 0's warm-up all-to-all (zeros, the plan's largest piece per peer) pairs with rank
    1's first real all-to-all of the step: rank 1 takes zeros for rank 0's rows, the ranks'
    collectives are shifted by one, the step gives a wrong update or ends in a mismatch or
    a wait. Right: the same agreement error on every rank (warm-up decided together, the
    setting agreed like the others), never a shifted collective."""
    twin, ref, subject, opt = _warm_pair(ctx)
    _same_error_everywhere_or_same_result(ctx, twin, ref, subject, opt, 0)
    if ctx.rank == 0:
        opt.warmup_setting = True
    for o in (ref, opt):
        o.workspace_bytes = 1 << 16
    _same_error_everywhere_or_same_result(ctx, twin, ref, subject, opt, 1)


@case("warmup_argument_given_on_one_rank", 2, risky=True)
def warmup_argument_given_on_one_rank(ctx: Context) -> None:
    """``Muon(..., warmup=True)`` on rank 0, the default (``None``: off on gloo) on rank 1:
    the constructor's warm-up is a collective run before any agreement check, so rank 0's
    all-to-all meets rank 1's first step (its agreement all-reduce) instead. Right: the
    agreement error on every rank at the first step (or both ranks warming), not a
    collective of one kind paired with another of another kind."""
    kwargs = {"warmup": True} if ctx.rank == 0 else {}
    twin, ref, subject, opt = _warm_pair(ctx, **kwargs)
    _same_error_everywhere_or_same_result(ctx, twin, ref, subject, opt, 0)


# ------------------------------------------------- the groups this package makes


@case("flattened_group_after_an_asymmetric_subgroup", 4, risky=True)
def flattened_group_after_an_asymmetric_subgroup(ctx: Context) -> None:
    """The job made one ordinary subgroup of ranks 0 and 1 (``dist.new_group([0, 1])``,
    called by every rank, as torch requires): ranks 0-1 now hold one more group than ranks
    2-3. A matrix sharded over both dims of the 2x2 mesh is exchanged over a group of all
    four ranks that ``_part_group`` makes with ``use_local_synchronization=True``, which
    torch names by the ranks and by how many groups the caller holds: ranks 0-1 and 2-3
    name it differently and wait for each other in different rendezvous. Right: the group
    is made and the step matches the single-process Muon (name the group by something
    every member agrees on, e.g. a counter of the partitions made, or make it with
    ``use_local_synchronization=False`` where every rank of the world plans it)."""
    dist.new_group([0, 1])
    specs = [Spec((32, 24), (S0, S1), "2d")]
    _, problems = compare_with_single(ctx, specs, check_traffic=False, steps=2)
    fail_on(problems)


def _reinit(ctx: Context) -> None:
    """Destroy the default group and make a new one (a file rendezvous every rank learns
    from rank 0 first), with the same short collective timeout."""
    path = [os.path.join(tempfile.mkdtemp(), "rendezvous") if ctx.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    timeout = (
        dist.distributed_c10d._get_default_group()
        ._get_backend(torch.device("cpu"))
        .options._timeout
    )
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{path[0]}",
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timeout if isinstance(timeout, timedelta) else timedelta(seconds=20),
    )


@case("overlap_after_destroy_and_reinit", 2, risky=True)
def overlap_after_destroy_and_reinit(ctx: Context) -> None:
    """A job that tears its process groups down and makes new ones (an elastic restart in
    the same process, or a test suite): ``_STEP_GROUPS`` (the overlapped step's groups, by
    ranks) still holds the destroyed group of ranks (0, 1), and ``step_process_groups``
    hands it to the next overlapped optimizer over the same ranks, whose background step
    then runs on a group torch no longer knows (``destroy_process_group`` called its
    ``shutdown()``: gloo's keeps working on the old store, which is why the losses still
    match here; NCCL's communicator is gone and the step fails). Right: a new world's
    optimizer steps as its sequential twin on groups of the current world (the registries
    keyed by the world they were made in, or dropped when the default group changes)."""
    from dist_overlap_cases import _fully_shard, _layers
    from torch.distributed.device_mesh import init_device_mesh

    first = _fully_shard(ctx.mesh)(_layers())
    opt = _optimizer(first, overlap="forward")
    opt.overlap_with(first)
    _train(ctx, first, opt, range(1))
    opt.synchronize()
    _reinit(ctx)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    wrap = _fully_shard(mesh)
    plain, overlapped = wrap(_layers()), wrap(_layers())
    a, b = _optimizer(plain), _optimizer(overlapped, overlap="forward")
    b.overlap_with(overlapped)
    losses_a = _train(ctx, plain, a, range(2))
    losses_b = _train(ctx, overlapped, b, range(2))
    b.synchronize()
    assert losses_a == losses_b
    assert_same_local_optimizers(a, list(plain.parameters()), b, list(overlapped.parameters()))
    stale = []
    for ranks, group in b.runner.overlap._step_groups.items():
        try:
            dist.get_process_group_ranks(group)
        except (KeyError, ValueError) as err:  # torch no longer knows it
            stale.append(f"{ranks}: {err}")
    assert not stale, f"the overlapped step ran on groups of the destroyed world: {stale}"


@case("flattened_group_after_destroy_and_reinit", 4, risky=True)
def flattened_group_after_destroy_and_reinit(ctx: Context) -> None:
    """As above, for the groups ``_part_group`` makes: ``_MADE_PARTITIONS`` and
    ``_FLATTENED_GROUPS`` outlive ``destroy_process_group``, so a matrix sharded over both
    dims of a new 2x2 mesh is planned over the destroyed group of all four ranks. Right:
    the new world's Muon matches the single-process Muon."""
    from torch.distributed.device_mesh import init_device_mesh

    specs = [Spec((32, 24), (S0, S1), "2d")]
    _, problems = compare_with_single(ctx, specs, check_traffic=False, steps=1)
    fail_on(problems)  # the first world plans over a group of its own: fine
    _reinit(ctx)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fresh = Context(ctx.rank, ctx.world_size, mesh, mesh_2d)
    _, problems = compare_with_single(fresh, specs, check_traffic=False, steps=1)
    fail_on(problems)


@case("warmup_covers_a_second_mesh_over_the_same_ranks", 2)
def warmup_covers_a_second_mesh_over_the_same_ranks(ctx: Context) -> None:
    """Two meshes over the same ranks (a model's, and one another library built over a group
    of its own, ``DeviceMesh.from_group``): two process-group objects, two communicators. ``warm_up`` warms
    ``agreement_groups``, which keeps one group per rank tuple, so the second mesh's group
    is first used inside the step (on NCCL: its communicator set up mid-step, what warm-up
    exists to avoid). Right: every group object the step's all-to-alls run on was warmed."""

    from torch.distributed.device_mesh import DeviceMesh

    from shardmuon.runtime import warmup as warmup_module

    # init_device_mesh hands the same group out twice; a mesh over a group of the job's own
    # (DeviceMesh.from_group) is a second communicator over the same ranks.
    second = DeviceMesh.from_group(dist.new_group(list(range(ctx.world_size))), "cpu")
    assert ctx.mesh.get_group(0) is not second.get_group(0)
    warmup_module._WARMED.clear()
    warmed: list[int] = []
    used: list[int] = []
    original, run = dist.all_to_all_single, warmup_module._run

    def recorded(output, input, *args, group=None, **kwargs):
        used.append(id(group))
        return original(output, input, *args, group=group, **kwargs)

    def warming(group, *args):
        warmed.append(id(group))
        return run(group, *args)

    init = random_tensors([(40, 24), (24, 36)], seed=2)
    p1 = nn.Parameter(_place_on(ctx.mesh, init[0]))
    p2 = nn.Parameter(_place_on(second, init[1]))
    dist.all_to_all_single, warmup_module._run = recorded, warming
    try:
        opt = Muon([p1, p2], lr=0.02, warmup=True)
        p1.grad = _place_on(ctx.mesh, torch.ones(40, 24))
        p2.grad = _place_on(second, torch.ones(24, 36))
        opt.step()  # warms (once the ranks agree), then steps
    finally:
        dist.all_to_all_single, warmup_module._run = original, run
    assert set(used) <= set(warmed), (
        f"the step's all-to-alls ran on {len(set(used) - set(warmed))} group object(s) "
        f"warm-up never touched (warmed {len(set(warmed))}, used {len(set(used))})"
    )


def _place_on(mesh, full_tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full_tensor.clone(), mesh, [S0])


@case("hsdp_split_replicas_warm_overlapped_uneven", 4)
def hsdp_split_replicas_warm_overlapped_uneven(ctx: Context) -> None:
    """HSDP with ``split_replicas``, uneven and empty shards, warm-up forced on: every rank
    warms the same groups in the same order (replica groups get a broadcast); the step is
    the single-process Muon's, and the overlapped step is bitwise the sequential one."""
    specs = [
        Spec((13, 7), (R2, S0), "2d"),
        Spec((1, 9), (R2, S0), "2d"),
        Spec((24, 40), (R2, S0), "2d"),
        Spec((4, 16, 24), (S0, S1), "2d"),
    ]
    _, problems = compare_with_single(
        ctx, specs, check_traffic=False, steps=2, split_replicas=True, warmup=True
    )
    init = random_tensors([s.shape for s in specs], seed=3)
    plain = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    overlapped = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    a = make_optimizer(plain, specs, split_replicas=True)
    b = make_optimizer(overlapped, specs, split_replicas=True, warmup=True, overlap="forward")
    for step in range(3):
        set_placed_random_grads(ctx, plain, specs, 100 + step)
        set_placed_random_grads(ctx, overlapped, specs, 100 + step)
        a.step()
        b.step()
    b.synchronize()
    try:
        assert_same_local_optimizers(a, plain, b, overlapped, "overlapped")
    except AssertionError as err:
        problems.append(str(err))
    fail_on(problems)


# What the harness looks cases up in (``"dist_groups_warmup_cases:CALLABLES"``): name -> case.
CALLABLES: dict[str, Callable[[Context], None]] = {
    name: fn for registry in (CASES, RISKY) for name, (fn, _) in registry.items()
}
