"""State dicts: round trips into fresh optimizers, ids and copies of the groups, ``torch.save``
with ``weights_only``, parameter names, edited groups taking effect after a load, and
non-dict entries in ``optimizer.state``. State exists for every parameter from
construction (DCP-safe), not after the first step.

One of PyTorch's generic optimizer checks applied to ``shardmuon.Muon``, as the module
docstring of ``tests/support/generic_setup.py`` describes them.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from checks import assert_all_bitwise, assert_same, assert_same_state, clone_params, snapshot
from generic_setup import (
    BASE,
    OPTIM_FACTORIES,
    OPTIM_IDS,
    make_groups,
    make_opt,
    make_params,
    step_both,
)
from torch import Tensor

from shardmuon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kwargs", OPTIM_FACTORIES, ids=OPTIM_IDS)
def test_state_dict_round_trip_into_a_fresh_optimizer(kwargs: Callable[[], dict]) -> None:
    """Load a state dict into a fresh optimizer (same constructor arguments): same steps."""
    ps = make_params()
    opt = make_opt(ps, **kwargs())
    for step in range(2):
        step_both([(opt, ps)], step)
    saved = copy.deepcopy(opt.state_dict())
    assert_same(saved, opt.state_dict())  # deterministic, and a deep copy round-trips

    fresh_ps = clone_params(ps)
    fresh = make_opt(fresh_ps, **kwargs())
    fresh.load_state_dict(saved)
    assert_same(fresh.state_dict(), opt.state_dict())
    for step in range(2, 5):
        step_both([(opt, ps), (fresh, fresh_ps)], step)
        assert_all_bitwise(fresh_ps, snapshot(ps))
    assert_same(fresh.state_dict(), opt.state_dict())
    assert_same_state(fresh, opt)


def test_state_dict_holds_ids_and_copies_of_the_groups() -> None:
    ps = make_params()
    opt = make_opt(ps)
    step_both([(opt, ps)], 0)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1, 2], [3]]
    # the groups of a state dict are copies: editing them leaves the optimizer alone
    sd["param_groups"][0]["lr"] = 123.0
    sd["param_groups"][1]["params"].append(7)
    assert opt.param_groups[0]["lr"] == BASE["lr"] and len(opt.param_groups[1]["params"]) == 1
    # a snapshot (deepcopy) is unaffected by later steps, while the live state moves on
    snap = copy.deepcopy(opt.state_dict())
    step_both([(opt, ps)], 1)
    assert not torch.equal(snap["state"][0]["momentum"], opt.state[ps[0]]["momentum"])
    assert snap["param_groups"][0]["step"] == 1 and opt.param_groups[0]["step"] == 2


def test_loaded_groups_are_not_aliased_to_the_state_dict() -> None:
    ps = make_params()
    opt = make_opt(ps)
    step_both([(opt, ps)], 0)
    saved = copy.deepcopy(opt.state_dict())
    fresh_ps = clone_params(ps)
    fresh = make_opt(fresh_ps)
    fresh.load_state_dict(saved)
    saved["param_groups"][0]["lr"] = 123.0
    saved["param_groups"][1]["beta1"] = 0.0
    assert fresh.param_groups[0]["lr"] == BASE["lr"] and fresh.param_groups[1]["beta1"] == 0.9
    assert fresh.param_groups[0]["params"][0] is fresh_ps[0]  # params are the fresh ones
    # loading from a deep copy: stepping the fresh optimizer leaves the source state alone
    before = copy.deepcopy(opt.state_dict())
    step_both([(fresh, fresh_ps)], 1)
    assert_same(opt.state_dict(), before)


def test_state_dict_survives_torch_save_with_weights_only() -> None:
    """torch's test_save_load_equality_with_weights_only, with a tensor lr in one group."""
    ps = make_params()
    groups = make_groups(ps, adamw=dict(lr=torch.tensor(0.01)))
    opt = Muon(groups, **BASE)
    for step in range(2):
        step_both([(opt, ps)], step)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_same(loaded, opt.state_dict())

    fresh_ps = clone_params(ps)
    fresh = Muon(make_groups(fresh_ps, adamw=dict(lr=torch.tensor(0.01))), **BASE)
    fresh.load_state_dict(loaded)
    for step in range(2, 4):
        step_both([(opt, ps), (fresh, fresh_ps)], step)
    assert_all_bitwise(fresh_ps, snapshot(ps))


@pytest.mark.parametrize(
    ("save_names", "load_names"),
    [(True, False), (False, True), (True, True)],
    ids=["named to unnamed", "unnamed to named", "named to named"],
)
def test_state_dict_with_and_without_param_names(save_names: bool, load_names: bool) -> None:
    """torch's test_can_load_from_to_named_state_dict."""
    names = ["w1", "w2", "w3", "b"]

    def build(ps: list[Tensor], named: bool) -> Muon:
        items = list(zip(names, ps)) if named else list(ps)
        return Muon(
            [dict(params=items[:3], algorithm="muon"), dict(params=items[3:], algorithm="adamw")],
            **BASE,
        )

    ps = make_params()
    opt = build(ps, save_names)
    step_both([(opt, ps)], 0)
    sd = copy.deepcopy(opt.state_dict())
    assert ("param_names" in sd["param_groups"][0]) == save_names
    fresh_ps = clone_params(ps)
    fresh = build(fresh_ps, load_names)
    fresh.load_state_dict(sd)
    if save_names or load_names:
        assert fresh.param_groups[0]["param_names"] == names[:3]
    for step in range(1, 3):
        step_both([(opt, ps), (fresh, fresh_ps)], step)
    assert_all_bitwise(fresh_ps, snapshot(ps))


# State-dict group edits that must take effect after loading: (group index, edits). Every
# optimizer in that test is built with EDIT_SOURCE's settings, so each edit changes a value.
EDIT_SOURCE = (
    dict(adjust_lr="spectral_norm", epsilon=1e-8, flatten=False, mu=0.95, nesterov=True),
    dict(beta1=0.9, beta2=0.95, epsilon=1e-8),
)
LOAD_EDITS = [
    (0, dict(lr=0.05)),
    (0, dict(weight_decay=0.5)),
    (0, dict(mu=0.5)),
    (0, dict(nesterov=False)),
    (0, dict(epsilon=1e-2)),
    (0, dict(adjust_lr="rms_norm")),
    (0, dict(adjust_lr="keller_muon")),
    (0, dict(adjust_lr=None)),
    (0, dict(flatten=True)),
    (1, dict(lr=0.05)),
    (1, dict(weight_decay=0.5)),
    (1, dict(beta1=0.5)),
    (1, dict(beta2=0.5)),
    (1, dict(epsilon=1e-3)),
    (1, dict(step=10)),
]


@pytest.mark.parametrize(
    ("group", "edits"), LOAD_EDITS, ids=[f"group{g}-{e}" for g, e in LOAD_EDITS]
)
def test_edited_param_groups_take_effect_after_load(group: int, edits: dict) -> None:
    """Edit a group of a state dict, load it: the next steps use the edited values.

    Reference: an optimizer constructed with the edited values from the start, loading the
    same state dict; a third optimizer loading the unedited dict shows the edit matters.
    """
    ps = make_params()
    opt = Muon(make_groups(ps, *EDIT_SOURCE), **BASE)
    for step in range(2):
        step_both([(opt, ps)], step)
    plain = copy.deepcopy(opt.state_dict())
    edited = copy.deepcopy(plain)
    edited["param_groups"][group].update(edits)
    assert edited["param_groups"] != plain["param_groups"]

    runs = []
    for built_with, sd in ((None, edited), (edits, edited), (None, plain)):
        run_ps = clone_params(ps)
        extra = list(EDIT_SOURCE)
        extra[group] = {**extra[group], **(built_with or {})}
        run = Muon(make_groups(run_ps, *extra), **BASE)
        run.load_state_dict(copy.deepcopy(sd))
        for key, value in edits.items():
            expected = value if sd is edited else plain["param_groups"][group][key]
            assert run.param_groups[group][key] == expected
        runs.append((run, run_ps))
    for step in range(2, 4):
        step_both(runs, step)
    (loaded, loaded_ps), (reference, reference_ps), (_, unedited_ps) = runs
    assert_all_bitwise(loaded_ps, snapshot(reference_ps))
    assert_same_state(loaded, reference)
    touched = slice(0, 3) if group == 0 else slice(3, 4)
    assert any(not torch.equal(a, b) for a, b in zip(loaded_ps[touched], unedited_ps[touched])), (
        "the edit changed nothing: the test would not see it ignored"
    )


# --------------------------------------------------------------- non-dict state


def test_non_dict_entries_in_state_survive_a_round_trip() -> None:
    """A flag stored in ``optimizer.state`` (as hooks do) must not break state dicts."""
    ps = make_params()
    opt = make_opt(ps)
    opt.state["flag"] = True
    step_both([(opt, ps)], 0)
    sd = opt.state_dict()
    assert sd["state"]["flag"] is True
    assert sorted(k for k in sd["state"] if isinstance(k, int)) == [0, 1, 2, 3]

    fresh_ps = clone_params(ps)
    fresh = make_opt(fresh_ps)
    fresh.load_state_dict(copy.deepcopy(sd))
    assert fresh.state["flag"] is True
    opt.load_state_dict(copy.deepcopy(sd))  # loading into itself, too
    assert opt.state["flag"] is True
    for step in range(1, 3):
        step_both([(opt, ps), (fresh, fresh_ps)], step)
    assert_all_bitwise(fresh_ps, snapshot(ps))
    assert_same_state(fresh, opt)
