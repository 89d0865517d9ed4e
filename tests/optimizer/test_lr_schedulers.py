"""Learning rates and schedulers: tensor lrs, torch's LR schedulers driving each group's lr,
and the momentum-cycling schedulers driving Muon's ``mu`` and AdamW's ``beta1`` through the
``momentum`` alias. Muon's groups have dion's keys (``mu``, ``beta1``, ``beta2``, not
``momentum``/``betas``) until a scheduler sets ``momentum``.

One of PyTorch's generic optimizer checks applied to ``shardmuon.Muon``, as the module
docstring of ``tests/support/generic_setup.py`` describes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from checks import assert_all_bitwise, grads_for, set_grads, snapshot
from generic_setup import BASE, make_groups, make_opt, make_params, step_both
from torch import Tensor
from torch.nn import Parameter
from torch.optim.lr_scheduler import (
    CyclicLR,
    ExponentialLR,
    LambdaLR,
    OneCycleLR,
    ReduceLROnPlateau,
    StepLR,
)

from shardmuon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "make_lr",
    [
        lambda: torch.tensor(0.02),
        lambda: torch.tensor([0.02]),
        lambda: torch.tensor(0.02, dtype=torch.float64),
    ],
    ids=["0-d float32", "1-element 1-d", "0-d float64"],
)
@pytest.mark.parametrize("where", ["default", "group"])
def test_tensor_lr(make_lr: Callable[[], Tensor], where: str) -> None:
    """A 1-element tensor lr steps like the float it holds, and in-place changes apply."""
    lr = make_lr()
    ps, ref_ps = make_params(), make_params()
    if where == "default":
        opt = Muon(make_groups(ps), **{**BASE, "lr": lr})
    else:
        opt = Muon(make_groups(ps, dict(lr=lr), dict(lr=lr)), **BASE)
    ref = Muon(make_groups(ref_ps), **{**BASE, "lr": lr.item()})
    for step in range(2):
        step_both([(opt, ps), (ref, ref_ps)], step)
        assert_all_bitwise(ps, snapshot(ref_ps))
    lr.fill_(0.005)  # what schedulers do with tensor lrs
    for group in ref.param_groups:
        group["lr"] = lr.item()
    for step in range(2, 4):
        step_both([(opt, ps), (ref, ref_ps)], step)
        assert_all_bitwise(ps, snapshot(ref_ps))
    assert isinstance(opt.state_dict()["param_groups"][0]["lr"], Tensor)


def _step_scheduler(scheduler: Any) -> None:
    if isinstance(scheduler, ReduceLROnPlateau):
        scheduler.step(1.0)  # a metric that never improves
    else:
        scheduler.step()


SCHEDULERS = {
    "StepLR": lambda o: StepLR(o, step_size=2, gamma=0.5),
    "ExponentialLR": lambda o: ExponentialLR(o, gamma=0.7),
    "LambdaLR": lambda o: LambdaLR(o, lr_lambda=[lambda k: 1 / (k + 1), lambda k: 0.9**k]),
    "OneCycleLR": lambda o: OneCycleLR(o, max_lr=[0.05, 0.01], total_steps=8, cycle_momentum=False),
    "CyclicLR": lambda o: CyclicLR(
        o, base_lr=[0.005, 0.001], max_lr=[0.05, 0.01], step_size_up=2, cycle_momentum=False
    ),
    "ReduceLROnPlateau": lambda o: ReduceLROnPlateau(o, factor=0.5, patience=0),
}


def _lr_value(lr: float | Tensor) -> float:
    return lr.item() if isinstance(lr, Tensor) else lr


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float lr", "tensor lr"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_scheduler(name: str, tensor_lr: bool) -> None:
    """The scheduler drives each group's lr; the steps equal steps with the lrs set by hand.

    The expected lr sequence comes from the same scheduler on a torch SGD with the same group
    lrs (an independent optimizer); the reference Muon gets each lr assigned, as a float,
    before each step. Muon's groups have no 'momentum'/'betas' key, so the cyclic schedulers
    run with ``cycle_momentum=False``.
    """
    make_scheduler = SCHEDULERS[name]
    group_lrs = [0.02, 0.01]
    dummy = torch.optim.SGD(
        [dict(params=[torch.zeros(1, requires_grad=True)], lr=lr) for lr in group_lrs]
    )
    dummy_scheduler = make_scheduler(dummy)
    expected_lrs = []
    for _ in range(6):
        expected_lrs.append([g["lr"] for g in dummy.param_groups])
        dummy.step()
        _step_scheduler(dummy_scheduler)
    assert len({tuple(lrs) for lrs in expected_lrs}) > 1, "the schedule must vary"

    ps, ref_ps = make_params(), make_params()
    opt = Muon(
        make_groups(ps, *[dict(lr=torch.tensor(lr) if tensor_lr else lr) for lr in group_lrs]),
        **BASE,
    )
    ref = Muon(make_groups(ref_ps, *[dict(lr=lr) for lr in group_lrs]), **BASE)
    scheduler = make_scheduler(opt)
    rel = 1e-6 if tensor_lr else 1e-12
    for step, lrs in enumerate(expected_lrs):
        actual = [_lr_value(g["lr"]) for g in opt.param_groups]
        assert actual == pytest.approx(lrs, rel=rel)
        for group, lr in zip(ref.param_groups, actual):
            group["lr"] = lr
        step_both([(opt, ps), (ref, ref_ps)], step)
        _step_scheduler(scheduler)
        assert_all_bitwise(ps, snapshot(ref_ps))
    if not isinstance(scheduler, ReduceLROnPlateau):
        last = [_lr_value(lr) for lr in scheduler.get_last_lr()]
        assert last == [_lr_value(g["lr"]) for g in opt.param_groups]


# ---------------------------------------------------------------- momentum schedulers


def _cycling_schedulers():
    from torch.optim.lr_scheduler import CyclicLR, OneCycleLR

    return {
        "OneCycleLR": lambda opt: OneCycleLR(opt, max_lr=0.05, total_steps=8),
        "CyclicLR": lambda opt: CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=3),
    }


@pytest.mark.parametrize("name", ["OneCycleLR", "CyclicLR"])
def test_momentum_cycling_schedulers_change_what_the_step_uses(name) -> None:
    """issue #20: torch's OneCycleLR and CyclicLR with their default ``cycle_momentum=True``
    (they raised "optimizer must support momentum or beta1"). Each step must use the
    scheduler's lr and momentum: Muon's ``mu`` and AdamW's ``beta1``, bit for bit like an
    optimizer given those values by hand."""
    ps, twin = make_params(), make_params()
    opt, ref = make_opt(ps), make_opt(twin)
    scheduler = _cycling_schedulers()[name](opt)
    momenta = []
    for step in range(6):
        for group, ref_group in zip(opt.param_groups, ref.param_groups):
            ref_group["lr"] = group["lr"]
            key = "beta1" if group["algorithm"] == "adamw" else "mu"
            ref_group[key] = group["momentum"]
        momenta.append(opt.param_groups[0]["momentum"])
        grads = grads_for(step, ps)
        set_grads(ps, grads)
        set_grads(twin, grads)
        opt.step()
        ref.step()
        scheduler.step()
        assert_all_bitwise(ps, twin)
    assert len(set(momenta)) > 2  # it really cycled


def test_groups_have_dion_keys_until_a_scheduler_sets_momentum() -> None:
    ps = make_params()
    opt = make_opt(ps)
    assert all("momentum" not in g for g in opt.param_groups)
    opt.add_param_group({"params": [Parameter(torch.zeros(3))], "algorithm": "adamw"})
    assert "momentum" not in opt.param_groups[-1]
    opt.param_groups[0]["momentum"] = 1.5
    with pytest.raises(ValueError, match=r"param group 0: momentum \(the alias of mu / beta1\)"):
        opt.step()
