"""The accelerator normalisation's element-wise pass as one Triton kernel per call.

:func:`shardmuon.ops.normalize.normalize_without_sync` divides ``X[B, m, n]`` by its
per-matrix divisor in torch ops: a handful of ``[B]`` kernels for the power-of-two prescale
and the divisor, then two kernels per 16 MiB slice (prescale, divide-and-cast) and the
non-finite mask, about 18 launches for a batch of expert matrices. :func:`normalize_into`
does all of it, given the fp64 norms, in one launch: each program reads its matrix's norm,
derives the same prescale and divisor (integer exponent arithmetic, exact), divides a block
of the matrix with IEEE round-to-nearest, rounds to the output dtype to nearest even and
writes zeros where the divisor is not finite; the first block of each matrix writes its
non-finite flag. The bits are those of the torch ops (tested under Triton's interpreter on
a CPU, ``tests/ops/test_fused_normalize.py``).

It is a ``torch.library`` custom op, ``shardmuon::normalize_into``: one call in a dispatch
trace, a fake implementation for meta tensors (the launch count of ``bench step
--kernels`` takes the accelerator path on the ``meta`` device), the Triton kernel on CUDA
and the torch ops elsewhere.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "GRAM_READY_RANGE",
    "fused_normalize_available",
    "gram_ready_into",
    "gram_ready_reference",
    "normalize_into",
    "normalize_into_reference",
    "normalize_unit_into",
    "normalize_unit_into_reference",
    "run_on_device",
]

# Elements of one matrix per program: memory-bound, large enough to amortise the per-program
# scalar work (the exponent arithmetic on the matrix's norm).
_BLOCK = 2048
_FP32_TINY = torch.finfo(torch.float32).tiny
# The output dtypes by the code the kernel branches on.
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _triton():
    """``(triton, triton.language)`` or ``None`` where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None
    return triton, tl


# Why the kernels were turned off in this process, if one failed to compile or launch.
_DISABLED: list[str] = []


def kernels_enabled() -> bool:
    """Triton imports and no kernel has failed to compile or launch in this process."""
    return _triton() is not None and not _DISABLED


def run_or_fall_back(kernel: Callable[[], None], reference: Callable[[], None]) -> None:
    """``kernel()``; if it fails (a GPU or driver Triton cannot compile for), a warning,
    the kernels off for the rest of the process, and ``reference()`` (the torch ops: the
    same bits). A kernel fails before it writes anything (compilation, launch)."""
    if kernels_enabled():
        try:
            kernel()
            return
        except Exception as err:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise  # a capture refused it (runtime/graphs.py): not the kernel's fault
            _DISABLED.append(repr(err))
            warnings.warn(
                f"shardmuon's Triton kernels failed ({err!r}); the torch ops run instead "
                "(same results, more kernel launches)",
                RuntimeWarning,
                stacklevel=3,
            )
    reference()


def run_on_device(
    device: torch.device, kernel: Callable[[], None], reference: Callable[[], None]
) -> None:
    """A fused op's body: on CUDA ``kernel()`` on the tensors' device (Triton launches on the
    current device and its current stream: make it theirs), falling back to ``reference()``
    if it fails (:func:`run_or_fall_back`); elsewhere ``reference()`` (the torch ops)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            run_or_fall_back(kernel, reference)
    else:
        reference()


def fused_normalize_available(device: torch.device) -> bool:
    """Whether the accelerator normalisation runs :func:`normalize_into` on ``device``:
    CUDA with Triton importable, and ``meta`` where Triton imports (so that a launch count on
    meta tensors counts what CUDA would launch)."""
    return device.type in ("cuda", "meta") and kernels_enabled()


@functools.cache
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def normalize_kernel(
        X, OUT, NORM, NONFINITE, FLOOR, eps, n, stride_b, stride_r, stride_c, numel,
        IN_BF16: tl.constexpr, OUT_KIND: tl.constexpr, MODE: tl.constexpr, IN_PLACE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # MODE 0: X / (||X|| + eps). 1: X / ||X|| and the floor (AOL's unit form). 2: AOL's
        # Gram-ready X: as it is where its norm is in [2^-30, 2^30] (in place: untouched),
        # else scaled by the prescale (exact), zero if non-finite; and the floor.
        b = tl.program_id(1).to(tl.int64)  # offsets past 2^31 elements
        block = tl.program_id(0)
        norm = tl.load(NORM + b)  # fp64: no overflow or underflow for fp32 data
        # frexp's exponent of a normal fp64 (zero, inf and NaN: 0), clamped so that the
        # prescale 2^-e is a normal fp32: normalize's _power_of_two_below.
        bits = norm.to(tl.int64, bitcast=True)
        field = ((bits >> 52) & 0x7FF).to(tl.int32)
        e = tl.where((field == 0) | (field == 0x7FF), 0, field - 1022)
        e = tl.minimum(tl.maximum(e, -126), 126)
        prescale = ((127 - e) << 23).to(tl.float32, bitcast=True)
        scaled_norm = (norm * prescale.to(tl.float64)).to(tl.float32)
        # Flagged from the norm, before eps: a finite matrix whose prescale * eps overflows
        # is divided by inf (zeros of its signs), not flagged.
        nonfinite = (scaled_norm - scaled_norm) != 0.0  # inf - inf and NaN: NaN
        if MODE == 0:
            divisor = scaled_norm + prescale * eps
        else:
            # X / ||X|| (a zero matrix stays zero) and the floor ||X|| / (||X|| + eps).
            tiny = 1.1754943508222875e-38  # fp32's smallest normal, 2^-126 (exact)
            divisor = tl.maximum(scaled_norm, tiny)
            if block == 0:
                floor = tl.math.div_rn(scaled_norm, tl.maximum(scaled_norm + prescale * eps, tiny))
                tl.store(FLOOR + b, tl.where(nonfinite, 0.0, floor))
        if block == 0:
            tl.store(NONFINITE + b, nonfinite.to(tl.int8))
        i = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < numel
        if MODE == 2:
            low = 9.313225746154785e-10  # 2^-30
            high = 1073741824.0  # 2^30
            outside = nonfinite | (norm < low) | (norm > high)
            prescale = tl.where(outside, prescale, 1.0)
            if IN_PLACE:
                # Only the matrices the Gram cannot take as they are are read and written:
                # the others' programs touch no element.
                inside = tl.where(outside, inside, 0) != 0
        row = i // n
        col = i - row * n
        where = X + b * stride_b + row * stride_r + col * stride_c
        if IN_BF16:
            # bf16 widened by its bits (exact, subnormals included on every backend).
            raw_in = tl.load(where, mask=inside, other=0).to(tl.uint16, bitcast=True)
            x = (raw_in.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(where, mask=inside, other=0.0).to(tl.float32)
        if MODE == 2:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
            q = x * prescale  # exact: a power of two, or 1
        else:
            q = tl.math.div_rn(x * prescale, divisor)
        q = tl.where(nonfinite, 0.0, q)
        target = OUT + b * numel + i
        if OUT_KIND == 1:
            # bf16 rounded to nearest even by hand: the same bits on a GPU and in Triton's
            # interpreter (whose own cast truncates). An overflowing quotient carries into
            # inf as a cast would; a NaN (0 / 0: a zero matrix with eps = 0) is written as
            # the quiet NaN, whose payload the carry would otherwise wreck.
            raw = q.to(tl.uint32, bitcast=True)
            rounded = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
            rounded = tl.where(q != q, 0x7FC0, rounded)
            tl.store(target, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)
        elif OUT_KIND == 2:
            tl.store(target, q.to(tl.float16), mask=inside)
        else:
            tl.store(target, q, mask=inside)

    return normalize_kernel


def launch(
    X: Tensor,
    norm: Tensor,
    eps: float,
    out: Tensor,
    nonfinite: Tensor,
    floor: Tensor | None = None,
    gram_ready: bool = False,
) -> None:
    """The Triton kernel on ``X[B, m, n]`` (fp32, bf16 or fp16, any strides), ``norm`` its
    ``[B]`` fp64 Frobenius norms, ``out`` a contiguous ``[B, m, n]`` (fp32, bf16 or fp16;
    ``X`` itself when ``X`` is contiguous), ``nonfinite`` a ``[B]`` bool; with ``floor`` (an
    fp32 ``[B]``) AOL's two factors instead (:func:`normalize_unit_into`), and with
    ``gram_ready`` as well AOL's Gram-ready input (:func:`gram_ready_into`). Runs wherever
    the tensors live (CUDA; a CPU under ``TRITON_INTERPRET=1``)."""
    batch, rows, cols = X.shape
    numel = rows * cols
    if batch == 0 or numel == 0:
        nonfinite.zero_()
        if floor is not None:
            floor.zero_()  # an empty matrix: norm 0, floor 0 / (0 + eps) = 0
        return
    target = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    source = X.view(torch.int16) if X.dtype == torch.bfloat16 else X
    grid = (math.ceil(numel / _BLOCK), batch)
    _kernel()[grid](
        source, target, norm, nonfinite.view(torch.int8), norm if floor is None else floor,
        float(eps), cols, *X.stride(), numel, IN_BF16=X.dtype == torch.bfloat16,
        OUT_KIND=_OUT_KINDS[out.dtype], MODE=2 if gram_ready else int(floor is not None),
        IN_PLACE=out.data_ptr() == X.data_ptr(), BLOCK=_BLOCK,
        enable_fp_fusion=False,  # no FMA: each operation rounds as the torch op does
    )  # fmt: skip


def normalize_into_reference(
    X: Tensor, norm: Tensor, eps: float, out: Tensor, nonfinite: Tensor
) -> None:
    """:func:`normalize_into` in torch ops (its meaning, and where Triton is not used)."""
    norm64 = norm.reshape(-1, 1, 1)
    # normalize's power of two below the norm (frexp's exponent, clamped to keep 2^-e a
    # normal fp32), written out: normalize imports this module.
    exponent = torch.frexp(norm64).exponent.clamp_(-126, 126)
    prescale = torch.ldexp(torch.ones_like(norm64, dtype=torch.float32), -exponent)
    divisor = (norm64 * prescale).to(torch.float32)
    bad = ~torch.isfinite(divisor)  # from the norm, before eps (normalize_without_sync's)
    divisor.add_(prescale * eps)
    torch.div(X * prescale, divisor, out=out)
    out.masked_fill_(bad, 0.0)
    nonfinite.copy_(bad.flatten())


def normalize_unit_into_reference(
    X: Tensor, norm: Tensor, eps: float, out: Tensor, nonfinite: Tensor, floor: Tensor
) -> None:
    """:func:`normalize_unit_into` in torch ops (its meaning, and where Triton is not
    used)."""
    prescale, denom, bad = _unit_factors(norm, eps, floor)
    torch.div(X * prescale, denom.clamp_min_(_FP32_TINY), out=out)  # a zero matrix stays 0
    out.masked_fill_(bad, 0.0)
    nonfinite.copy_(bad.flatten())


# AOL's Gram takes a matrix as it is where its norm lies in [2^-30, 2^30]: its Gram entries
# then neither overflow nor underflow in bf16 or fp32 (AOL's scaling does not depend on X's
# scale, only its row sums must be representable).
GRAM_READY_RANGE = (2.0**-30, 2.0**30)


def _unit_factors(norm: Tensor, eps: float, floor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """AOL's factors from the fp64 ``norm[B]``, as the kernel derives them: the fp32
    power-of-two prescale and the prescaled norm (``[B, 1, 1]``), the ``[B, 1, 1]`` mask
    where it is not finite, and ``floor[B] = ||X|| / (||X|| + eps)`` written (0 there)."""
    norm64 = norm.reshape(-1, 1, 1)
    exponent = torch.frexp(norm64).exponent.clamp_(-126, 126)
    prescale = torch.ldexp(torch.ones_like(norm64, dtype=torch.float32), -exponent)
    denom = (norm64 * prescale).to(torch.float32)
    bad = ~torch.isfinite(denom)
    unit_floor = denom / (denom + prescale * eps).clamp_min_(_FP32_TINY)  # 0 / 0 (eps 0): 0
    floor.copy_(unit_floor.masked_fill_(bad, 0.0).flatten())
    return prescale, denom, bad


def gram_ready_reference(
    X: Tensor, norm: Tensor, eps: float, out: Tensor, nonfinite: Tensor, floor: Tensor
) -> None:
    """:func:`gram_ready_into` in torch ops (its meaning, and where Triton is not used)."""
    prescale, _, bad = _unit_factors(norm, eps, floor)
    low, high = GRAM_READY_RANGE
    norm64 = norm.reshape(-1, 1, 1)
    outside = bad | (norm64 < low) | (norm64 > high)
    # X * 1 is X; X * 2^-e is exact; one rounding into out's dtype
    torch.mul(X, torch.where(outside, prescale, 1.0), out=out)
    out.masked_fill_(bad, 0.0)
    nonfinite.copy_(bad.flatten())


@torch.library.custom_op("shardmuon::gram_ready_into", mutates_args=("out", "nonfinite", "floor"))
def gram_ready_into(
    X: Tensor, norm: Tensor, eps: float, out: Tensor, nonfinite: Tensor, floor: Tensor
) -> None:
    """AOL's input without a normalisation pass: each matrix of ``X[B, m, n]`` into the
    contiguous ``out`` (``X`` itself: in place) as it is where its fp64 ``norm`` lies in
    ``GRAM_READY_RANGE``, else scaled by the power of two that brings its norm into
    ``[0.5, 1)`` (exact), zero where the norm is not finite (flagged in ``nonfinite[B]``);
    the fp32 ``floor[B]`` is ``||X|| / (||X|| + eps)`` (0 for a flagged matrix). One Triton
    kernel on CUDA; in place, its programs touch no element of a matrix left as it is."""
    run_on_device(
        X.device,
        lambda: launch(X, norm, eps, out, nonfinite, floor, gram_ready=True),
        lambda: gram_ready_reference(X, norm, eps, out, nonfinite, floor),
    )


@gram_ready_into.register_fake
def _gram_ready_into_fake(X, norm, eps, out, nonfinite, floor) -> None:
    return None


@torch.library.custom_op(
    "shardmuon::normalize_unit_into", mutates_args=("out", "nonfinite", "floor")
)
def normalize_unit_into(
    X: Tensor, norm: Tensor, eps: float, out: Tensor, nonfinite: Tensor, floor: Tensor
) -> None:
    """AOL's normalisation in one pass: ``out = X / ||X||`` per matrix (through the same
    power-of-two prescale as :func:`normalize_into`; a zero matrix stays zero), the fp32
    ``floor[B] = ||X|| / (||X|| + eps)``, both zero where the norm is not finite, and
    ``nonfinite[B]`` those matrices. One Triton kernel on CUDA."""
    run_on_device(
        X.device,
        lambda: launch(X, norm, eps, out, nonfinite, floor),
        lambda: normalize_unit_into_reference(X, norm, eps, out, nonfinite, floor),
    )


@normalize_unit_into.register_fake
def _normalize_unit_into_fake(X, norm, eps, out, nonfinite, floor) -> None:
    return None


@torch.library.custom_op("shardmuon::normalize_into", mutates_args=("out", "nonfinite"))
def normalize_into(X: Tensor, norm: Tensor, eps: float, out: Tensor, nonfinite: Tensor) -> None:
    """``out = X * p / (||X|| p + p eps)`` per matrix of ``X[B, m, n]`` with ``p`` the power
    of two that brings the fp64 ``norm`` into ``[0.5, 1)``, in ``out``'s dtype (rounded to
    nearest even), zero where that divisor is not finite; ``nonfinite[B]`` flags those
    matrices. ``norm``: fp64 ``[B]``. One Triton kernel on CUDA."""
    run_on_device(
        X.device,
        lambda: launch(X, norm, eps, out, nonfinite),
        lambda: normalize_into_reference(X, norm, eps, out, nonfinite),
    )


@normalize_into.register_fake
def _normalize_into_fake(X, norm, eps, out, nonfinite) -> None:
    return None
