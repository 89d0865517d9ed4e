"""Optimizer settings on a resume: a checkpoint fixes them, flags may not silently differ.

Loading a checkpoint restores the optimizer's param groups, and with them ``lr``,
``weight_decay``, ``mu`` and ``nesterov``; the state it holds was built by one optimizer
with one set of Newton-Schulz coefficients and update RMS, under one lr schedule. A resume
therefore continues with the checkpoint's settings: :func:`adopt_checkpoint_settings` takes
those the caller did not set from the checkpoint, and :func:`settings_conflicts` lists
those set to another value, which the run refuses (rather than record one value and run
another).

A setting is named by its place in :class:`~.config.TrainConfig`: ``"optimizer"`` is the
field, ``"optim.lr"`` the ``MuonConfig`` field under ``optim``. Checkpoints written before
the settings were nested (flat ``lr``, ``coefficients``, ``ns_dtype="bf16"`` ...) are read
through :data:`FLAT_NAMES`.
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

# The settings a resume takes from the checkpoint, each with its command-line flag.
RESUME_FIXED: dict[str, str] = {
    "optimizer": "--optimizer",
    "optim.newton_schulz_coefficients": "--coefficients",
    "optim.newton_schulz_impl": "--ns-impl",
    "optim.newton_schulz_dtype": "--ns-dtype",
    "optim.newton_schulz_preconditioner": "--ns-preconditioner",
    "optim.update_rms": "--update-rms",
    "optim.lr": "--lr",
    "optim.weight_decay": "--weight-decay",
    "optim.mu": "--mu",
    "optim.nesterov": "--nesterov",
    "adamw_lr": "--adamw-lr",
    "embedding_update": "--embedding-update",
    "warmup_steps": "--warmup",
    "schedule": "--schedule",
}
# Where a checkpoint written with the flat fields kept each nested one.
FLAT_NAMES = {
    "optim.newton_schulz_coefficients": "coefficients",
    "optim.newton_schulz_impl": "ns_impl",
    "optim.newton_schulz_dtype": "ns_dtype",
    "optim.newton_schulz_preconditioner": "ns_preconditioner",
}
_FLAT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# The ones a plain optimizer state_dict (the dion format) carries in its param groups.
_DION_GROUP_KEYS: tuple[str, ...] = ("lr", "weight_decay", "mu", "nesterov")


def flag_name(name: str) -> str:
    """The command-line flag of a setting (``"optim.lr"`` -> ``--lr``)."""
    return RESUME_FIXED.get(name) or "--" + name.split(".")[-1].replace("_", "-")


def setting(config: TrainConfig, name: str) -> Any:
    """The value of setting ``name`` in ``config``."""
    owner = config
    *parents, leaf = name.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return getattr(owner, leaf)


def _dion_path(config: TrainConfig) -> str | None:
    if config.resume_dion:
        return config.resume_dion
    if config.resume and Path(config.resume).is_file():
        return config.resume
    return None


def _from_saved(saved: dict[str, Any]) -> dict[str, Any]:
    """The :data:`RESUME_FIXED` settings a trainer state's ``config`` records."""
    nested = saved.get("optim")
    out = {}
    for name in RESUME_FIXED:
        if not name.startswith("optim."):
            if name in saved:
                out[name] = saved[name]
        elif isinstance(nested, dict):
            if name[len("optim.") :] in nested:
                out[name] = nested[name[len("optim.") :]]
        else:  # written before the settings were nested
            flat = FLAT_NAMES.get(name, name[len("optim.") :])
            if flat in saved:
                value = saved[flat]
                out[name] = _FLAT_DTYPES.get(value, value) if flat == "ns_dtype" else value
    return out


def recorded_settings(config: TrainConfig, checkpoint: Path | None = None) -> dict[str, Any]:
    """The :data:`RESUME_FIXED` settings the checkpoint ``config`` resumes from records.

    ``checkpoint``: the DCP directory already chosen (default: found from ``config.resume``
    without changing anything on disk). A dion-format file records the group settings that
    all its param groups share (its lr only when the run's lr is the same at every step:
    the groups hold the lr of the step the file was written at). Empty when ``config``
    does not resume.
    """
    dion_path = _dion_path(config)
    if dion_path:
        groups = dion_format.read_dion_file(dion_path)["optimizer"].get("param_groups", [])
        scheduled = config.warmup_steps > 0 or config.schedule != "constant"
        shared = {}
        for key in _DION_GROUP_KEYS:
            values = {repr(g[key]) for g in groups if key in g}
            if key == "lr" and scheduled:
                continue
            if groups and len(values) == 1 and all(key in g for g in groups):
                shared[f"optim.{key}"] = groups[0][key]
        return shared
    if not config.resume:
        return {}
    ckpt = (
        checkpoint if checkpoint is not None else find_checkpoint(config.resume, repair=False).path
    )
    return _from_saved(read_trainer_state(ckpt).get("config") or {})


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
        f"{flag_name(name)} {setting(config, name)!r} (checkpoint: {value!r})"
        for name, value in recorded.items()
        if not _same(setting(config, name), value)
    ]


def adopt_checkpoint_settings(config: TrainConfig, given: set[str]) -> TrainConfig:
    """``config`` with the checkpoint's value for every :data:`RESUME_FIXED` setting not in
    ``given`` (the settings the user set explicitly); unchanged when not resuming."""
    from shardmuon.train.config import optim_settings

    recorded = recorded_settings(config)
    adopted = {name: value for name, value in recorded.items() if name not in given}
    if not adopted:
        return config
    optim = {k[len("optim.") :]: v for k, v in adopted.items() if k.startswith("optim.")}
    fields = {k: v for k, v in adopted.items() if not k.startswith("optim.")}
    if optim:
        fields["optim"] = optim_settings(config.optim, **optim)
    return dataclasses.replace(config, **fields)
