"""The divergence guard of Newton–Schulz: an exact check of each result, a safe recompute.

What it certifies, for every matrix it checks: the result is finite, and its largest
singular value is at most ``GUARD_SLACK`` (1.15) times the band (:func:`band_high`: the
largest value the composed scalar polynomial of the coefficients takes on ``[0, 1]``, 1.145
for dion's schedule). In exact arithmetic every singular value of the result lies below the
band; a result above 1.15x the band diverged (the Gram iteration without restarts does, on
ill-conditioned and low-rank inputs: 1.3x to 1000x the band). A failed matrix is recomputed
by the standard iteration in fp32.

The test is sound (no diverged-above-the-band result passes), not an estimate: with
``A = O O^T`` (one GEMM on the short side, a tenth of an iteration's FLOPs) in fp32,
``sigma_max(O)^2 = lambda_max(A)``, and

* ``||A||_F`` is an upper bound of ``lambda_max(A)``: a matrix it clears passes (a low-rank
  result usually does, at no further cost);
* every other matrix gets ``lambda_max`` from a symmetric eigensolver (``eigvalsh`` on the
  ``m x m`` fp32 ``A``, one batched call) — exact up to fp32 rounding of ``A``. A power
  estimate from a fixed start (the guard before) is a lower bound that falls short when
  the top singular values cluster: 1.148x estimated for a true 1.458x.

What it does not certify: that a result inside the band is accurate. A Gram iteration that
drifted can land inside the band with a large error (fp16 GEMMs without restarts); the
engines refuse the settings for which that was measured (``ops.engines``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from shardmuon.ops.newton_schulz import (
    Coefficients,
    iterate_folded,
    orthogonalize_with,
    resolve_coefficients,
)

__all__ = ["GUARD_SLACK", "GuardVerdict", "band_high", "guarded", "largest_singular_value"]

# How far above the band a result may lie before it counts as diverged: bf16 rounding puts
# the standard iteration at 1.00x the band and the Gram iteration with restarts at up to
# 1.06x (docs/benchmarks.md); diverged results start at 1.3x.
GUARD_SLACK = 1.15


@functools.lru_cache(maxsize=64)
def band_high(coefficients: Coefficients) -> float:
    """The largest singular value the iteration can produce in exact arithmetic: the max of
    the composed ``s -> a s + b s^3 + c s^5`` over ``s`` in ``[0, 1]`` (fp64, fine grid)."""
    s = torch.linspace(0.0, 1.0, 200_001, dtype=torch.float64)
    for a, b, c in coefficients:
        s = a * s + b * s**3 + c * s**5
    return float(s.abs().max())


def _gram_fp32(result: Tensor) -> Tensor:
    """``O O^T`` on the short side, computed in fp32 from ``result``'s own values: a bf16
    product rounds ``A`` to 8 bits, enough to put a result above the limit below it."""
    X = result if result.size(-2) <= result.size(-1) else result.mT
    X = X.to(torch.float32)
    return torch.bmm(X, X.mT)


def largest_singular_value(result: Tensor) -> Tensor:
    """Each matrix's largest singular value, ``result[B, m, n]`` -> fp32 ``[B]`` (exact up
    to fp32 rounding of ``O O^T``; ``inf`` for a non-finite matrix)."""
    A = _gram_fp32(result)
    lam = torch.linalg.eigvalsh(A.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))[..., -1]
    finite = torch.isfinite(A).flatten(1).all(dim=1)
    return torch.where(finite, lam.clamp_min(0).sqrt(), torch.full_like(lam, float("inf")))


@dataclass
class GuardVerdict:
    """What the guard saw in one call: matrices checked, recomputed, and the largest ratio of
    a top singular value to the band (1.0: at the band's top) among those it measured
    exactly or bounded below (a matrix cleared by the Frobenius bound counts as its bound)."""

    checked: int = 0
    fallbacks: int = 0
    worst_ratio: float = 0.0


def _ratios(out: Tensor, band: float, slack: float) -> Tensor:
    """``sigma_max / band`` of each matrix of ``out[B, m, n]`` where it matters, fp32 ``[B]``:
    the Frobenius upper bound where it is already below ``slack``, else exact (a symmetric
    eigensolver on the small Gram matrix); ``inf`` for a non-finite matrix."""
    A = _gram_fp32(out).div_(band * band)
    finite = torch.isfinite(A).flatten(1).all(dim=1)
    A = A.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    limit = slack * slack
    lam = torch.linalg.matrix_norm(A)  # Frobenius >= lambda_max: clears a low-rank result
    undecided = lam > limit
    if bool(undecided.any()):
        lam[undecided] = torch.linalg.eigvalsh(A[undecided])[..., -1]
    ratio = lam.clamp_min(0).sqrt()
    return torch.where(finite, ratio, torch.full_like(ratio, float("inf")))


def guarded(
    G: Tensor,
    orthogonalize: Callable[[Tensor], Tensor],
    coefficients: str | Coefficients | None,
    eps: float,
    slack: float = GUARD_SLACK,
    preconditioner: str | None = None,
) -> tuple[Tensor, GuardVerdict]:
    """``orthogonalize(G)`` with every result checked; diverged matrices recomputed, one at
    a time, by the standard iteration in fp32 (cast to the result's dtype), with the same
    ``preconditioner``.

    ``G[B, m, n]`` is left intact by ``orthogonalize``. Returns the result (written in
    place on a recompute) and the verdict.
    """
    coefficients = resolve_coefficients(coefficients)
    out = orthogonalize(G)
    if out.numel() == 0:
        return out, GuardVerdict()
    flat = out.reshape(-1, *out.shape[-2:])
    ratio = _ratios(flat, band_high(coefficients), slack)
    bad = ~(ratio <= slack)
    verdict = GuardVerdict(flat.size(0), int(bad.sum()), float(ratio.max()))
    if verdict.fallbacks:
        inputs = G.reshape(-1, *G.shape[-2:])
        for i in bad.nonzero().flatten().tolist():
            safe = orthogonalize_with(
                iterate_folded,
                inputs[i : i + 1].float(),
                coefficients,
                eps,
                dtype=torch.float32,
                preconditioner=preconditioner,
            )
            flat[i] = safe.X[0].to(flat.dtype)
        out = flat.reshape(out.shape)  # a view of ``out`` unless reshape had to copy
    return out, verdict
