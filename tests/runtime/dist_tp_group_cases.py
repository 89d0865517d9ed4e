"""The process groups of two-dimensional shards (issue #13): one group per dp x tp rank set,
a user's flattened mesh reused, pipeline-like stages without TP taking no part in another
stage's group, and ranks that disagree on their pieces all raising. Part of ``dist_tp_cases``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from dist_cases import expect_raises
from dist_checks import S0, S1, R, Spec, fail_on, place, random_tensors
from dist_tp_checks import SS0, WORLD4, WORLD8, TPContext, tp_registry
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor

from shardmuon import Muon
from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.placements import local_tensor

CASES, TRAFFIC_CASES, case = tp_registry()


def _exchange_groups(opt: Muon) -> list:
    return [c.layout.group for c in opt.chunks() if isinstance(c, MuonBatch) and c.layout.exchanged]


@case("flattened_group_reused", WORLD4, traffic=False)
def _flattened_group_reused(ctx: TPContext) -> None:
    """Two optimizers over the same dp x tp ranks share one group; once the user has
    flattened the mesh (``mesh["dp", "tp"]._flatten()``, as torchtitan does), a new
    optimizer exchanges over that flattened mesh's group instead of making another."""
    spec = Spec((12, 8), (S0, S1), "2d")
    full_weight = random_tensors([spec.shape], 5)[0]
    groups = []
    for _ in range(2):
        weight = nn.Parameter(place(ctx, spec, full_weight))
        groups += _exchange_groups(Muon([weight]))
    problems = []
    if len({id(g.process_group) for g in groups}) != 1:
        problems.append("two optimizers over the same ranks made two groups")
    flat = ctx.meshes["2d"]._flatten()
    weight = nn.Parameter(place(ctx, spec, full_weight))
    (group,) = set(_exchange_groups(Muon([weight])))
    if group.process_group is not flat.get_group(0):
        problems.append("the user's flattened mesh was not reused")
    if group.ranks != tuple(flat.mesh.flatten().tolist()):
        problems.append(f"group ranks {group.ranks} != the flattened mesh's")
    fail_on(problems)


@case("stages_without_tp_take_no_part", WORLD8, traffic=False)
def _stages(ctx: TPContext) -> None:
    """Like pipeline stages: on a ("pp", "dp", "tp") mesh whose stages are ranks 0, 2, 4, 6
    and 1, 3, 5, 7 (rank sets no earlier case flattened), stage 0 holds FSDP-over-TP weights
    and stage 1 only 1-D ones. Only stage 0 makes its dp x tp group (no rank waits for the
    other stage), and each stage steps bitwise like one process.

    With the world group bound to a device (``init_process_group(device_id=...)``, stood in
    for on gloo while the optimizers plan and step): torch would make each new group by
    splitting the world's communicator, which every world rank must call, so stage 0's
    group, made by stage 0 alone, would wait forever on NCCL. No group may be made that way."""
    world = dist.distributed_c10d._get_default_group()
    original, split_by_members = dist.new_group, []

    def new_group(ranks=None, *args, **kwargs):
        local = kwargs.get("use_local_synchronization", False)
        bound = getattr(world, "bound_device_id", None)
        if local and bound is not None:
            split_by_members.append(tuple(ranks))  # an ncclCommSplit some ranks never join
            world.bound_device_id = None  # made anyway, so that the case reports it
            try:
                return original(ranks, *args, **kwargs)
            finally:
                world.bound_device_id = bound
        return original(ranks, *args, **kwargs)

    @contextlib.contextmanager
    def bound_world():  # around the optimizer's work only (gloo makes no groups while bound)
        world.bound_device_id = torch.device("cpu", 0)
        dist.new_group = new_group
        try:
            yield
        finally:
            dist.new_group = original
            world.bound_device_id = None

    ranks = torch.arange(8).view(2, 2, 2).permute(2, 0, 1).contiguous()
    _stages_step_alone(ctx, ranks, bound_world)
    fail_on([f"group {r} split from the bound world by its members only" for r in split_by_members])


def _stages_step_alone(
    ctx: TPContext, ranks: torch.Tensor, around_the_optimizer=contextlib.nullcontext
) -> None:
    from shardmuon.planning import groups as planning_groups

    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("pp", "dp", "tp"))
    stage_mesh = mesh["dp", "tp"]
    stage = mesh.get_local_rank(0)
    stage_ranks = tuple(stage_mesh.mesh.flatten().tolist())
    problems = []
    if stage_ranks in planning_groups._FLATTENED_GROUPS:
        problems.append(f"stage ranks {stage_ranks} already have a group: the case tests nothing")
    if stage == 0:
        specs = [(12, 8), (9, 7)]
        placements = [(S0, S1), (SS0, S0)]
    else:
        specs = [(12, 8)]
        placements = [(S0, R)]
    fulls = random_tensors(specs, 11)
    grads = random_tensors(specs, 12)
    params = [
        nn.Parameter(distribute_tensor(f.clone(), stage_mesh, list(p), src_data_rank=None))
        for f, p in zip(fulls, placements)
    ]
    for param, g, p in zip(params, grads, placements):
        param.grad = distribute_tensor(g.clone(), stage_mesh, list(p), src_data_rank=None)
    with around_the_optimizer():
        opt = Muon(params, lr=0.02, weight_decay=0.1)
        opt.step()
    refs = [nn.Parameter(f.clone()) for f in fulls]
    for ref, g in zip(refs, grads):
        ref.grad = g.clone()
    Muon(refs, lr=0.02, weight_decay=0.1).step()
    for i, (param, ref, p) in enumerate(zip(params, refs, placements)):
        want = distribute_tensor(ref.detach(), stage_mesh, list(p), src_data_rank=None)
        if not torch.equal(local_tensor(param), want.to_local()):
            problems.append(f"stage {stage} param {i} {p}: not bitwise one process")
    groups = _exchange_groups(opt)
    sizes = sorted({g.size for g in groups})
    if sizes != ([4] if stage == 0 else [2]):
        problems.append(f"stage {stage}: exchange group sizes {sizes}")
    # The world can still make groups together afterwards: stage 0's group creation left no
    # trace that differs between the stages (torch numbers unnamed groups by a counter).
    everyone = dist.new_group(list(range(ctx.world_size)))
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    if total.item() != ctx.world_size:
        problems.append(f"a group of the whole world reduced to {total.item()}")
    fail_on(problems)


@case("error_ranks_disagree_on_pieces", WORLD4, traffic=False)
def _disagree_on_pieces(ctx: TPContext) -> None:
    """Rank 0 places a 12x8 weight as (Shard(1), Shard(0)), the others as (Shard(0),
    Shard(1)): the same group, the same 6x4 local shape, different pieces. Exchanging would
    assemble a wrong matrix without any error; every rank must raise at the first step
    instead, with the weight untouched."""
    mesh = ctx.mesh_for("2d")
    placements = [S1, S0] if ctx.rank == 0 else [S0, S1]
    full_weight = random_tensors([(12, 8)], 21)[0]
    weight = nn.Parameter(distribute_tensor(full_weight, mesh, placements, src_data_rank=None))
    weight.grad = distribute_tensor(torch.ones(12, 8), mesh, placements, src_data_rank=None)
    problems = []
    if tuple(local_tensor(weight).shape) != (6, 4):
        problems.append(f"setup: local shape {tuple(local_tensor(weight).shape)}")
    before = local_tensor(weight).detach().clone()
    opt = Muon([weight], lr=0.1)
    problems += expect_raises(ValueError, ["disagree"], opt.step)
    if not torch.equal(local_tensor(weight), before):
        problems.append("the weight changed although the step raised")
    fail_on(problems)
