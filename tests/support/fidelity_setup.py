"""The parameters, gradients and optimizers that the fidelity tests share
(``tests/optimizer``: live settings, dion call sites, split sizes, strided parameters,
refused inputs, atomic loads, failed chunks, copies). Single process, CPU."""

from __future__ import annotations

from typing import Any

import torch
from checks import grads_for_shapes, set_grads, state_tensor_keys
from torch import Tensor, nn

from shardmuon import Muon


def param(shape: tuple[int, ...], seed: int) -> nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(shape, generator=gen) * 0.1)


def step_with(opt: Muon, params: list[Tensor], seed: int) -> None:
    """One step on the gradients of step ``seed``."""
    set_grads(params, grads_for_shapes([tuple(p.shape) for p in params], seed))
    opt.step()


def copy_state(src: Muon, src_params: list[Tensor], dst: Muon, dst_params: list[Tensor]) -> None:
    """``dst`` gets ``src``'s state tensors and group step counters (by hand, no load)."""
    for ps, pd in zip(src_params, dst_params):
        for key in state_tensor_keys(src, ps):
            dst.state[pd][key].copy_(src.state[ps][key])
    for gs, gd in zip(src.param_groups, dst.param_groups):
        gd["step"] = gs["step"]


# A mixed optimizer: a muon group (a matrix and a 3-D stack) and an adamw group.
MIXED_SHAPES = [(16, 8), (3, 8, 4), (8,)]
MIXED_KWARGS = dict(
    lr=0.02,
    mu=0.9,
    weight_decay=0.1,
    nesterov=False,
    adjust_lr="rms_norm",
    epsilon=1e-8,
    flatten=False,
)


def mixed_params(seed: int = 0) -> list[nn.Parameter]:
    return [param(s, seed + i) for i, s in enumerate(MIXED_SHAPES)]


def mixed_groups(params: list[Tensor], overrides: dict | None = None) -> list[dict]:
    groups = [
        dict(params=params[:2], algorithm="muon"),
        dict(params=params[2:], algorithm="adamw"),
    ]
    for index, extra in (overrides or {}).items():
        groups[index].update(extra)
    return groups


def mixed(params: list[Tensor], overrides: dict | None = None, **kwargs: Any) -> Muon:
    return Muon(mixed_groups(params, overrides), **{**MIXED_KWARGS, **kwargs})
