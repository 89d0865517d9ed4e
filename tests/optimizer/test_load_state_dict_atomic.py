"""``load_state_dict`` is atomic: every defective state dict is refused naming the defect, with
the optimizer left bitwise as it was and stepping like one that never saw it; the good ones
(round trip, non-dict entries, missing entries made as zeros) load and step bitwise.

Single process, CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from checks import (
    assert_same,
    assert_same_optimizers,
    clone_params,
    grads_for_shapes,
    set_grads,
    state_tensor_keys,
)
from fidelity_setup import copy_state, param, step_with
from torch import Tensor, nn

from shardmuon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")


# Optimizer for these tests: muon group (a [16, 8], b [8, 8]), adamw group (c [8], d [4]);
# saved state ids 0, 1 (muon), 2, 3 (adamw).
FIVE_SHAPES = [(16, 8), (8, 8), (8,), (4,)]


def _five_params(seed: int = 0) -> list[nn.Parameter]:
    return [param(s, seed + i) for i, s in enumerate(FIVE_SHAPES)]


def _five(params: list[Tensor]) -> Muon:
    return Muon(
        [dict(params=params[:2]), dict(params=params[2:], algorithm="adamw")],
        lr=0.02,
        weight_decay=0.1,
    )


def _set(path: tuple, value: Any) -> Callable[[dict], dict]:
    def edit(sd: dict) -> dict:
        target = sd
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return sd

    return edit


def _delete(path: tuple) -> Callable[[dict], dict]:
    def edit(sd: dict) -> dict:
        target = sd
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return sd

    return edit


def _pop_group(sd: dict) -> dict:
    sd["param_groups"].pop()
    return sd


def _pop_param(sd: dict) -> dict:
    sd["param_groups"][0]["params"].pop()
    return sd


def _torch_adamw(_: dict) -> dict:
    params = _five_params()
    other = torch.optim.AdamW(params)
    set_grads(params, grads_for_shapes(FIVE_SHAPES, 0))
    other.step()
    return other.state_dict()


def _torch_muon(_: dict) -> dict:
    params = _five_params()[:2]
    other = torch.optim.Muon(params)
    set_grads(params, grads_for_shapes(FIVE_SHAPES[:2], 0))
    other.step()
    return other.state_dict()


BAD_STATE_DICTS = [
    # (id, defect, exception, message pattern)
    ("groups", _pop_group, ValueError, r"the state dict has 1 param groups, this optimizer has 2"),
    (
        "params",
        _pop_param,
        ValueError,
        r"param group 0 of the state dict has 1 parameters, this optimizer's has 2",
    ),
    (
        "algorithm",
        _set(("param_groups", 0, "algorithm"), "adamw"),
        ValueError,
        r"param group 0 of the state dict is a 'adamw' group, this optimizer's is 'muon'",
    ),
    (
        "unknown-algorithm",
        _set(("param_groups", 1, "algorithm"), "lion"),
        ValueError,
        r"param group 1 of the state dict is a 'lion' group, this optimizer's is 'adamw'",
    ),
    (
        "no-variance",
        _delete(("state", 2, "variance")),
        ValueError,
        r"param group 1 parameter 0 \('adamw'\): saved state has keys \['momentum'\], "
        r"expected \['momentum', 'variance'\]",
    ),
    (
        "extra-key",
        _set(("state", 0, "extra"), torch.zeros(16, 8)),
        ValueError,
        r"param group 0 parameter 0 \('muon'\): saved state has keys \['extra', 'momentum'\], "
        r"expected \['momentum'\]",
    ),
    (
        "no-state-entry-dict",
        _set(("state", 1), [1, 2]),
        ValueError,
        r"param group 0 parameter 1: saved state must be a dict, got list",
    ),
    (
        "momentum-shape",
        _set(("state", 1, "momentum"), torch.zeros(8, 4)),
        ValueError,
        r"param group 0 parameter 1: state 'momentum' has shape \(8, 4\), the parameter has "
        r"\(8, 8\)",
    ),
    (
        "momentum-transposed",
        _set(("state", 0, "momentum"), torch.zeros(8, 16)),
        ValueError,
        r"param group 0 parameter 0: state 'momentum' has shape \(8, 16\), the parameter has "
        r"\(16, 8\)",
    ),
    (
        "variance-shape",
        _set(("state", 3, "variance"), torch.zeros(5)),
        ValueError,
        r"param group 1 parameter 1: state 'variance' has shape \(5,\), the parameter has \(4,\)",
    ),
    (
        "momentum-not-tensor",
        _set(("state", 0, "momentum"), [[0.0] * 8] * 16),
        TypeError,
        r"param group 0 parameter 0: state 'momentum' must be a tensor, got list",
    ),
    (
        "momentum-int",
        _set(("state", 0, "momentum"), torch.zeros(16, 8, dtype=torch.int64)),
        TypeError,
        r"param group 0 parameter 0: state 'momentum' has dtype torch\.int64; expected a real "
        r"floating dtype",
    ),
    (
        "lr",
        _set(("param_groups", 0, "lr"), -1),
        ValueError,
        r"state dict: param group 0: lr must be a finite number >= 0, got -1",
    ),
    (
        "mu",
        _set(("param_groups", 0, "mu"), 1.5),
        ValueError,
        r"state dict: param group 0: mu must be a number in \[0, 1\), got 1\.5",
    ),
    (
        "epsilon",
        _set(("param_groups", 1, "epsilon"), 0),
        ValueError,
        r"state dict: param group 1: epsilon must be a finite number >= 1\.17549435.*, got 0",
    ),
    (
        "adjust_lr",
        _set(("param_groups", 0, "adjust_lr"), "max"),
        ValueError,
        r"state dict: param group 0: unknown adjust_lr 'max'",
    ),
    (
        "step",
        _set(("param_groups", 1, "step"), -3),
        ValueError,
        r"state dict: param group 1: step must be an int >= 0, got -3",
    ),
    (
        "split_sizes",
        _set(("param_groups", 0, "split_sizes"), [8, 4]),
        ValueError,
        r"param group 0: split_sizes = \[8, 4\] sums to 12, but the parameter has 16 rows",
    ),
    (
        "cautious_wd",
        _set(("param_groups", 1, "cautious_wd"), True),
        ValueError,
        r"state dict: param group 1 has cautious_wd=True",
    ),
    (
        "not-a-dict",
        lambda sd: [sd],
        ValueError,
        r"not an optimizer state dict \(expected the keys 'state' and 'param_groups', got list\)",
    ),
    (
        "no-state",
        _delete(("state",)),
        ValueError,
        r"not an optimizer state dict \(expected the keys 'state' and 'param_groups', got "
        r"\['param_groups'\]\)",
    ),
    (
        "torch-adamw",
        _torch_adamw,
        ValueError,
        r"holds the state key 'exp_avg': it comes from torch\.optim\.Adam/AdamW",
    ),
    (
        "torch-muon",
        _torch_muon,
        ValueError,
        r"holds the state key 'momentum_buffer': it comes from torch\.optim\.Muon",
    ),
]


@pytest.mark.parametrize(
    ("defect", "error", "pattern"),
    [case[1:] for case in BAD_STATE_DICTS],
    ids=[case[0] for case in BAD_STATE_DICTS],
)
def test_bad_state_dict_changes_nothing(defect: Callable, error: type, pattern: str) -> None:
    params, ref_params = _five_params(), _five_params()
    opt, ref = _five(params), _five(ref_params)
    step_with(opt, params, 0)
    step_with(ref, ref_params, 0)
    before = copy.deepcopy(opt.state_dict())
    bad = defect(copy.deepcopy(before))
    with pytest.raises(error, match=pattern):
        opt.load_state_dict(bad)
    assert_same(opt.state_dict(), before)
    for s in (1, 2):
        step_with(opt, params, s)
        step_with(ref, ref_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)
    assert [g["step"] for g in opt.param_groups] == [3, 3]


def test_good_state_dict_round_trip() -> None:
    """Control for the table above: the unedited state dict loads into a fresh optimizer."""
    params = _five_params()
    opt = _five(params)
    step_with(opt, params, 0)
    sd = copy.deepcopy(opt.state_dict())
    other_params = [nn.Parameter(p.detach().clone()) for p in params]
    other = _five(other_params)
    other.load_state_dict(sd)
    assert_same_optimizers(opt, params, other, other_params)
    for s in (1, 2):
        step_with(opt, params, s)
        step_with(other, other_params, s)
    assert_same_optimizers(opt, params, other, other_params)


def test_non_dict_state_entry_survives_round_trip() -> None:
    params, ref_params = _five_params(), _five_params()
    opt, ref = _five(params), _five(ref_params)
    step_with(opt, params, 0)
    step_with(ref, ref_params, 0)
    opt.state["flag"] = True
    sd = opt.state_dict()
    assert sd["state"]["flag"] is True
    opt.load_state_dict(copy.deepcopy(sd))
    assert opt.state["flag"] is True
    copy_params = clone_params(params)
    other = _five(copy_params)
    other.load_state_dict(copy.deepcopy(sd))
    assert other.state["flag"] is True
    for s in (1, 2):
        step_with(opt, params, s)
        step_with(ref, ref_params, s)
        step_with(other, copy_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)
    assert_same_optimizers(other, copy_params, ref, ref_params)
    assert opt.state["flag"] is True and opt.state_dict()["state"]["flag"] is True


def test_missing_state_entries_are_created_as_zeros() -> None:
    params = _five_params()
    opt = _five(params)
    step_with(opt, params, 0)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]  # a muon parameter
    del sd["state"][2]  # an adamw parameter
    # Reference: the full state, with the two missing entries zeroed by hand.
    ref_params = clone_params(params)
    ref = _five(ref_params)
    copy_state(opt, params, ref, ref_params)
    ref.state[ref_params[0]]["momentum"].zero_()
    ref.state[ref_params[2]]["momentum"].zero_()
    ref.state[ref_params[2]]["variance"].zero_()
    opt.load_state_dict(sd)
    assert state_tensor_keys(opt, params[0]) == ["momentum", "step"]
    assert state_tensor_keys(opt, params[2]) == ["momentum", "step", "variance"]
    assert opt.state[params[0]]["step"].item() == 1  # made from the group's step
    for i, key in ((0, "momentum"), (2, "momentum"), (2, "variance")):
        value = opt.state[params[i]][key]
        assert value.shape == params[i].shape and value.dtype == params[i].dtype
        assert torch.count_nonzero(value) == 0
    assert torch.count_nonzero(opt.state[params[1]]["momentum"]) > 0
    assert_same_optimizers(opt, params, ref, ref_params)
    for s in (1, 2):
        step_with(opt, params, s)
        step_with(ref, ref_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)
