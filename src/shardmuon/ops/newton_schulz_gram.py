"""Gram Newton–Schulz: the same polynomial iteration, run on the small Gram matrix.

For ``X`` of shape ``[m, n]`` with ``m < n``, every step of the quintic iteration is
``X <- p(R) X`` with ``R = X X^T`` (``m x m``) and ``p(R) = a I + b R + c R^2``. Writing
``X_k = Q_k X_0``, the steps only ever multiply ``m x m`` matrices::

    P = a I + b R + c R^2          (one GEMM, R R, with the scale-and-add folded in)
    Q <- P Q                       (skipped while Q = I: Q <- P)
    R <- P (P R)                   (P and R commute: X_{k+1} X_{k+1}^T = P^2 R)

and ``X = Q X_0`` once at the end. The ``m x n`` products fall from two per step to two in
all, so the FLOPs fall with the aspect ratio ``n / m``; square matrices gain nothing and go
through the standard iteration. ``Q`` accumulates rounding error step after step (it is
never renormalised), which is what makes Gram diverge on ill-conditioned or low-rank
inputs; a *restart* after step ``k`` computes ``X_k = Q X_0`` and ``R = X_k X_k^T`` afresh
and resets ``Q = I``, flushing the drift for two ``m x n`` GEMMs. ``R`` is not updated after
the last step, nor before a restart (it is recomputed).

The normalisation is the standard iteration's (fp32, overflow-safe, non-finite matrices
zeroed). ``dtype`` (bf16, fp16 or fp32) is what ``X`` is held in: the normalised input,
each restart's ``X_k`` and the result. The GEMMs run in ``gemm_dtype`` (accumulating in
fp32): by default ``dtype`` itself, except that bf16 runs them in fp16 on CUDA (as fast)
and in fp32 elsewhere. Measured (``scripts/gram_error.py``): with its GEMMs in bf16, the
rounding of ``P = a I + b R + c R^2`` (a diagonal near ``a``, rounded to 8 bits) and of
``Q`` gives 1.8-2.2x the standard bf16 iteration's error; with them in fp16 or fp32, X held
in bf16, 0.55-0.85x.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from shardmuon.ops.newton_schulz import (
    Coefficients,
    aol_rescale_,
    iterate_folded,
    orthogonalize_with,
)

__all__ = [
    "default_restarts",
    "gram_flops",
    "gram_gemm_dtype",
    "iterate_gram",
    "newton_schulz_gram",
    "standard_flops",
]

# The steps after which Gram restarts by default: after step 2, then every 3 steps
# (dion's 5 steps: (2,); DeepSeek-V4's 10: (2, 5, 8)), whatever the dtype. Chosen by
# ``python scripts/gram_error.py`` (docs/benchmarks.md, "Gram Newton–Schulz"): without
# restarts bf16 GEMMs diverge on log-spaced and low-rank inputs (10^2-10^3 x the error);
# one restart after step 2 brought dion's schedule to 0.9-2.2x the standard bf16
# iteration's error for 0.67x its FLOPs at aspect 4 (a second one, after step 4, gains
# under 10% for 0.78x); a 10-step schedule needs one every 3 steps in fp16, and diverges
# with bf16 GEMMs anyway (the guard recomputes those matrices).
FIRST_RESTART, RESTART_EVERY = 2, 3


def default_restarts(steps: int) -> tuple[int, ...]:
    """The default restart steps for a schedule of ``steps`` iterations."""
    return tuple(range(FIRST_RESTART, steps, RESTART_EVERY))


def gram_gemm_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype :func:`newton_schulz_gram`'s GEMMs run in by default for ``dtype``: bf16's
    in fp16 on CUDA (tensor cores run both at one speed; ``meta`` too, which stands for
    CUDA in launch counts) and in fp32 elsewhere (CPUs rarely have fast fp16 GEMMs); fp16
    and fp32 in themselves."""
    if dtype != torch.bfloat16:
        return dtype
    # meta: the accelerator path as counted without one (bench step --kernels)
    return torch.float16 if device_type in ("cuda", "meta") else torch.float32


def iterate_gram(
    X: Tensor,
    coefficients: Coefficients,
    *,
    restarts: Sequence[int] | None = None,
    gemm_dtype: torch.dtype | None = None,
    preconditioner: str | None = None,
    eps_floor: Tensor | None = None,
) -> Tensor:
    """The Gram iteration on a normalised wide ``X[B, m, n]`` (``m <= n``), ``X`` held in
    its dtype; returns ``[B, m, n]`` in that dtype. Square matrices run the folded one.

    ``restarts``: the steps (1-based) after which to restart; ``None``: the default
    (:func:`default_restarts`), ``()``: none. ``gemm_dtype``: what the GEMMs run in
    (``None``: :func:`gram_gemm_dtype`). ``preconditioner``, ``eps_floor``: as
    :func:`~shardmuon.ops.newton_schulz.iterate_folded`'s.
    """
    m, n = X.shape[-2:]
    if m == n:
        return iterate_folded(X, coefficients, preconditioner, eps_floor)
    dtype = X.dtype
    steps = len(coefficients)
    restart_after = frozenset(default_restarts(steps) if restarts is None else restarts)
    chain = gram_gemm_dtype(dtype, X.device.type) if gemm_dtype is None else gemm_dtype
    # X_k is rounded to ``dtype`` (as the standard iteration holds it), its GEMMs run in
    # ``chain``; the cast is a no-op when the two agree.
    base = X.to(chain)
    R = torch.bmm(base, base.mT)
    if preconditioner == "aol":
        aol_rescale_(base, R, eps_floor)  # the normalised input is the iteration's own
    Q: Tensor | None = None  # None: the identity
    for k, (a, b, c) in enumerate(coefficients, start=1):
        P = torch.baddbmm(R, R, R, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else torch.bmm(P, Q)
        if k == steps:
            break
        if k in restart_after:
            base = torch.bmm(Q, base).to(dtype).to(chain)
            R = torch.bmm(base, base.mT)
            Q = None
        else:
            R = torch.bmm(P, torch.bmm(P, R))
    return (base if Q is None else torch.bmm(Q, base)).to(dtype)


def newton_schulz_gram(
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
    *,
    restarts: Sequence[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    gemm_dtype: torch.dtype | None = None,
    preconditioner: str | None = None,
) -> Tensor:
    """Orthogonalize each matrix of ``G[..., m, n]`` by the Gram iteration; ``dtype`` out.

    The shared normalisation (:func:`shardmuon.ops.newton_schulz.orthogonalize_with`),
    then :func:`iterate_gram` with ``restarts`` and ``gemm_dtype``. Tall matrices are
    transposed so that the Gram side is the short one.
    """
    iterate = functools.partial(iterate_gram, restarts=restarts, gemm_dtype=gemm_dtype)
    chain = gram_gemm_dtype(dtype, G.device.type) if gemm_dtype is None else gemm_dtype
    return orthogonalize_with(
        iterate,
        G,
        coefficients,
        eps,
        dtype=dtype,
        preconditioner=preconditioner,
        gemm_dtype=chain,
    ).X


def standard_flops(m: int, n: int, steps: int) -> int:
    """FLOPs of the standard iteration on one ``[m, n]`` matrix (``m <= n``), counted from
    the GEMMs it runs: per step ``X X^T``, ``R R`` and ``B X``."""
    m, n = min(m, n), max(m, n)
    return steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)


def gram_flops(m: int, n: int, steps: int, restarts: Sequence[int] = ()) -> int:
    """FLOPs of :func:`newton_schulz_gram` on one ``[m, n]`` matrix, counted from the GEMMs
    it runs (restarts included; square matrices run the standard iteration)."""
    m, n = min(m, n), max(m, n)
    if m == n:
        return standard_flops(m, n, steps)
    rect, square = 2 * m * m * n, 2 * m * m * m
    flops = rect  # R = X X^T
    identity = True
    for k in range(1, steps + 1):
        flops += square  # R R
        if not identity:
            flops += square  # P Q
        identity = False
        if k == steps:
            break
        if k in restarts:
            flops += 2 * rect  # X = Q X_0, R = X X^T
            identity = True
        else:
            flops += 2 * square  # P (P R)
    return flops + (0 if identity else rect)  # X = Q X_0
