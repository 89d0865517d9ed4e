"""The step decays its fp32 parameters up front (``decay_all_params``: one ``_foreach_mul_``
per factor) instead of in each segment's update: the same bits as the per-segment path, on
random groups (several learning rates and decays, zero decay, bf16 and fp32 parameters,
partitioned rows, stacks split over batches), over several steps."""

from __future__ import annotations

import random

import pytest
import torch

import shardmuon.runtime.pipeline as pipeline
from shardmuon import Muon


def _model(seed: int):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    params = []
    for _ in range(rng.randint(3, 7)):
        shape = rng.choice([(16, 24), (24, 16), (6, 16, 12), (32, 16)])
        dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
        params.append(torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.1).to(dtype)))
    groups, start = [], 0
    while start < len(params):
        stop = rng.randint(start + 1, len(params))
        groups.append(
            {
                "params": params[start:stop],
                "lr": rng.choice([0.02, 0.005, 0.3]),
                "weight_decay": rng.choice([0.0, 0.1, 0.37]),
            }
        )
        start = stop
    partitions = {params[i]: (8, 8, 16) for i, p in enumerate(params) if p.shape == (32, 16)}
    return params, groups, partitions, rng.choice([2048, 8192, 1 << 20])


def _run(seed: int, up_front: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    params, groups, partitions, workspace = _model(seed)
    calls = []
    real = pipeline.decay_all_params

    def counted(ctx, runs):
        calls.append(len(runs))
        if up_front:
            real(ctx, runs)

    monkeypatch.setattr(pipeline, "decay_all_params", counted)
    opt = Muon(groups, matrix_partitions=partitions, workspace_bytes=workspace)
    gen = torch.Generator().manual_seed(seed + 100)
    for _ in range(3):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        opt.step()
    monkeypatch.undo()
    return [p.detach().clone() for p in params], len(calls)


def test_the_up_front_decay_gives_the_per_segment_bits(monkeypatch) -> None:
    for seed in range(12):
        got, steps = _run(seed, True, monkeypatch)
        want, _ = _run(seed, False, monkeypatch)
        assert steps == 3
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), seed


def test_a_run_decayed_up_front_is_not_decayed_again(monkeypatch) -> None:
    """A zero grad gives a zero direction, so only the decay moves the parameter: once,
    exactly (applied twice, or not at all, the test sees it)."""
    p = torch.nn.Parameter(torch.randn(16, 24, generator=torch.Generator().manual_seed(1)))
    start = p.detach().clone()
    opt = Muon([{"params": [p], "lr": 0.1, "weight_decay": 0.5}])
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), start * (1.0 - 0.1 * 0.5))


def test_a_step_that_fails_midway_leaves_what_its_docstring_says(monkeypatch) -> None:
    """Out of memory in the second Newton–Schulz call: the first chunk is updated, the rest
    are decayed (the step decays every fp32 parameter first) and not updated; momenta have
    all advanced. ``step()``'s docstring says so; ``step_chunk`` is the resumable path."""
    import shardmuon.runtime.phases as phases

    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(16, 24, generator=gen)) for _ in range(3)]
    opt = Muon(params, lr=0.1, weight_decay=0.5, workspace_bytes=4096)
    assert len(opt.chunks()) == 3
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn(16, 24, generator=gen)
    real, calls = phases.StepContext.orthogonalize, []

    def failing(self, U, batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(self, U, batch)

    monkeypatch.setattr(phases.StepContext, "orthogonalize", failing)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    decayed = [torch.equal(p.detach(), b * (1 - 0.1 * 0.5)) for p, b in zip(params, before)]
    assert decayed.count(True) == 2  # decayed, not updated
    assert not any(torch.equal(p.detach(), b) for p, b in zip(params, before))
