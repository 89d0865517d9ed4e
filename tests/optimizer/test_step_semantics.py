"""What a step does: ``zero_grad``, parameters without grads, closures, going the right way,
determinism, ``add_param_group``, dtypes, and no warnings.

One of PyTorch's generic optimizer checks applied to ``shardmuon.Muon``, as the module
docstring of ``tests/support/generic_setup.py`` describes them.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from checks import assert_all_bitwise, assert_same, clone_params, grads_for, set_grads, snapshot
from generic_setup import (
    BASE,
    OPTIM_FACTORIES,
    OPTIM_IDS,
    dion_state,
    make_opt,
    make_params,
    step_both,
)
from torch import Tensor
from torch.nn import Parameter

from shardmuon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")


def without_counters(state: dict) -> dict:
    """A state dict's ``state`` without the ``step`` counters."""
    return {i: {k: v for k, v in entry.items() if k != "step"} for i, entry in state.items()}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none: bool) -> None:
    """torch's test_step_is_noop_when_params_have_no_grad / _for_zero_grads.

    ``set_to_none=True`` (after a first step, with weight decay): the next step skips every
    parameter, state included. ``set_to_none=False`` on a fresh optimizer without weight
    decay: zero grads give a zero update and zero state.
    """
    ps = make_params()
    opt = make_opt(ps, weight_decay=0.1 if set_to_none else 0.0)
    if set_to_none:
        step_both([(opt, ps)], 0)
    set_grads(ps, grads_for(1, ps))
    grads = [p.grad for p in ps]
    opt.zero_grad(set_to_none=set_to_none)
    if set_to_none:
        assert all(p.grad is None for p in ps)
    else:
        assert all(p.grad is g for p, g in zip(ps, grads))
        assert all(torch.count_nonzero(p.grad) == 0 for p in ps)
    before, state_before = snapshot(ps), copy.deepcopy(opt.state_dict())
    opt.step()
    assert_all_bitwise(ps, before)
    steps = 2 if set_to_none else 1
    assert [g["step"] for g in opt.param_groups] == [steps, steps]
    assert_same(
        without_counters(opt.state_dict()["state"]), without_counters(state_before["state"])
    )
    assert all(opt.state[p]["step"].item() == steps for p in ps)
    if not set_to_none:
        assert all(torch.count_nonzero(v) == 0 for p in ps for v in dion_state(opt, p))


SUBSETS = {
    "none": [],
    "muon only": [0, 1, 2],
    "adamw only": [3],
    "3-D only": [2],
    "all but the first": [1, 2, 3],
    "all": [0, 1, 2, 3],
}


@pytest.mark.parametrize("subset", list(SUBSETS))
def test_params_without_grad_are_skipped(subset: str) -> None:
    """No momentum, no decay, no update for a param without a grad; the others as if alone."""
    with_grad = SUBSETS[subset]
    ps = make_params()
    ps[0].requires_grad_(0 in with_grad)  # also a frozen param, kept in its group
    opt = make_opt(ps)
    ref_ps = clone_params([ps[i] for i in with_grad])
    ref_groups = [
        g
        for g in (
            dict(params=[q for i, q in zip(with_grad, ref_ps) if i < 3], algorithm="muon"),
            dict(params=[q for i, q in zip(with_grad, ref_ps) if i == 3], algorithm="adamw"),
        )
        if g["params"]
    ]
    ref = Muon(ref_groups, **BASE) if ref_groups else None
    initial = snapshot(ps)
    for step in range(3):
        grads = grads_for(step, ps)
        for i, p in enumerate(ps):
            p.grad = grads[i].clone() if i in with_grad else None
        set_grads(ref_ps, [grads[i] for i in with_grad])
        opt.step()
        if ref is not None:
            ref.step()
    for i, p in enumerate(ps):
        if i in with_grad:
            assert_all_bitwise([p.detach()], [ref_ps[with_grad.index(i)].detach()])
        else:
            assert_all_bitwise([p.detach()], [initial[i]])
            assert all(torch.count_nonzero(v) == 0 for v in dion_state(opt, p))
    assert [g["step"] for g in opt.param_groups] == [3, 3]
    assert all(opt.state[p]["step"].item() == 3 for p in ps)  # dion: the group's count


def test_closure() -> None:
    """step(closure) evaluates it once, with grad enabled, and returns its loss."""
    ps, ref_ps = make_params(), make_params()
    opt, ref = make_opt(ps), make_opt(ref_ps)
    targets = [t.detach() * 10 for t in make_params(seed=1)]

    def loss_of(params: list[Tensor]) -> Tensor:
        return sum(((p - t) ** 2).sum() for p, t in zip(params, targets))

    calls = []

    def closure() -> Tensor:
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_of(ps)
        loss.backward()
        return loss

    for _ in range(3):
        ref.zero_grad()
        expected_loss = loss_of(ref_ps)
        expected_loss.backward()
        ref.step()
        loss = opt.step(closure)
        assert isinstance(loss, Tensor) and torch.equal(loss.detach(), expected_loss.detach())
        assert_all_bitwise(ps, snapshot(ref_ps))
    assert calls == [True] * 3


@pytest.mark.parametrize("kwargs", OPTIM_FACTORIES, ids=OPTIM_IDS)
def test_goes_in_the_right_direction(kwargs: Callable[[], dict]) -> None:
    """torch's test_forloop_goes_right_direction: a quadratic loss decreases."""
    ps = make_params()
    opt = make_opt(ps, **kwargs())
    targets = [t.detach() * 10 for t in make_params(seed=1)]

    def closure() -> Tensor:
        opt.zero_grad()
        loss = sum(((p - t) ** 2).sum() for p, t in zip(ps, targets))
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(5):
        opt.step(closure)
    assert closure().item() < initial


@pytest.mark.parametrize("kwargs", OPTIM_FACTORIES, ids=OPTIM_IDS)
def test_two_identical_optimizers_are_bitwise_identical(kwargs: Callable[[], dict]) -> None:
    runs = []
    for _ in range(2):
        ps = make_params()
        runs.append((make_opt(ps, **kwargs()), ps))
    for step in range(3):
        step_both(runs, step)
    (a, a_ps), (b, b_ps) = runs
    assert_all_bitwise(a_ps, snapshot(b_ps))
    assert_same(a.state_dict(), b.state_dict())


# ------------------------------------------------------------------- param groups


@pytest.mark.parametrize("steps_before", [0, 2])
def test_add_param_group_then_step(steps_before: int) -> None:
    """Groups added later step as if they had their own optimizer from that point."""
    ps = make_params()
    opt = Muon([dict(params=ps[:1], algorithm="muon")], **BASE)
    old_ref_ps = clone_params(ps[:1])
    old_ref = Muon([dict(params=old_ref_ps, algorithm="muon")], **BASE)
    for step in range(steps_before):
        step_both([(opt, ps[:1]), (old_ref, old_ref_ps)], step)
    opt.add_param_group(dict(params=ps[1:3], algorithm="muon", lr=0.03))
    opt.add_param_group(dict(params=ps[3:], algorithm="adamw"))
    assert [g["step"] for g in opt.param_groups] == [steps_before, 0, 0]
    assert opt.param_groups[1]["lr"] == 0.03 and opt.param_groups[2]["lr"] == BASE["lr"]
    new_ref_ps = clone_params(ps[1:])
    new_ref = Muon(
        [
            dict(params=new_ref_ps[:2], algorithm="muon", lr=0.03),
            dict(params=new_ref_ps[2:], algorithm="adamw"),
        ],
        **BASE,
    )
    for step in range(steps_before, steps_before + 3):
        grads = grads_for(step, ps)
        set_grads(ps, grads)
        set_grads(old_ref_ps, grads[:1])
        set_grads(new_ref_ps, grads[1:])
        opt.step()
        old_ref.step()
        new_ref.step()
    assert_all_bitwise(ps, snapshot(old_ref_ps + new_ref_ps))
    assert [g["step"] for g in opt.param_groups] == [steps_before + 3, 3, 3]


# ------------------------------------------------------------------------ dtypes

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "mixed": [torch.float64, torch.float32, torch.bfloat16, torch.bfloat16],
}
# Relative distance of the update (param - initial) from a float64 run after 3 steps, by the
# param's dtype. Newton-Schulz runs in bf16 for every dtype, so float32 is near float64 (seen:
# < 1e-6; the margin allows a flipped bf16 rounding); bf16 params round each update (seen: 4%).
DTYPE_TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-3, torch.bfloat16: 0.1}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_dtypes(dtype_name: str) -> None:
    """State in each param's dtype, params keep it, updates close to a float64 run."""
    ps = make_params(DTYPES[dtype_name])
    dtypes = [p.dtype for p in ps]
    opt = make_opt(ps)
    ref_ps = [Parameter(p.detach().double()) for p in ps]
    ref = make_opt(ref_ps)
    initial = snapshot(ref_ps)
    for step in range(3):
        grads = grads_for(step, ps)
        set_grads(ps, grads)
        set_grads(ref_ps, [g.double() for g in grads])
        opt.step()
        ref.step()
    assert [p.dtype for p in ps] == dtypes
    for p in ps:
        assert all(v.dtype == p.dtype for v in dion_state(opt, p))
    for i, (p, r, x0) in enumerate(zip(ps, ref_ps, initial)):
        delta = (r.detach() - x0).norm()
        err = (p.detach().double() - r.detach()).norm() / delta
        assert err < DTYPE_TOLERANCE[p.dtype], f"param {i} ({p.dtype}): {err:.3g}"

    # a float32 state dict loaded into these params is cast to each param's dtype
    src_ps = make_params()
    src = make_opt(src_ps)
    step_both([(src, src_ps)], 0)
    opt.load_state_dict(copy.deepcopy(src.state_dict()))
    for p in ps:
        assert all(v.dtype == p.dtype for v in dion_state(opt, p))
    step_both([(opt, ps)], 3)
    assert all(torch.isfinite(p).all() for p in ps)


def test_no_warnings_on_a_plain_step() -> None:
    ps = make_params()
    opt = make_opt(ps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step_both([(opt, ps)], 0)
        opt.state_dict()
