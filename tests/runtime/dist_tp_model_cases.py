"""FSDP2 over TP on a small torchtitan-style model (issue #13): its plan (colwise and
rowwise projections), per-block FSDP2 on the dp mesh, uneven sizes where FSDP2's layout and
``distribute_tensor``'s differ, HSDP over TP; against one process, in FSDP2's real layout.
Part of ``dist_tp_cases``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_checks import (
    S0,
    S1,
    Context,
    R,
    agreement_groups_of,
    check_orthogonalized,
    check_step_collectives,
    check_step_traffic,
    counting_all_to_all,
    fail_on,
    muon_params,
    random_tensors,
    recording_collectives,
)
from dist_tp_checks import (
    SS0,
    WORLD4,
    WORLD8,
    TPContext,
    check_pieces,
    flat_index,
    log_traffic,
    tp_registry,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardmuon import Muon
from shardmuon.planning.placements import local_tensor
from shardmuon.runtime.agreement import spread_rounds

CASES, TRAFFIC_CASES, case = tp_registry()


class _Block(nn.Module):
    """Attention-like projections and a SwiGLU-like feed-forward, as torchtitan names them."""

    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, heads, bias=False)
        self.wo = nn.Linear(heads, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.norm = nn.Parameter(torch.ones(dim))


class TPModel(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block(dim, hidden, heads) for _ in range(layers))


TP_PLAN = {"wq": "colwise", "w1": "colwise", "w3": "colwise", "wo": "rowwise", "w2": "rowwise"}


def parallelize(model: TPModel, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """TP on ``tp_mesh`` (torchtitan's plan), then FSDP2 per block and at the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in model.layers:
        parallelize_module(block, tp_mesh, {n: styles[s]() for n, s in TP_PLAN.items()})
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def fsdp_index(sizes: tuple[int, int, int], tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> dict:
    """Name -> the global flat index of every local element, as FSDP2 over TP really lays the
    params out: a model whose every parameter holds ``arange`` (exact in float64), sharded
    the same way. Independent of DTensor's reading of the placements."""
    model = TPModel(*sizes).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.arange(p.numel(), dtype=torch.float64).view(p.shape))
    parallelize(model, tp_mesh, dp_mesh)
    return {n: local_tensor(p).detach().long() for n, p in model.named_parameters()}


def check_tp_model(
    ctx: Context,
    name: str,
    sizes: tuple[int, int, int],
    tp_mesh: DeviceMesh,
    dp_mesh: DeviceMesh,
    expected: dict,
    fsdp_differs: bool = False,
) -> None:
    """FSDP2 over TP on a small model, random grads set on the params, vs one process.

    Grads are built from FSDP2's real layout (read from an ``arange`` model sharded the same
    way) and the states are compared shard by shard in that layout, so the check does not
    rely on DTensor's reading of ``_StridedShard`` (which differs from FSDP2's where sizes are
    uneven). ``fsdp_differs``: the sizes are chosen so that on some rank FSDP2's layout of
    some parameter is not ``distribute_tensor``'s (checked)."""
    reference, sharded = TPModel(*sizes), TPModel(*sizes)
    parallelize(sharded, tp_mesh, dp_mesh)
    index = fsdp_index(sizes, tp_mesh, dp_mesh)
    ref_named = dict(reference.named_parameters())
    named = dict(sharded.named_parameters())
    names = sorted(ref_named)
    problems = []
    if set(named) != set(ref_named):
        problems.append("test setup: names differ between the two models")
    for n in names:
        leaf = n.split(".")[-2] if n.endswith(".weight") else n.split(".")[-1]
        want = expected.get(TP_PLAN.get(leaf, leaf))
        got = tuple(named[n].placements) if isinstance(named[n], DTensor) else None
        if want is not None and got != want:
            problems.append(f"test setup: {n} has placements {got}, expected {want}")
        if tuple(index[n].shape) != tuple(local_tensor(named[n]).shape):
            problems.append(f"test setup: {n}: the arange model's shard has another shape")
        elif not torch.equal(local_tensor(named[n]), ref_named[n].detach().flatten()[index[n]]):
            problems.append(f"test setup: {n}: FSDP2's shard is not where the arange model says")
    differs = [
        n
        for n in names
        if isinstance(named[n], DTensor) and not torch.equal(index[n], flat_index(named[n]))
    ]
    seen: list = [None] * ctx.world_size
    dist.all_gather_object(seen, differs)
    if fsdp_differs and not any(seen):
        problems.append("test setup: FSDP2's layout equals distribute_tensor's everywhere")
    muon_names = [n for n in names if ref_named[n].ndim == 2]
    adamw_names = [n for n in names if ref_named[n].ndim != 2]

    def groups(params: dict) -> list[dict]:
        return [
            {"params": [params[n] for n in muon_names], "algorithm": "muon"},
            {"params": [params[n] for n in adamw_names], "algorithm": "adamw"},
        ]

    def shard_of(n: str, full_tensor: torch.Tensor) -> DTensor:
        p = named[n]
        local = full_tensor.detach().flatten()[index[n]].clone()
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": True}
    ref, opt = Muon(groups(ref_named), **kwargs), Muon(groups(named), **kwargs)
    tally: list[tuple[int, int]] = []
    agreement = len(agreement_groups_of(muon_params(opt), False))
    for step in range(3):
        grads = random_tensors([tuple(ref_named[n].shape) for n in names], 40 + step)
        for n, g in zip(names, grads):
            ref_named[n].grad = g.clone()
            named[n].grad = shard_of(n, g)
        ref.step()
        with counting_all_to_all() as calls, recording_collectives() as collectives:
            opt.step()
        label = f"{name} step {step + 1}"
        problems += check_step_traffic(ctx, opt, calls, False, label, tally)
        problems += check_orthogonalized(ctx, opt, False, label)
        rounds = spread_rounds(muon_params(opt))
        problems += check_step_collectives(collectives, agreement, step == 0, label, rounds)
    for n in names:
        p, r = named[n], ref_named[n]
        pairs = [("param", p, r)]
        pairs += [(k, opt.state[p][k], ref.state[r][k]) for k in ref.state[r] if k != "step"]
        for what, got, want in pairs:
            if not isinstance(want, torch.Tensor):
                continue
            got, want = local_tensor(got).detach(), want.detach().flatten()[index[n]]
            if got.shape != want.shape or not torch.equal(got, want):
                problems.append(f"{name}: {what} of {n} {tuple(p.placements)} differs")
    steps = [g["step"] for g in opt.param_groups]
    if steps != [g["step"] for g in ref.param_groups]:
        problems.append(f"{name}: step counters {steps}")
    position = {id(p): i for i, p in enumerate(muon_params(opt))}
    muon_index = {position[id(named[n])]: index[n] for n in muon_names}
    problems += check_pieces(ctx, opt, name, muon_index)
    problems += log_traffic(ctx, name, tally)
    fail_on(problems)


@case("tp_torchtitan_fsdp_tp", WORLD4)
def _torchtitan(ctx: TPContext) -> None:
    """hidden 14: tp gives 7 rows each, dp's strided shard 4 and 3 (uneven)."""
    mesh = ctx.meshes["2d"]
    expected = {
        "colwise": (SS0, S0),
        "rowwise": (S0, S1),
        "norm": (S0,),  # not TP'd: FSDP2 on the dp mesh alone
    }
    check_tp_model(ctx, "tp_torchtitan_fsdp_tp", (10, 14, 12), mesh["tp"], mesh["dp"], expected)


@case("tp_torchtitan_dp4_tp2", WORLD8)
def _torchtitan_dp4(ctx: TPContext) -> None:
    """hidden 9 and heads 17 on dp 4 x tp 2: tp gives 5 and 4 rows, FSDP2 then 2/2/1/0 and
    1/1/1/1 (where DTensor's _StridedShard reading would put rows elsewhere)."""
    mesh = ctx.meshes["2d"]
    expected = {"colwise": (SS0, S0), "rowwise": (S0, S1), "norm": (S0,)}
    check_tp_model(
        ctx, "tp_torchtitan_dp4_tp2", (10, 9, 17), mesh["tp"], mesh["dp"], expected, True
    )


@case("tp_torchtitan_hsdp_tp", WORLD8)
def _torchtitan_hsdp(ctx: TPContext) -> None:
    """HSDP (replicate x dp) over TP: torchtitan's 3-D layout."""
    mesh = ctx.meshes["3d"]
    expected = {"colwise": (R, SS0, S0), "rowwise": (R, S0, S1), "norm": (R, S0)}
    check_tp_model(
        ctx, "tp_torchtitan_hsdp_tp", (10, 14, 12), mesh["tp"], mesh["replicate", "dp"], expected
    )
