"""The one normalisation every Newton–Schulz engine starts from: ``X / (||X||_F + eps)``.

Three promises, for every engine, at the cost of the one fp32 reduction the iteration
needs anyway:

* **Overflow-safe.** A gradient scaled by 1e18 has a sum of squares that overflows fp32;
  the update must not silently be zero. A matrix whose fp32 norm came out non-finite (or
  so small that its squares may have underflowed) is the rare path: its norm is reduced
  again with its entries scaled by a power of two (exact), which changes no bit wherever
  the plain reduction neither overflowed nor underflowed.
* **Non-finite masked.** A matrix with an inf or NaN entry gets a zero direction (its
  update is skipped, not spread as NaN over the whole weight); the mask of such matrices
  is returned so the step can count them without another pass over the directions.
* **No extra pass on the common path.** On a CPU the rare path is chosen on the host (a
  ``[B]`` check costs nothing there). On an accelerator, where a host check would stall
  the stream, the norm is accumulated in fp64 instead (a memory-bound reduction: no
  overflow or underflow for any fp32/bf16/fp16 input, one pass) and the mask is applied
  unconditionally (one element-wise pass, no synchronisation).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "NORMALIZE_CHUNK_ELEMENTS",
    "Normalized",
    "frobenius_norm_fp32",
    "normalize",
    "safe_norm_fp32",
]

# Elements of one float32 temporary in the division (16 MiB): the fp32 copy of a large
# matrix is never made whole, only this much of it at a time.
NORMALIZE_CHUNK_ELEMENTS = 4 * 2**20
# Below this fp32 norm some entries' squares may have underflowed: the rare path re-reduces.
# (Entries under 2^-63 square below fp32's smallest normal; with a norm of at least 2^-40
# what they could add is under n * 2^-46 of it.)
_SMALLEST_TRUSTED_NORM = 2.0**-40


class Normalized(NamedTuple):
    """The normalised ``X[B, m, n]`` (in the requested dtype) and the ``[B]`` bool mask of
    matrices that held a non-finite entry (their rows of ``X`` are zero)."""

    X: Tensor
    nonfinite: Tensor


def frobenius_norm_fp32(X: Tensor) -> Tensor:
    """``||X||_F`` of each matrix of ``X[B, m, n]``, in fp32, shape ``[B, 1, 1]``, without
    overflow or underflow (the rare path of :func:`normalize`; any device).

    Each matrix is scaled by the power of two that brings its largest entry into
    ``[0.5, 1)`` before the reduction and unscaled after: exact, so wherever the plain fp32
    reduction neither overflows nor underflows the result is the same bits. Non-finite
    entries give a non-finite norm.
    """
    largest = torch.linalg.vector_norm(
        X, ord=math.inf, dim=(-2, -1), keepdim=True, dtype=torch.float32
    )
    _, exponent = torch.frexp(largest)
    # 0 (an all-zero matrix) gives exponent 0; the clamp keeps 2^-exponent a normal fp32.
    exponent.clamp_(-120, 120)
    scale = torch.ldexp(torch.ones_like(largest), -exponent)
    scaled = X.to(torch.float32, copy=True).mul_(scale)
    norm = torch.linalg.vector_norm(scaled, dim=(-2, -1), keepdim=True)
    del scaled
    return norm.div_(scale)


def safe_norm_fp32(X: Tensor) -> Tensor:
    """``||X||_F`` per matrix of ``X[B, m, n]`` in fp32 ``[B, 1, 1]``, overflow-safe, from
    one reduction on the common path (see the module docstring)."""
    if X.device.type != "cpu":
        # One pass, no synchronisation: fp64 holds the square of any fp32 value.
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64)
        return norm.to(torch.float32)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    suspect = ~(norm >= _SMALLEST_TRUSTED_NORM) | torch.isinf(norm)
    if bool(suspect.any()):  # the rare path (a host check is free on a CPU)
        for i in suspect.flatten().nonzero().flatten().tolist():  # one fp32 copy at a time
            norm[i] = frobenius_norm_fp32(X[i : i + 1])[0]
    return norm


def normalize(
    X: Tensor, eps: float, dtype: torch.dtype = torch.bfloat16, out: Tensor | None = None
) -> Normalized:
    """``X / (||X||_F + eps)`` per matrix of ``X[B, m, n]``, computed in fp32, in ``dtype``;
    matrices with a non-finite entry zeroed and flagged.

    The division is element-wise, so doing it in slices of at most
    ``NORMALIZE_CHUNK_ELEMENTS`` elements gives the same bits as doing it whole, while the
    fp32 temporary stays small. Writes into ``out`` (which may be ``X`` itself: each slice
    is read before it is written) or a new contiguous ``[B, m, n]`` tensor. Inputs wider
    than fp32 are rounded to fp32 first.
    """
    if X.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        X = X.float()
    denom = safe_norm_fp32(X)
    nonfinite = ~torch.isfinite(denom)
    denom.add_(eps)
    if out is None:
        out = torch.empty(X.shape, dtype=dtype, device=X.device)
    batch, rows, cols = X.shape

    def divide_into(target: Tensor, source: Tensor, divisor: Tensor) -> None:
        # One fp32 copy, divided in place (a mixed-dtype div would add a second one).
        target.copy_(source.to(torch.float32, copy=True).div_(divisor))

    if X.numel() <= NORMALIZE_CHUNK_ELEMENTS:
        divide_into(out, X, denom)
    elif rows * cols <= NORMALIZE_CHUNK_ELEMENTS:
        step = NORMALIZE_CHUNK_ELEMENTS // (rows * cols)
        for b in range(0, batch, step):
            divide_into(out[b : b + step], X[b : b + step], denom[b : b + step])
    else:
        step = max(1, NORMALIZE_CHUNK_ELEMENTS // cols)
        for b in range(batch):
            for r in range(0, rows, step):
                divide_into(out[b, r : r + step], X[b, r : r + step], denom[b])
    if X.device.type != "cpu" or bool(nonfinite.any()):
        out.masked_fill_(nonfinite, 0.0)
    return Normalized(out, nonfinite.flatten())
