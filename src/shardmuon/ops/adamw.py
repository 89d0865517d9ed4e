"""AdamW for the non-matrix parameters, with dion's exact arithmetic (plain local tensors).

dion (samsja/dion@3c4bce5, ``scalar_opts.adamw_update_foreach``) turns the hyper-parameters into
float32 0-d tensors and computes, with ``t`` the group step after its increment::

    M = lerp(M, G, 1 - beta1);  V = lerp(V, G*G, 1 - beta2)
    denom = sqrt(V) / sqrt(1 - beta2**t) + eps
    X = X * (1 - lr*wd);  X = X - (M / denom) * (lr / (1 - beta1**t))

Reproducing the same operations (``torch._foreach_*``, in the same order, with the float32
scalars) keeps AdamW-routed parameters within an ulp of dion, which is what makes a dion
checkpoint resume cleanly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AdamWScalars",
    "adamw_scalars",
    "adamw_temp_bytes",
    "adamw_update_",
    "foreach_adamw_",
]


@dataclass(frozen=True)
class AdamWScalars:
    """dion's AdamW scalars of one step, as the fp32 values its ops take: the two lerp
    weights ``1 - beta``, the second moment's bias correction ``sqrt(1 - beta2**t)``,
    ``epsilon``, the step size ``lr / (1 - beta1**t)`` and the decay ``1 - lr*wd``."""

    one_minus_beta1: float
    one_minus_beta2: float
    bias2_sqrt: float
    epsilon: float
    step_size: float
    decay: float

    def as_args(self) -> tuple[float, float, float, float, float, float]:
        """The six values in the order :func:`shardmuon.ops.fused_adamw.adamw_into` takes."""
        return (
            self.one_minus_beta1,
            self.one_minus_beta2,
            self.bias2_sqrt,
            self.epsilon,
            self.step_size,
            self.decay,
        )


def adamw_update_(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    variances: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    epsilon: float,
    step: int,
    max_temp_bytes: int | None = None,
    on_param_done: Callable[[int], None] | None = None,
) -> None:
    """One AdamW step on lists of same-length local tensors; params and state change in place.

    The parameters go through ``torch._foreach_*`` ops in runs whose fp32 temporaries
    (``G*G``, the denominator, ``M/denom``, a cast grad: 16 bytes per element) stay within
    ``max_temp_bytes`` (one parameter at least; ``None``: all in one run). Each op is the
    per-tensor op dion's foreach AdamW uses, so the bits do not depend on the runs.
    ``on_param_done(i)`` is called for every parameter ``i`` of a run once the run is done
    (lets a caller resume a step that failed part-way without stepping a parameter twice).
    """
    scalars = adamw_scalars(
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, epsilon=epsilon, step=step
    )
    for run in _runs([p.numel() for p in params], max_temp_bytes):
        foreach_adamw_(
            [params[i] for i in run],
            [grads[i] for i in run],
            [momenta[i] for i in run],
            [variances[i] for i in run],
            scalars,
        )
        if on_param_done is not None:
            for i in run:
                on_param_done(i)


def adamw_scalars(
    *, lr: float, beta1: float, beta2: float, weight_decay: float, epsilon: float, step: int
) -> AdamWScalars:
    """dion's scalars of one step, computed as it does (float32 on the host; ``step`` is the
    group step after its increment), as plain numbers of the same values: handed to the
    ``_foreach_`` ops on an accelerator that is the fast multi-tensor path (a host tensor
    scalar sends every tensor down torch's per-tensor path), with the same bits (the kernel
    takes the scalar in float32 either way)."""
    lr_t = torch.tensor(lr)
    beta1_t = torch.tensor(beta1)
    beta2_t = torch.tensor(beta2)
    wd_t = torch.tensor(weight_decay)
    return AdamWScalars(
        one_minus_beta1=float(1 - beta1_t),
        one_minus_beta2=float(1 - beta2_t),
        bias2_sqrt=float((1 - beta2_t**step).sqrt()),
        epsilon=float(torch.tensor(epsilon)),
        step_size=float(lr_t / (1 - beta1_t**step)),
        decay=float(1 - lr_t * wd_t),
    )


def foreach_adamw_(
    X: list[Tensor], G: list[Tensor], M: list[Tensor], V: list[Tensor], s: AdamWScalars
) -> None:
    """dion's AdamW step on lists of local tensors, in its ``_foreach_`` ops and order;
    ``X``, ``M`` and ``V`` change in place.

    Everything that allocates runs before any state or parameter is written, so an
    out-of-memory leaves them as they were and a retry updates them once (the out-of-place
    ops give the in-place ones' bits)."""
    grads = [g.to(m.dtype) for g, m in zip(G, M)]
    new_M = torch._foreach_lerp(M, grads, s.one_minus_beta1)
    squares = [sq.to(v.dtype) for sq, v in zip(torch._foreach_mul(grads, grads), V)]
    new_V = torch._foreach_lerp(V, squares, s.one_minus_beta2)
    del squares, grads
    denom = torch._foreach_sqrt(new_V)
    torch._foreach_div_(denom, s.bias2_sqrt)
    torch._foreach_add_(denom, s.epsilon)
    quotient = torch._foreach_div(new_M, denom)
    del denom
    torch._foreach_mul_(quotient, s.step_size)
    torch._foreach_copy_(M, new_M)
    torch._foreach_copy_(V, new_V)
    del new_M, new_V
    torch._foreach_mul_(X, s.decay)
    torch._foreach_sub_(X, quotient)


# fp32 temporaries per element at the worst moment of a run (see adamw_update_).
TEMP_BYTES_PER_ELEMENT = 16


def adamw_temp_bytes(sizes: list[int], max_temp_bytes: int | None) -> int:
    """The largest run's temporaries for parameters of these element counts."""
    runs = _runs(sizes, max_temp_bytes)
    return max((TEMP_BYTES_PER_ELEMENT * sum(sizes[i] for i in run) for run in runs), default=0)


def _runs(sizes: list[int], max_temp_bytes: int | None) -> list[list[int]]:
    """Consecutive index runs whose temporaries fit ``max_temp_bytes`` (at least one each)."""
    if max_temp_bytes is None:
        return [list(range(len(sizes)))] if sizes else []
    runs: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        need = TEMP_BYTES_PER_ELEMENT * size
        if runs and used + need <= max_temp_bytes:
            runs[-1].append(i)
            used += need
        else:
            runs.append([i])
            used = need
    return runs
