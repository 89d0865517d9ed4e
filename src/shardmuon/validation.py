"""Checks of user input that every rank can do alone, before any collective.

Each check raises ``ValueError``/``TypeError`` naming the value given and what is accepted.
Running them locally and before communication means an SPMD job fails on every rank with
the same message instead of hanging in an all-to-all.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from shardmuon.ops.sinkhorn import SINKHORN_DEFAULTS, check_iters
from shardmuon.ops.update import ADJUST_LR_CHOICES
from shardmuon.settings import SETTING_NAMES

__all__ = [
    "EPSILON_MIN",
    "MOMENTUM_ALIAS",
    "check_dion_arguments",
    "check_grads",
    "check_group",
    "check_live_groups",
    "check_number",
    "group_defaults",
    "refuse_state_offloader",
    "resolve_max_in_flight",
    "split_by_shape",
    "with_sinkhorn_defaults",
]

ALGORITHMS = ("muon", "sinkhorn", "adamw")
# The smallest ``epsilon``: float32's smallest normal number. The normalisation adds epsilon
# to a float32 norm; a smaller one is 0 or subnormal there (flushed to 0 where denormals
# are), and an all-zero gradient (an expert that got no token) is then 0 / 0: NaN in every
# weight, counted nowhere.
EPSILON_MIN = torch.finfo(torch.float32).tiny


def _bound(value: float) -> str:
    """A bound as an error message shows it: short where that is exact (``0``, ``1``),
    else every digit, so that the number shown is accepted where the bound is."""
    if value == EPSILON_MIN:
        return f"{value!r} (float32's smallest normal number)"
    return f"{value:g}" if float(f"{value:g}") == value else repr(value)


def check_number(
    name: str,
    value: Any,
    upper: float | None = None,
    *,
    positive: bool = False,
    lower: float = 0.0,
) -> None:
    """``value`` must be a finite real number ``>= lower`` (``> lower`` if ``positive``;
    ``< upper``); ``lower`` is 0 unless given.

    A 1-element tensor counts as its value (torch's tensor lr); a larger tensor is refused.
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a number or a 1-element tensor, got a tensor of shape "
                f"{tuple(value.shape)}"
            )
        value = value.item()
    low = f"{'>' if positive else '>='} {_bound(lower)}"
    if upper is not None:
        accepted = f"a number in {'(' if positive else '['}{_bound(lower)}, {upper:g})"
    else:
        accepted = f"a finite number {low}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {accepted}, got {value!r}")
    if isinstance(value, int) and abs(value) > sys.float_info.max:  # no float holds it
        shown = f"an int of {len(str(abs(value)))} digits"
        raise ValueError(f"{name} must be {accepted}, got {shown}")
    low_ok = value > lower if positive else value >= lower
    if not low_ok or not math.isfinite(value) or (upper is not None and not value < upper):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")


def check_epsilon(name: str, value: Any) -> None:
    """``value`` must be a finite number ``>= EPSILON_MIN`` (float32's smallest normal
    number; config.FIELD_RANGES states the same range for ``MuonConfig``)."""
    check_number(name, value, lower=EPSILON_MIN)


def check_adjust_lr(where: str, adjust_lr: Any) -> None:
    if adjust_lr not in ADJUST_LR_CHOICES:
        raise ValueError(
            f"{where}unknown adjust_lr {adjust_lr!r}; accepted: 'rms_norm', 'spectral_norm', "
            "'keller_muon' or None"
        )


# The key torch's OneCycleLR/CyclicLR write when they cycle momentum (optimizers without
# "betas" in their defaults get group["momentum"]).
MOMENTUM_ALIAS = "momentum"


def apply_momentum_alias(index: int, group: dict) -> None:
    """A group's ``momentum`` (when it has one that is not ``None``) is its momentum
    coefficient: copied into ``mu`` (muon) or ``beta1`` (adamw) before each step, so a
    scheduler cycling it changes what the step uses. It rules over a ``mu``/``beta1`` set
    by hand while present."""
    value = group.get(MOMENTUM_ALIAS)
    if value is None:
        return
    check_momentum_alias(index, group)
    group["beta1" if group.get("algorithm") == "adamw" else "mu"] = value


def check_momentum_alias(index: int, group: dict) -> None:
    """A group's ``momentum`` alias, when set, must be a valid ``mu`` / ``beta1``."""
    value = group.get(MOMENTUM_ALIAS)
    if value is not None:
        check_number(f"param group {index}: momentum (the alias of mu / beta1)", value, 1.0)


def check_group_settings(index: int, group: dict) -> None:
    """A group's hyper-parameters (cheap: run before every step, as they are live)."""
    where = f"param group {index}"
    check_momentum_alias(index, group)
    if group["algorithm"] not in ALGORITHMS:
        raise ValueError(
            f"{where}: unknown algorithm {group['algorithm']!r}; accepted: 'muon', "
            "'sinkhorn', 'adamw'"
            + (" (dion's 'lion' is not implemented)" if group["algorithm"] == "lion" else "")
        )
    check_adjust_lr(f"{where}: ", group["adjust_lr"])
    check_number(f"{where}: lr", group["lr"])
    check_number(f"{where}: mu", group["mu"], 1.0)
    check_number(f"{where}: beta1", group["beta1"], 1.0)
    check_number(f"{where}: beta2", group["beta2"], 1.0)
    check_number(f"{where}: weight_decay", group["weight_decay"])
    check_epsilon(f"{where}: epsilon", group["epsilon"])
    if group["algorithm"] == "sinkhorn":
        check_sinkhorn_settings(where, group)
    for key in ("nesterov", "flatten"):
        if not isinstance(group[key], bool):
            raise TypeError(f"{where}: {key} must be True or False, got {group[key]!r}")
    misplaced = sorted(set(group) & ({*SETTING_NAMES, "coefficients"} - {"warmup"}))
    if misplaced:
        raise ValueError(
            f"{where} sets {', '.join(map(repr, misplaced))}: optimizer-wide settings, which a "
            "group's keys would silently not change; pass them to Muon(...) (torchtitan's "
            "container: optimizer_factory_kwargs_by_name)"
        )
    torch_names = sorted({"betas", "eps"} & set(group))
    if torch_names:
        raise ValueError(
            f"{where} sets {', '.join(map(repr, torch_names))} (torch.optim's names), which "
            "shardmuon's groups do not read: it would silently step with beta1/beta2/epsilon; "
            "use beta1 and beta2 for betas, epsilon for eps (dion's names)"
        )
    if group.get("cautious_wd"):
        raise ValueError(
            f"{where} has cautious_wd=True (microsoft/dion's cautious weight decay), which "
            "shardmuon does not implement; stepping would silently change the update"
        )
    step = group.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{where}: step must be an int >= 0, got {step!r}")


def check_sinkhorn_settings(where: str, group: dict) -> None:
    """A Sinkhorn group's own keys (``ops/sinkhorn.py``; prime-rl's defaults are filled in)."""
    iters = group.get("sinkhorn_iters")
    try:
        check_iters(iters)
    except ValueError as err:
        raise ValueError(f"{where}: sinkhorn_iters: {err}") from None
    check_number(f"{where}: sinkhorn_tau", group.get("sinkhorn_tau"))
    check_number(f"{where}: sinkhorn_eps", group.get("sinkhorn_eps"), positive=True)
    check_number(f"{where}: sinkhorn_lr_scale", group.get("sinkhorn_lr_scale"), positive=True)


def with_sinkhorn_defaults(group: dict) -> dict:
    """A Sinkhorn group with prime-rl's defaults for the keys it does not give (other
    groups as they are: the keys stay out of dion-compatible groups)."""
    if group.get("algorithm") != "sinkhorn":
        return group
    return {**group, **{k: v for k, v in SINKHORN_DEFAULTS.items() if k not in group}}


def check_group(index: int, group: dict) -> None:
    """A param group after defaults are filled in: settings, then each parameter."""
    check_group_settings(index, group)
    where = f"param group {index}"
    seen: set[int] = set()
    for i, p in enumerate(group["params"]):
        if id(p) in seen:
            raise ValueError(
                f"{where}: parameter {i} (shape {tuple(p.shape)}) is listed twice; each "
                "parameter may appear once"
            )
        seen.add(id(p))
        if p.is_complex() or not p.is_floating_point():
            raise TypeError(
                f"{where}: parameter {i} has dtype {p.dtype}; shardmuon steps real "
                "floating-point parameters only (as torch.optim.Muon, complex ones are refused)"
            )
        if group["algorithm"] == "sinkhorn" and p.ndim != 2:
            raise ValueError(
                f"{where} (algorithm 'sinkhorn'): parameter {i} has shape {tuple(p.shape)}; "
                "the Sinkhorn update needs 2-D matrices (embedding tables, output heads)"
            )
        if group["algorithm"] == "muon" and p.ndim < 2:
            raise ValueError(
                f"{where} (algorithm 'muon'): parameter {i} has shape {tuple(p.shape)}; "
                "Muon needs matrices (2-D or more); put 0-D/1-D parameters in an "
                "'adamw' group"
            )


def check_mesh(mesh: Any, name: str = "distributed_mesh") -> None:
    """dion's mesh arguments are accepted for drop-in use, and only type-checked."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is not None and not isinstance(mesh, (DeviceMesh, dist.ProcessGroup)):
        raise TypeError(
            f"{name} must be None, a DeviceMesh or a ProcessGroup, got "
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
            if grad.layout != torch.strided:
                raise TypeError(
                    f"{where} has a sparse grad (layout {grad.layout}); shardmuon needs dense "
                    "grads (use nn.Embedding(sparse=False))"
                )
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


def check_dion_arguments(
    distributed_mesh: Any,
    world_mesh: Any,
    fsdp_mesh_dim: Any,
    use_triton: Any,
    newton_schulz_func: Any,
) -> None:
    """dion's constructor arguments that shardmuon accepts for drop-in use: type-checked
    (the meshes and ``use_triton`` are otherwise ignored), a custom orthogonalization refused."""
    check_mesh(distributed_mesh)
    check_mesh(world_mesh, "world_mesh")
    if fsdp_mesh_dim is not None and not isinstance(fsdp_mesh_dim, (int, str)):
        raise TypeError(
            f"fsdp_mesh_dim must be None, an int or a mesh dim name, got {fsdp_mesh_dim!r}"
        )
    if not isinstance(use_triton, bool):
        raise TypeError(f"use_triton must be True or False, got {use_triton!r}")
    if newton_schulz_func is not None:
        raise ValueError(
            "newton_schulz_func (dion's custom orthogonalization) is not supported; choose "
            "the iteration with newton_schulz_coefficients (a preset name or (a, b, c) "
            "triples)"
        )


def refuse_state_offloader(state_offloader: Any) -> None:
    """``Muon.step(state_offloader=...)``: prime-rl's protocol for dion is refused, saying
    what to use instead."""
    if state_offloader is not None:
        raise TypeError(
            f"Muon.step(state_offloader={type(state_offloader).__name__}(...)) is prime-rl's "
            "protocol for dion and is not taken: use Muon(offload='state') (the state "
            "streamed chunk by chunk, at most offload_prefetch chunks on the device), or "
            "step chunk by chunk yourself: for chunk in opt.chunks(): move "
            "opt.chunk_info(chunk).params' grads and state to the device, "
            "opt.step_chunk(chunk), move them back (Muon(adamw_chunks='parameter'): one "
            "AdamW parameter per chunk)"
        )


def resolve_max_in_flight(max_in_flight: Any, max_concurrent_tasks: Any) -> Any:
    """``max_in_flight``, given under its own name or prime-rl's (``max_concurrent_tasks``);
    3 when neither is; both given and different: ``ValueError`` (the value is checked with
    the other settings)."""
    if max_in_flight is None:
        return 3 if max_concurrent_tasks is None else max_concurrent_tasks
    if max_concurrent_tasks is not None and max_concurrent_tasks != max_in_flight:
        raise ValueError(
            f"max_in_flight={max_in_flight!r} and max_concurrent_tasks={max_concurrent_tasks!r} "
            "disagree: they are one setting (max_concurrent_tasks is prime-rl's name for it); "
            "pass one of them"
        )
    return max_in_flight


def group_defaults(
    *,
    lr: Any,
    mu: Any,
    betas: Any,
    weight_decay: Any,
    epsilon: Any,
    nesterov: Any,
    flatten: Any,
    adjust_lr: Any,
) -> dict[str, Any]:
    """The param groups' defaults (dion's keys), checked as a group's settings are."""
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for name, value, upper in (
        ("lr", lr, None),
        ("mu", mu, 1.0),
        ("betas[0]", betas[0], 1.0),
        ("betas[1]", betas[1], 1.0),
        ("weight_decay", weight_decay, None),
    ):
        check_number(name, value, upper)
    check_epsilon("epsilon", epsilon)
    check_adjust_lr("", adjust_lr)
    return dict(
        lr=lr,
        mu=mu,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
        algorithm="muon",
        step=0,
        epsilon=epsilon,
        nesterov=nesterov,
        flatten=flatten,
        adjust_lr=adjust_lr,
    )


def check_live_groups(param_groups: list[dict]) -> None:
    """The per-step checks of every group's live settings (all checked before the momentum
    alias is applied to any, so that a failure changes nothing)."""
    for index, group in enumerate(param_groups):
        check_momentum_alias(index, group)
    for index, group in enumerate(param_groups):
        apply_momentum_alias(index, group)
        check_group_settings(index, group)


def split_by_shape(params: Any) -> Any:
    """``params`` with every group that names no ``algorithm`` (or a plain iterable of
    tensors, one such group) split in two: its matrices (2-D or more) as a Muon group and
    the rest as an ``"adamw"`` group, both keeping the group's other keys; an empty half is
    left out. Groups that name their algorithm pass unchanged."""
    if isinstance(params, Tensor):
        return params  # torch's own error for a single tensor
    items = list(params)
    if not items:
        return items  # torch's own error
    if not all(isinstance(item, dict) for item in items):
        if any(isinstance(item, dict) for item in items):
            return items  # mixed: torch's own error
        items = [{"params": items}]
    out = []
    for group in items:
        raw = group.get("params")
        if "algorithm" in group or raw is None or isinstance(raw, set):
            out.append(group)  # named, or torch's own error
            continue
        members = [raw] if isinstance(raw, Tensor) else list(raw)
        named = [isinstance(p, tuple) for p in members]
        if any(named) and not all(named):
            out.append({**group, "params": members})  # torch's own error
            continue
        tensors = [p[1] if isinstance(p, tuple) else p for p in members]
        is_matrix = [isinstance(t, Tensor) and t.ndim >= 2 for t in tensors]
        matrices = [p for p, matrix in zip(members, is_matrix) if matrix]
        others = [p for p, matrix in zip(members, is_matrix) if not matrix]
        rest = {k: v for k, v in group.items() if k != "params"}
        if matrices or not others:
            out.append({**rest, "params": matrices})
        if others:
            out.append({**rest, "params": others, "algorithm": "adamw"})
    return out
