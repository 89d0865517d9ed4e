"""Muon's element-wise math around Newton–Schulz, on plain local tensors.

Everything here is element-wise, so it gives the same bits on a shard as on the whole
matrix: that is what lets the distributed optimizer update each rank's shard locally and
still equal the single-process update bitwise.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from torch import Tensor

from shardmuon.ops.fused_update import fused_update_available, update_into

__all__ = [
    "ADJUST_LR_CHOICES",
    "direction",
    "lr_scale",
    "momentum_update_",
    "weight_update_",
    "weight_updates_",
]

ADJUST_LR_CHOICES = ("rms_norm", "spectral_norm", "keller_muon", None)


def momentum_update_(momentum: Tensor, grad: Tensor, mu: float) -> None:
    """``M = mu*M + G`` in place (shapes match; the grad cast to the momentum dtype first,
    as dion does). The direction is :func:`direction`'s."""
    # Cast first: after the in-place ops start, nothing may allocate (a failure there would
    # leave M half-updated, and a resumed step would update it again).
    grad = grad.to(momentum.dtype)
    momentum.mul_(mu).add_(grad)


def direction(momentum: Tensor, grad: Tensor, mu: float, nesterov: bool) -> Tensor:
    """The direction from an already updated momentum: ``mu*M + G`` (Nesterov) or ``M``."""
    if nesterov:
        return momentum.mul(mu).add_(grad.to(momentum.dtype))
    return momentum


def lr_scale(fan_out: int, fan_in: int, adjust_lr: str | None, update_rms: float) -> float:
    """The per-matrix factor on the learning rate for a ``[fan_out, fan_in]`` matrix.

    ``"rms_norm"``: ``update_rms * sqrt(max(fan_out, fan_in))`` (0.2 gives dion's rms_norm and
    an update RMS like AdamW's); ``"spectral_norm"``: ``sqrt(fan_out / fan_in)``;
    ``"keller_muon"``: ``sqrt(max(1, fan_out / fan_in))`` (KellerJordan/Muon's scale);
    ``None``: 1. A matrix with no elements has nothing to scale: 1.
    """
    if fan_out == 0 or fan_in == 0:
        return 1.0
    if adjust_lr == "rms_norm":
        return update_rms * math.sqrt(max(fan_out, fan_in))
    if adjust_lr == "spectral_norm":
        return math.sqrt(fan_out / fan_in)
    if adjust_lr == "keller_muon":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if adjust_lr is None:
        return 1.0
    raise ValueError(
        f"unknown adjust_lr {adjust_lr!r}; accepted: 'rms_norm', 'spectral_norm', "
        "'keller_muon' or None"
    )


def weight_update_(
    param: Tensor,
    ortho: Tensor,
    lr: float,
    weight_decay: float,
    row_scales: list[tuple[int, int, float]],
) -> None:
    """``X *= 1 - lr*wd`` then ``X -= lr*scale*O``, in place, bits independent of the shard.

    ``param``: ``[B, rows, cols]`` (a view of the local shard); ``ortho``: the bf16 Newton–Schulz
    output of the same shape. ``row_scales`` lists ``(row_start, row_end, scale)`` ranges of
    the local rows (one range unless the matrix is partitioned). ``lr*scale*O`` is formed in
    fp32 by one multiply and added by one add (a bf16 parameter is updated in fp32 and
    rounded once): each is a single correctly rounded operation per element, so the result
    does not depend on how long the local tensor is (a fused ``add_(alpha=)`` may take a
    vector path with an FMA on one length and a scalar path on another).

    Everything that allocates (the fp32 steps, a bf16 parameter's fp32 copy) happens before
    the parameter is written, so an out-of-memory leaves it unchanged and a retry updates it
    once. On CUDA (with Triton) an fp32 parameter whose ranges cover its rows is updated by
    one kernel per range with the same roundings (``ops/fused_update.py``).
    """
    if param.dtype == torch.float32 and fused_update_available(param.device):
        ranges = [(start, end, scale) for start, end, scale in row_scales if end > start]
        covered = [(start, end) for start, end, _ in sorted(ranges)]
        rows = param.size(-2)
        if (
            covered
            and covered[0][0] == 0
            and covered[-1][1] == rows
            and all(a[1] == b[0] for a, b in itertools.pairwise(covered))
        ):
            decay = 1.0 - lr * weight_decay if weight_decay != 0.0 else 1.0
            for start, end, scale in ranges:
                update_into(param[..., start:end, :], ortho[..., start:end, :], -lr * scale, decay)
            return
    steps = [
        (start, end, _scaled_fp32(ortho[..., start:end, :], -lr * scale))
        for start, end, scale in row_scales
        if end > start
    ]
    if param.dtype != torch.float32:
        wide = [param[..., start:end, :].to(torch.float32) for start, end, _ in steps]
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    for k, (start, end, step) in enumerate(steps):
        rows = param[..., start:end, :]
        if rows.dtype == torch.float32:
            rows.add_(step)
        else:
            # The decay rounded to the param's dtype first, as before: same bits.
            wide[k].copy_(rows)
            rows.copy_(wide[k].add_(step))


def _scaled_fp32(results: Tensor, factor: float) -> Tensor:
    """``fl32(results) * factor`` in a new fp32 tensor (``factor`` rounded to fp32 first, as a
    multiply by a Python float does). On a CPU one pass: the factor is a cached one-element
    fp32 tensor with dimensions, so the multiply promotes to fp32 (widening is exact)
    instead of a widened copy multiplied in place (an fp32 ``results`` is never written)."""
    if results.device.type == "cpu":
        return torch.mul(results, _cpu_factor(factor, math.copysign(1.0, factor), results.dim()))
    if results.dtype == torch.float32:
        return results * factor
    return results.to(torch.float32).mul_(factor)


@functools.lru_cache(maxsize=256)
def _cpu_factor(factor: float, sign: float, dims: int) -> Tensor:
    """``factor`` as an fp32 CPU tensor of ``dims`` unit dimensions, made once per value
    (``sign`` keeps ``-0.0`` and ``0.0`` apart: they compare equal). Never written."""
    # Through fp64: a factor beyond fp32's range rounds to inf, as a multiply by it does
    # (torch.full refuses it).
    return torch.tensor(factor, dtype=torch.float64).to(torch.float32).reshape((1,) * dims)


def weight_updates_(
    params: list[Tensor],
    results: Tensor,
    lrs: list[float],
    weight_decays: list[float],
    row_scales: list[list[tuple[int, int, float]]],
) -> None:
    """:func:`weight_update_` of several fp32 parameters at once, in ``_foreach_`` passes:
    the same roundings per element (one multiply forms ``lr*scale*O`` in fp32, one multiply
    decays, one add updates), so the same bits, in one cast and three launches of torch's
    multi-tensor apply (per kernel's worth of tensors) instead of four kernels per parameter.

    ``params[k]``: fp32 ``[B_k, rows, cols]`` views updated in place; ``results``: their
    Newton–Schulz results stacked, ``[sum B_k, rows, cols]`` in any float dtype (read only).
    The fp32 steps are allocated before any parameter is written.
    """
    wide = results.to(torch.float32, copy=True)
    steps, targets, factors = [], [], []
    offset = 0
    for param, lr, ranges in zip(params, lrs, row_scales):
        ortho = wide[offset : offset + param.size(0)]
        offset += param.size(0)
        for start, end, scale in ranges:
            if end > start:
                steps.append(ortho[..., start:end, :])
                targets.append(param[..., start:end, :])
                factors.append(-lr * scale)
    if steps:
        torch._foreach_mul_(steps, factors)
    # Every parameter is decayed, its rows in no range too (as weight_update_ does).
    decayed = [(p, 1.0 - lr * wd) for p, lr, wd in zip(params, lrs, weight_decays) if wd != 0.0]
    if decayed:
        torch._foreach_mul_([p for p, _ in decayed], [f for _, f in decayed])
    if steps:
        torch._foreach_add_(targets, steps)
