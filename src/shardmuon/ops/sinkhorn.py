"""The Sinkhorn update for embeddings and output heads (DeepSeek-V4.1 tech report, §2.5, Alg. 1).

For an ``(m, n)`` matrix ``W`` whose rows are tokens (an embedding table, the LM head), with
fp32 momentum ``M``, group ``lr``, momentum ``beta`` (the group's ``mu``), ``K`` odd::

    M  = beta*M + (1 - beta)*G                  (M.lerp_(G, 1 - beta))
    Gh = beta*M + (1 - beta)*G                  (the Nesterov direction)
    rho_i = ||Gh_i||;  rows with rho_i <= tau * mean(rho) are zeroed
    U  = K alternating L2 normalisations of Gh: rows, columns, rows, ..., rows
         (each ``x / (||x|| + eps)``)
    W  = W - lr * lr_scale * sqrt(n) * U         (no weight decay)

``U`` is never written: it is ``diag(r) Gh diag(c)``, and a normalisation only updates a
scale vector. With ``Q = Gh*Gh`` (elementwise, computed once), the squared row norms of the
current ``U`` are ``r^2 * (Q @ c^2)`` and the column norms ``c^2 * (r^2 @ Q)``: one GEMV per
normalisation, no temporary. A row scale becomes ``r / (r*t + eps)`` (``t``: the row norm of
``Gh diag(c)``), zero where ``r*t`` is zero (a zeroed row stays zero; dividing 0 by eps
would give the same zero); likewise for columns.

Sharded matrices: every statistic is a sum over rows or over columns, so it does not matter
which rows or columns a rank holds, or in which order (FSDP2's ``_StridedShard``, uneven and
empty shards). ``sum_across_cols`` completes a row statistic (the sum over the columns
other ranks hold); ``sum_across_rows`` a column statistic and the sum of ``rho``. Both are
in place and default to nothing (one process, or a matrix whole on this rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "SINKHORN_DEFAULTS",
    "check_iters",
    "sinkhorn_apply_",
    "sinkhorn_momentum_",
    "sinkhorn_reference",
    "sinkhorn_temp_bytes",
    "sinkhorn_update_",
]

# prime-rl's defaults (the group keys of an ``algorithm="sinkhorn"`` group).
SINKHORN_DEFAULTS = {
    "sinkhorn_iters": 11,
    "sinkhorn_tau": 1e-3,
    "sinkhorn_eps": 1e-20,
    "sinkhorn_lr_scale": 0.18,
}

Reduce = Callable[[Tensor], None]


def _nothing(_: Tensor) -> None:
    return None


def sinkhorn_momentum_(momentum: Tensor, grad: Tensor, beta: float) -> None:
    """``M = beta*M + (1 - beta)*G`` in place (``momentum``: fp32; ``grad``: any float dtype)."""
    if momentum.dtype != torch.float32:
        raise TypeError(f"the Sinkhorn momentum must be float32, got {momentum.dtype}")
    momentum.lerp_(grad.to(torch.float32), 1.0 - beta)


def sinkhorn_update_(param: Tensor, grad: Tensor, momentum: Tensor, **settings) -> None:
    """One Sinkhorn step on a local ``[rows, cols]`` shard: :func:`sinkhorn_momentum_` with
    ``settings["beta"]``, then :func:`sinkhorn_apply_` with ``settings`` (its keywords);
    ``param`` and ``momentum`` change in place."""
    check_iters(settings.get("iters"))
    sinkhorn_momentum_(momentum, grad, settings["beta"])
    sinkhorn_apply_(param, grad, momentum, **settings)


def check_iters(iters: object) -> None:
    """``iters`` must be an odd int >= 1 (rows first and last)."""
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1 or iters % 2 != 1:
        raise ValueError(
            "the Sinkhorn update needs an odd number of normalisations (rows first and last), "
            f"an int >= 1; got {iters!r}"
        )


def sinkhorn_apply_(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    *,
    lr: float,
    beta: float,
    iters: int,
    tau: float,
    eps: float,
    lr_scale: float,
    shape: tuple[int, int] | None = None,
    sum_across_cols: Reduce = _nothing,
    sum_across_rows: Reduce = _nothing,
) -> None:
    """The update from the momentum already updated: ``param`` changes in place (its last
    operation), ``grad`` and ``momentum`` are only read.

    ``shape``: the global ``(m, n)`` (default: the local shape). ``sum_across_cols(t)``:
    sums ``t`` (fp32, one value per local row) in place over the ranks holding the other
    columns of these rows; ``sum_across_rows(t)`` (one value per local column, or 0-d) over
    the ranks holding the other rows. Every rank of those groups calls this together.
    Temporaries: two fp32 ``[rows, cols]`` buffers (:func:`sinkhorn_temp_bytes`).
    """
    m, n = tuple(param.shape) if shape is None else shape
    g_hat = torch.lerp(grad.to(torch.float32), momentum, beta)
    squares = g_hat * g_hat
    rho_sq = squares.sum(dim=1)
    sum_across_cols(rho_sq)
    rho = rho_sq.sqrt()
    total = rho.sum()
    sum_across_rows(total)
    # The first row normalisation: r = 1 on the rows kept, c = 1, so its norms are rho.
    kept = (rho > tau * total / m).to(torch.float32)
    r = _rescaled(kept, rho_sq, eps)
    c = torch.ones(g_hat.shape[1], dtype=torch.float32, device=g_hat.device)
    for k in range(1, iters):
        if k % 2 == 0:  # rows: ||U_i||^2 = r_i^2 * sum_j Q_ij c_j^2
            norms_sq = squares @ (c * c)
            sum_across_cols(norms_sq)
            r = _rescaled(r, norms_sq, eps)
        else:  # columns: ||U_:j||^2 = c_j^2 * sum_i r_i^2 Q_ij
            norms_sq = (r * r) @ squares
            sum_across_rows(norms_sq)
            c = _rescaled(c, norms_sq, eps)
    del squares
    g_hat.mul_(r[:, None]).mul_(c[None, :])
    param.add_(g_hat.to(param.dtype), alpha=-lr * lr_scale * math.sqrt(n))


def _rescaled(scale: Tensor, partial_norms_sq: Tensor, eps: float) -> Tensor:
    """``scale / (||x|| + eps)`` where ``||x|| = scale * sqrt(partial_norms_sq) > 0``, else 0."""
    norm = scale * partial_norms_sq.sqrt()
    return torch.where(norm > 0, scale / (norm + eps), torch.zeros_like(scale))


def sinkhorn_temp_bytes(local_rows: int, local_cols: int) -> int:
    """Transient bytes of :func:`sinkhorn_update_` on a ``[local_rows, local_cols]`` shard."""
    return 2 * 4 * local_rows * local_cols


def sinkhorn_reference(
    weight: Tensor,
    grad: Tensor,
    momentum: Tensor,
    *,
    lr: float,
    beta: float,
    iters: int,
    tau: float,
    eps: float,
    lr_scale: float,
) -> tuple[Tensor, Tensor]:
    """The algorithm as written, on the whole matrix in float64 (for tests): the new weight
    and momentum. The update is materialised and normalised ``iters`` times."""
    w, g, mom = (t.detach().to(torch.float64) for t in (weight, grad, momentum))
    mom = beta * mom + (1 - beta) * g
    u = beta * mom + (1 - beta) * g
    rho = u.norm(dim=1)
    u = torch.where((rho <= tau * rho.mean())[:, None], torch.zeros_like(u), u)
    for k in range(iters):
        dim = 1 if k % 2 == 0 else 0
        u = u / (u.norm(dim=dim, keepdim=True) + eps)
    return w - lr_scale * lr * math.sqrt(w.shape[1]) * u, mom
