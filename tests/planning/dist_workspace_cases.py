"""Workspace budget on 2 gloo ranks: measured transient under the budget, bits and bytes
unchanged by it, ranks that disagree on it refused (run by ``test_workspace.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from dist_cases import expect_raises
from dist_checks import (
    S0,
    S1,
    Context,
    Spec,
    compare_with_single,
    make_context,
    make_optimizer,
    place,
    random_tensors,
    set_placed_random_grads,
)
from torch import nn

from shardmuon.bench.memory import gemm_scratch_bytes, measure_cpu_step

__all__ = ["CASES", "make_context"]

KiB = 1024
BUDGET = 200 * KiB
SPECS = [
    *[Spec((96, 64), (S0,))] * 4,  # exchanged, rows sharded
    *[Spec((64, 160), (S1,))] * 2,  # exchanged, columns sharded
    *[Spec((4, 48, 80), (S0,))] * 3,  # expert stacks: sharded on the batch dim, local
    Spec((128,), (S0,), algorithm="adamw"),
]


def _build(ctx: Context, budget: int):
    init = random_tensors([s.shape for s in SPECS], 0)
    params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(SPECS, init)]
    opt = make_optimizer(params, SPECS, nesterov=True, weight_decay=0.1, workspace_bytes=budget)
    return params, opt


def transient_under_budget(ctx: Context) -> None:
    params, opt = _build(ctx, BUDGET)
    set_placed_random_grads(ctx, params, SPECS, 100)
    opt.step()
    set_placed_random_grads(ctx, params, SPECS, 101)
    memory = measure_cpu_step(opt.step, 0)
    stats = opt.last_step_stats
    estimate = stats.workspace_peak_bytes
    # gloo keeps a reference to each all-to-all's buffers until its own thread lets go; if
    # that thread drops the last one, the free happens where the profiler does not look and
    # the buffer seems alive to the end. At most every buffer handed to gloo: that slack.
    gloo_slack = stats.bytes_sent + stats.bytes_received
    # And one GEMM's library scratch (see gemm_scratch_bytes), measured on this machine.
    gloo_slack += gemm_scratch_bytes(stats.ns_calls)
    assert memory.transient_bytes <= BUDGET + gloo_slack, (ctx.rank, memory, BUDGET, gloo_slack)
    assert estimate <= BUDGET, (ctx.rank, estimate)
    # a generous budget really holds more in flight (the cap is what bounds it): more than
    # the tight plan's estimate, measured (the tight step's own measure can hold gloo's
    # late frees, the slack above, so it is not the yardstick)
    params, opt = _build(ctx, 64 * 2**20)
    set_placed_random_grads(ctx, params, SPECS, 100)
    opt.step()
    set_placed_random_grads(ctx, params, SPECS, 101)
    generous = measure_cpu_step(opt.step, 0)
    assert opt.last_step_stats.workspace_peak_bytes > BUDGET, opt.last_step_stats
    assert generous.transient_bytes > estimate, (generous, estimate)


def tight_budget_bitwise_and_minimum_bytes(ctx: Context) -> None:
    # compare_with_single: params, momentum, variance, counters bitwise against one process;
    # all-to-all bytes counted at the call equal the minimum the shapes imply.
    _, problems = compare_with_single(ctx, SPECS, steps=3, workspace_bytes=BUDGET)
    assert not problems, "\n".join(problems)


def ranks_disagreeing_on_the_budget_are_refused(ctx: Context) -> None:
    params, opt = _build(ctx, BUDGET if ctx.rank == 0 else 2 * BUDGET)
    set_placed_random_grads(ctx, params, SPECS, 100)
    before = [p.to_local().clone() for p in params]
    problems = expect_raises(ValueError, ["disagree on the Muon step"], opt.step)
    assert not problems, "\n".join(problems)
    for p, b in zip(params, before):
        assert torch.equal(p.to_local(), b)


CASES: dict[str, Callable[[Context], None]] = {
    "transient_under_budget": transient_under_budget,
    "tight_budget_bitwise_and_minimum_bytes": tight_budget_bitwise_and_minimum_bytes,
    "ranks_disagreeing_on_the_budget_are_refused": ranks_disagreeing_on_the_budget_are_refused,
}
