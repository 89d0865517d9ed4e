"""Optimizer settings on a resume: a checkpoint fixes them, flags may not silently differ.

Loading a checkpoint restores the optimizer's param groups, and with them ``lr``,
``weight_decay``, ``mu`` and ``nesterov``; the state it holds was built by one optimizer
with one set of Newton-Schulz coefficients and update RMS. A resume therefore continues
with the checkpoint's settings: :func:`adopt_checkpoint_settings` takes those the caller did
not set from the checkpoint, and :func:`settings_conflicts` lists those set to another value,
which the run refuses (rather than record one value and run another).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardmuon.train import dion_format
from shardmuon.train.checkpoint import read_trainer_state
from shardmuon.train.recovery import find_checkpoint

if TYPE_CHECKING:
    from shardmuon.train.config import TrainConfig

__all__ = [
    "RESUME_FIXED",
    "adopt_checkpoint_settings",
    "flag_name",
    "recorded_settings",
    "settings_conflicts",
]

# TrainConfig fields a resume takes from the checkpoint.
RESUME_FIXED: tuple[str, ...] = (
    "optimizer",
    "coefficients",
    "ns_impl",
    "ns_dtype",
    "ns_preconditioner",
    "update_rms",
    "lr",
    "weight_decay",
    "mu",
    "nesterov",
)
# The ones a plain optimizer state_dict (the dion format) carries in its param groups.
_DION_GROUP_KEYS: tuple[str, ...] = ("lr", "weight_decay", "mu", "nesterov")


def flag_name(field_name: str) -> str:
    """The command-line flag of a :class:`~.loop.TrainConfig` field (``lr`` -> ``--lr``)."""
    return "--" + field_name.replace("_", "-")


def _dion_path(config: TrainConfig) -> str | None:
    if config.resume_dion:
        return config.resume_dion
    if config.resume and Path(config.resume).is_file():
        return config.resume
    return None


def recorded_settings(config: TrainConfig, checkpoint: Path | None = None) -> dict[str, Any]:
    """The :data:`RESUME_FIXED` settings the checkpoint ``config`` resumes from records.

    ``checkpoint``: the DCP directory already chosen (default: found from ``config.resume``
    without changing anything on disk). A dion-format file records the group settings that
    all its param groups share. Empty when ``config`` does not resume.
    """
    dion_path = _dion_path(config)
    if dion_path:
        groups = dion_format.read_dion_file(dion_path)["optimizer"].get("param_groups", [])
        shared = {}
        for key in _DION_GROUP_KEYS:
            values = {repr(g[key]) for g in groups if key in g}
            if groups and len(values) == 1 and all(key in g for g in groups):
                shared[key] = groups[0][key]
        return shared
    if not config.resume:
        return {}
    ckpt = (
        checkpoint if checkpoint is not None else find_checkpoint(config.resume, repair=False).path
    )
    saved = read_trainer_state(ckpt).get("config") or {}
    return {name: saved[name] for name in RESUME_FIXED if name in saved}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b


def settings_conflicts(config: TrainConfig, recorded: dict[str, Any]) -> list[str]:
    """``--flag VALUE (checkpoint: VALUE)`` for each recorded setting ``config`` differs in."""
    return [
        f"{flag_name(name)} {getattr(config, name)!r} (checkpoint: {value!r})"
        for name, value in recorded.items()
        if not _same(getattr(config, name), value)
    ]


def adopt_checkpoint_settings(config: TrainConfig, given: set[str]) -> TrainConfig:
    """``config`` with the checkpoint's value for every :data:`RESUME_FIXED` field not in
    ``given`` (the fields the user set explicitly); unchanged when not resuming."""
    recorded = recorded_settings(config)
    adopted = {name: value for name, value in recorded.items() if name not in given}
    return dataclasses.replace(config, **adopted) if adopted else config
