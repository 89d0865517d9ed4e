"""Attacks on the ``momentum`` alias for torch's schedulers (Muon's ``mu``, AdamW's
``beta1``), single process: given at construction or set later, refused before anything
changes, loaded all or nothing, cycled by OneCycleLR/CyclicLR like torch's AdamW, resumed
from state dicts, on groups added later and on copies.

Against independent references, as the module docstring of ``tests/support/counter_setup.py``
says; failing tests are escapes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from checks import assert_same_optimizers, clone_params, set_random_grads
from copies import COPY_METHODS
from counter_setup import (
    MUON_COUNT,
    assert_counters_mirror_groups,
    groups_of,
    make_opt,
    make_params,
    run_then_save,
    step_with,
    uninterrupted,
)
from torch.nn import Parameter

from shardmuon import Muon


def _cycling(name: str):
    from torch.optim.lr_scheduler import CyclicLR, OneCycleLR

    return {
        "OneCycleLR": lambda opt: OneCycleLR(opt, max_lr=0.05, total_steps=10),
        "CyclicLR": lambda opt: CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=2),
    }[name]


def test_momentum_given_in_the_group_dicts_at_construction_is_used() -> None:
    ps, ref_ps = make_params(), make_params()
    opt = Muon(
        [
            dict(params=ps[:MUON_COUNT], algorithm="muon", momentum=0.5),
            dict(params=ps[MUON_COUNT:], algorithm="adamw", momentum=0.7),
        ],
        lr=0.02,
    )
    ref = Muon(
        [
            dict(params=ref_ps[:MUON_COUNT], algorithm="muon", mu=0.5),
            dict(params=ref_ps[MUON_COUNT:], algorithm="adamw", beta1=0.7),
        ],
        lr=0.02,
    )
    for seed in range(3):
        step_with(opt, ps, seed)
        step_with(ref, ref_ps, seed)
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)


def test_momentum_none_leaves_mu_and_beta1() -> None:
    ps, ref_ps = make_params(), make_params()
    opt = Muon(groups_of(ps, momentum=None), mu=0.8)
    ref = Muon(groups_of(ref_ps), mu=0.8)
    opt.param_groups[1]["momentum"] = None
    for seed in range(2):
        step_with(opt, ps, seed)
        step_with(ref, ref_ps, seed)
    assert opt.param_groups[0]["mu"] == 0.8 and opt.param_groups[1]["beta1"] == 0.9
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)


BAD_MOMENTA = [
    (1.0, ValueError),
    (-0.1, ValueError),
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    ("0.9", TypeError),
    (True, TypeError),
    (torch.tensor([0.9, 0.8]), ValueError),
]


@pytest.mark.parametrize(("value", "error"), BAD_MOMENTA, ids=repr)
def test_a_bad_momentum_at_construction_is_refused_naming_it(value, error) -> None:
    with pytest.raises(error, match=r"param group 0: momentum \(the alias of mu / beta1\)"):
        Muon(groups_of(make_params(), momentum=value))


@pytest.mark.parametrize(("value", "error"), BAD_MOMENTA, ids=repr)
@pytest.mark.parametrize("group", [0, 1])
def test_a_bad_momentum_set_later_is_refused_before_anything_changes(value, error, group) -> None:
    ps = make_params()
    opt = make_opt(ps)
    step_with(opt, ps, 0)
    before_groups = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )
    before_params = [p.detach().clone() for p in ps]
    opt.param_groups[group]["momentum"] = value
    set_random_grads(ps, 1)
    with pytest.raises(error, match=rf"param group {group}: momentum"):
        opt.step()
    after = [
        {k: v for k, v in g.items() if k not in ("params", "momentum")} for g in opt.param_groups
    ]
    assert after == [{k: v for k, v in g.items() if k != "momentum"} for g in before_groups]
    assert all(torch.equal(p, b) for p, b in zip(ps, before_params))
    assert_counters_mirror_groups(opt)


def test_a_refused_momentum_in_one_group_changes_no_other_group() -> None:
    """Group 1's momentum is invalid: the refused step must not have copied group 0's
    (valid) momentum into its mu either — 'before anything changes'."""
    ps = make_params()
    opt = make_opt(ps, mu=0.95)
    opt.param_groups[0]["momentum"] = 0.5
    opt.param_groups[1]["momentum"] = 2.0
    set_random_grads(ps, 0)
    with pytest.raises(ValueError, match="param group 1: momentum"):
        opt.step()
    assert opt.param_groups[0]["mu"] == 0.95


def test_a_tensor_momentum_is_used_as_its_value() -> None:
    ps, ref_ps = make_params(), make_params()
    opt = make_opt(ps)
    opt.param_groups[0]["momentum"] = torch.tensor(0.8)
    ref = make_opt(ref_ps, mu=torch.tensor(0.8).item())
    for seed in range(2):
        step_with(opt, ps, seed)
        step_with(ref, ref_ps, seed)
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)
    again = make_opt(clone_params(ps))
    again.load_state_dict(copy.deepcopy(opt.state_dict()))


def test_load_state_dict_with_a_bad_momentum_is_all_or_nothing() -> None:
    """README: load_state_dict is all or nothing. A saved group with momentum=1.5 must be
    refused before anything is loaded; the optimizer keeps its groups and state."""
    _, _, saved = run_then_save()
    saved["param_groups"][0]["momentum"] = 1.5
    ps = make_params(seed=3)
    opt = make_opt(ps)
    step_with(opt, ps, 0)
    groups_before = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    )
    momentum_before = opt.state[ps[0]]["momentum"].clone()
    with pytest.raises(ValueError, match="momentum"):
        opt.load_state_dict(saved)
    assert [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ] == groups_before
    assert torch.equal(opt.state[ps[0]]["momentum"], momentum_before)
    step_with(opt, ps, 1)  # still able to step


def test_a_loaded_mu_is_not_overridden_by_a_momentum_set_before_the_load() -> None:
    """Loaded group settings take effect: a checkpoint (no momentum key, mu=0.95) loaded
    into an optimizer whose group had momentum=0.5 set by hand must step with mu=0.95,
    like the run that wrote it."""
    src_ps, _, saved = run_then_save()
    ref_ps, ref = uninterrupted(steps=4)
    ps = clone_params(src_ps)
    opt = make_opt(ps)
    opt.param_groups[0]["momentum"] = 0.5
    opt.load_state_dict(saved)
    step_with(opt, ps, 3)
    assert opt.param_groups[0]["mu"] == 0.95
    assert_same_optimizers(opt, ps, ref, ref_ps)


@pytest.mark.parametrize("name", ["OneCycleLR", "CyclicLR"])
def test_scheduler_resume_from_state_dicts_is_bitwise(name) -> None:
    make_scheduler = _cycling(name)
    ref_ps = make_params()
    ref = make_opt(ref_ps)
    ref_sched = make_scheduler(ref)
    ps = make_params()
    opt = make_opt(ps)
    sched = make_scheduler(opt)
    for seed in range(3):
        for o, s, p in ((ref, ref_sched, ref_ps), (opt, sched, ps)):
            step_with(o, p, seed)
            s.step()
    saved_opt, saved_sched = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    new_ps = clone_params(ps)
    new = make_opt(new_ps)
    new_sched = make_scheduler(new)
    new.load_state_dict(saved_opt)
    new_sched.load_state_dict(saved_sched)
    for seed in range(3, 7):
        for o, s, p in ((ref, ref_sched, ref_ps), (new, new_sched, new_ps)):
            step_with(o, p, seed)
            s.step()
    assert_same_optimizers(new, new_ps, ref, ref_ps)
    assert [g["momentum"] for g in new.param_groups] == [g["momentum"] for g in ref.param_groups]


@pytest.mark.parametrize("name", ["OneCycleLR", "CyclicLR"])
def test_adamw_beta1_cycles_like_torch_adamw_betas(name) -> None:
    """Independent reference: torch.optim.AdamW is a ``use_beta1`` optimizer (the scheduler
    writes ``betas``); the same scheduler must give our AdamW group the same beta1 at each
    step (read from what the step used: the group's beta1 after the step)."""
    make_scheduler = _cycling(name)
    ps = make_params()
    opt = make_opt(ps)
    sched = make_scheduler(opt)
    torch_opt = torch.optim.AdamW([Parameter(torch.zeros(2))], lr=0.02, betas=(0.9, 0.95))
    torch_sched = make_scheduler(torch_opt)
    ours, theirs = [], []
    for seed in range(6):
        step_with(opt, ps, seed)
        ours.append((opt.param_groups[1]["beta1"], opt.param_groups[1]["lr"]))
        theirs.append((torch_opt.param_groups[0]["betas"][0], torch_opt.param_groups[0]["lr"]))
        torch_opt.step()
        sched.step()
        torch_sched.step()
    assert ours == theirs
    assert opt.param_groups[1]["beta2"] == 0.95


def test_add_param_group_after_a_scheduler_keeps_dion_keys_and_its_own_beta1() -> None:
    from torch.optim.lr_scheduler import CyclicLR

    ps = make_params()
    opt = make_opt(ps)
    CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=2)
    extra = Parameter(torch.ones(4))
    opt.add_param_group({"params": [extra], "algorithm": "adamw", "beta1": 0.6, "lr": 0.01})
    assert "momentum" not in opt.param_groups[-1]
    for seed in range(3):  # (torch's CyclicLR.step itself refuses a group added later)
        set_random_grads(ps, seed)
        extra.grad = torch.full((4,), 0.1 * (seed + 1))
        opt.step()
    assert opt.param_groups[-1]["beta1"] == 0.6
    assert "momentum" in opt.param_groups[0]


def test_add_param_group_with_momentum_after_a_scheduler_uses_it() -> None:
    from torch.optim.lr_scheduler import CyclicLR

    ps = make_params()
    opt = make_opt(ps)
    CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=2)
    extra = Parameter(torch.ones(4))
    opt.add_param_group({"params": [extra], "algorithm": "adamw", "momentum": 0.7})
    extra.grad = torch.ones(4)
    step_with(opt, ps, 0)
    assert opt.param_groups[-1]["beta1"] == 0.7


def test_add_param_group_with_a_bad_momentum_is_refused_and_removed() -> None:
    ps = make_params()
    opt = make_opt(ps)
    with pytest.raises(ValueError, match="param group 2: momentum"):
        opt.add_param_group(
            {"params": [Parameter(torch.ones(4))], "algorithm": "adamw", "momentum": 1.2}
        )
    assert len(opt.param_groups) == 2
    step_with(opt, ps, 0)


def test_a_copy_keeps_momentum_in_defaults_for_schedulers() -> None:
    from torch.optim.lr_scheduler import OneCycleLR

    ps = make_params()
    opt = make_opt(ps)
    for copy_method in COPY_METHODS:
        clone_ps, clone = copy_method((ps, opt))
        OneCycleLR(clone, max_lr=0.05, total_steps=4)
        step_with(clone, clone_ps, 0)
