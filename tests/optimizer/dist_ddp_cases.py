"""Plain (non-DTensor) parameters under DDP sharing their Newton–Schulz work, in gloo worlds
of 2-4 ranks (run by ``tests/optimizer/test_ddp_sharing.py``).

Every rank holds the same plain parameters and grads (DDP's promise). With
``split_replicas=True``, or a process group as ``distributed_mesh`` (dion's DDP argument),
each rank orthogonalizes its share of the batches and broadcasts the results: the weights
and states must be bitwise those of every rank doing all of it, through ``step()``,
``step_chunk``, offload and the overlapped step, and under ``DistributedDataParallel``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from dist_checks import Context, make_context
from dist_harness import case_registry
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardmuon import Muon

__all__ = ["CASES", "cases_for", "make_context"]

CASES, case, cases_for = case_registry()

SHAPES = [(32, 48)] * 4 + [(48, 32)] * 2 + [(6, 16, 24)] + [(24, 16)] + [(20,)]


def _model(seed: int = 0) -> tuple[list[nn.Parameter], list[dict], dict]:
    """Plain parameters, the same on every rank: Muon matrices (one a fused gate_up with
    two row blocks) and an AdamW vector."""
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in SHAPES]
    groups = [dict(params=params[:-1]), dict(params=params[-1:], algorithm="adamw")]
    return params, groups, {params[7]: (12, 12)}


def _grads(params: list[nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _run(make: Callable[..., Muon], way: str = "step", steps: int = 3):
    params, groups, partitions = _model()
    opt = make(groups, partitions)
    if way == "overlap":
        opt.overlap_with(nn.Module())
    for step in range(steps):
        _grads(params, step)
        if way == "chunks":
            for chunk in opt.chunks():
                opt.step_chunk(chunk)
        else:
            opt.step()
            opt.synchronize()
    return params, opt


def _assert_bitwise(label: str, a, oa, b, ob) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.detach(), y.detach()), f"{label}: parameter {i}"
        for key, value in oa.state[x].items():
            assert torch.equal(value, ob.state[y][key]), f"{label}: state {key} of {i}"


def _every_rank_all(groups, partitions, **kwargs) -> Muon:
    return Muon(groups, lr=0.02, matrix_partitions=partitions, **kwargs)


@case("plain_parameters_share_the_work_bitwise", (2, 3, 4))
def plain_parameters_share_the_work_bitwise(ctx: Context) -> None:
    base, base_opt = _run(_every_rank_all)
    total = base_opt.last_step_stats.matrices_orthogonalized
    for label, kwargs in (
        ("split_replicas=True", {"split_replicas": True}),
        ("distributed_mesh=WORLD", {"distributed_mesh": dist.group.WORLD}),
    ):
        params, opt = _run(lambda g, p, kw=kwargs: _every_rank_all(g, p, **kw))
        _assert_bitwise(label, base, base_opt, params, opt)
        mine = opt.last_step_stats.matrices_orthogonalized
        shares = [None] * ctx.world_size
        dist.all_gather_object(shares, mine)
        assert sum(shares) == total, (label, shares, total)
        assert max(shares) < total, (label, shares)  # each rank did a share only
        assert (
            opt.last_step_stats.replica_bytes_sent + (opt.last_step_stats.replica_bytes_received)
            > 0
        ), label


@case("chunks_offload_and_overlap_are_bitwise", (2, 3))
def chunks_offload_and_overlap_are_bitwise(ctx: Context) -> None:
    base, base_opt = _run(lambda g, p: _every_rank_all(g, p, split_replicas=True))
    for way, kwargs in (
        ("chunks", {}),
        ("step", {"offload": "state"}),
        ("overlap", {"overlap": "forward"}),
    ):
        params, opt = _run(
            lambda g, p, kw=kwargs: _every_rank_all(g, p, split_replicas=True, **kw), way
        )
        _assert_bitwise(f"{way} {kwargs}", base, base_opt, params, opt)
    # A chunk that broadcasts says so.
    params, groups, partitions = _model()
    opt = _every_rank_all(groups, partitions, split_replicas=True)
    kinds = [(opt.chunk_info(c).kind, opt.chunk_info(c).communicates) for c in opt.chunks()]
    assert ("muon", True) in kinds, kinds


@case("differing_values_raise_on_every_rank", (2, 3))
def differing_values_raise_on_every_rank(ctx: Context) -> None:
    params, groups, partitions = _model()
    if ctx.rank == ctx.world_size - 1:
        with torch.no_grad():
            params[2][0, 0] += 1.0  # not a replica any more
    opt = _every_rank_all(groups, partitions, split_replicas=True)
    _grads(params, 0)
    try:
        opt.step()
    except ValueError as err:
        assert "values and grad" in str(err), err
    else:
        raise AssertionError("plain parameters that differ between ranks were shared")


@case("a_process_group_of_some_ranks", (4,))
def a_process_group_of_some_ranks(ctx: Context) -> None:
    # Two DDP groups of two ranks (say, two pipeline stages' data-parallel groups): each
    # shares its work within its own group only.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[ctx.rank // 2]
    base, base_opt = _run(_every_rank_all)
    params, opt = _run(lambda g, p: _every_rank_all(g, p, distributed_mesh=mine))
    _assert_bitwise("pair group", base, base_opt, params, opt)
    shares = [None] * ctx.world_size
    dist.all_gather_object(shares, opt.last_step_stats.matrices_orthogonalized)
    total = base_opt.last_step_stats.matrices_orthogonalized
    assert shares[0] + shares[1] == total and shares[2] + shares[3] == total, shares


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 48, bias=False)
        self.mid = nn.Linear(48, 48)
        self.down = nn.Linear(48, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.mid(torch.tanh(self.up(x)))))


def _train_ddp(ctx: Context, **kwargs) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = DistributedDataParallel(_Net())
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    opt = Muon([dict(params=matrices), dict(params=others, algorithm="adamw")], lr=0.02, **kwargs)
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + ctx.rank)  # each rank its own data
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    done = opt.last_step_stats.matrices_orthogonalized
    return [p.detach().clone() for p in model.parameters()], done


@case("distributed_data_parallel_trains_bitwise", (2, 4))
def distributed_data_parallel_trains_bitwise(ctx: Context) -> None:
    want, every = _train_ddp(ctx)
    got, mine = _train_ddp(ctx, split_replicas=True)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"parameter {i}"
    shares = [None] * ctx.world_size
    dist.all_gather_object(shares, mine)
    assert sum(shares) == every and max(shares) < every, (shares, every)
    # And every rank holds the same weights (DDP's replicas stayed replicas).
    for p in got:
        copy = p.clone()
        dist.broadcast(copy, src=0)
        assert torch.equal(copy, p)
