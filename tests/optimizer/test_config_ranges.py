"""Attacks on ``MuonConfig``'s range checks: strings read as numbers, every bad value refused
with a ValueError naming the field (huge ints, NaN and inf from JSON included), numpy
scalars accepted, and the same numbers accepted as by the ``Muon`` constructor.

The reference is the constructor's own checks (one range per setting, spelled once).
Failing tests are escapes.
"""

from __future__ import annotations

import argparse
import math
import re

import pytest
import torch
from torch.nn import Parameter

from shardmuon import Muon
from shardmuon.config import FIELD_RANGES, MuonConfig, check_setting


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
    ("betas", (0.9, True)),
    ("betas", ("0.9", "nan")),
    ("betas", "0.9,0.95"),
    ("betas", (0.9, 0.95, 0.99)),
    ("betas", torch.tensor([0.9, 0.95])),
    ("adjust_lr", "rms"),
]


@pytest.mark.parametrize(("field", "value"), BAD_CONFIG, ids=lambda v: repr(v)[:30])
def test_config_refuses_naming_the_field(field, value) -> None:
    with pytest.raises(ValueError) as info:
        MuonConfig(**{field: value})
    assert field in str(info.value)


@pytest.mark.parametrize(
    "value", [10**400, -(10**400), 2**1024 - 1], ids=["huge", "huge-negative", "beyond-float"]
)
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


@pytest.mark.parametrize("value", NUMBERS, ids=repr)
@pytest.mark.parametrize("field", sorted(FIELD_RANGES))
def test_the_stated_ranges_are_what_the_config_accepts(field, value) -> None:
    """``FIELD_RANGES`` (what the command line's flags say they take) states exactly what
    the validators accept."""
    try:
        MuonConfig(**{field: value})
        by_config = True
    except ValueError:
        by_config = False
    assert (value in FIELD_RANGES[field]) == by_config


def test_one_setting_is_checked_alone_in_one_line() -> None:
    assert check_setting("mu", "0.5") == 0.5
    assert check_setting("qk_clip_alpha", 1) == 1.0
    with pytest.raises(ValueError, match=r"^mu must be a number in \[0, 1\), got 2\.0$"):
        check_setting("mu", 2.0)
    with pytest.raises(ValueError, match=r"^qk_clip_alpha must be in \[0, 1\]"):
        check_setting("qk_clip_alpha", 1.5)
    with pytest.raises(ValueError, match=r"^offload: Input should be 'state'$"):
        check_setting("offload", "disk")
    with pytest.raises(ValueError, match="'momentum' is not a MuonConfig setting"):
        check_setting("momentum", 0.9)


def test_a_range_holds_no_int_beyond_any_float() -> None:
    from shardmuon.config import FIELD_RANGES
    from shardmuon.train.config import check_train_lr

    assert all(10**400 not in limits for limits in FIELD_RANGES.values())
    with pytest.raises(ValueError, match="adamw_lr must be a finite number > 0"):
        check_train_lr("adamw_lr", 10**400)


SMALLEST_NORMAL = torch.finfo(torch.float32).tiny
BELOW_SMALLEST_NORMAL = [1e-50, 1e-40, math.nextafter(SMALLEST_NORMAL, 0.0), "1e-45"]


@pytest.mark.parametrize("value", BELOW_SMALLEST_NORMAL, ids=repr)
def test_an_epsilon_float32_cannot_hold_as_a_normal_number_is_refused(value) -> None:
    """Was an escape: ``epsilon=1e-50`` is 0 in float32 (1e-40 a subnormal, flushed to 0
    where denormals are) and an all-zero grad then gave NaN in every weight, uncounted.
    Refused alike by ``MuonConfig``, by ``check_setting`` (what a ``shardmuon train`` flag
    of the setting runs, ``train.cli_flags.setting_type``) and by ``Muon``, naming what
    was given and what is accepted."""
    from shardmuon.train.cli_flags import setting_type

    accepted = "epsilon must be a finite number >= 1.1754943508222875e-38 (float32's smallest"
    with pytest.raises(ValueError) as info:
        MuonConfig(epsilon=value)
    assert accepted in str(info.value) and f"got {float(value)!r}" in str(info.value)
    with pytest.raises(ValueError, match=re.escape(accepted)):
        check_setting("epsilon", value)
    assert float(value) not in FIELD_RANGES["epsilon"]
    flag = setting_type("epsilon")
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be .*, got "):
        flag(str(value))
    with pytest.raises(ValueError, match=re.escape(accepted)):
        Muon([Parameter(torch.zeros(2, 2))], epsilon=float(value))


def test_the_smallest_normal_float32_is_the_smallest_epsilon() -> None:
    """The bound itself, and a number just above it, are accepted everywhere (the value a
    refusal shows is one that is accepted: every digit is printed)."""
    from shardmuon.train.cli_flags import setting_type

    for value in (SMALLEST_NORMAL, math.nextafter(SMALLEST_NORMAL, 1.0), 1e-30):
        assert value in FIELD_RANGES["epsilon"]
        assert MuonConfig(epsilon=value).epsilon == value
        assert setting_type("epsilon")(repr(value)) == value
        Muon([Parameter(torch.zeros(2, 2))], epsilon=value)
