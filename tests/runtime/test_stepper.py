"""The step runner (``runtime/stepper.py``): the facade hands it the step, and its two seams
(how a round reads its groups' hyperparameters, what the owner computes from a whole
direction) change the update exactly as they say. Multi-process cases are in
``dist_stepper_cases``."""

from __future__ import annotations

import dataclasses

import dist_stepper_cases
import pytest
import torch
from dist_harness import WorldPlan

from shardmuon import Muon
from shardmuon.runtime.phases import read_hyperparams

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [(12, 8), (8, 12), (3, 6, 10), (16,)]


def _model(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]


def _run(lr: float, weight_decay: float = 0.0, steps: int = 3, configure=None) -> list:
    params = _model()
    opt = Muon(params, lr=lr, weight_decay=weight_decay, nesterov=True)
    if configure is not None:
        configure(opt)
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        opt.step()
    return [p.detach().clone() for p in params]


def _assert_bitwise(got: list, want: list) -> None:
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"param {k}"


def test_an_owner_update_that_halves_is_bitwise_half_the_lr() -> None:
    """The hook's result is what the update applies: Newton-Schulz's result halved (exact in
    bf16) is bitwise the step at half the lr, for every Muon matrix; AdamW untouched."""
    seen: list[tuple[int, int]] = []

    def hooked(opt: Muon) -> None:
        opt.runner.owner_update = dist_stepper_cases.scaled_owner_update(seen)
        for group in opt.param_groups:
            if group["algorithm"] == "adamw":
                group["lr"] = 0.04  # AdamW at the full lr on both sides

    def halved(opt: Muon) -> None:
        for group in opt.param_groups:
            if group["algorithm"] == "adamw":
                group["lr"] = 0.04

    _assert_bitwise(_run(0.04, configure=hooked), _run(0.02, configure=halved))
    assert sorted(set(seen)) == [(6, 10), (8, 12), (12, 8)]  # each Muon matrix, whole


def test_a_hyperparameter_reader_is_what_the_phases_read() -> None:
    """A reader that hands every Muon group half its lr is bitwise the step at half the lr
    (the seam the phases read their lr, decay and momentum through)."""

    def halve(groups: list[dict]) -> list:
        return [dataclasses.replace(h, lr=h.lr / 2) for h in read_hyperparams(groups)]

    def reader(opt: Muon) -> None:
        opt.runner.hyperparams = halve
        for group in opt.param_groups:
            if group["algorithm"] == "adamw":
                group["lr"] = 0.01  # AdamW reads its group directly: the same lr both sides

    def plain(opt: Muon) -> None:
        for group in opt.param_groups:
            if group["algorithm"] == "adamw":
                group["lr"] = 0.01

    _assert_bitwise(_run(0.04, 0.1, configure=reader), _run(0.02, 0.1, configure=plain))


def test_the_facade_hands_the_step_to_its_runner() -> None:
    params = _model()
    opt = Muon(params)
    calls = []
    run = opt.runner.step
    opt.runner.step = lambda closure: calls.append(closure) or run(closure)
    for p in params:
        p.grad = torch.ones_like(p)
    assert opt.step(lambda: 3.0) == 3.0
    assert len(calls) == 1
    assert opt.plan is opt.runner.plan and opt.plan.batches


WORLDS = WorldPlan("dist_stepper_cases:CASES", lambda _: list(dist_stepper_cases.CASES), (2,))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(dist_stepper_cases.CASES))
def test_distributed(worlds, name) -> None:
    worlds[2].check(name)
