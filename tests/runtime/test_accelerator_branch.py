"""The step's accelerator branch (the fused passes: momentum and direction, decay and
update; ``runtime/phases.py``; AdamW, ``runtime/adamw_step.py``) taken on a CPU, where each fused op runs its torch reference:
bitwise the CPU branch's step on random groups (Nesterov or not, fp32 and bf16 parameters,
partitioned rows, stacks over several batches, offload, ``step_chunk`` rounds), and a
momentum pass that failed part-way resumes without updating a momentum twice."""

from __future__ import annotations

import random

import pytest
import torch

import shardmuon.ops.update as update_module
import shardmuon.runtime.adamw_step as adamw_step
import shardmuon.runtime.phases as phases
from shardmuon import Muon


def _model(seed: int):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    params = []
    for _ in range(rng.randint(3, 6)):
        shape = rng.choice([(16, 24), (24, 16), (6, 16, 12), (32, 16)])
        dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
        params.append(torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.1).to(dtype)))
    group = {"params": params, "lr": 0.02, "weight_decay": rng.choice([0.0, 0.1])}
    vectors = [
        torch.nn.Parameter(
            torch.randn(n, generator=gen).to(rng.choice([torch.float32, torch.bfloat16]))
        )
        for n in rng.sample([5, 24, 300], 2)
    ]
    adamw = {"params": vectors, "algorithm": "adamw", "lr": 3e-3, "weight_decay": 0.1}
    params = params + vectors
    partitions = {p: (8, 8, 16) for p in params if p.shape == (32, 16)}
    options = dict(
        nesterov=rng.random() < 0.5,
        workspace_bytes=rng.choice([4096, 1 << 20]),
        offload=rng.choice([None, "state"]),
    )
    return params, [group, adamw], partitions, options


def _steps(seed: int, accelerator: bool, monkeypatch, chunked: bool = False):
    """Three steps of a random model; its parameters, its momenta and how many fused
    momentum passes ran."""
    fused, fused_adamw = [], []
    if accelerator:
        real = phases.momentum_direction_into
        monkeypatch.setattr(phases, "fused_update_available", lambda device: True)
        monkeypatch.setattr(update_module, "fused_update_available", lambda device: True)
        monkeypatch.setattr(
            phases, "momentum_direction_into", lambda *a: (fused.append(1), real(*a))[1]
        )
        real_adamw = adamw_step.adamw_into
        monkeypatch.setattr(adamw_step, "fused_adamw_available", lambda device: True)
        monkeypatch.setattr(
            adamw_step, "adamw_into", lambda *a: (fused_adamw.append(1), real_adamw(*a))[1]
        )
    params, groups, partitions, options = _model(seed)
    opt = Muon(groups, matrix_partitions=partitions, **options)
    gen = torch.Generator().manual_seed(seed + 7)
    for _ in range(3):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        if chunked:
            for chunk in opt.chunks():
                opt.step_chunk(chunk)
        else:
            opt.step()
    monkeypatch.undo()
    state = [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return [p.detach().clone() for p in params] + state, (len(fused), len(fused_adamw))


@pytest.mark.parametrize("chunked", [False, True], ids=["step", "step_chunk"])
def test_the_accelerator_branch_gives_the_cpu_branchs_bits(monkeypatch, chunked) -> None:
    for seed in range(8):
        got, fused = _steps(seed, True, monkeypatch, chunked)
        want, _ = _steps(seed, False, monkeypatch, chunked)
        assert min(fused) > 0, seed  # the fused momentum pass and AdamW kernel ran
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), seed


def test_a_momentum_pass_that_failed_part_way_resumes_once(monkeypatch) -> None:
    """The fused pass raises on its second segment: the first segment's momentum is
    updated; the retried chunk updates the rest only (the same bits as no failure)."""
    monkeypatch.setattr(phases, "fused_update_available", lambda device: True)
    monkeypatch.setattr(update_module, "fused_update_available", lambda device: True)
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(16, 24, generator=gen)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = Muon(params, lr=0.02), Muon(twins, lr=0.02)
    for p, t in zip(params, twins):
        p.grad = torch.randn(16, 24, generator=gen)
        t.grad = p.grad.clone()
    real, seen = phases.momentum_direction_into, []

    def failing(*args):
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("CUDA out of memory (injected)")
        real(*args)

    monkeypatch.setattr(phases, "momentum_direction_into", failing)
    chunks = opt.chunks()
    assert len(chunks) == 1  # one batch of three segments
    with pytest.raises(RuntimeError, match="injected"):
        opt.step_chunk(chunks[0])
    opt.step_chunk(chunks[0])
    ref.step()
    for a, b in zip(params, twins):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), ref.state.values()):
        assert torch.equal(a["momentum"], b["momentum"])


def test_the_estimate_counts_the_temporaries_of_parameters_the_adamw_kernel_cannot_take(
    monkeypatch,
) -> None:
    """With the fused AdamW kernel, a parameter it cannot take (a transposed one: its moments
    are laid out alike) runs the ``_foreach_`` ops and their 16 bytes an element: the
    estimate holds them; the ones it takes add nothing."""
    monkeypatch.setattr(adamw_step, "fused_adamw_available", lambda device: True)
    gen = torch.Generator().manual_seed(0)
    taken = torch.nn.Parameter(torch.randn(64, generator=gen))
    transposed = torch.nn.Parameter(torch.randn(24, 40, generator=gen).t())
    estimates = []
    for vectors in ([taken], [taken, transposed]):
        matrix = torch.nn.Parameter(torch.randn(16, 24, generator=gen))
        opt = Muon(
            [{"params": [matrix]}, {"params": vectors, "algorithm": "adamw"}],
            workspace_bytes=4096,
        )
        for p in [matrix, *vectors]:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        estimates.append(opt.last_step_stats.workspace_peak_bytes)
    assert estimates[1] >= 16 * transposed.numel() > estimates[0]
