"""Plain parameters under DDP share their Newton–Schulz work (``split_replicas=True``, or a
process group as ``distributed_mesh``): gloo worlds of 2-4 ranks in ``dist_ddp_cases``;
here, what one process sees."""

from __future__ import annotations

import warnings

import dist_ddp_cases
import pytest
import torch
from dist_harness import WorldPlan
from torch import nn

from shardmuon import Muon


def test_split_replicas_with_nothing_to_split_says_so_and_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    a = [nn.Parameter(torch.randn(16, 24, generator=gen)) for _ in range(3)]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    plain = Muon(a, lr=0.02)
    with pytest.warns(UserWarning, match="split_replicas=True has no effect"):
        split = Muon(b, lr=0.02, split_replicas=True)
    for _ in range(2):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        plain.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once, when planned
            split.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


WORLDS = WorldPlan("dist_ddp_cases:CASES", dist_ddp_cases.cases_for, (2, 3, 4), timeout_s=240.0)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), WORLDS.params())
def test_distributed(worlds, world, name) -> None:
    worlds[world].check(name)
