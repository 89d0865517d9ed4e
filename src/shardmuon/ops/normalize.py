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

AOL's variant, :func:`normalize_unit`, keeps the same promises in the same pass and hands
the quotient back in two factors: ``X / ||X||`` and the ``[B]`` floor
``||X|| / (||X|| + eps)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from shardmuon.ops.fused_normalize import (
    GRAM_READY_RANGE,
    fused_normalize_available,
    gram_ready_into,
    normalize_into,
    normalize_unit_into,
)

__all__ = [
    "NORMALIZE_CHUNK_ELEMENTS",
    "Normalized",
    "gram_ready",
    "normalize",
    "normalize_unit",
    "normalize_without_sync",
    "power_of_two_exponent",
]

# Elements of one float32 temporary in the division (16 MiB): the fp32 copy of a large
# matrix is never made whole, only this much of it at a time.
NORMALIZE_CHUNK_ELEMENTS = 4 * 2**20
# Below this fp32 norm some entries' squares may have underflowed: the rare path re-reduces.
# (Entries under 2^-63 square below fp32's smallest normal; with a norm of at least 2^-40
# what they could add is under n * 2^-46 of it.)
_SMALLEST_TRUSTED_NORM = 2.0**-40
_FP32_TINY = torch.finfo(torch.float32).tiny


class Normalized(NamedTuple):
    """The normalised ``X[B, m, n]`` (in the requested dtype) and the ``[B]`` bool mask of
    matrices that held a non-finite entry (their rows of ``X`` are zero)."""

    X: Tensor
    nonfinite: Tensor


def power_of_two_exponent(value: Tensor) -> Tensor:
    """``e`` with ``value * 2^-e`` in ``[0.5, 1)``, clamped to [-126, 126] so that ``2^-e``
    is a normal fp32 (int32, the shape of ``value``; 0 for 0, inf and NaN)."""
    return torch.frexp(value).exponent.clamp_(-126, 126)


def _power_of_two_below(value: Tensor) -> Tensor:
    """``2^-e`` with ``value * 2^-e`` in ``[0.5, 1)`` (``e`` clamped so the factor stays a
    normal fp32; 0 gives 1): multiplying by it is exact."""
    exponent = power_of_two_exponent(value)
    return torch.ldexp(torch.ones_like(value, dtype=torch.float32), -exponent).to(torch.float32)


def _decides_on_host(device: torch.device) -> bool:
    """Whether the rare paths are chosen on the host (a CPU: reading ``[B]`` norms costs
    nothing there); elsewhere the branch without a synchronisation runs."""
    return device.type == "cpu"


def _suspects(norm: Tensor, eps: float) -> list[int]:
    """Matrices whose plain fp32 norm may have overflowed or underflowed (or is NaN). A
    zero norm is left to the plain path when ``eps`` dwarfs whatever may have underflowed
    (then both paths divide by ``eps``): an all-zero matrix (an expert that got no token)
    costs nothing extra."""
    # One read of the [B] norms (free on a CPU, where this runs) instead of a chain of [B]
    # operators: the same test, in Python.
    zero_is_plain = eps >= _SMALLEST_TRUSTED_NORM
    return [
        i
        for i, value in enumerate(norm.flatten().tolist())
        if (not value >= _SMALLEST_TRUSTED_NORM or math.isinf(value))
        and not (zero_is_plain and value == 0.0)
    ]


def normalize(
    X: Tensor, eps: float, dtype: torch.dtype = torch.bfloat16, out: Tensor | None = None
) -> Normalized:
    """``X / (||X||_F + eps)`` per matrix of ``X[B, m, n]``, computed in fp32, in ``dtype``;
    matrices with a non-finite entry zeroed and flagged.

    The division is element-wise, so doing it in slices of at most
    ``NORMALIZE_CHUNK_ELEMENTS`` elements gives the same bits as doing it whole, while the
    fp32 temporary stays small. Writes into ``out`` (which may be ``X`` itself: each slice
    is read before it is written) or a new contiguous ``[B, m, n]`` tensor. Inputs wider
    than fp32 are rounded to fp32 first. Where the norm needs it (its fp32 value overflows
    or underflows, on a CPU; always elsewhere) the matrix is first scaled by a power of two
    ``s`` (exact) and divided by ``||s X|| + s eps``: the same quotient, representable.
    """
    normalized, _ = _normalize(X, eps, dtype, out, unit=False)
    return normalized


def normalize_unit(
    X: Tensor, eps: float, dtype: torch.dtype = torch.bfloat16, out: Tensor | None = None
) -> tuple[Normalized, Tensor]:
    """:func:`normalize`'s quotient in two factors: ``X / ||X||_F`` (in ``dtype``; a zero
    matrix stays zero) and the fp32 ``[B]`` floor ``||X||_F / (||X||_F + eps)`` (0 for a
    zero or non-finite matrix), whose product is ``X / (||X||_F + eps)``.

    For AOL (:func:`shardmuon.ops.newton_schulz.aol_rescale_`): its Gram matrix must not
    underflow in the iteration's dtype, which ``X / (||X|| + eps)`` of a gradient far below
    ``eps`` does (entries ``~(||X|| / eps)^2``); the unit matrix's do not, and the floor is
    applied with AOL's own scaling, in fp32. Same pass, same promises (overflow-safe,
    non-finite matrices zeroed and flagged); on a CPU a zero norm always takes the rare path
    (whether its squares underflowed decides the unit matrix, not only the floor).
    """
    normalized, floor = _normalize(X, eps, dtype, out, unit=True)
    return normalized, floor


def _normalize(
    X: Tensor, eps: float, dtype: torch.dtype, out: Tensor | None, unit: bool
) -> tuple[Normalized, Tensor | None]:
    """:func:`normalize` (``unit=False``: floor ``None``) or :func:`normalize_unit`."""
    if X.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        X = X.float()
    batch = X.size(0)
    if out is None:
        out = torch.empty(X.shape, dtype=dtype, device=X.device)
    if not _decides_on_host(X.device):
        return _normalize_without_sync(X, eps, out, unit)
    denom = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    # A unit matrix needs the true norm even where eps would dwarf what underflowed.
    suspects = _suspects(denom, 0.0 if unit else eps)  # a [B] check on the host: free on a CPU
    nonfinite = torch.zeros(batch, dtype=torch.bool, device=X.device)
    # Unit: the plain norms left are in [2^-40, inf), the divisor as it is.
    floor = denom / (denom + eps) if unit else None
    if not unit:
        denom.add_(eps)
    # ``out`` may be ``X`` itself: then the rare rows are done first and divided by 1 in
    # the plain pass (exact); otherwise the plain pass first, the rare rows over it.
    aliased = out.data_ptr() == X.data_ptr()
    if not aliased:
        _divide(out, X, denom, None)
    for i in suspects:  # the rare path: one matrix, one fp32 copy at a time
        scaled = X[i : i + 1].to(torch.float32, copy=True)
        scale = _power_of_two_below(torch.linalg.vector_norm(scaled, ord=math.inf))
        norm = torch.linalg.vector_norm(scaled.mul_(scale))
        nonfinite[i] = ~torch.isfinite(norm)
        if unit:
            floor[i] = norm / (norm + scale * eps).clamp_min(_FP32_TINY)  # 0 / 0: 0
            out[i : i + 1] = scaled.div_(norm.clamp_min(_FP32_TINY))  # zero stays zero
        else:
            out[i : i + 1] = scaled.div_(norm + scale * eps)
        denom[i] = 1.0
    if aliased:
        _divide(out, X, denom, None)
    if suspects:
        out[nonfinite] = 0
        if unit:
            floor[nonfinite] = 0.0
    return Normalized(out, nonfinite), None if floor is None else floor.flatten()


def gram_ready(
    X: Tensor, eps: float, dtype: torch.dtype = torch.bfloat16, out: Tensor | None = None
) -> tuple[Normalized, Tensor]:
    """AOL's input with no normalisation pass (Turbo-Muon's): ``X[B, m, n]`` in ``dtype``, a
    matrix as it is where its norm lies in ``GRAM_READY_RANGE`` (its Gram matrix then
    neither overflows nor underflows, and AOL's scaling does not depend on ``X``'s scale),
    else scaled by a power of two (exact) that brings its norm into ``[0.5, 1)``; non-finite
    matrices zeroed and flagged; and the fp32 ``[B]`` floor ``||X|| / (||X|| + eps)``
    (0 for a flagged matrix) for :func:`shardmuon.ops.newton_schulz.aol_rescale_`.

    The norms are those of ``X`` as given (a wider input is scaled before it is rounded to
    ``dtype``). In place (``out`` is ``X``, already in ``dtype``) ``X`` is read once for its
    norms and written only where a matrix is out of range (on a CPU decided on the host;
    elsewhere by one kernel whose programs skip the others, with Triton); otherwise the
    cast into ``out`` (or a new contiguous tensor) is the one pass. Not for fp16, whose
    range is too narrow for the Gram matrix of an unscaled ``X`` (:func:`normalize_unit`).
    """
    if dtype == torch.float16:
        raise ValueError("gram_ready: fp16 needs the unit normalisation (normalize_unit)")
    if X.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        X = X.float()
    if out is None:
        out = torch.empty(X.shape, dtype=dtype, device=X.device)
    in_place = out.data_ptr() == X.data_ptr() and out.dtype == X.dtype
    batch = X.size(0)
    if not _decides_on_host(X.device):
        norm64 = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
        nonfinite = torch.empty(batch, dtype=torch.bool, device=X.device)
        floor = torch.empty(batch, dtype=torch.float32, device=X.device)
        gram_ready_into(X, norm64, eps, out, nonfinite, floor)
        return Normalized(out, nonfinite), floor
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float32)
    low, high = GRAM_READY_RANGE
    outside = [i for i, v in enumerate(norm.tolist()) if not low <= v <= high]  # NaN too
    floor = norm / (norm + eps)  # in range: no 0 / 0
    nonfinite = torch.zeros(batch, dtype=torch.bool, device=X.device)
    if not in_place:
        out.copy_(X)
    for i in outside:  # the rare path: one matrix, one fp32 copy at a time
        scaled = X[i].to(torch.float32, copy=True)
        scale = _power_of_two_below(torch.linalg.vector_norm(scaled, ord=math.inf))
        exact = torch.linalg.vector_norm(scaled.mul_(scale))  # ||scale X||: representable
        if not torch.isfinite(exact):
            nonfinite[i] = True
            floor[i] = 0.0
            out[i] = 0
            continue
        floor[i] = exact / (exact + scale * eps).clamp_min(_FP32_TINY)  # 0 / 0: 0
        out[i] = scaled.mul_(_power_of_two_below(exact))  # norm into [0.5, 1); zero stays 0
    return Normalized(out, nonfinite), floor


def normalize_without_sync(X: Tensor, eps: float, out: Tensor) -> Normalized:
    """:func:`normalize`'s accelerator branch (public for tests on any device): one pass,
    no synchronisation. fp64 holds the square of any fp32 value, and the power-of-two
    prescale keeps the divisor an fp32 number; the mask is applied unconditionally.
    ``X[B, m, n]`` in any float dtype (wider than fp32: rounded to fp32 first, as
    :func:`normalize` does); ``out`` of its shape, in the result's dtype."""
    normalized, _ = _normalize_without_sync(X, eps, out, unit=False)
    return normalized


def _normalize_without_sync(
    X: Tensor, eps: float, out: Tensor, unit: bool
) -> tuple[Normalized, Tensor | None]:
    """:func:`normalize_without_sync`, or with ``unit`` :func:`normalize_unit`'s two
    factors (four more ``[B, 1, 1]`` kernels than the plain divisor's two: the floor's
    clamp and division, its mask, the divisor's clamp)."""
    if X.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        X = X.float()
    if fused_normalize_available(X.device):
        # The norm, then everything else in one kernel (ops/fused_normalize.py).
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
        nonfinite = torch.empty(X.size(0), dtype=torch.bool, device=X.device)
        if not unit:
            normalize_into(X, norm, eps, out, nonfinite)
            return Normalized(out, nonfinite), None
        floor = torch.empty(X.size(0), dtype=torch.float32, device=X.device)
        normalize_unit_into(X, norm, eps, out, nonfinite, floor)
        return Normalized(out, nonfinite), floor
    norm64 = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64)
    prescale = _power_of_two_below(norm64)
    denom = (norm64 * prescale).to(torch.float32)
    nonfinite = ~torch.isfinite(denom)
    floor = None
    if unit:
        floor = denom / (denom + prescale * eps).clamp_min_(_FP32_TINY)  # 0 / 0 (eps = 0): 0
        floor.masked_fill_(nonfinite, 0.0)
        denom.clamp_min_(_FP32_TINY)  # a zero matrix stays zero
    else:
        denom.add_(prescale * eps)
    _divide(out, X, denom, prescale, fused=True)
    out.masked_fill_(nonfinite, 0.0)
    return Normalized(out, nonfinite.flatten()), None if floor is None else floor.flatten()


def _divide(
    out: Tensor, X: Tensor, denom: Tensor, prescale: Tensor | None, fused: bool = False
) -> None:
    """``out = X * prescale / denom`` per matrix, in fp32 slices of at most
    ``NORMALIZE_CHUNK_ELEMENTS`` elements (the same bits as whole).

    ``fused`` (the accelerator branch): the division rounds its fp32 quotient into
    ``out``'s dtype itself — on an accelerator the kernel casts as it loads and stores, so a
    slice is two kernels (the prescale, whose fp32 result is the slice's one temporary, and
    the division) instead of four, with no separate copy or cast pass. On a CPU a
    mixed-dtype division makes an fp32 copy of a narrower operand and of its quotient: it
    divides each slice in two halves of its rows instead (two fp32 copies of a half are the
    unfused slice's one fp32 copy), one call each instead of three (copy, divide, cast
    back); an fp32 slice in one call (its quotient's one fp32 copy). Same bits."""
    batch, rows, cols = X.shape
    on_cpu = X.device.type == "cpu"

    def divide_into(target: Tensor, source: Tensor, divisor: Tensor, pre: Tensor | None) -> None:
        if on_cpu and pre is None:
            if source.dtype == torch.float32:  # one fp32 temporary: the quotient's
                torch.div(source, divisor, out=target)
                return
            half = source.size(-2) // 2
            if half and source.size(-2) % 2 == 0:
                # Each matrix's rows in two halves: every [..., 1, 1] divisor broadcasts.
                torch.div(source[..., :half, :], divisor, out=target[..., :half, :])
                torch.div(source[..., half:, :], divisor, out=target[..., half:, :])
                return
        if fused:
            if pre is not None:
                source = source * pre  # fp32, exact: pre is a power of two
            torch.div(source, divisor, out=target)
            return
        quotient = source.to(torch.float32, copy=True)  # the slice's one fp32 temporary
        if pre is not None:
            quotient.mul_(pre)
        target.copy_(quotient.div_(divisor))

    def at(t: Tensor | None, index) -> Tensor | None:
        return None if t is None else t[index]

    if X.numel() <= NORMALIZE_CHUNK_ELEMENTS:
        divide_into(out, X, denom, prescale)
    elif rows * cols <= NORMALIZE_CHUNK_ELEMENTS:
        step = NORMALIZE_CHUNK_ELEMENTS // (rows * cols)
        for b in range(0, batch, step):
            part = slice(b, b + step)
            divide_into(out[part], X[part], denom[part], at(prescale, part))
    else:
        step = max(1, NORMALIZE_CHUNK_ELEMENTS // cols)
        for b in range(batch):
            for r in range(0, rows, step):
                divide_into(out[b, r : r + step], X[b, r : r + step], denom[b], at(prescale, b))
