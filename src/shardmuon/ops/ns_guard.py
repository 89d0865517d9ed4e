"""The divergence guard of Newton–Schulz: a cheap check of each result, a safe recompute.

In exact arithmetic the iteration maps each singular value ``s`` of the normalised input
(``s`` in ``[0, 1]``) through the composed scalar polynomial of its coefficients, so every
singular value of the result lies below that polynomial's maximum on ``[0, 1]``
(:func:`band_high`: 1.145 for dion's schedule). A result whose largest singular value
exceeds the band by more than rounding can explain — or that is not finite — diverged (the
Gram iteration without restarts does, on ill-conditioned and low-rank inputs: 1.5x to 1000x
the band). The largest singular value is estimated by a few power steps on ``O O^T`` from a
fixed start vector, on the small Gram matrix ``O O^T`` (one GEMM, about a tenth of the
iteration's FLOPs): the same verdict for the same matrix on every rank, a lower bound that
only sharpens with steps.
Flagged matrices are recomputed by the standard iteration in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from shardmuon.ops.newton_schulz import Coefficients, newton_schulz, resolve_coefficients

__all__ = ["GUARD_SLACK", "GuardVerdict", "band_high", "guarded", "largest_singular_value"]

# How far above the band a result may lie before it counts as diverged: bf16 rounding puts
# the standard iteration at 1.00x the band and the Gram iteration with restarts at up to
# 1.06x (docs/benchmarks.md); diverged results start at 1.3x.
GUARD_SLACK = 1.15
POWER_STEPS = 8


@functools.lru_cache(maxsize=64)
def band_high(coefficients: Coefficients) -> float:
    """The largest singular value the iteration can produce in exact arithmetic: the max of
    the composed ``s -> a s + b s^3 + c s^5`` over ``s`` in ``[0, 1]`` (fp64, fine grid)."""
    s = torch.linspace(0.0, 1.0, 200_001, dtype=torch.float64)
    for a, b, c in coefficients:
        s = a * s + b * s**3 + c * s**5
    return float(s.abs().max())


def largest_singular_value(result: Tensor, steps: int = POWER_STEPS) -> Tensor:
    """An estimate (from below) of each matrix's largest singular value, ``result[B, m, n]``;
    fp32 ``[B]``. One GEMM for the short side's Gram matrix ``A = O O^T`` (in the result's
    dtype, a tenth of an iteration's FLOPs), then power steps on the small ``A`` in fp32 from
    a fixed vector."""
    X = result if result.size(-2) <= result.size(-1) else result.mT
    A = torch.bmm(X, X.mT).float()
    m = A.size(-1)
    # A fixed start with no special direction: the same verdict on every rank.
    v = torch.cos(torch.arange(m, dtype=torch.float32, device=A.device) * 0.7 + 0.3)
    v = v.expand(A.size(0), m).unsqueeze(-1).contiguous()
    estimate = torch.zeros(A.size(0), device=A.device)
    for _ in range(steps):
        v = v / v.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-30)
        v = torch.bmm(A, v)
        estimate = v.norm(dim=(-2, -1))  # -> the largest eigenvalue of A: sigma_max^2
    return estimate.clamp_min(0).sqrt().nan_to_num(nan=float("inf"))


@dataclass
class GuardVerdict:
    """What the guard saw in one call: matrices checked, recomputed, and the largest ratio of
    an estimated top singular value to the band (1.0: at the band's top)."""

    checked: int = 0
    fallbacks: int = 0
    worst_ratio: float = 0.0


def guarded(
    G: Tensor,
    orthogonalize: Callable[[Tensor], Tensor],
    coefficients: str | Coefficients | None,
    eps: float,
    slack: float = GUARD_SLACK,
) -> tuple[Tensor, GuardVerdict]:
    """``orthogonalize(G)`` with every result checked; diverged matrices recomputed by the
    standard iteration in fp32 (cast to the result's dtype). ``G[B, m, n]``."""
    coeffs = resolve_coefficients(coefficients)
    out = orthogonalize(G)
    if out.numel() == 0:
        return out, GuardVerdict()
    flat = out.reshape(-1, *out.shape[-2:])
    sigma = largest_singular_value(flat)
    finite = torch.isfinite(flat).flatten(1).all(dim=1)
    ratio = torch.where(finite, sigma / band_high(coeffs), torch.full_like(sigma, float("inf")))
    bad = ~(ratio <= slack)
    verdict = GuardVerdict(flat.size(0), int(bad.sum()), float(ratio.max()))
    if verdict.fallbacks:
        inputs = G.reshape(-1, *G.shape[-2:])[bad]
        safe = newton_schulz(inputs.float(), coeffs, eps, dtype=torch.float32)
        flat = flat.clone()
        flat[bad] = safe.to(flat.dtype)
        out = flat.reshape(out.shape)
    return out, verdict
