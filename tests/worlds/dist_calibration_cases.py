"""``newton_schulz_impl="auto"`` across ranks: rank 0's measured choices reach every rank,
whatever each rank's own timings say (cases for a world of 2; ``test_calibration``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from dist_checks import Context, make_context
from torch.distributed.tensor import Replicate, distribute_tensor

import shardmuon.runtime.calibration as calibration
from shardmuon import Muon

__all__ = ["CASES", "make_context"]


def _rank_biased_timer(make, shape, device, coefficients, eps):
    """A timer that disagrees across ranks: rank 0 finds gram faster, the others folded."""
    gram_fast = dist.get_rank() == 0
    return {"gram": 1.0 if gram_fast else 2.0, "folded": 2.0 if gram_fast else 1.0}


def every_rank_runs_rank_0s_choice(ctx: Context) -> None:
    calibration._CHOICES.clear()
    original = calibration.time_engines
    calibration.time_engines = _rank_biased_timer
    try:
        g = torch.Generator().manual_seed(0)
        # Replicated weights (HSDP replicas without split_replicas): every rank computes
        # the same matrices, so the engines must agree or the replicas drift apart.
        full = [torch.randn(s, generator=g) for s in ((16, 96), (24, 24))]
        params = [
            torch.nn.Parameter(distribute_tensor(t.clone(), ctx.mesh, [Replicate()])) for t in full
        ]
        grads = [torch.randn(t.shape, generator=g) for t in full]
        for p, grad in zip(params, grads):
            p.grad = distribute_tensor(grad, ctx.mesh, [Replicate()])
        opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
        opt.step()
        assert opt._auto_choices == {(16, 96): "gram", (24, 24): "folded"}, opt._auto_choices
        # The same bits on every rank, and those of one process with gram for (16, 96).
        reference = [torch.nn.Parameter(t.clone()) for t in full]
        for p, grad in zip(reference, grads):
            p.grad = grad.clone()
        Muon(reference, lr=0.1, newton_schulz_impl="gram").step()
        for p, want in zip(params, reference):
            got = p.to_local()
            gathered = [torch.empty_like(got) for _ in range(ctx.world_size)]
            dist.all_gather(gathered, got)
            assert all(torch.equal(x, gathered[0]) for x in gathered)
            assert torch.equal(got, want.detach())
    finally:
        calibration.time_engines = original
        calibration._CHOICES.clear()


CASES: dict[str, Callable[[Context], None]] = {
    "every_rank_runs_rank_0s_choice": every_rank_runs_rank_0s_choice,
}
