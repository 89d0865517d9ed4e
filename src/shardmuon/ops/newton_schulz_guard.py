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

* ``||A||_F`` is an upper bound of ``lambda_max(A)``: a matrix it clears passes (a result
  of rank 1 or 2 usually does);
* every other matrix passes when ``slack^2 band^2 I - A`` is positive definite, which one
  batched fp32 Cholesky factorisation decides (``cholesky_ex``: a third of an eigensolver's
  FLOPs and 3-8x faster than ``eigvalsh`` here), against a limit lowered by the
  factorisation's own rounding (``4 m u``). A power estimate from a fixed start (the guard
  two rounds ago) is a lower bound that falls short when the top singular values cluster:
  1.148x estimated for a true 1.458x.

The factorisation runs on every matrix, the ones the Frobenius bound already clears too,
and the two tests are combined elementwise: selecting the undecided matrices first would
give the batch a data-dependent size, which the host has to read back from the device. As
it is, the host waits for the device once per call, to learn whether any matrix failed
(the recompute is host-driven); everything else the verdict holds (the count, the worst
ratio) stays on the device until it is read. Only when some matrix failed are those
matrices picked out (more synchronisations, on a path that is rare) and given an exact
``lambda_max`` (``eigvalsh``), for the verdict.

Why not the iteration's own products: the Gram iteration's ``R`` is updated by ``R <- P R P``
beside ``Q <- P Q``, so it describes the ``Q`` the iteration meant, not the drifted one that
is applied; a test on it cannot see the divergence it is there to catch. The Gram of the
pre-rounding result, ``Q R_0 Q^T``, can, but it certifies the result before its cast to
bf16 (a rounding of up to ``2^-9 sqrt(m)`` of the norm, more than the slack at ``m`` in the
thousands). ``O O^T`` of the result as returned is what is checked.

What it does not certify: that a result inside the band is accurate. A Gram iteration that
drifted can land inside the band with a large error (fp16 GEMMs without restarts); the
engines refuse the settings for which that was measured (``ops.engines``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from shardmuon.ops.newton_schulz import (
    Coefficients,
    iterate_folded,
    orthogonalize_with,
    resolve_coefficients,
)

__all__ = [
    "GUARD_SLACK",
    "Branch",
    "GuardVerdict",
    "band_high",
    "fp32_output_refusals",
    "guarded",
    "guarded_on_device",
    "host_branch",
]

# ``branch(pred, body)``: run ``body()`` when the 0-d bool tensor ``pred`` holds, wherever
# that is decided: on the host (:func:`host_branch`), or on the device by a CUDA graph's
# conditional node (``runtime.graphs``), with no synchronisation.
Branch = Callable[[Tensor, Callable[[], None]], None]

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


# (device type, dtype) pairs whose half-precision bmm with an fp32 output was refused (torch
# before 2.8 has no out_dtype; fp16 under allow_fp16_accumulation; a backend without it).
_NO_FP32_OUTPUT: set[tuple[str, torch.dtype]] = set()


def fp32_output_refusals() -> frozenset[tuple[str, torch.dtype]]:
    """The (device type, dtype) pairs whose fp32-output GEMM was refused in this process
    (the guard then upcasts): part of what a captured call's kernels depend on."""
    return frozenset(_NO_FP32_OUTPUT)


def _fp32_output_gemm_allowed(X: Tensor) -> bool:
    on_device = X.is_cuda or X.is_meta  # meta: CUDA's path, counted without a GPU
    if not (on_device and X.dim() == 3 and X.dtype in (torch.bfloat16, torch.float16)):
        return False
    if X.dtype == torch.float16 and getattr(
        torch.backends.cuda.matmul, "allow_fp16_accumulation", False
    ):
        return False  # refused by torch's fp16 bgemm with an fp32 output
    return (X.device.type, X.dtype) not in _NO_FP32_OUTPUT


def _gram_fp32(result: Tensor) -> Tensor:
    """``O O^T`` on the short side, computed in fp32 from ``result``'s own values: a bf16
    product rounds ``A`` to 8 bits, enough to put a result above the limit below it.

    On CUDA a 3-D bf16/fp16 ``result`` goes through the half-precision GEMM with an fp32
    output (``out_dtype``): each product of two 8- or 11-bit significands is exact in fp32
    and the sum accumulates in fp32, as in the fp32 GEMM of the upcast values (up to the
    order of summation), at tensor-core speed instead of fp32's (13.6x on an H200)."""
    X = result if result.size(-2) <= result.size(-1) else result.mT
    if _fp32_output_gemm_allowed(X):
        try:
            return torch.bmm(X, X.mT, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise  # a real failure, not a missing kernel: the fp32 path needs more memory
        except (RuntimeError, TypeError, NotImplementedError):
            _NO_FP32_OUTPUT.add((X.device.type, X.dtype))
    X = X.to(torch.float32)
    return torch.bmm(X, X.mT)


def largest_singular_value(result: Tensor) -> Tensor:
    """Each matrix's largest singular value, ``result[B, m, n]`` -> fp32 ``[B]`` (exact up
    to fp32 rounding of ``O O^T``; ``inf`` for a non-finite matrix)."""
    A = _gram_fp32(result)
    lam = torch.linalg.eigvalsh(A.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))[..., -1]
    finite = torch.isfinite(A).flatten(1).all(dim=1)
    return torch.where(finite, lam.clamp_min(0).sqrt(), torch.full_like(lam, float("inf")))


def _zero(dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    return torch.zeros((), dtype=dtype, device=device)


@dataclass
class GuardVerdict:
    """What the guard saw in one call: matrices checked, recomputed, and the largest ratio of
    a top singular value to the band (1.0: at the band's top): exact for a recomputed
    matrix, and for a passing one a lower bound (its largest row norm), which is all a
    certificate that it is below the slack needs.

    ``checked`` is known on the host; the other two stay on the result's device as 0-d
    tensors (``fallback_count``: int64, ``worst_ratio_tensor``: fp32) so that a call costs
    no synchronisation for them. :attr:`fallbacks` and :attr:`worst_ratio` read them (one
    synchronisation each); a caller with many verdicts stacks the tensors and reads them
    at once (``runtime.telemetry.StepStats``)."""

    checked: int = 0
    fallback_count: Tensor = field(default_factory=lambda: _zero(torch.int64))
    worst_ratio_tensor: Tensor = field(default_factory=lambda: _zero(torch.float32))

    @property
    def fallbacks(self) -> int:
        """Matrices recomputed by the safe iteration (reads the device)."""
        return int(self.fallback_count)

    @property
    def worst_ratio(self) -> float:
        """The largest ``sigma_max / band`` seen (reads the device); 0.0 when none checked."""
        return float(self.worst_ratio_tensor)


# Relative slack for the rounding of an fp32 Cholesky factorisation of an ``m x m`` matrix:
# a factorisation that succeeds is exact for a matrix within about ``m u`` of the one given
# (normwise backward error; ``u = 2^-24``); four times that is subtracted from the limit.
_CHOLESKY_ROUNDING = 4 * 2.0**-24


def _exceeds(A: Tensor, limit: float) -> Tensor:
    """Whether ``lambda_max(A) > limit`` for each symmetric PSD ``A[B, m, m]`` (fp32), as a
    bool ``[B]``: ``limit I - A`` is positive definite exactly when a Cholesky factorisation
    of it succeeds (a third of an eigensolver's FLOPs, no iteration), tested against a limit
    lowered by the factorisation's rounding so that no matrix above ``limit`` passes."""
    m = A.size(-1)
    shifted = torch.diag_embed(A.new_full(A.shape[:-1], limit * (1 - _CHOLESKY_ROUNDING * m)))
    shifted.sub_(A)
    return torch.linalg.cholesky_ex(shifted).info != 0


def _ratios(out: Tensor, band: float, slack: float) -> tuple[Tensor, Tensor, Tensor]:
    """Which matrices of ``out[B, m, n]`` diverged, and a lower bound of each one's
    ``sigma_max / band``: bool ``[B]`` (``True``: above ``slack``, or non-finite) and fp32
    ``[B]``, both left on the device (no synchronisation).

    ``A = O O^T / band^2`` in fp32; a matrix passes when ``||A||_F`` (an upper bound of
    ``lambda_max``) is below ``slack^2`` (a low-rank result), else when ``slack^2 I - A``
    has a Cholesky factor (:func:`_exceeds`, run on every matrix so that no shape depends on
    the data); a non-finite one has diverged. The ratio is ``inf`` for a non-finite matrix
    and otherwise its largest row norm (``sqrt(max_i A_ii)``): exact enough for a passing
    matrix's certificate; the caller replaces it by the exact one for the few that fail."""
    A = _gram_fp32(out).div_(band * band)
    finite = torch.isfinite(A).flatten(1).all(dim=1)
    A = A.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    limit = slack * slack
    frobenius = torch.linalg.matrix_norm(A)
    above = (frobenius > limit) & _exceeds(A, limit)
    diverged = torch.where(finite, above, True)
    ratio = A.diagonal(dim1=-2, dim2=-1).amax(dim=-1).clamp_min_(0).sqrt_()
    infinite = float("inf")
    return (
        diverged,
        torch.where(finite, ratio, infinite),
        torch.where(finite, frobenius.sqrt(), infinite),
    )


def _safe_result(
    G: Tensor, coefficients: Coefficients, eps: float, preconditioner: str | None
) -> Tensor:
    """One matrix ``G[m, n]`` through the standard iteration in fp32: the recompute of a
    diverged result (fp32 ``[m, n]``)."""
    safe = orthogonalize_with(
        iterate_folded,
        G[None].float(),
        coefficients,
        eps,
        dtype=torch.float32,
        preconditioner=preconditioner,
    )
    return safe.X[0]


def _empty_verdict(out: Tensor) -> GuardVerdict:
    return GuardVerdict(0, _zero(torch.int64, out.device), _zero(torch.float32, out.device))


def _checked(
    out: Tensor, coefficients: Coefficients, slack: float
) -> tuple[Tensor, float, tuple[Tensor, Tensor, Tensor]]:
    """``out`` as ``[B, m, n]`` (a view where it can be), the band, and :func:`_ratios`."""
    flat = out.reshape(-1, *out.shape[-2:])
    band = band_high(coefficients)
    return flat, band, _ratios(flat, band, slack)


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
        return out, _empty_verdict(out)
    flat, band, (bad, ratio, _) = _checked(out, coefficients, slack)
    count = bad.sum()
    # The call's one synchronisation: the recompute below is driven from the host.
    if not bool(bad.any()):
        return out, GuardVerdict(flat.size(0), count, ratio.max())
    failed = bad.nonzero().flatten()
    # The exact ratio of the failed matrices (before they are overwritten), for the verdict.
    ratio = ratio.index_put((failed,), largest_singular_value(flat[failed]) / band)
    verdict = GuardVerdict(flat.size(0), count, ratio.max())
    inputs = G.reshape(-1, *G.shape[-2:])
    for i in failed.tolist():
        flat[i] = _safe_result(inputs[i], coefficients, eps, preconditioner).to(flat.dtype)
    return flat.reshape(out.shape), verdict  # a view of ``out`` unless reshape had to copy


def host_branch(pred: Tensor, body: Callable[[], None]) -> None:
    """``body()`` if ``pred`` holds, read on the host (a synchronisation on a GPU)."""
    if bool(pred):
        body()


def guarded_on_device(
    G: Tensor,
    orthogonalize: Callable[[Tensor], Tensor],
    coefficients: str | Coefficients | None,
    eps: float,
    branch: Branch,
    slack: float = GUARD_SLACK,
    preconditioner: str | None = None,
) -> tuple[Tensor, GuardVerdict]:
    """:func:`guarded` with nothing read on the host: whether to recompute is ``branch``'s
    to decide (a CUDA graph's conditional node reads it on the device), and the recompute
    has no data-dependent shape. It recomputes every matrix of the call, one at a time as
    :func:`guarded` recomputes a failed one (the same bits), and keeps the recomputed one
    only where the matrix failed: where none failed it does not run; where one did, the
    call pays for all (a rare path).

    The result is :func:`guarded`'s bit for bit. The verdict's worst ratio differs for a
    failed matrix: its upper bound ``sqrt(||O O^T||_F) / band`` instead of the exact
    ``sigma_max / band`` (an eigensolver checks its errors on the host).
    """
    coefficients = resolve_coefficients(coefficients)
    out = orthogonalize(G)
    if out.numel() == 0:
        return out, _empty_verdict(out)
    flat, band, (bad, ratio, bound) = _checked(out, coefficients, slack)
    inputs = G.reshape(-1, *G.shape[-2:])

    def recompute() -> None:
        for i in range(flat.size(0)):
            safe = _safe_result(inputs[i], coefficients, eps, preconditioner)
            flat[i] = torch.where(bad[i], safe.to(flat.dtype), flat[i])
        ratio.copy_(torch.where(bad, bound / band, ratio))

    branch(bad.any(), recompute)
    return flat.reshape(out.shape), GuardVerdict(flat.size(0), bad.sum(), ratio.max())
