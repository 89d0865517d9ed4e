"""AdamW for the non-matrix parameters, with dion's exact arithmetic (plain local tensors).

dion (samsja/dion@3c4bce5, ``scalar_opts.adamw_update``) turns the hyper-parameters into
float32 0-d tensors and computes, with ``t`` the group step after its increment::

    M = lerp(M, G, 1 - beta1);  V = lerp(V, G*G, 1 - beta2)
    denom = sqrt(V) / sqrt(1 - beta2**t) + eps
    X = X * (1 - lr*wd);  X = X - (M / denom) * (lr / (1 - beta1**t))

Reproducing the same operation order (and the float32 scalars) keeps AdamW-routed
parameters within an ulp of dion, which is what makes a dion checkpoint resume cleanly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["adamw_update_"]


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
    on_param_done: Callable[[int], None] | None = None,
) -> None:
    """One AdamW step on lists of same-length local tensors; params and state change in place.

    ``on_param_done(i)`` is called after parameter ``i`` is fully updated (lets a caller
    resume a step that failed part-way without stepping a parameter twice).
    """
    lr_t = torch.tensor(lr)
    beta1_t = torch.tensor(beta1)
    beta2_t = torch.tensor(beta2)
    wd_t = torch.tensor(weight_decay)
    eps_t = torch.tensor(epsilon)
    bias1 = 1 - beta1_t**step
    bias2_sqrt = (1 - beta2_t**step).sqrt()
    decay = 1 - lr_t * wd_t
    step_size = lr_t / bias1
    for i, (param, grad, momentum, variance) in enumerate(zip(params, grads, momenta, variances)):
        grad = grad.to(momentum.dtype)
        momentum.lerp_(grad, 1 - beta1_t)
        variance.lerp_((grad * grad).to(variance.dtype), 1 - beta2_t)
        denom = variance.sqrt().div_(bias2_sqrt).add_(eps_t)
        param.mul_(decay)
        param.sub_(momentum.div(denom).mul_(step_size))
        if on_param_done is not None:
            on_param_done(i)
