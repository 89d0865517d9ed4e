"""Every group setting of ``shardmuon.Muon`` is live: a setting edited into a group or loaded
with a state dict == an optimizer constructed with that setting from the start (same params,
grads and state), and != one that kept the old setting (so the test would fail if the
setting were silently ignored). A bad edit raises before anything changes.

Single process, CPU; compared bitwise.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from checks import (
    assert_same,
    assert_same_optimizers,
    assert_unchanged,
    clone_params,
    differs,
    optimizer_snapshot,
)
from fidelity_setup import copy_state, mixed, mixed_params, step_with

pytestmark = pytest.mark.usefixtures("one_thread")


LIVE_SETTINGS = [
    # (group index, key, new value); the optimizer starts with MIXED_KWARGS
    (0, "adjust_lr", "spectral_norm"),
    (0, "adjust_lr", "keller_muon"),
    (0, "adjust_lr", None),
    (0, "epsilon", 1.0),
    (0, "flatten", True),
    (0, "lr", 0.05),
    (0, "weight_decay", 0.0),
    (0, "mu", 0.5),
    (0, "nesterov", True),
    (1, "lr", 0.05),
    (1, "epsilon", 0.01),
    (1, "beta1", 0.5),
    (1, "beta2", 0.5),
    (1, "weight_decay", 0.3),
]


@pytest.mark.parametrize("steps_before", [0, 1])
@pytest.mark.parametrize("how", ["edit", "load_state_dict"])
@pytest.mark.parametrize(("index", "key", "value"), LIVE_SETTINGS)
def test_changed_group_setting_takes_effect(
    index: int, key: str, value: Any, how: str, steps_before: int
) -> None:
    params = mixed_params()
    opt = mixed(params)
    for s in range(steps_before):
        step_with(opt, params, s)
    # References from the same point: constructed with the new value, and with the old one.
    ref_params, old_params = clone_params(params), clone_params(params)
    ref = mixed(ref_params, {index: {key: value}})
    old = mixed(old_params)
    copy_state(opt, params, ref, ref_params)
    copy_state(opt, params, old, old_params)

    if how == "edit":
        opt.param_groups[index][key] = value
    else:
        sd = copy.deepcopy(opt.state_dict())
        sd["param_groups"][index][key] = value
        opt.load_state_dict(sd)
    assert opt.param_groups[index][key] == value
    for s in range(steps_before, steps_before + 2):
        step_with(opt, params, s)
        step_with(ref, ref_params, s)
        step_with(old, old_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)
    assert differs(params, old_params), "the new value must change the update"


def test_update_rms_edit_takes_effect() -> None:
    params = mixed_params()
    opt = mixed(params, update_rms=0.2)
    step_with(opt, params, 0)
    ref_params, old_params = clone_params(params), clone_params(params)
    ref = mixed(ref_params, update_rms=0.35)
    old = mixed(old_params, update_rms=0.2)
    copy_state(opt, params, ref, ref_params)
    copy_state(opt, params, old, old_params)
    opt.update_rms = 0.35
    for s in (1, 2):
        step_with(opt, params, s)
        step_with(ref, ref_params, s)
        step_with(old, old_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)
    assert differs(params, old_params)


def test_update_rms_edit_to_a_bad_value_raises_at_assignment() -> None:
    params = mixed_params()
    opt = mixed(params)
    step_with(opt, params, 0)
    snap = optimizer_snapshot(opt, params)
    with pytest.raises(ValueError, match=r"update_rms must be a finite number > 0, got -1\.0"):
        opt.update_rms = -1.0
    assert opt.update_rms == 0.2
    assert_unchanged(opt, params, snap)


@pytest.mark.parametrize(
    ("index", "saved", "pattern"),
    [
        (
            0,
            "adamw",
            r"param group 0 of the state dict is a 'adamw' group, this optimizer's is 'muon'",
        ),
        (
            1,
            "muon",
            r"param group 1 of the state dict is a 'muon' group, this optimizer's is 'adamw'",
        ),
    ],
)
def test_state_dict_with_another_algorithm_is_refused(index: int, saved: str, pattern: str) -> None:
    params = mixed_params()
    opt = mixed(params)
    step_with(opt, params, 0)
    before = copy.deepcopy(opt.state_dict())
    sd = copy.deepcopy(before)
    sd["param_groups"][index]["algorithm"] = saved
    with pytest.raises(ValueError, match=pattern):
        opt.load_state_dict(sd)
    assert_same(opt.state_dict(), before)
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw"]
