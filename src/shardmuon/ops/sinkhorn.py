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
in place; ``None`` where this rank holds whole rows (columns).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from shardmuon.ops.normalize import power_of_two_exponent

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


def sinkhorn_update_(param: Tensor, grad: Tensor, momentum: Tensor, **settings) -> Tensor:
    """One Sinkhorn step on a local ``[rows, cols]`` shard: :func:`sinkhorn_momentum_` with
    ``settings["beta"]``, then :func:`sinkhorn_apply_` with ``settings`` (its keywords);
    ``param`` and ``momentum`` change in place. Returns whether the update was skipped for a
    non-finite direction (0-d bool, on the device)."""
    check_iters(settings.get("iters"))
    sinkhorn_momentum_(momentum, grad, settings["beta"])
    return sinkhorn_apply_(param, grad, momentum, **settings)


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
    sum_across_cols: Reduce | None = None,
    sum_across_rows: Reduce | None = None,
) -> Tensor:
    """The update from the momentum already updated: ``param`` changes in place (its last
    operation), ``grad`` and ``momentum`` are only read. Returns a 0-d bool tensor on the
    device: whether the direction held NaN or inf anywhere in the matrix (on any rank); then
    ``param`` is left as it was.

    ``shape``: the global ``(m, n)`` (default: the local shape). ``sum_across_cols(t)``:
    sums ``t`` (one value per local row; fp64 once, then fp32) in place over the ranks
    holding the other columns of these rows (``None``: this rank holds whole rows);
    ``sum_across_rows(t)`` (one value per local column, or 0-d) over the ranks holding the
    other rows (``None``: whole columns). Every rank of those groups calls this together.
    Temporaries: two fp32 ``[rows, cols]`` buffers (:func:`sinkhorn_temp_bytes`).

    Any overall scale works (an fp32 direction from denormals to 3e38; rows and columns
    within about 1e17 of each other, whose scales' squares stay in fp32). Each rank squares
    its own block scaled by a power of two (its largest entry in [0.5, 1)) and sums the row
    norms in fp64; the scale vectors are then kept in units of the mean row norm (a power of
    two every rank reads from the same summed norms), the block's own power of two folded
    into the scale whose sums stay on this rank. The result does not depend on the scale
    but through ``eps``, which is scaled with it.
    """
    m, n = tuple(param.shape) if shape is None else shape
    rows_whole, cols_whole = sum_across_rows is None, sum_across_cols is None
    sum_across_rows = sum_across_rows or _nothing
    sum_across_cols = sum_across_cols or _nothing
    g_hat = torch.lerp(grad.to(torch.float32), momentum, beta)
    # Q = squares * 4**block_exp: this rank's block, its largest entry below 1.
    block_exp = _block_exponent(g_hat)
    squares = torch.mul(g_hat, _pow2(-block_exp, torch.float32)).square_()
    rho_sq = squares.sum(dim=1).to(torch.float64).mul_(_pow2(2 * block_exp, torch.float64))
    sum_across_cols(rho_sq)
    rho = rho_sq.sqrt()
    total = rho.sum()
    sum_across_rows(total)
    # NaN or inf anywhere reaches every rank's total through the sums above.
    nonfinite = ~torch.isfinite(total)
    mean = total / m
    unit_exp = torch.where(nonfinite, 0, torch.frexp(mean).exponent)
    # Statistics in units of the mean row norm: squares * to_unit. A block holds no entry
    # above m times the mean, so the power is at most log2(m) + 1 (the cap keeps a zero or
    # empty block's factor and its square finite).
    fold_exp = (block_exp - unit_exp).clamp_(max=63)
    # The first row normalisation: r = 1 on the rows kept, c = 1, so its norms are rho.
    # Where eps outweighs the row norms, U = Gh / (rho + eps) is far below 1; that scale
    # (1 / lift) goes to c so that r and r^2 stay within fp32 (U is the same).
    kept = (rho > tau * mean).to(torch.float64)
    unit = _pow2(-unit_exp, torch.float64)
    eps_in_units = eps * unit
    lift = 1.0 + eps_in_units
    r = _rescaled(kept, rho_sq.mul_(unit * unit), eps_in_units) * lift
    c = (1.0 / lift).expand(g_hat.shape[1])
    # to_unit is folded into the scale whose statistic this rank sums alone (r for whole
    # rows, c for whole columns): its squares then carry it into every GEMV. Only a block
    # split both ways multiplies each GEMV's result.
    to_unit = None
    if cols_whole:
        r = r * _pow2(fold_exp, torch.float64)
    elif rows_whole:
        c = c * _pow2(fold_exp, torch.float64)
    else:
        to_unit = _pow2(2 * fold_exp, torch.float32)
    r, c = r.to(torch.float32), c.to(torch.float32).contiguous()
    for k in range(1, iters):
        if k % 2 == 0:  # rows: ||U_i||^2 = r_i^2 * sum_j Q_ij c_j^2
            norms_sq = squares @ (c * c)
            if to_unit is not None:
                norms_sq.mul_(to_unit)
            sum_across_cols(norms_sq)
            r = _rescaled(r, norms_sq, eps)
        else:  # columns: ||U_:j||^2 = c_j^2 * sum_i r_i^2 Q_ij
            norms_sq = torch.mv(squares.t(), r * r)
            if to_unit is not None:
                norms_sq.mul_(to_unit)
            sum_across_rows(norms_sq)
            c = _rescaled(c, norms_sq, eps)
    del squares
    # U = r * (g_hat * 2**-out_exp) * c: each scale takes half of that power of two.
    out_exp = unit_exp if to_unit is not None else unit_exp + fold_exp
    half = torch.div(out_exp, 2, rounding_mode="floor")
    # A non-finite table: every row scale 0, and the NaN that 0 * inf or 0 * NaN leaves, 0
    # (nan_to_num_ reads and writes once, far faster than a broadcast mask).
    r = torch.where(nonfinite, 0.0, r * _pow2(-half, torch.float32))
    g_hat.mul_(r[:, None]).nan_to_num_(0.0, 0.0, 0.0)
    c = c * _pow2(half - out_exp, torch.float32)
    # One rounding into the parameter's dtype (computed in fp32).
    param.addcmul_(g_hat, c[None, :], value=-lr * lr_scale * math.sqrt(n))
    return nonfinite


def _block_exponent(x: Tensor) -> Tensor:
    """The power of two ``e`` with ``max|x| * 2**-e`` in [0.5, 1), kept in [-126, 126] so
    that ``2**-e`` is a normal fp32 (int32, 0-d, on the device; 0 for an empty, zero or
    non-finite ``x``)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int32, device=x.device)
    smallest, largest = torch.aminmax(x)  # one read (a norm with ord=inf is far slower)
    return power_of_two_exponent(torch.maximum(largest, smallest.neg_()))


def _pow2(exponent: Tensor, dtype: torch.dtype) -> Tensor:
    """``2**exponent`` (an integer tensor) as ``dtype``."""
    return torch.exp2(exponent.to(dtype))


def _rescaled(scale: Tensor, partial_norms_sq: Tensor, eps: float | Tensor) -> Tensor:
    """``scale / (||x|| + eps)`` where ``||x|| = scale * sqrt(partial_norms_sq) > 0``, else 0.
    ``partial_norms_sq`` is overwritten (a GEMV's fresh result)."""
    norm = partial_norms_sq.sqrt_().mul_(scale)
    return torch.where(norm > 0, scale / (norm + eps), 0.0)


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
