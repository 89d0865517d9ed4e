"""Checks of user input that every rank can do alone, before any collective.

Each check raises ``ValueError``/``TypeError`` naming the value given and what is accepted.
Running them locally and before communication means an SPMD job fails on every rank with
the same message instead of hanging in an all-to-all.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from shardmuon.update import ADJUST_LR_CHOICES

__all__ = ["ALGORITHMS", "check_grads", "check_group", "check_mesh", "check_number"]

ALGORITHMS = ("muon", "adamw")


def check_number(name: str, value: Any, upper: float | None = None) -> None:
    """``value`` must be a real number ``>= 0`` (and ``< upper`` when given)."""
    if isinstance(value, Tensor):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not value >= 0.0 or (upper is not None and not value < upper):
        accepted = f"in [0, {upper:g})" if upper is not None else ">= 0"
        raise ValueError(f"{name} must be {accepted}, got {value!r}")


def check_adjust_lr(where: str, adjust_lr: Any) -> None:
    if adjust_lr not in ADJUST_LR_CHOICES:
        raise ValueError(
            f"{where}unknown adjust_lr {adjust_lr!r}; accepted: 'rms_norm', 'spectral_norm', "
            "'keller_muon' or None"
        )


def check_group(index: int, group: dict) -> None:
    """A param group after defaults are filled in: algorithm, hyper-parameters, shapes."""
    where = f"param group {index}"
    if group["algorithm"] not in ALGORITHMS:
        raise ValueError(
            f"{where}: unknown algorithm {group['algorithm']!r}; accepted: 'muon', 'adamw'"
        )
    check_adjust_lr(f"{where}: ", group["adjust_lr"])
    check_number(f"{where}: lr", group["lr"])
    check_number(f"{where}: mu", group["mu"], 1.0)
    check_number(f"{where}: beta1", group["beta1"], 1.0)
    check_number(f"{where}: beta2", group["beta2"], 1.0)
    check_number(f"{where}: weight_decay", group["weight_decay"])
    check_number(f"{where}: epsilon", group["epsilon"])
    if group["algorithm"] == "muon":
        for i, p in enumerate(group["params"]):
            if p.ndim < 2:
                raise ValueError(
                    f"{where} (algorithm 'muon'): parameter {i} has shape {tuple(p.shape)}; "
                    "Muon needs matrices (2-D or more); put 0-D/1-D parameters in an "
                    "'adamw' group"
                )


def check_mesh(mesh: Any) -> None:
    """``distributed_mesh`` is accepted for drop-in use with dion, and only type-checked."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is not None and not isinstance(mesh, (DeviceMesh, dist.ProcessGroup)):
        raise TypeError(
            f"distributed_mesh must be None, a DeviceMesh or a ProcessGroup, got "
            f"{type(mesh).__name__}; shardmuon reads the distribution from the parameters"
        )


def check_grads(param_groups: list[dict]) -> None:
    """Every present grad is laid out like its parameter (kind, placements, mesh, shape)."""
    for g, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            where = f"param group {g} parameter {i} (shape {tuple(p.shape)})"
            if isinstance(p, DTensor) != isinstance(grad, DTensor):
                kind = "a DTensor" if isinstance(p, DTensor) else "a plain tensor"
                grad_kind = "a DTensor" if isinstance(grad, DTensor) else "a plain tensor"
                raise TypeError(
                    f"{where} is {kind} but its grad is {grad_kind}; the grad must be laid "
                    "out like the parameter"
                )
            if isinstance(p, DTensor) and (
                grad.placements != p.placements or grad.device_mesh != p.device_mesh
            ):
                raise ValueError(
                    f"{where}: grad placements {tuple(grad.placements)} on mesh "
                    f"{grad.device_mesh} differ from the parameter's {tuple(p.placements)} on "
                    f"mesh {p.device_mesh}"
                )
            if grad.shape != p.shape:
                raise ValueError(
                    f"{where}: grad shape {tuple(grad.shape)} differs from the parameter's"
                )
