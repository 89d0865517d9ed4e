"""Attacks on this session's features, single process: per-parameter step counters, the
``momentum`` alias for torch's schedulers, ``MuonConfig``'s range checks and
``Muon.step_chunk`` (orders, retries after injected failures, offload).

Each test states the correct behaviour against an independent reference: an optimizer
never interrupted, an optimizer given the values by hand, torch's own optimizer driven by
the same scheduler, or the constructor's own checks. Failing tests are escapes.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from checks import assert_same_optimizers, set_random_grads
from copies import COPY_METHODS
from torch.nn import Parameter

import shardmuon.runtime.phases as phases
from shardmuon import Muon
from shardmuon.config import MuonConfig

SHAPES = [(8, 12), (8, 12), (12, 8), (2, 6, 10), (10,), (6,)]
MUON_COUNT = 4


def make_params(seed: int = 0, dtypes=None) -> list[Parameter]:
    gen = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * len(SHAPES)
    return [Parameter((torch.randn(s, generator=gen) * 0.1).to(d)) for s, d in zip(SHAPES, dtypes)]


def twin_of(params: list[Parameter]) -> list[Parameter]:
    return [Parameter(p.detach().clone()) for p in params]


def groups_of(params: list[Parameter], **muon_keys) -> list[dict]:
    return [
        dict(params=params[:MUON_COUNT], algorithm="muon", **muon_keys),
        dict(params=params[MUON_COUNT:], algorithm="adamw"),
    ]


def make_opt(params: list[Parameter], **kwargs) -> Muon:
    kwargs.setdefault("lr", 0.02)
    kwargs.setdefault("weight_decay", 0.1)
    return Muon(groups_of(params), **kwargs)


def step_with(opt: Muon, params, seed: int) -> None:
    set_random_grads(params, seed)
    opt.step()


def copy_in_place(target: dict, source: dict) -> None:
    """DCP's load into ``target = opt.state_dict()``: tensors overwritten in place; other
    values replaced in the dict only (they never reach the optimizer's groups)."""
    for index, entry in source["state"].items():
        for key, value in entry.items():
            target["state"][index][key].copy_(value)
    target["param_groups"] = source["param_groups"]


def counters(opt: Muon) -> list[list[float]]:
    return [[opt.state[p]["step"].item() for p in g["params"]] for g in opt.param_groups]


def assert_counters_mirror_groups(opt: Muon) -> None:
    for g, values in zip(opt.param_groups, counters(opt)):
        assert values == [float(g["step"])] * len(values), (g["step"], values)


# ============================================================ 1. step counters


def test_counters_are_float32_cpu_scalars_that_mirror_group_step() -> None:
    ps = make_params()
    opt = make_opt(ps)
    for p in ps:
        c = opt.state[p]["step"]
        assert c.dtype == torch.float32 and c.dim() == 0 and c.device.type == "cpu"
    for seed in range(3):
        step_with(opt, ps, seed)
    assert [g["step"] for g in opt.param_groups] == [3, 3]
    assert_counters_mirror_groups(opt)


def _run_then_save(offload=None, steps: int = 3):
    ps = make_params()
    opt = make_opt(ps, offload=offload)
    for seed in range(steps):
        step_with(opt, ps, seed)
    return ps, opt, copy.deepcopy(opt.state_dict())


def _uninterrupted(offload=None, steps: int = 5):
    ps = make_params()
    opt = make_opt(ps, offload=offload)
    for seed in range(steps):
        step_with(opt, ps, seed)
    return ps, opt


def _fresh_loaded_in_place(src_ps, saved, offload=None):
    ps = twin_of(src_ps)
    opt = make_opt(ps, offload=offload)
    copy_in_place(opt.state_dict(), saved)
    return ps, opt


@pytest.mark.parametrize("copy_method", COPY_METHODS, ids=lambda f: f.__name__)
def test_a_copy_made_right_after_an_in_place_load_keeps_the_loaded_count(copy_method) -> None:
    """README: copies of the optimizer step identically. After a DCP-style in-place load
    the count lives only in the counters until the next step; a copy taken then (deepcopy,
    pickle, torch.save) must still resume at step 4, like the uninterrupted run."""
    src_ps, _, saved = _run_then_save()
    ref_ps, ref = _uninterrupted()
    ps, opt = _fresh_loaded_in_place(src_ps, saved)
    clone_ps, clone = copy_method((ps, opt))
    for seed in range(3, 5):
        step_with(clone, clone_ps, seed)
    assert_same_optimizers(clone, clone_ps, ref, ref_ps)


def test_state_dict_right_after_an_in_place_load_round_trips_the_count() -> None:
    """Resume in place, save at once (before any step), resume that with load_state_dict:
    the count must still be 3 (the second state dict says group step 0, counters 3)."""
    src_ps, _, saved = _run_then_save()
    ref_ps, ref = _uninterrupted()
    ps, opt = _fresh_loaded_in_place(src_ps, saved)
    resaved = copy.deepcopy(opt.state_dict())
    again_ps = twin_of(ps)
    again = make_opt(again_ps)
    again.load_state_dict(resaved)
    for seed in range(3, 5):
        step_with(again, again_ps, seed)
    assert_same_optimizers(again, again_ps, ref, ref_ps)


@pytest.mark.parametrize("offload", [None, "state"])
def test_a_load_that_replaces_the_counters_instead_of_copying_resumes(offload) -> None:
    """A loader that puts new 0-d float32 tensors into ``state_dict()``'s entries (they are
    the optimizer's own entry dicts) instead of copying into the old ones."""
    src_ps, _, saved = _run_then_save(offload)
    ref_ps, ref = _uninterrupted(offload)
    ps = twin_of(src_ps)
    opt = make_opt(ps, offload=offload)
    target = opt.state_dict()
    for index, entry in saved["state"].items():
        target["state"][index]["step"] = entry["step"].clone()
        for key in ("momentum", "variance"):
            if key in entry:
                target["state"][index][key].copy_(entry[key])
    for seed in range(3, 5):
        step_with(opt, ps, seed)
    assert_same_optimizers(opt, ps, ref, ref_ps)


@pytest.mark.parametrize("offload", [None, "state"])
def test_in_place_load_then_add_param_group_then_resume(offload) -> None:
    """A replan (add_param_group) between the in-place load and the first step keeps the
    loaded count for the old groups; the new group starts at 0."""
    src_ps, _, saved = _run_then_save(offload)
    ref_ps, ref = _uninterrupted(offload)
    ps, opt = _fresh_loaded_in_place(src_ps, saved, offload)
    extra = Parameter(torch.zeros(4))
    opt.add_param_group({"params": [extra], "algorithm": "adamw"})
    for seed in range(3, 5):
        step_with(opt, ps, seed)
    assert [g["step"] for g in opt.param_groups] == [5, 5, 2]
    assert_counters_mirror_groups(opt)
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], ref.state[q][k]) for k in ref.state[q])


@pytest.mark.parametrize("offload", [None, "state"])
def test_in_place_load_then_step_chunk_rounds_in_reverse(offload) -> None:
    src_ps, _, saved = _run_then_save(offload)
    ref_ps, ref = _uninterrupted(offload)
    ps, opt = _fresh_loaded_in_place(src_ps, saved, offload)
    for seed in range(3, 5):
        set_random_grads(ps, seed)
        for chunk in reversed(opt.chunks()):
            opt.step_chunk(chunk)
    assert_same_optimizers(opt, ps, ref, ref_ps)


def test_an_edited_group_step_wins_in_a_step_chunk_round() -> None:
    """A hand-set ``group["step"] = 0`` restarts AdamW's bias correction (step 1), also
    when the round is stepped chunk by chunk with the AdamW chunk first. Reference: a
    load_state_dict of a dion-style dict (no counters) saying step 0."""
    ps, opt, _ = _run_then_save()
    ref_ps = twin_of(ps)
    ref = make_opt(ref_ps)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][1]["step"] = 0
    for entry in sd["state"].values():
        del entry["step"]
    ref.load_state_dict(sd)
    opt.param_groups[1]["step"] = 0
    set_random_grads(ps, 7)
    for chunk in sorted(opt.chunks(), key=lambda c: type(c).__name__ != "AdamWChunk"):
        opt.step_chunk(chunk)
    step_with(ref, ref_ps, 7)
    assert [g["step"] for g in opt.param_groups] == [4, 1]
    assert_counters_mirror_groups(opt)
    assert_same_optimizers(opt, ps, ref, ref_ps)


@pytest.mark.parametrize("offload", [None, "state"])
def test_a_dion_dict_without_counters_resumes_bitwise(offload) -> None:
    src_ps, _, saved = _run_then_save(offload)
    ref_ps, ref = _uninterrupted(offload)
    for entry in saved["state"].values():
        del entry["step"]
    ps = twin_of(src_ps)
    opt = make_opt(ps, offload=offload)
    opt.load_state_dict(saved)
    assert_counters_mirror_groups(opt)
    assert counters(opt)[1] == [3.0, 3.0]
    for seed in range(3, 5):
        step_with(opt, ps, seed)
    assert_same_optimizers(opt, ps, ref, ref_ps)


def test_a_dion_dict_with_state_for_only_some_params_creates_the_rest() -> None:
    """dion creates state lazily: a dict with state for the AdamW params only."""
    src_ps, _, saved = _run_then_save()
    adamw_ids = saved["param_groups"][1]["params"]
    saved["state"] = {
        i: {k: v for k, v in saved["state"][i].items() if k != "step"} for i in adamw_ids
    }
    ps = twin_of(src_ps)
    opt = make_opt(ps)
    opt.load_state_dict(saved)
    assert counters(opt) == [[3.0] * MUON_COUNT, [3.0, 3.0]]
    assert all(torch.count_nonzero(opt.state[p]["momentum"]) == 0 for p in ps[:MUON_COUNT])


def test_load_state_dict_group_step_wins_over_disagreeing_counters() -> None:
    """A whole load: the saved group's ``step`` rules; the counters follow it."""
    ps, _, saved = _run_then_save()
    saved["param_groups"][1]["step"] = 7
    fresh = make_opt(twin_of(ps))
    fresh.load_state_dict(saved)
    assert [g["step"] for g in fresh.param_groups] == [3, 7]
    assert_counters_mirror_groups(fresh)


def test_add_param_group_after_steps_starts_its_adamw_at_step_one() -> None:
    """The added group's bias correction starts at 1: its update equals a fresh optimizer
    holding just that parameter, stepped once."""
    ps = make_params()
    opt = make_opt(ps)
    for seed in range(2):
        step_with(opt, ps, seed)
    extra = Parameter(torch.linspace(-1, 1, 5))
    ref_extra = Parameter(extra.detach().clone())
    opt.add_param_group({"params": [extra], "algorithm": "adamw"})
    ref = Muon([{"params": [ref_extra], "algorithm": "adamw"}], lr=0.02, weight_decay=0.1)
    set_random_grads(ps, 5)
    extra.grad = torch.linspace(0.5, -0.3, 5)
    ref_extra.grad = extra.grad.clone()
    opt.step()
    ref.step()
    assert [g["step"] for g in opt.param_groups] == [3, 3, 1]
    assert_counters_mirror_groups(opt)
    assert torch.equal(extra, ref_extra)
    assert torch.equal(opt.state[extra]["variance"], ref.state[ref_extra]["variance"])


def test_add_param_group_with_an_explicit_step_keeps_it() -> None:
    ps = make_params()
    opt = make_opt(ps)
    step_with(opt, ps, 0)
    extra = Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra], "algorithm": "adamw", "step": 9})
    assert opt.state[extra]["step"].item() == 9.0
    extra.grad = torch.ones(3)
    step_with(opt, ps, 1)
    assert opt.param_groups[-1]["step"] == 10 and opt.state[extra]["step"].item() == 10.0


def test_a_step_refused_by_its_checks_advances_nothing() -> None:
    ps = make_params()
    opt = make_opt(ps)
    step_with(opt, ps, 0)
    ps[0].grad = ps[0].grad.to_sparse()  # refused by the step's checks
    with pytest.raises(TypeError, match="sparse grad"):
        opt.step()
    assert [g["step"] for g in opt.param_groups] == [1, 1]
    assert_counters_mirror_groups(opt)


def test_a_step_failing_after_its_checks_keeps_counters_and_groups_together(monkeypatch) -> None:
    """A failed step (documented: the counters advanced) must leave group steps and
    counters equal, so a checkpoint of it is self-consistent and reloads to that count."""
    ps = make_params()
    opt = make_opt(ps)
    step_with(opt, ps, 0)

    def boom(self, U, batch):
        raise RuntimeError("injected out of memory")

    monkeypatch.setattr(phases.StepContext, "orthogonalize", boom)
    set_random_grads(ps, 1)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    monkeypatch.undo()
    assert [g["step"] for g in opt.param_groups] == [2, 2]
    assert_counters_mirror_groups(opt)
    fresh = make_opt(twin_of(ps))
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [g["step"] for g in fresh.param_groups] == [2, 2]
    assert_counters_mirror_groups(fresh)


def test_group_step_keeps_advancing_past_float32_integers() -> None:
    """dion's ``group["step"]`` is an int: one step adds one, whatever its size. The
    float32 counters cannot hold 2**24 + 1; they must not drag the int back."""
    ps = make_params()
    opt = make_opt(ps)
    step_with(opt, ps, 0)
    opt.param_groups[1]["step"] = 2**24
    seen = []
    for seed in range(1, 4):
        step_with(opt, ps, seed)
        seen.append(opt.param_groups[1]["step"])
    assert seen == [2**24 + 1, 2**24 + 2, 2**24 + 3]


@pytest.mark.parametrize("copy_method", COPY_METHODS, ids=lambda f: f.__name__)
def test_copies_mid_training_step_identically_with_counters(copy_method) -> None:
    ps = make_params()
    opt = make_opt(ps, offload="state")
    for seed in range(2):
        step_with(opt, ps, seed)
    clone_ps, clone = copy_method((ps, opt))
    assert_counters_mirror_groups(clone)
    for seed in range(2, 4):
        step_with(opt, ps, seed)
        step_with(clone, clone_ps, seed)
    assert_same_optimizers(opt, ps, clone, clone_ps)


# ============================================================ 2. the momentum alias


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
    again = make_opt(twin_of(ps))
    again.load_state_dict(copy.deepcopy(opt.state_dict()))


def test_load_state_dict_with_a_bad_momentum_is_all_or_nothing() -> None:
    """README: load_state_dict is all or nothing. A saved group with momentum=1.5 must be
    refused before anything is loaded; the optimizer keeps its groups and state."""
    _, _, saved = _run_then_save()
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
    src_ps, _, saved = _run_then_save()
    ref_ps, ref = _uninterrupted(steps=4)
    ps = twin_of(src_ps)
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
    new_ps = twin_of(ps)
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


# ============================================================ 4. MuonConfig


@pytest.mark.parametrize(
    ("field", "text", "value"),
    [
        ("lr", "0.02", 0.02),
        ("lr", " 0.02 ", 0.02),
        ("lr", "1e-3", 1e-3),
        ("weight_decay", "0", 0.0),
        ("epsilon", "1e-12", 1e-12),
        ("mu", "0.9", 0.9),
        ("update_rms", "0.25", 0.25),
    ],
)
def test_config_reads_toml_ish_strings(field, text, value) -> None:
    assert getattr(MuonConfig(**{field: text}), field) == value


def test_config_reads_string_betas_and_tensors() -> None:
    assert MuonConfig(betas=["0.8", "0.99"]).betas == (0.8, 0.99)
    assert MuonConfig(lr=torch.tensor(0.5)).lr == 0.5
    assert isinstance(MuonConfig(lr=torch.tensor(0.5)).lr, float)


BAD_CONFIG = [
    ("lr", True),
    ("lr", False),
    ("lr", "nan"),
    ("lr", "inf"),
    ("lr", float("nan")),
    ("lr", -float("inf")),
    ("lr", "-0.1"),
    ("lr", torch.tensor([0.1, 0.2])),
    ("lr", torch.tensor(True)),
    ("lr", torch.tensor(float("nan"))),
    ("lr", None),
    ("lr", "fast"),
    ("lr", b"0.02x"),
    ("weight_decay", -1e-9),
    ("epsilon", 0),
    ("epsilon", 0.0),
    ("epsilon", "0"),
    ("epsilon", -0.0),
    ("mu", 1.0),
    ("mu", "1"),
    ("mu", -1e-12),
    ("update_rms", 0.0),
    ("update_rms", float("inf")),
    ("betas", (0.9, True)),
    ("betas", ("0.9", "nan")),
    ("betas", "0.9,0.95"),
    ("betas", (0.9, 0.95, 0.99)),
    ("betas", torch.tensor([0.9, 0.95])),
    ("max_in_flight", 0),
    ("max_in_flight", True),
    ("max_in_flight", 2.5),
    ("offload_prefetch", -1),
    ("workspace_bytes", 0),
    ("adjust_lr", "rms"),
]


@pytest.mark.parametrize(("field", "value"), BAD_CONFIG, ids=lambda v: repr(v)[:30])
def test_config_refuses_naming_the_field(field, value) -> None:
    with pytest.raises(ValueError) as info:
        MuonConfig(**{field: value})
    assert field in str(info.value)


@pytest.mark.parametrize("value", [10**400, -(10**400)], ids=["huge", "huge-negative"])
@pytest.mark.parametrize("field", ["lr", "weight_decay", "epsilon", "mu", "update_rms"])
def test_config_refuses_an_int_too_large_for_a_float_with_a_value_error(field, value) -> None:
    """Every bad config raises ValueError (the module docstring): a JSON/Python int beyond
    float range must be refused like inf, not escape as OverflowError."""
    with pytest.raises(ValueError, match=field):
        MuonConfig(**{field: value})


def test_config_from_json_with_a_huge_int_is_a_validation_error() -> None:
    with pytest.raises(ValueError, match="lr"):
        MuonConfig.model_validate_json('{"lr": 1' + "0" * 400 + "}")


def test_config_from_json_refuses_nan_and_inf() -> None:
    for text in ('{"lr": NaN}', '{"lr": Infinity}', '{"epsilon": 0}', '{"lr": 1e400}'):
        with pytest.raises(ValueError):
            MuonConfig.model_validate_json(text)


def test_config_accepts_numpy_scalars_as_before() -> None:
    """Before this session's refactor ``_number`` used ``float(value)``: a numpy float32
    (e.g. from ``np.logspace(...).astype(np.float32)`` in a sweep) was accepted. The range
    check now refuses every non-int/float, a regression for such configs."""
    np = pytest.importorskip("numpy")
    assert MuonConfig(lr=np.float32(0.5)).lr == 0.5
    assert MuonConfig(mu=np.float16(0.5)).mu == 0.5


NUMBERS = [0, 0.0, -0.0, 1e-300, 0.5, 0.999999, 1.0, 2, 1e300, -1e-9, math.inf, math.nan]


@pytest.mark.parametrize("value", NUMBERS, ids=repr)
@pytest.mark.parametrize("field", ["lr", "weight_decay", "epsilon", "mu", "update_rms"])
def test_config_and_constructor_accept_the_same_numbers(field, value) -> None:
    """The config's ranges are the constructor's, spelled once."""

    def accepted(build) -> bool:
        try:
            build()
        except (TypeError, ValueError):
            return False
        return True

    by_config = accepted(lambda: MuonConfig(**{field: value}))
    by_muon = accepted(lambda: Muon([Parameter(torch.zeros(2, 2))], **{field: value}))
    assert by_config == by_muon


def test_config_betas_and_constructor_agree() -> None:
    for pair in [(0.0, 0.0), (0.999, 0.5), (1.0, 0.5), (0.5, -0.1), (0.5, math.nan)]:
        try:
            Muon([Parameter(torch.zeros(2, 2))], betas=pair)
            by_muon = True
        except (TypeError, ValueError):
            by_muon = False
        try:
            MuonConfig(betas=pair)
            by_config = True
        except ValueError:
            by_config = False
        assert by_config == by_muon, pair


# ============================================================ 5. step_chunk


def _chunk_dtypes():
    return [
        torch.float32,
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.bfloat16,
        torch.float32,
    ]


def _pair(offload=None, nesterov=True, dtypes=None):
    dtypes = dtypes or _chunk_dtypes()
    ps, ref_ps = make_params(1, dtypes), make_params(1, dtypes)
    kw = dict(offload=offload, nesterov=nesterov, workspace_bytes=4096)
    return ps, make_opt(ps, **kw), ref_ps, make_opt(ref_ps, **kw)


ORDERS = {
    "forward": lambda n, r: list(range(n)),
    "reverse": lambda n, r: list(range(n))[::-1],
    "shuffled": lambda n, r: random.Random(r).sample(range(n), n),
}


@pytest.mark.parametrize("offload", [None, "state"])
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_step_chunk_in_any_order_equals_step(order, offload) -> None:
    ps, opt, ref_ps, ref = _pair(offload)
    assert len(opt.chunks()) >= 3
    for r in range(3):
        set_random_grads(ps, r)
        chunks = opt.chunks()
        for i in ORDERS[order](len(chunks), r):
            opt.step_chunk(chunks[i])
        step_with(ref, ref_ps, r)
    assert_same_optimizers(opt, ps, ref, ref_ps)


def _Once(real, at: int = 1):
    """Wrap ``real`` (a function, so that it binds as a method too): raise on call number
    ``at`` (1-based) once, then behave."""
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(*args, **kwargs)

    return wrapper


def _round_with_retries(opt: Muon, order) -> int:
    """Step a round in ``order``; a chunk that raises is retried at the end. Returns the
    number of failures seen."""
    chunks = opt.chunks()
    todo = [chunks[i] for i in order]
    failures = 0
    while todo:
        chunk = todo.pop(0)
        try:
            opt.step_chunk(chunk)
        except RuntimeError as error:
            assert "injected" in str(error)
            failures += 1
            todo.append(chunk)
    return failures


def _retry_case(monkeypatch, target, attr, make_wrapper, offload, order="reverse"):
    ps, opt, ref_ps, ref = _pair(offload)
    for r in range(3):
        set_random_grads(ps, r)
        step_with(ref, ref_ps, r)
        wrapper = make_wrapper(getattr(target, attr))
        monkeypatch.setattr(target, attr, wrapper)
        failures = _round_with_retries(opt, ORDERS[order](len(opt.chunks()), r))
        monkeypatch.undo()
        assert failures == 1
    assert_same_optimizers(opt, ps, ref, ref_ps)


@pytest.mark.parametrize("offload", [None, "state"])
@pytest.mark.parametrize("at", [1, 2])
def test_retry_after_orthogonalize_raised_before_it_ran(monkeypatch, offload, at) -> None:
    _retry_case(
        monkeypatch, phases.StepContext, "orthogonalize", lambda real: _Once(real, at), offload
    )


@pytest.mark.parametrize("offload", [None, "state"])
@pytest.mark.parametrize("at", [1, 3])
def test_retry_after_weight_update_raised_before_it_ran(monkeypatch, offload, at) -> None:
    _retry_case(monkeypatch, phases, "weight_update_", lambda real: _Once(real, at), offload)


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_adamw_raised_before_it_ran(monkeypatch, offload) -> None:
    _retry_case(monkeypatch, phases, "adamw_update_", lambda real: _Once(real, 1), offload)


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_nesterov_direction_raised(monkeypatch, offload) -> None:
    """The direction allocates after the momentum update: a failure there must not update
    the momentum twice on retry."""
    _retry_case(monkeypatch, phases, "direction", lambda real: _Once(real, 2), offload)


# The failures below happen inside the ops, after some in-place writes: what a real out
# of memory does (an allocation after the first in-place op). The docstrings promise that
# a retried chunk updates nothing twice.


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_newton_schulz_ran_out_of_memory_midway(monkeypatch, offload) -> None:
    """The folded Newton–Schulz normalises the batch's own buffer in place and iterates in
    it (overwrite_input=True); an OOM in its third iteration (the 2-matrix stack's fifth
    baddbmm) leaves the buffer holding an iterate, which the retry orthogonalizes again."""
    _retry_case(monkeypatch, torch, "baddbmm", lambda real: _Once(real, 5), offload)


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_adamw_ran_out_of_memory_midway(monkeypatch, offload) -> None:
    """An OOM in AdamW's ``_foreach_sqrt`` (after the momentum and variance lerps) must not
    lerp them again on retry."""
    _retry_case(monkeypatch, torch, "_foreach_sqrt", lambda real: _Once(real, 1), offload)


class _FailingResults:
    """Stands for the bf16 results: slicing them (the fp32 cast that follows) runs out of
    memory once, as ``ortho[...].to(torch.float32)`` in weight_update_ can."""

    def __init__(self, real):
        self.real = real

    def __getitem__(self, index):
        raise RuntimeError("CUDA out of memory (injected, in weight_update_)")


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_weight_update_ran_out_of_memory_after_the_decay(monkeypatch, offload) -> None:
    """weight_update_ applies the decay in place, then allocates the fp32 step: an OOM
    there must not decay the parameter twice on retry."""
    real = phases.weight_update_

    def make_wrapper(_):
        state = {"fired": False}

        def wrapper(param, ortho, lr, wd, row_scales):
            if not state["fired"]:
                state["fired"] = True
                return real(param, _FailingResults(ortho), lr, wd, row_scales)
            return real(param, ortho, lr, wd, row_scales)

        return wrapper

    _retry_case(monkeypatch, phases, "weight_update_", make_wrapper, offload)


def test_a_chunk_stepped_twice_or_stale_is_refused() -> None:
    ps, opt, _, _ = _pair()
    set_random_grads(ps, 0)
    chunks = opt.chunks()
    opt.step_chunk(chunks[0])
    with pytest.raises(RuntimeError, match="already stepped in this round"):
        opt.step_chunk(chunks[0])
    with pytest.raises(RuntimeError, match="step_chunk"):
        opt.step()
    for chunk in chunks[1:]:
        opt.step_chunk(chunk)
    opt.param_groups[0]["epsilon"] = 1e-7  # a planned setting: new chunks
    with pytest.raises(ValueError, match="not in this optimizer's chunks"):
        opt.step_chunk(chunks[0])


def test_a_round_whose_first_chunk_fails_its_checks_is_not_opened() -> None:
    ps, opt, ref_ps, ref = _pair()
    set_random_grads(ps, 0)
    ps[0].grad = ps[0].grad.to_sparse()
    with pytest.raises(TypeError, match="sparse grad"):
        opt.step_chunk(opt.chunks()[0])
    assert [g["step"] for g in opt.param_groups] == [0, 0]
    set_random_grads(ps, 0)
    opt.step()
    step_with(ref, ref_ps, 0)
    assert_same_optimizers(opt, ps, ref, ref_ps)


def test_a_round_stuck_on_a_chunk_that_keeps_failing_can_be_ended_by_restoring(monkeypatch) -> None:
    """A local chunk that fails every time (a batch too large for the memory left): the
    user restores a checkpoint. load_state_dict must end the round (as it does for a
    broken one) instead of refusing forever, leaving the optimizer unusable."""
    ps, opt, ref_ps, ref = _pair()
    step_with(opt, ps, 0)
    step_with(ref, ref_ps, 0)
    saved = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in ps]

    def always(self, U, batch):
        raise RuntimeError("CUDA out of memory (injected, every time)")

    monkeypatch.setattr(phases.StepContext, "orthogonalize", always)
    set_random_grads(ps, 1)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step_chunk(opt.chunks()[0])
    monkeypatch.undo()
    with torch.no_grad():
        for p, s in zip(ps, saved_params):
            p.copy_(s)
    opt.load_state_dict(saved)
    step_with(opt, ps, 1)
    step_with(ref, ref_ps, 1)
    assert_same_optimizers(opt, ps, ref, ref_ps)
