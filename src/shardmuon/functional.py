r"""Muon's update on plain tensors, in one function, as ``torch.optim``'s functional API has.

For each parameter ``X`` (its matrices: the last two dims, leading dims a stack; with
``flatten``, dim 0 by all the others), with gradient ``G`` and momentum ``M``::

    M <- mu * M + G                                    (in M's dtype)
    U <- mu * M + G   if nesterov   else   M
    O <- NS(U / (||U||_F + eps))                       (per matrix; bf16 by default)
    X <- X * (1 - lr * weight_decay) - lr * scale(m, n) * O

``NS`` is the Newton–Schulz iteration: for each ``(a, b, c)`` of the coefficients,
``A = X X^T``, ``X <- a X + (b A + c A^2) X`` (on the short side), run by the engine
``newton_schulz_impl`` in ``newton_schulz_dtype`` (``ops/engines.py``); a matrix whose
direction is not finite gets ``O = 0``. ``scale`` for an ``[m, n]`` matrix is
``sqrt(m / n)`` (``adjust_lr="spectral_norm"``, dion's default), ``update_rms *
sqrt(max(m, n))`` (``"rms_norm"``), ``sqrt(max(1, m / n))`` (``"keller_muon"``) or 1
(``None``). ``X`` is updated in fp32 and rounded once.

This is the single-process update the optimizer's local path computes, built from the same
functions (``ops/update.py``, the engine); :class:`shardmuon.Muon` adds what a training run
needs around it: param groups, state and checkpoints, batching within a memory budget,
partitions of fused weights, and the distribution. With a batch-invariant engine
(``"per-matrix"``) the bits equal ``Muon``'s whatever it batches together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from shardmuon.ops.adamw import adamw_update_
from shardmuon.ops.engines import NS_CHOICES, resolve_ns_dtype
from shardmuon.ops.newton_schulz import Coefficients, resolve_coefficients
from shardmuon.ops.orthogonalizer import Orthogonalizer
from shardmuon.ops.update import direction, lr_scale, momentum_update_, weight_update_

__all__ = ["adamw_update_", "muon_update_"]


def _matrices(tensor: Tensor, flatten: bool) -> Tensor:
    """The ``[N, m, n]`` view of ``tensor`` (a view: the tensors here are contiguous)."""
    if flatten:
        return tensor.reshape(1, tensor.size(0), -1)
    return tensor.reshape(-1, *tensor.shape[-2:])


@torch.no_grad()
def muon_update_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momenta: Sequence[Tensor],
    *,
    lr: float,
    mu: float = 0.95,
    nesterov: bool = False,
    weight_decay: float = 0.01,
    adjust_lr: str | None = "spectral_norm",
    update_rms: float = 0.2,
    epsilon: float = 1e-8,
    flatten: bool = False,
    coefficients: str | Coefficients | None = None,
    newton_schulz_impl: str = "folded",
    newton_schulz_dtype: torch.dtype | str = torch.bfloat16,
    newton_schulz_preconditioner: str | None = None,
) -> None:
    """One Muon step, in place on ``params`` and ``momenta`` (see the module docstring).

    ``params[i]``: a contiguous tensor of at least 2 dims (fp32 or bf16); ``grads[i]`` of
    its shape (any float dtype); ``momenta[i]`` of its shape, contiguous (fp32 or the
    param's dtype). Each parameter's matrices are orthogonalized in one call.
    """
    if not len(params) == len(grads) == len(momenta):
        raise ValueError(
            f"muon_update_ needs one grad and one momentum per parameter, got "
            f"{len(params)} params, {len(grads)} grads, {len(momenta)} momenta"
        )
    if newton_schulz_impl not in NS_CHOICES:
        raise ValueError(
            f"newton_schulz_impl must be one of {', '.join(NS_CHOICES)}, got {newton_schulz_impl!r}"
        )
    for k, (p, g, m) in enumerate(zip(params, grads, momenta)):
        if p.dim() < 2 or g.shape != p.shape or m.shape != p.shape:
            raise ValueError(
                f"muon_update_: parameter {k} must have at least 2 dims and its grad and "
                f"momentum its shape, got param {tuple(p.shape)}, grad {tuple(g.shape)}, "
                f"momentum {tuple(m.shape)}"
            )
        if not (p.is_contiguous() and m.is_contiguous()):
            raise ValueError(f"muon_update_: parameter {k} and its momentum must be contiguous")
    coeffs = resolve_coefficients(
        "aol" if coefficients is None and newton_schulz_preconditioner == "aol" else coefficients
    )
    orthogonalize = Orthogonalizer(
        newton_schulz_impl,
        resolve_ns_dtype(newton_schulz_dtype),
        preconditioner=newton_schulz_preconditioner,
    )
    for param, grad, momentum in zip(params, grads, momenta):
        X, M, G = (_matrices(t, flatten) for t in (param, momentum, grad))
        momentum_update_(M, G, mu)
        U = direction(M, G, mu, nesterov).to(torch.bfloat16)
        result = orthogonalize(U, coeffs, epsilon)
        orthogonalize.take_report()
        rows, cols = X.shape[-2:]
        scale = lr_scale(rows, cols, adjust_lr, update_rms)
        weight_update_(X, result, lr, weight_decay, [(0, rows, scale)])
