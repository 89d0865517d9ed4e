"""Load dion's reference trajectories and build shardmuon params / groups from them.

The case files are kept in the repository, in ``tests/fixtures/dion`` (their README says what
they are and how they were produced). A missing file fails the test with a message instead
of skipping it: these fixtures are the acceptance bar and must not silently disappear.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import shardmuon

FIXTURE_DIR = Path(__file__).parent.parent / "fixtures" / "dion"

# bf16 noise floor from the README ("grads x 1.001" row, case A, steps 1-4): how far the Muon
# update of dion itself moves when only its bf16 rounding changes.
NOISE_FLOOR_PER_STEP = {1: 0.01880, 2: 0.01940, 3: 0.01941, 4: 0.01932}


@functools.cache
def _load(name: str) -> dict[str, Any]:
    path = FIXTURE_DIR / name
    if not path.is_file():
        pytest.fail(
            f"dion fixture {path.resolve()} is missing; the acceptance tests need "
            f"case_A.pt, case_B.pt and case_C_resume.pt in {FIXTURE_DIR.resolve()}",
            pytrace=False,
        )
    return torch.load(path, weights_only=True)


def load_case(name: str) -> dict[str, Any]:
    """The case file ``name`` (e.g. ``"case_A.pt"``); shared between tests, do not mutate."""
    return _load(name)


def muon_names(case: dict[str, Any]) -> list[str]:
    """Names of the Muon-routed params, in model order."""
    return [n for n in case["names"] if case["routing"][n] != "adamw"]


def adamw_names(case: dict[str, Any]) -> list[str]:
    """Names of the AdamW-routed params, in model order."""
    return [n for n in case["names"] if case["routing"][n] == "adamw"]


def group_spec(case: dict[str, Any], name: str) -> dict[str, Any]:
    """The group dict (as given to dion, with ``label``/``param_names``) holding ``name``."""
    return case["param_group_specs"][case["group_index"][name]]


def build_params(case: dict[str, Any], values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh float32 leaf params named as in the case, initialised from ``values``."""
    return {
        n: torch.nn.Parameter(values[n].detach().clone().to(torch.float32)) for n in case["names"]
    }


def build_groups(case: dict[str, Any], params: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The case's param groups, in the case's order, holding ``params`` instead of names."""
    groups = []
    for spec in case["param_group_specs"]:
        group = {k: v for k, v in spec.items() if k not in ("label", "param_names")}
        group["params"] = [params[n] for n in spec["param_names"]]
        groups.append(group)
    return groups


def ctor_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments dion was built with, ``betas`` as a tuple."""
    kwargs = dict(case["muon_ctor_kwargs"])
    kwargs["betas"] = tuple(kwargs["betas"])
    return kwargs


def make_optimizer(
    case: dict[str, Any], params: dict[str, torch.Tensor], **overrides: Any
) -> shardmuon.Muon:
    """``shardmuon.Muon`` over ``params`` with the case's groups and constructor call."""
    kwargs = ctor_kwargs(case)
    kwargs.update(overrides)
    return shardmuon.Muon(params=build_groups(case, params), **kwargs)


def loadable_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A deep copy: ``load_state_dict`` keeps the given tensors and later steps mutate them."""
    return copy.deepcopy(state_dict)
