"""Checkpoints of two-dimensional shards (issue #13): a state-dict round trip mid-run, a
strided layout that only some ranks can see is not FSDP2's (every rank raises alike), and
``layout.local_slice`` equal to what FSDP2 over TP holds. Part of ``dist_tp_cases``.
"""

from __future__ import annotations

import copy

import torch
from dist_cases import expect_raises
from dist_checks import (
    S0,
    S1,
    R,
    Spec,
    compare_states,
    fail_on,
    make_optimizer,
    place,
    random_tensors,
    set_placed_random_grads,
)
from dist_tp_checks import SS0, WORLD4, WORLD8, TPContext, tp_registry
from dist_tp_model_cases import TPModel, fsdp_index, parallelize
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardmuon import Muon
from shardmuon.planning.placements import local_tensor

CASES, TRAFFIC_CASES, case = tp_registry()


@case("tp_state_dict_round_trip", WORLD4, traffic=False)
def _state_dict(ctx: TPContext) -> None:
    """Two steps, ``state_dict()``, a new optimizer on copies of the params loads it, two
    more steps: bitwise what one process gets in four."""
    specs = [
        Spec((12, 8), (S0, S1), "2d"),
        Spec((9, 7), (SS0, S0), "2d"),
        Spec((8, 12), (S1, S0), "2d"),
        Spec((10,), (S0, R), "2d", algorithm="adamw"),
    ]
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": True}
    init = random_tensors([s.shape for s in specs], 11)
    ref_params = [nn.Parameter(t.clone()) for t in init]
    params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    ref = make_optimizer(ref_params, specs, **kwargs)
    opt = make_optimizer(params, specs, **kwargs)

    for step in range(2):
        set_placed_random_grads(ctx, params, specs, 300 + step, ref_params)
        ref.step()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = make_optimizer(resumed_params, specs, **kwargs)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        set_placed_random_grads(ctx, resumed_params, specs, 300 + step, ref_params)
        ref.step()
        resumed.step()
    problems = compare_states(specs, resumed, resumed_params, ref, ref_params, "resumed")
    momentum = resumed.state[resumed_params[0]]["momentum"]
    if not isinstance(momentum, DTensor) or tuple(momentum.placements) != specs[0].placements:
        problems.append(f"test setup: momentum of param 0 is {type(momentum).__name__}")
    fail_on(problems)


@case("error_split_tensor_strided_layout", WORLD8, traffic=False)
def _split_tensor_layout(ctx: TPContext) -> None:
    """9 rows under (_StridedShard(0, sf=2), Shard(0)) on 4x2, laid out by distribute_tensor
    (``_split_tensor``'s reading), not as FSDP2 would: only ranks 6 and 7 can see that from
    their shapes. No rank may raise alone (its peers would hang): every rank raises the same
    error at the first step, with nothing updated."""
    mesh = ctx.mesh_for("2d")
    full_weight = torch.randn(9, 7, generator=torch.Generator().manual_seed(3))
    weight = nn.Parameter(distribute_tensor(full_weight, mesh, [SS0, S0], src_data_rank=None))
    weight.grad = distribute_tensor(torch.ones(9, 7), mesh, [SS0, S0], src_data_rank=None)
    before = local_tensor(weight).detach().clone()
    opt = Muon([weight], lr=0.1)
    problems = expect_raises(ValueError, ["disagree", "_StridedShard"], opt.step)
    if not torch.equal(local_tensor(weight), before):
        problems.append("the weight changed although the step raised")
    fail_on(problems)


@case("local_slice_is_fsdp_layout", WORLD8, traffic=False)
def _local_slice(ctx: TPContext) -> None:
    """``layout.local_slice`` (what checkpoint loading keeps of a whole tensor) is exactly what
    FSDP2 over TP holds, on 4x2 with uneven sizes and under HSDP x TP: checked against the
    arange model's real local elements."""
    from shardmuon.planning.placements import local_slice

    problems = []
    for label, tp_mesh, dp_mesh in (
        ("dp4_tp2", ctx.meshes["2d"]["tp"], ctx.meshes["2d"]["dp"]),
        ("hsdp_tp", ctx.meshes["3d"]["tp"], ctx.meshes["3d"]["replicate", "dp"]),
    ):
        sizes = (10, 9, 17)
        real = fsdp_index(sizes, tp_mesh, dp_mesh)
        model = TPModel(*sizes).double()
        parallelize(model, tp_mesh, dp_mesh)
        for name, p in model.named_parameters():
            whole = torch.arange(p.numel(), dtype=torch.float64).view(p.shape)
            got = local_slice(whole, p).long()
            if not torch.equal(got, real[name]):
                problems.append(
                    f"{label} {name} {tuple(p.placements)}: local_slice {got.flatten().tolist()}"
                    f" != FSDP2's {real[name].flatten().tolist()}"
                )
    fail_on(problems)
