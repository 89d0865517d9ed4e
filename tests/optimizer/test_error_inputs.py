"""Generic error inputs (torch's ``get_error_inputs_for_all_optims``, for dion-style groups),
a parameter listed twice, and printing the optimizer.

One of PyTorch's generic optimizer checks applied to ``shardmuon.Muon``, as the module
docstring of ``tests/support/generic_setup.py`` describes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from generic_setup import make_opt, make_params
from torch.nn import Parameter

from shardmuon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")


def _generic_error_cases() -> list[tuple[str, Callable[[], Any], type, str]]:
    """torch's get_error_inputs_for_all_optims, for dion-style groups."""
    a = Parameter(torch.randn(2, 2))
    b = Parameter(torch.randn(2, 2))
    return [
        (
            "a tensor instead of an iterable",
            lambda: Muon(a),
            TypeError,
            r"should be an iterable of Tensors or dicts",
        ),
        (
            "a parameter in two groups",
            lambda: Muon([dict(params=[a]), dict(params=[a])]),
            ValueError,
            r"some parameters appear in more than one parameter group",
        ),
        (
            "names on some parameters only",
            lambda: Muon([("weight", a), b]),
            ValueError,
            r"all optimizer params should be with/without names",
        ),
        (
            "names in some groups only",
            lambda: Muon([dict(params=[a]), dict(params=[("weight", b)])]),
            ValueError,
            r"all optimizer param groups should be with/without names",
        ),
        (
            "a 2-element tensor lr",
            lambda: Muon([a], lr=torch.tensor([0.001, 0.001])),
            ValueError,
            r"lr",
        ),
        (
            "a 2-element tensor lr in a group",
            lambda: Muon([dict(params=[a], lr=torch.tensor([0.001, 0.001]))]),
            ValueError,
            r"lr",
        ),
        (
            "an empty parameter list",
            lambda: Muon([]),
            ValueError,
            r"optimizer got an empty parameter list",
        ),
        (
            "a set of parameters",
            lambda: Muon([dict(params={a})]),
            TypeError,
            r"ordered collections",
        ),
    ]


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [case[1:] for case in _generic_error_cases()],
    ids=[case[0] for case in _generic_error_cases()],
)
def test_generic_error_inputs(build: Callable[[], Any], error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        build()


def test_duplicate_parameter_in_a_group_is_refused() -> None:
    """torch only warns (and would step the parameter twice); shardmuon refuses it."""
    a = Parameter(torch.randn(2, 2))
    with (
        warnings.catch_warnings(),
        pytest.raises(ValueError, match=r"listed twice|duplicate"),
    ):
        warnings.simplefilter("ignore", UserWarning)
        Muon([a, a])


def test_optimizer_can_be_printed() -> None:
    text = repr(make_opt(make_params()))
    assert text.startswith("Muon (") and "Parameter Group 1" in text and "adamw" in text
