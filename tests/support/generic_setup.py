"""Our version of the generic checks PyTorch's ``test/test_optim.py`` runs on every optimizer
of its ``optim_db`` (each with the optimizer's constructor inputs, ``optim_inputs_func_*``, and
generic error inputs), applied to ``shardmuon.Muon`` (``tests/optimizer``: error inputs, state
dicts, copies, hooks, steps, lrs and schedulers); here, their parameters and optimizers.

Groups are dion-style (``algorithm`` = ``"muon"`` for matrices, ``"adamw"`` for 1-D
parameters). Where possible a check compares against an independent reference run (a second
optimizer on a parallel copy of the parameters, stepped with the same gradients) and asks for
bitwise equality: one CPU process, where shardmuon is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from checks import grads_for, set_grads
from torch import Tensor
from torch.nn import Parameter

from shardmuon import Muon

# Two Muon matrices of different shapes, a stack of two matrices (3-D) and an AdamW vector.
SHAPES = [(16, 8), (8, 16), (2, 12, 6), (8,)]
BASE = dict(lr=0.02, weight_decay=0.1, nesterov=True)


def make_params(dtype: torch.dtype | list[torch.dtype] = torch.float32, seed: int = 0):
    """Fresh parameters (same values for the same seed), one dtype or one per parameter."""
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(SHAPES)
    gen = torch.Generator().manual_seed(seed)
    return [
        Parameter((torch.randn(s, generator=gen, dtype=torch.float64) * 0.05).to(d))
        for s, d in zip(SHAPES, dtypes)
    ]


def make_groups(ps: list[Tensor], muon: dict | None = None, adamw: dict | None = None):
    return [
        dict(params=list(ps[:3]), algorithm="muon", **(muon or {})),
        dict(params=list(ps[3:]), algorithm="adamw", **(adamw or {})),
    ]


def make_opt(ps: list[Tensor], **kwargs: Any) -> Muon:
    return Muon(make_groups(ps), **{**BASE, **kwargs})


def dion_state(opt: Muon, p: Tensor) -> list[Tensor]:
    """``p``'s state tensors under dion's keys (without shardmuon's ``step`` counter, which
    counts the group's steps for every parameter, with a grad or not)."""
    return [v for k, v in opt.state[p].items() if k != "step"]


def step_both(opts_and_params: list[tuple[Muon, list[Tensor]]], step: int) -> None:
    for opt, ps in opts_and_params:
        set_grads(ps, grads_for(step, ps))
        opt.step()


# Constructor inputs, in the spirit of torch's optim_inputs_func_muon / _adamw: each generic
# test that takes them runs on every entry. Built lazily so tensor lrs are never shared between tests.
OPTIM_INPUTS: list[tuple[str, Callable[[], dict]]] = [
    ("default", lambda: {}),
    ("non-default lr", lambda: dict(lr=0.01)),
    ("tensor lr", lambda: dict(lr=torch.tensor(0.001))),
    ("weight_decay", lambda: dict(weight_decay=0.2)),
    ("no weight_decay", lambda: dict(weight_decay=0.0)),
    ("mu", lambda: dict(mu=0.8)),
    ("no nesterov", lambda: dict(nesterov=False)),
    ("betas", lambda: dict(betas=(0.8, 0.9))),
    ("epsilon", lambda: dict(epsilon=1e-6)),
    ("keller coefficients", lambda: dict(newton_schulz_coefficients="keller")),
    ("six custom triples", lambda: dict(newton_schulz_coefficients=[(3.4, -4.7, 2.0)] * 6)),
    ("spectral_norm", lambda: dict(adjust_lr="spectral_norm")),
    ("rms_norm", lambda: dict(adjust_lr="rms_norm")),
    ("keller_muon", lambda: dict(adjust_lr="keller_muon")),
    ("adjust_lr None", lambda: dict(adjust_lr=None)),
    ("update_rms", lambda: dict(update_rms=0.3)),
    ("flatten", lambda: dict(flatten=True)),
    ("max_in_flight 1", lambda: dict(max_in_flight=1)),
    ("unfolded Newton-Schulz", lambda: dict(newton_schulz_impl="unfolded")),
    ("no owner rotation, split replicas", lambda: dict(rotate_owners=False, split_replicas=True)),
    ("check_grads always", lambda: dict(check_grads="always")),
]
OPTIM_IDS = [name for name, _ in OPTIM_INPUTS]
OPTIM_FACTORIES = [factory for _, factory in OPTIM_INPUTS]
