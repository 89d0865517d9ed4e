"""Validation of a state dict before ``Muon.load_state_dict`` changes anything.

``torch.optim.Optimizer.load_state_dict`` replaces the groups' settings and the state as it
goes, and checks little (group count and sizes). A checkpoint of another optimizer, of
another routing or of another layout would load "successfully" and then step wrongly or
fail later. Everything here runs first, on plain Python and tensor metadata, so a failed
load names what is wrong and leaves the optimizer as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor

from shardmuon.validation import MOMENTUM_ALIAS, check_group, check_number

__all__ = ["DROPPED_KEYS", "checked_groups"]

# The state a parameter has under each algorithm (dion's keys).
STATE_KEYS = {"muon": {"momentum"}, "sinkhorn": {"momentum"}, "adamw": {"momentum", "variance"}}
# shardmuon's per-parameter step counter: optional on load (dion has none; it is made from
# the group's ``step``).
OPTIONAL_KEYS = {"step"}
# Keys other dion versions add that shardmuon drops on load (microsoft/dion's AdamW
# ``step_dev`` device counter duplicates the group's ``step``).
DROPPED_KEYS = {"step_dev"}
# State keys that identify another optimizer's state dict.
FOREIGN_KEYS = {
    "exp_avg": "torch.optim.Adam/AdamW",
    "exp_avg_sq": "torch.optim.Adam/AdamW",
    "momentum_buffer": "torch.optim.Muon or torch.optim.SGD",
    "square_avg": "torch.optim.RMSprop/Adagrad",
}


def checked_groups(
    state_dict: Any, param_groups: list[dict], check_plan: Callable[[list[dict]], None]
) -> list[dict]:
    """Validate ``state_dict`` against the optimizer's groups; return the groups it would make.

    The returned groups are the saved groups with the current ``params`` (what torch's
    ``load_state_dict`` builds). ``check_plan`` is called with them and raises if they cannot
    be planned (bad dion ``split_sizes``, say). Raises ``ValueError``/``TypeError`` naming the
    group, parameter and key that is wrong.
    """
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"not an optimizer state dict (expected the keys 'state' and 'param_groups', got "
            f"{keys})"
        )
    saved_groups = state_dict["param_groups"]
    saved_state = state_dict["state"]
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        raise ValueError(
            "not an optimizer state dict: 'param_groups' must be a list and 'state' a dict"
        )
    _check_not_foreign(saved_state)
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups, this optimizer has "
            f"{len(param_groups)}; build the optimizer with the routing of the checkpoint"
        )
    merged = []
    for index, (saved, current) in enumerate(zip(saved_groups, param_groups)):
        if not isinstance(saved, dict) or "params" not in saved:
            raise ValueError(f"param group {index} of the state dict has no 'params' list")
        if len(saved["params"]) != len(current["params"]):
            raise ValueError(
                f"param group {index} of the state dict has {len(saved['params'])} parameters, "
                f"this optimizer's has {len(current['params'])}"
            )
        algorithm = saved.get("algorithm", "muon")
        if algorithm != current["algorithm"]:
            raise ValueError(
                f"param group {index} of the state dict is a {algorithm!r} group, this "
                f"optimizer's is {current['algorithm']!r}; the checkpoint was routed differently"
            )
        group = {**current, **{k: v for k, v in saved.items() if k != "params"}}
        group["params"] = current["params"]
        if MOMENTUM_ALIAS not in saved:  # the loaded mu / beta1 rule, not an old alias
            group.pop(MOMENTUM_ALIAS, None)
        try:
            check_group(index, group)
        except (TypeError, ValueError) as err:
            raise type(err)(f"state dict: {err}") from None
        merged.append(group)
    saved_ids = chain.from_iterable(g["params"] for g in saved_groups)
    for (index, position, param, algorithm), saved_id in zip(_params(param_groups), saved_ids):
        entry = saved_state.get(saved_id)
        if entry is not None:
            _check_entry(f"param group {index} parameter {position}", entry, param, algorithm)
    check_plan(merged)
    return merged


def _params(param_groups: list[dict]):
    for index, group in enumerate(param_groups):
        for position, param in enumerate(group["params"]):
            yield index, position, param, group["algorithm"]


def _check_not_foreign(saved_state: dict) -> None:
    for entry in saved_state.values():
        if not isinstance(entry, dict):
            continue
        for key in entry:
            if key in FOREIGN_KEYS:
                raise ValueError(
                    f"this state dict holds the state key {key!r}: it comes from "
                    f"{FOREIGN_KEYS[key]}, not from shardmuon or dion's Muon; their states "
                    "do not carry over"
                )


def _check_entry(where: str, entry: Any, param: Tensor, algorithm: str) -> None:
    """One parameter's saved state: the keys of its algorithm, tensors shaped like it."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: saved state must be a dict, got {type(entry).__name__}")
    expected = STATE_KEYS[algorithm]
    keys = set(entry) - DROPPED_KEYS - OPTIONAL_KEYS
    if keys != expected:
        raise ValueError(
            f"{where} ({algorithm!r}): saved state has keys {sorted(keys)}, expected "
            f"{sorted(expected)} (and optionally {sorted(OPTIONAL_KEYS)})"
        )
    if "step" in entry:
        _check_step(where, entry["step"])
    for key in sorted(expected):
        value = entry[key]
        label = f"{where}: state {key!r}"
        if not isinstance(value, Tensor):
            raise TypeError(f"{label} must be a tensor, got {type(value).__name__}")
        if value.is_complex() or not value.is_floating_point():
            raise TypeError(f"{label} has dtype {value.dtype}; expected a real floating dtype")
        if value.shape != param.shape:
            hint = ""
            if isinstance(param, DTensor) and value.shape == param.to_local().shape:
                hint = (
                    " (it has this rank's local shape: a sharded state must be a DTensor; "
                    "load it with torch.distributed.checkpoint)"
                )
            raise ValueError(
                f"{label} has shape {tuple(value.shape)}, the parameter has "
                f"{tuple(param.shape)}{hint}"
            )
        if isinstance(value, DTensor):
            if not isinstance(param, DTensor):
                raise ValueError(f"{label} is a DTensor but the parameter is a plain tensor")
            if value.placements != param.placements or value.device_mesh != param.device_mesh:
                raise ValueError(
                    f"{label} has placements {tuple(value.placements)} on mesh "
                    f"{value.device_mesh}, the parameter {tuple(param.placements)} on mesh "
                    f"{param.device_mesh}"
                )


def _check_step(where: str, value: Any) -> None:
    """A saved step counter: a whole number >= 0, as a number or a one-element tensor."""
    check_number(f"{where}: state 'step'", value)
    number = value.item() if isinstance(value, Tensor) else value
    if not float(number).is_integer():
        raise ValueError(f"{where}: state 'step' must be a whole number >= 0, got {number!r}")
