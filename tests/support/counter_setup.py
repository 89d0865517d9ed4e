"""The parameters and optimizers of the single-process tests of the per-parameter step
counters, the ``momentum`` alias and ``step_chunk`` (``tests/runtime``): four Muon matrices
(one a 3-D stack) and two AdamW vectors, each run stepped on :func:`set_random_grads`.

Each test states the correct behaviour against an independent reference: an optimizer
never interrupted, an optimizer given the values by hand, torch's own optimizer driven by
the same scheduler, or the constructor's own checks.
"""

from __future__ import annotations

import copy

import torch
from checks import set_random_grads
from torch.nn import Parameter

from shardmuon import Muon

SHAPES = [(8, 12), (8, 12), (12, 8), (2, 6, 10), (10,), (6,)]
MUON_COUNT = 4


def make_params(seed: int = 0, dtypes=None) -> list[Parameter]:
    gen = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * len(SHAPES)
    return [Parameter((torch.randn(s, generator=gen) * 0.1).to(d)) for s, d in zip(SHAPES, dtypes)]


def groups_of(params: list[Parameter], **muon_keys) -> list[dict]:
    return [
        dict(params=params[:MUON_COUNT], algorithm="muon", **muon_keys),
        dict(params=params[MUON_COUNT:], algorithm="adamw"),
    ]


def make_opt(params: list[Parameter], **kwargs) -> Muon:
    kwargs.setdefault("lr", 0.02)
    kwargs.setdefault("weight_decay", 0.1)
    return Muon(groups_of(params), **kwargs)


def step_with(opt: Muon, params, seed: int) -> None:
    set_random_grads(params, seed)
    opt.step()


def counters(opt: Muon) -> list[list[float]]:
    return [[opt.state[p]["step"].item() for p in g["params"]] for g in opt.param_groups]


def assert_counters_mirror_groups(opt: Muon) -> None:
    for g, values in zip(opt.param_groups, counters(opt)):
        assert values == [float(g["step"])] * len(values), (g["step"], values)


def run_then_save(offload=None, steps: int = 3):
    """``steps`` steps, then a deep copy of the state dict: ``(params, optimizer, saved)``."""
    ps = make_params()
    opt = make_opt(ps, offload=offload)
    for seed in range(steps):
        step_with(opt, ps, seed)
    return ps, opt, copy.deepcopy(opt.state_dict())


def uninterrupted(offload=None, steps: int = 5):
    """The reference run: ``steps`` steps without a break."""
    ps = make_params()
    opt = make_opt(ps, offload=offload)
    for seed in range(steps):
        step_with(opt, ps, seed)
    return ps, opt
