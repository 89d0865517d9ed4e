"""Group settings through a checkpoint loaded *in place* (DCP into the tensors of
``state_dict()``, without ``load_state_dict``: prime-rl's loader): the scheduled settings
(``lr``, ``mu``, ``beta1``, ``beta2``, ``weight_decay``) are handed out as tensors and the next step
adopts what the load wrote into them, so a warm-up schedule resumes where it stopped, bitwise
against the uninterrupted run, with and without offload. A whole ``load_state_dict`` of the
same dict gives plain numbers back."""

from __future__ import annotations

import copy

import pytest
import torch
from checks import clone_params
from counter_setup import make_opt, make_params, step_with
from torch.optim.lr_scheduler import LinearLR

STEPS, SAVED_AT = 8, 3


def _load_in_place(target: dict, source: dict) -> None:
    """What DCP does to ``target = opt.state_dict()``: every tensor, in the state and in the
    groups, overwritten in place; other values replaced in the
    dict only (they never reach the optimizer)."""
    for index, entry in source["state"].items():
        for key, value in entry.items():
            target["state"][index][key].copy_(value)
    for mine, theirs in zip(target["param_groups"], source["param_groups"]):
        for key, value in theirs.items():
            if isinstance(mine.get(key), torch.Tensor):
                mine[key].copy_(value)
            elif isinstance(mine.get(key), tuple) and isinstance(mine[key][0], torch.Tensor):
                for t, v in zip(mine[key], value):
                    t.copy_(v)
            else:
                mine[key] = value


def _build(ps, offload):
    opt = make_opt(ps, offload=offload)
    # Settings a run changed by hand before the checkpoint: they must come back as well.
    opt.param_groups[0]["mu"] = 0.9
    opt.param_groups[1]["beta1"], opt.param_groups[1]["beta2"] = 0.8, 0.97
    opt.param_groups[1]["weight_decay"] = 0.03
    schedule = LinearLR(opt, start_factor=1e-8, end_factor=1.0, total_iters=6)
    return opt, schedule


def _train(opt, schedule, ps, seeds, lrs) -> None:
    for seed in seeds:
        step_with(opt, ps, seed)
        schedule.step()
        lrs.append([g["lr"] for g in opt.param_groups])


@pytest.mark.parametrize("offload", [None, "state"])
def test_a_warmup_schedule_resumes_bitwise_after_an_in_place_load(offload) -> None:
    reference_ps = make_params()
    reference, reference_schedule = _build(reference_ps, offload)
    reference_lrs: list = []
    _train(reference, reference_schedule, reference_ps, range(STEPS), reference_lrs)

    ps = make_params()
    opt, schedule = _build(ps, offload)
    lrs: list = []
    _train(opt, schedule, ps, range(SAVED_AT), lrs)
    saved = copy.deepcopy(opt.state_dict())
    saved_schedule = copy.deepcopy(schedule.state_dict())
    saved_ps = clone_params(ps)

    # A fresh run of the same job: its optimizer built anew (default settings, the
    # schedule's first factor), the checkpoint loaded in place.
    resumed_ps = clone_params(saved_ps)
    resumed = make_opt(resumed_ps, offload=offload)
    resumed_schedule = LinearLR(resumed, start_factor=1e-8, end_factor=1.0, total_iters=6)
    _load_in_place(resumed.state_dict(), saved)
    resumed_schedule.load_state_dict(saved_schedule)
    _train(resumed, resumed_schedule, resumed_ps, range(SAVED_AT, STEPS), lrs)

    assert lrs == reference_lrs
    for p, q in zip(resumed_ps, reference_ps):
        assert torch.equal(p, q)
    for live, want in zip(resumed.param_groups, reference.param_groups):
        for key in ("lr", "mu", "beta1", "beta2", "weight_decay", "step"):
            assert live.get(key) == want.get(key), key


def test_without_a_load_the_groups_own_values_rule_and_a_whole_load_gives_numbers() -> None:
    """A scheduler changing the groups after ``state_dict()`` is not undone (nothing was
    loaded into the handed-out tensors); ``load_state_dict`` of such a dict leaves plain
    numbers in the groups, equal to what was saved."""
    ps = make_params()
    opt = make_opt(ps)
    step_with(opt, ps, 0)
    handed = opt.state_dict()
    assert isinstance(handed["param_groups"][0]["lr"], torch.Tensor)
    assert isinstance(handed["param_groups"][1]["beta2"], torch.Tensor)
    opt.param_groups[0]["lr"] = 0.5
    step_with(opt, ps, 1)
    assert opt.param_groups[0]["lr"] == 0.5
    other = make_opt(make_params())
    other.load_state_dict(copy.deepcopy(handed))
    for group, saved in zip(other.param_groups, handed["param_groups"]):
        for key in ("lr", "mu", "beta1", "beta2", "weight_decay"):
            assert type(group[key]) is float and group[key] == float(saved[key]), key
