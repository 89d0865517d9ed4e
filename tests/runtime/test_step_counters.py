"""Attacks on the per-parameter step counters, single process: float32 scalars that mirror
each group's ``step`` through in-place (DCP-style) and whole loads, dion dicts without
counters, copies, ``add_param_group``, refused and failed steps, and ints past float32.

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
    counters,
    make_opt,
    make_params,
    run_then_save,
    step_with,
    uninterrupted,
)
from torch.nn import Parameter

import shardmuon.runtime.phases as phases
from shardmuon import Muon


def copy_in_place(target: dict, source: dict) -> None:
    """DCP's load into ``target = opt.state_dict()``: tensors overwritten in place; other
    values replaced in the dict only (they never reach the optimizer's groups)."""
    for index, entry in source["state"].items():
        for key, value in entry.items():
            target["state"][index][key].copy_(value)
    target["param_groups"] = source["param_groups"]


def _fresh_loaded_in_place(src_ps, saved, offload=None):
    ps = clone_params(src_ps)
    opt = make_opt(ps, offload=offload)
    copy_in_place(opt.state_dict(), saved)
    return ps, opt


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


@pytest.mark.parametrize("copy_method", COPY_METHODS, ids=lambda f: f.__name__)
def test_a_copy_made_right_after_an_in_place_load_keeps_the_loaded_count(copy_method) -> None:
    """README: copies of the optimizer step identically. After a DCP-style in-place load
    the count lives only in the counters until the next step; a copy taken then (deepcopy,
    pickle, torch.save) must still resume at step 4, like the uninterrupted run."""
    src_ps, _, saved = run_then_save()
    ref_ps, ref = uninterrupted()
    ps, opt = _fresh_loaded_in_place(src_ps, saved)
    clone_ps, clone = copy_method((ps, opt))
    for seed in range(3, 5):
        step_with(clone, clone_ps, seed)
    assert_same_optimizers(clone, clone_ps, ref, ref_ps)


def test_state_dict_right_after_an_in_place_load_round_trips_the_count() -> None:
    """Resume in place, save at once (before any step), resume that with load_state_dict:
    the count must still be 3 (the second state dict says group step 0, counters 3)."""
    src_ps, _, saved = run_then_save()
    ref_ps, ref = uninterrupted()
    ps, opt = _fresh_loaded_in_place(src_ps, saved)
    resaved = copy.deepcopy(opt.state_dict())
    again_ps = clone_params(ps)
    again = make_opt(again_ps)
    again.load_state_dict(resaved)
    for seed in range(3, 5):
        step_with(again, again_ps, seed)
    assert_same_optimizers(again, again_ps, ref, ref_ps)


@pytest.mark.parametrize("offload", [None, "state"])
def test_a_load_that_replaces_the_counters_instead_of_copying_resumes(offload) -> None:
    """A loader that puts new 0-d float32 tensors into ``state_dict()``'s entries (they are
    the optimizer's own entry dicts) instead of copying into the old ones."""
    src_ps, _, saved = run_then_save(offload)
    ref_ps, ref = uninterrupted(offload)
    ps = clone_params(src_ps)
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
    src_ps, _, saved = run_then_save(offload)
    ref_ps, ref = uninterrupted(offload)
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
    src_ps, _, saved = run_then_save(offload)
    ref_ps, ref = uninterrupted(offload)
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
    ps, opt, _ = run_then_save()
    ref_ps = clone_params(ps)
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
    src_ps, _, saved = run_then_save(offload)
    ref_ps, ref = uninterrupted(offload)
    for entry in saved["state"].values():
        del entry["step"]
    ps = clone_params(src_ps)
    opt = make_opt(ps, offload=offload)
    opt.load_state_dict(saved)
    assert_counters_mirror_groups(opt)
    assert counters(opt)[1] == [3.0, 3.0]
    for seed in range(3, 5):
        step_with(opt, ps, seed)
    assert_same_optimizers(opt, ps, ref, ref_ps)


def test_a_dion_dict_with_state_for_only_some_params_creates_the_rest() -> None:
    """dion creates state lazily: a dict with state for the AdamW params only."""
    src_ps, _, saved = run_then_save()
    adamw_ids = saved["param_groups"][1]["params"]
    saved["state"] = {
        i: {k: v for k, v in saved["state"][i].items() if k != "step"} for i in adamw_ids
    }
    ps = clone_params(src_ps)
    opt = make_opt(ps)
    opt.load_state_dict(saved)
    assert counters(opt) == [[3.0] * MUON_COUNT, [3.0, 3.0]]
    assert all(torch.count_nonzero(opt.state[p]["momentum"]) == 0 for p in ps[:MUON_COUNT])


def test_load_state_dict_group_step_wins_over_disagreeing_counters() -> None:
    """A whole load: the saved group's ``step`` rules; the counters follow it."""
    ps, _, saved = run_then_save()
    saved["param_groups"][1]["step"] = 7
    fresh = make_opt(clone_params(ps))
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
    fresh = make_opt(clone_params(ps))
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
