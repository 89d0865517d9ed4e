"""The optimizer-wide settings, one table of cases for every way a user gives one.

Each case is a value for one setting and what must happen to it: accepted (and read back),
or refused with the named error. Every case runs through the constructor, an assignment to
a live optimizer (refused: raises there and changes nothing), ``MuonSettings`` itself,
``MuonConfig`` (a refusal is a ``ValidationError`` naming the field) and, where the setting
has one, ``shardmuon train``'s flag. The metadata the settings are declared with (docs,
ranges, what is planned and agreed) is checked against the signature and the config.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import math
import pickle
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from shardmuon import Muon
from shardmuon.config import MuonConfig
from shardmuon.ops.newton_schulz import NS_PRESETS
from shardmuon.settings import SETTING_NAMES, MuonSettings, setting_doc, setting_field
from shardmuon.train.cli import add_parser

ACCEPTED = None  # the case's expected error: none


# (setting, value, expected error (None: accepted), message pattern, value read back)
CASES: list[tuple[str, Any, type[Exception] | None, str, Any]] = [
    ("update_rms", 0.35, None, "", 0.35),
    ("update_rms", 1, None, "", 1.0),
    ("update_rms", 0.0, ValueError, r"update_rms must be a finite number > 0, got 0\.0", None),
    ("update_rms", -0.2, ValueError, r"update_rms must be a finite number > 0, got -0\.2", None),
    ("update_rms", math.inf, ValueError, r"update_rms must be a finite number > 0, got inf", None),
    ("update_rms", 10**400, ValueError, r"update_rms .* an int of 401 digits", None),
    ("update_rms", 2**1024 - 1, ValueError, r"update_rms .* an int of 309 digits", None),
    ("update_rms", True, TypeError, r"update_rms must be a number, got True", None),
    ("newton_schulz_coefficients", "keller", None, "", NS_PRESETS["keller"]),
    ("newton_schulz_coefficients", [(3.0, -4.0, 2.0)], None, "", ((3.0, -4.0, 2.0),)),
    ("newton_schulz_coefficients", "quintic", ValueError, r"unknown Newton-Schulz preset", None),
    ("newton_schulz_coefficients", [], ValueError, r"newton_schulz_coefficients is empty", None),
    ("newton_schulz_coefficients", [(1.0, 2.0)], ValueError, r"\[0\] must be an \(a, b, c\)", None),
    ("newton_schulz_coefficients", [(1.0, 2.0, math.nan)], ValueError, r"must be finite", None),
    ("newton_schulz_coefficients", 5, TypeError, r"must be a preset name or a list of", None),
    ("max_in_flight", 1, None, "", 1),
    ("max_in_flight", 0, ValueError, r"max_in_flight must be an int >= 1, got 0", None),
    ("max_in_flight", 2.5, TypeError, r"max_in_flight must be an int >= 1, got 2\.5", None),
    ("max_in_flight", True, TypeError, r"max_in_flight must be an int >= 1, got True", None),
    ("workspace_bytes", 1 << 20, None, "", 1 << 20),
    (
        "workspace_bytes",
        0,
        ValueError,
        r"workspace_bytes must be an int > 0 \(bytes\) or 'auto'",
        None,
    ),
    ("workspace_bytes", "lots", TypeError, r"workspace_bytes must be an int > 0", None),
    ("offload", "state", None, "", "state"),
    ("offload", "disk", ValueError, r"unknown offload 'disk'; accepted: None, 'state'", None),
    ("offload_prefetch", 1, None, "", 1),
    ("offload_prefetch", 0, ValueError, r"offload_prefetch must be an int >= 1, got 0", None),
    ("offload_prefetch", 1.5, ValueError, r"offload_prefetch must be an int >= 1, got 1\.5", None),
    ("newton_schulz_impl", "gram", None, "", "gram"),
    ("newton_schulz_impl", "per-matrix", None, "", "per-matrix"),
    (
        "newton_schulz_impl",
        "Gram",
        ValueError,
        r"unknown newton_schulz_impl 'Gram'; accepted:",
        None,
    ),
    ("newton_schulz_dtype", "float32", None, "", "float32"),
    ("newton_schulz_dtype", "fp32", ValueError, r"newton_schulz_dtype", None),
    ("newton_schulz_dtype", torch.float64, ValueError, r"newton_schulz_dtype", None),
    ("newton_schulz_restarts", (3,), None, "", (3,)),
    ("newton_schulz_restarts", 2, ValueError, r"newton_schulz_restarts", None),
    ("newton_schulz_restarts", (0,), ValueError, r"newton_schulz_restarts", None),
    ("newton_schulz_restarts", (True,), ValueError, r"newton_schulz_restarts", None),
    ("newton_schulz_restarts", torch.tensor([2]), ValueError, r"newton_schulz_restarts", None),
    ("newton_schulz_guard", True, None, "", True),
    (
        "newton_schulz_guard",
        "yes",
        TypeError,
        r"newton_schulz_guard must be None, True or False",
        None,
    ),
    ("newton_schulz_preconditioner", "aol", None, "", "aol"),
    (
        "newton_schulz_preconditioner",
        "AOL",
        ValueError,
        r"unknown newton_schulz_preconditioner",
        None,
    ),
    ("check_grads", "always", None, "", "always"),
    ("check_grads", "sometimes", ValueError, r"unknown check_grads 'sometimes'", None),
    ("overlap", "forward", None, "", "forward"),
    ("overlap", "backward", ValueError, r"unknown overlap 'backward'", None),
    ("adamw_chunks", "parameter", None, "", "parameter"),
    ("adamw_chunks", "tensor", ValueError, r"unknown adamw_chunks 'tensor'", None),
    ("cuda_graphs", True, None, "", True),
    ("cuda_graphs", "on", TypeError, r"cuda_graphs must be None, True or False, got 'on'", None),
    ("rotate_owners", False, None, "", False),
    ("rotate_owners", 1, TypeError, r"rotate_owners must be True or False, got 1", None),
    ("split_replicas", True, None, "", True),
    ("split_replicas", "maybe", TypeError, r"split_replicas must be True or False", None),
    ("warmup", False, None, "", False),
    ("warmup", "yes", TypeError, r"warmup must be True, False or None \(on with NCCL\)", None),
]
# The Gram-only settings are given with the Gram engine (the folded one never restarts).
WITH = {"newton_schulz_restarts": {"newton_schulz_impl": "gram"}}
# Parsed text the config reads as a boolean (TOML and the command line give text; pydantic's
# coercion), where the constructor takes only the bool itself.
CONFIG_READS = {
    ("cuda_graphs", "'on'"): True,
    ("rotate_owners", "1"): True,
    ("warmup", "'yes'"): True,
}
# Values of a flag of `shardmuon train`, where one sets the setting (the flag's own spelling).
FLAGS = {"update_rms": "--update-rms", "newton_schulz_impl": "--ns-impl"}

_IDS = [f"{name}={value!r}"[:48] for name, value, *_ in CASES]


def _attribute(name: str) -> str:
    return {"warmup": "warmup_setting", "newton_schulz_coefficients": "coefficients"}.get(
        name, name
    )


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(12))]


def _read_back(opt_or_settings: Any, name: str) -> Any:
    if isinstance(opt_or_settings, MuonSettings):
        return (
            opt_or_settings.coefficients
            if name == "newton_schulz_coefficients"
            else getattr(opt_or_settings, name)
        )
    return getattr(opt_or_settings, _attribute(name))


@pytest.mark.parametrize(("name", "value", "error", "pattern", "read"), CASES, ids=_IDS)
def test_the_constructor(name, value, error, pattern, read) -> None:
    kwargs = {**WITH.get(name, {}), name: value}
    if error is None:
        assert _read_back(Muon(_params(), **kwargs), name) == read
        return
    with pytest.raises(error, match=pattern):
        Muon(_params(), **kwargs)


@pytest.mark.parametrize(("name", "value", "error", "pattern", "read"), CASES, ids=_IDS)
def test_an_assignment_to_a_live_optimizer(name, value, error, pattern, read) -> None:
    params = _params()
    opt = Muon(params, **WITH.get(name, {}))
    before = opt.settings
    if error is None:
        setattr(opt, _attribute(name), value)
        assert _read_back(opt, name) == read
        assert opt.settings == before.replace(**{name: value})
        return
    with pytest.raises(error, match=pattern):
        setattr(opt, _attribute(name), value)
    assert opt.settings is before  # refused at the assignment: nothing changed


@pytest.mark.parametrize(("name", "value", "error", "pattern", "read"), CASES, ids=_IDS)
def test_the_settings_object(name, value, error, pattern, read) -> None:
    kwargs = {**WITH.get(name, {}), name: value}
    if error is None:
        assert _read_back(MuonSettings(**kwargs), name) == read
        return
    with pytest.raises(error, match=pattern):
        MuonSettings(**kwargs)


@pytest.mark.parametrize(("name", "value", "error", "pattern", "read"), CASES, ids=_IDS)
def test_the_config(name, value, error, pattern, read) -> None:
    """The config refuses what the constructor refuses (a ``ValidationError``, which is a
    ``ValueError``, naming the field) and hands the constructor what it accepts."""
    kwargs = {**WITH.get(name, {}), name: value}
    parsed = CONFIG_READS.get((name, repr(value)))
    if error is None or parsed is not None:
        config = MuonConfig(**kwargs)
        opt = Muon(_params(), **config.muon_kwargs())
        assert _read_back(opt, name) == (read if parsed is None else parsed)
        return
    with pytest.raises(ValidationError, match=name):
        MuonConfig(**kwargs)


@pytest.mark.parametrize(
    ("name", "value", "error", "pattern", "read"),
    [case for case in CASES if case[0] in FLAGS and not isinstance(case[1], bool)],
    ids=lambda v: repr(v)[:24],
)
def test_the_command_line_flag(name, value, error, pattern, read) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    argv = ["train", FLAGS[name], str(value)]
    if error is None:
        parser.parse_args(argv)
        return
    with pytest.raises(SystemExit):
        parser.parse_args(argv)


def test_every_setting_has_a_case_accepted_and_refused() -> None:
    accepted = {name for name, _, error, _, _ in CASES if error is None}
    refused = {name for name, _, error, _, _ in CASES if error is not None}
    assert refused == set(SETTING_NAMES)
    assert accepted == set(SETTING_NAMES)


def test_each_setting_is_a_keyword_with_the_fields_default_and_documented() -> None:
    """Declared once: the constructor's keyword has the field's default (``max_in_flight``:
    ``None``, resolved with prime-rl's ``max_concurrent_tasks``), the config field too, and
    the field's doc reaches ``Muon``'s docstring."""
    signature = inspect.signature(Muon.__init__).parameters
    config = MuonConfig()
    for name in SETTING_NAMES:
        field = setting_field(name)
        given = signature[name].default
        assert given == (None if name == "max_in_flight" else field.default), name
        assert getattr(config, name) == field.default, name
        assert setting_doc(name) and f"{name}: " in (Muon.__doc__ or ""), name


def test_planned_and_agreed_name_what_the_plan_and_the_digest_read() -> None:
    settings = MuonSettings(newton_schulz_dtype=torch.float32, newton_schulz_coefficients="dion")
    assert set(settings.planned()) == {
        "update_rms", "workspace_bytes", "newton_schulz_impl", "newton_schulz_dtype",
        "newton_schulz_restarts", "newton_schulz_guard", "newton_schulz_preconditioner",
        "adamw_chunks", "rotate_owners", "split_replicas",
    }  # fmt: skip
    agreed = settings.agreed()
    assert "offload" not in agreed and "cuda_graphs" not in agreed
    assert agreed["newton_schulz_dtype"] == "torch.float32"  # one spelling per dtype
    assert agreed["coefficients"] == NS_PRESETS["dion"]  # a preset's name is its triples
    assert MuonSettings(newton_schulz_dtype="float32").agreed() == agreed | {
        "coefficients": NS_PRESETS["dion"]
    }


def test_the_default_coefficients_follow_the_preconditioner_until_given() -> None:
    opt = Muon(_params())
    assert opt.coefficients == NS_PRESETS["dion"]
    opt.newton_schulz_preconditioner = "aol"
    assert opt.coefficients == NS_PRESETS["aol"]
    opt.coefficients = opt.coefficients  # the default read back stays the default
    opt.newton_schulz_preconditioner = None
    assert opt.coefficients == NS_PRESETS["dion"]
    opt.coefficients = "keller"
    opt.newton_schulz_preconditioner = "aol"
    assert opt.coefficients == NS_PRESETS["keller"]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_carry_the_settings_object(how: str) -> None:
    opt = Muon(
        _params(), newton_schulz_impl="gram", newton_schulz_restarts=(2,), workspace_bytes=1 << 20
    )
    copied = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert copied.settings == opt.settings
    assert dataclasses.asdict(copied.settings) == dataclasses.asdict(opt.settings)
    copied.update_rms = 0.5
    assert opt.update_rms == 0.2  # the copy's settings are its own


def test_the_settings_attribute_holds_settings_only() -> None:
    opt = Muon(_params())
    before = opt.settings
    with pytest.raises(TypeError, match=r"settings must be a MuonSettings .* got dict"):
        opt.settings = {"update_rms": 0.3}
    assert opt.settings is before
    opt.settings = before.replace(update_rms=0.3, max_in_flight=1)  # several at once
    assert (opt.update_rms, opt.max_in_flight) == (0.3, 1)
