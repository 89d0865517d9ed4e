"""Copying an optimizer (``copy.deepcopy``, pickle, ``torch.save``: ``support/copies.py``): a
copy keeps every public attribute and setting (torch's ``test_deepcopy_copies_all_public_attrs``,
plus shardmuon's own), steps its own parameters bitwise as the original steps the originals,
and never touches the original's.

Single process, CPU; the setups of ``tests/support/generic_setup.py`` and
``tests/support/fidelity_setup.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import (
    assert_all_bitwise,
    assert_same,
    assert_same_optimizers,
    assert_same_state,
    clone_params,
    differs,
    params_of,
    snapshot,
)
from copies import COPY_METHODS
from fidelity_setup import copy_state, param, step_with
from generic_setup import make_opt, make_params, step_both
from torch import Tensor, nn

from shardmuon import Muon
from shardmuon.settings import MuonSettings

pytestmark = pytest.mark.usefixtures("one_thread")


# shardmuon's own public attributes (besides torch's defaults / param_groups / state).
MUON_ATTRS = (
    "update_rms",
    "coefficients",
    "max_in_flight",
    "rotate_owners",
    "split_replicas",
    "check_grads",
)


# A value other than the default for each of them (both kinds of copy test use these).
NON_DEFAULT_ATTRIBUTES = dict(
    update_rms=0.3,
    newton_schulz_coefficients="keller",
    max_in_flight=1,
    rotate_owners=False,
    split_replicas=True,
    check_grads="always",
)

COPIES = COPY_METHODS
COPY_IDS = ["deepcopy", "pickle", "torch.save"]
COPY_CONFIGS = {
    "default": lambda: {},
    "non-default attributes": lambda: dict(NON_DEFAULT_ATTRIBUTES, nesterov=False, mu=0.8),
    "tensor lr": lambda: dict(lr=torch.tensor(0.01)),
}


@pytest.mark.parametrize("config", list(COPY_CONFIGS))
@pytest.mark.parametrize("make_copy", COPIES, ids=COPY_IDS)
def test_copy_keeps_public_attributes(make_copy: Callable[[Muon], Muon], config: str) -> None:
    """torch's test_deepcopy_copies_all_public_attrs, plus the values of shardmuon's own."""
    ps = make_params()
    opt = make_opt(ps, **COPY_CONFIGS[config]())
    step_both([(opt, ps)], 0)
    dup = make_copy(opt)
    assert type(dup) is Muon

    def public(o: Muon) -> set[str]:
        return {k for k in vars(o) if not k.startswith("_")}

    assert public(dup) == public(opt)
    for name in MUON_ATTRS:
        assert getattr(dup, name) == getattr(opt, name), name
    # torch's __setstate__ adds defaults["differentiable"] = False; nothing else may change
    assert_same({k: v for k, v in dup.defaults.items() if k in opt.defaults}, opt.defaults)
    assert set(dup.defaults) - set(opt.defaults) <= {"differentiable"}
    assert len(dup.param_groups) == len(opt.param_groups)
    for g_dup, g_opt in zip(dup.param_groups, opt.param_groups):
        assert_same(g_dup, g_opt)  # params compared by value
        assert not any(a is b for a, b in zip(g_dup["params"], g_opt["params"]))
    assert all(p in dup.state for p in params_of(dup))
    assert_same_state(dup, opt)


@pytest.mark.parametrize("config", list(COPY_CONFIGS))
@pytest.mark.parametrize("make_copy", COPIES, ids=COPY_IDS)
def test_copy_steps_like_the_original(make_copy: Callable[[Muon], Muon], config: str) -> None:
    """A copy steps its own parameters exactly as the original steps the originals."""
    ps = make_params()
    opt = make_opt(ps, **COPY_CONFIGS[config]())
    for step in range(2):
        step_both([(opt, ps)], step)
    dup = make_copy(opt)
    dup_ps = params_of(dup)
    for step in range(2, 5):
        before = snapshot(ps)
        state_before = copy.deepcopy(opt.state_dict())
        step_both([(dup, dup_ps)], step)
        assert_all_bitwise(ps, before)  # the copy must not touch the original's params...
        assert_same(opt.state_dict(), state_before)  # ...or its state
        step_both([(opt, ps)], step)
        assert_all_bitwise(dup_ps, snapshot(ps))
    assert_same_state(dup, opt)
    assert [g["step"] for g in dup.param_groups] == [g["step"] for g in opt.param_groups]


# ------------------------------------------------------------ copies of a mixed optimizer

COPY_SHAPES = [(16, 8), (16, 8), (3, 8, 4), (8,)]
COPY_SETTINGS = dict(NON_DEFAULT_ATTRIBUTES, newton_schulz_impl="unfolded")
PARTITIONS = (4, 12)


def _copy_params() -> list[nn.Parameter]:
    return [param(s, i) for i, s in enumerate(COPY_SHAPES)]


def _copy_opt(params: list[Tensor], partitions: bool = True, **overrides: Any) -> Muon:
    settings = {**COPY_SETTINGS, **overrides}
    return Muon(
        [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw")],
        lr=0.02,
        weight_decay=0.1,
        adjust_lr="rms_norm",
        matrix_partitions={params[1]: PARTITIONS} if partitions else None,
        **settings,
    )


@pytest.mark.parametrize("duplicate", COPY_METHODS, ids=lambda f: f.__name__)
def test_copied_optimizer_steps_like_the_original(duplicate: Callable) -> None:
    params = _copy_params()
    opt = _copy_opt(params)
    step_with(opt, params, 0)
    copy_params, copied = duplicate((params, opt))
    assert copied is not opt and all(c is not p for c, p in zip(copy_params, params))
    for name in (*COPY_SETTINGS, "coefficients"):
        if name != "newton_schulz_coefficients":
            assert getattr(copied, name) == getattr(opt, name), name
    assert list(copied.matrix_partitions.values()) == [PARTITIONS]
    assert next(iter(copied.matrix_partitions)) is copy_params[1]
    assert all(p in copied.state for p in copy_params)
    assert copied.param_groups[0]["params"][0] is copy_params[0]
    assert_same_optimizers(opt, params, copied, copy_params)
    # Controls from the same point: each setting that changes bits, left at its default.
    controls = []
    for overrides, partitions in (
        (dict(update_rms=0.2), True),
        (dict(newton_schulz_coefficients="dion"), True),
        (dict(newton_schulz_impl="folded"), True),
        ({}, False),
    ):
        control_params = clone_params(params)
        control = _copy_opt(control_params, partitions, **overrides)
        copy_state(opt, params, control, control_params)
        controls.append((control, control_params))
    for s in (1, 2):
        step_with(opt, params, s)
        step_with(copied, copy_params, s)
        for control, control_params in controls:
            step_with(control, control_params, s)
    assert_same_optimizers(opt, params, copied, copy_params)
    for _, control_params in controls:
        assert differs(params, control_params)
    # The copy is independent: stepping it does not move the original.
    before = [p.detach().clone() for p in params]
    step_with(copied, copy_params, 3)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


# A whole-optimizer copy saved by an earlier version (a dict of its attributes, made with
# torch.save by that version: tests/fixtures/copies), with the params its original reached
# after two more steps (one of them with an edit first: default coefficients follow the
# preconditioner).
EARLIER_COPIES = Path(__file__).parents[1] / "fixtures" / "copies" / "muon_copies_0523705.pt"


@pytest.mark.parametrize(
    "case", ["gram_restarts", "aol_default_coefficients", "given_coefficients_partitions"]
)
def test_a_copy_saved_by_an_earlier_version_loads_and_steps_as_its_original(case) -> None:
    import io

    record = torch.load(EARLIER_COPIES, weights_only=False)[case]
    saved = torch.load(io.BytesIO(record["copy"]), weights_only=False)
    params, opt = saved["params"], saved["optimizer"]
    assert isinstance(opt.settings, MuonSettings)
    for key, value in record["edit"].items():  # as the original was edited after the copy
        setattr(opt, key, value)
    for grads in record["grads"]:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    for k, (p, want) in enumerate(zip(params, record["after"])):
        assert torch.equal(p.detach(), want), f"param {k}"
