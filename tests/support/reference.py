"""Independent float64 Muon / AdamW reference, written from the formulas in the dion fixtures README.

Nothing here imports shardmuon: these functions are what the optimizer is checked against.
All arithmetic is float64 with no bf16 casts; inputs of any float dtype are promoted.

Newton-Schulz is written in the "right-multiplied" form for tall matrices
(``A = X^T X``; ``X = a X + X (b A + c A^2)``) instead of transposing, so that it shares no
code path with ``shardmuon.newton_schulz_reference``. Both forms are the same polynomial
``X p(X^T X) = p(X X^T) X`` in exact arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# dion's quintic schedule, as listed in the fixtures README (one (a, b, c) per iteration).
DION_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def orthogonalize_fp64(
    G: Tensor,
    coefficients: Sequence[Sequence[float]] = DION_COEFFICIENTS,
    eps: float = 1e-8,
) -> Tensor:
    """Quintic Newton-Schulz on each matrix of ``G[..., m, n]`` in float64; returns float64."""
    X = G.to(torch.float64)
    X = X / (torch.linalg.matrix_norm(X, ord="fro", keepdim=True) + eps)
    tall = X.size(-2) > X.size(-1)
    for a, b, c in coefficients:
        if tall:
            A = X.mT @ X
            X = a * X + X @ (b * A + c * (A @ A))
        else:
            A = X @ X.mT
            X = a * X + (b * A + c * (A @ A)) @ X
    return X


def lr_scale(rows: int, cols: int, adjust_lr: str | None, update_rms: float = 0.2) -> float:
    """Per-matrix lr multiplier: dion's ``rms_norm`` / ``spectral_norm`` / none."""
    if adjust_lr == "rms_norm":
        return update_rms * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral_norm":
        return math.sqrt(rows / cols)
    if adjust_lr is None:
        return 1.0
    raise ValueError(f"adjust_lr must be 'rms_norm', 'spectral_norm' or None, got {adjust_lr!r}")


def muon_update_fp64(
    momentum: Tensor,
    grad: Tensor,
    *,
    lr: float,
    mu: float,
    nesterov: bool,
    adjust_lr: str | None = "rms_norm",
    update_rms: float = 0.2,
    coefficients: Sequence[Sequence[float]] = DION_COEFFICIENTS,
    eps: float = 1e-8,
    partitions: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """One Muon update for a matrix or a stack ``[..., rows, cols]``; returns ``(M_new, delta)``.

    ``M_new = mu M + G``; the orthogonalized direction is NS(``mu M_new + G`` if nesterov
    else ``M_new``), split into row blocks ``partitions`` along dim -2 if given, each block
    orthogonalized and scaled on its own. ``delta = lr * scale * O`` is what is subtracted
    from the decayed parameter. Both outputs are float64.
    """
    M = mu * momentum.to(torch.float64) + grad.to(torch.float64)
    U = mu * M + grad.to(torch.float64) if nesterov else M
    sizes = list(partitions) if partitions is not None else [U.size(-2)]
    deltas = []
    for block in torch.split(U, sizes, dim=-2):
        scale = lr_scale(block.size(-2), block.size(-1), adjust_lr, update_rms)
        deltas.append(lr * scale * orthogonalize_fp64(block, coefficients, eps))
    return M, torch.cat(deltas, dim=-2)


def adamw_step_fp64(
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    step: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """dion's AdamW for one tensor at group step ``step`` (1-based); returns float64 (X, M, V)."""
    g = grad.to(torch.float64)
    M = exp_avg.to(torch.float64) + (1 - beta1) * (g - exp_avg.to(torch.float64))
    V = exp_avg_sq.to(torch.float64) + (1 - beta2) * (g * g - exp_avg_sq.to(torch.float64))
    bias1 = 1 - beta1**step
    bias2_sqrt = math.sqrt(1 - beta2**step)
    denom = V.sqrt() / bias2_sqrt + eps
    X = param.to(torch.float64) * (1 - lr * weight_decay)
    X = X - (M / denom) * (lr / bias1)
    return X, M, V


def applied_update(x_prev: Tensor, x_new: Tensor, lr: float, weight_decay: float) -> Tensor:
    """``delta = X_prev (1 - lr wd) - X_new`` in float64, the decay factor rounded to float32.

    This is how the fixtures measure the update an optimizer actually applied (dion computes
    the decay factor from float32 0-d tensors).
    """
    decay = (1 - torch.tensor(lr, dtype=torch.float32) * torch.tensor(weight_decay)).double()
    return x_prev.to(torch.float64) * decay - x_new.to(torch.float64)
