"""AOL's two ``m x m`` passes as one Triton kernel each on CUDA.

With AOL (:func:`shardmuon.ops.newton_schulz.aol_row_scales_`) the first iteration scales
its Gram matrix, ``A <- D A D`` (an fp32 outer product of the row scales, then a
mixed-dtype multiply: two kernels), and folds ``D`` into its ``m x m`` factor,
``B <- (B + a I) D`` (a widening copy, the diagonal add, the column scaling and the copy
back: four kernels). :func:`aol_scale_gram_` and :func:`aol_fold_` do each in one pass,
with the same roundings per element (compiled without floating-point contraction; bf16
rounded to nearest even by hand): the same bits (tested under Triton's interpreter,
``tests/ops/test_fused_aol.py``).

``torch.library`` custom ops (``shardmuon::aol_scale_gram_``, ``shardmuon::aol_fold_``): one
call each in a dispatch trace, fakes for meta tensors, the kernels on CUDA and the torch
ops elsewhere.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from shardmuon.ops.fused_normalize import _triton, run_on_device

__all__ = [
    "aol_fold_",
    "aol_fold_reference",
    "aol_scale_gram_",
    "aol_scale_gram_reference",
    "fused_aol_supported",
]

_BLOCK = 1024


def fused_aol_supported(M: Tensor) -> bool:
    """Whether the kernels take ``M`` (a Gram-sized ``[B, m, m]``): contiguous bf16 or fp32."""
    return M.dim() == 3 and M.is_contiguous() and M.dtype in (torch.bfloat16, torch.float32)


@functools.cache
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def aol_kernel(
        M, D, a, m, numel,
        FOLD: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(1).to(tl.int64)
        k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = k < numel
        i = k // m
        j = k - i * m
        where = M + b * numel + k
        if BF16:
            raw_in = tl.load(where, mask=inside, other=0).to(tl.uint16, bitcast=True)
            x = (raw_in.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(where, mask=inside, other=0.0)
        d_j = tl.load(D + b * m + j, mask=inside, other=0.0)
        if FOLD:
            x = tl.where(i == j, x + a, x)  # (B + a I)
            y = x * d_j  # ... D
        else:
            d_i = tl.load(D + b * m + i, mask=inside, other=0.0)
            y = x * (d_i * d_j)  # D A D, the scales' product first
        if BF16:
            raw = y.to(tl.uint32, bitcast=True)
            rounded = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
            rounded = tl.where(y != y, 0x7FC0, rounded)
            tl.store(where, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)
        else:
            tl.store(where, y, mask=inside)

    return aol_kernel


def launch(M: Tensor, d: Tensor, a: float | None) -> None:
    """The kernel on a contiguous ``M[B, m, m]`` (bf16 or fp32) in place with the fp32 row
    scales ``d[B, m]``: ``D M D`` (``a`` None) or ``(M + a I) D``. Runs where the tensors
    live (CUDA; a CPU under ``TRITON_INTERPRET=1``)."""
    batch, m, _ = M.shape
    numel = m * m
    if batch == 0 or numel == 0:
        return
    target = M.view(torch.int16) if M.dtype == torch.bfloat16 else M
    grid = (math.ceil(numel / _BLOCK), batch)
    _kernel()[grid](
        target, d.contiguous(), 0.0 if a is None else float(a), m, numel,
        FOLD=a is not None, BF16=M.dtype == torch.bfloat16, BLOCK=_BLOCK,
        enable_fp_fusion=False,  # no FMA: each operation rounds as the torch op does
    )  # fmt: skip


def aol_scale_gram_reference(A: Tensor, d: Tensor) -> None:
    """:func:`aol_scale_gram_` in torch ops (``aol_row_scales_``'s accelerator branch)."""
    A.mul_(d.unsqueeze(-1) * d.unsqueeze(-2))


def aol_fold_reference(B: Tensor, d: Tensor, a: float) -> None:
    """:func:`aol_fold_` in torch ops (``_fold_row_scales_``'s)."""
    wide = B if B.dtype == d.dtype else B.to(d.dtype)
    wide.diagonal(dim1=-2, dim2=-1).add_(a)
    wide.mul_(d.unsqueeze(-2))
    if wide is not B:
        B.copy_(wide)


@torch.library.custom_op("shardmuon::aol_scale_gram_", mutates_args=("A",))
def aol_scale_gram_(A: Tensor, d: Tensor) -> None:
    """``A <- D A D`` in place: ``A[b, i, j] * fl(d[b, i] * d[b, j])`` in fp32, rounded once
    into ``A``'s dtype (contiguous bf16 or fp32 ``[B, m, m]``; ``d`` fp32 ``[B, m]``). One
    Triton kernel on CUDA."""
    run_on_device(A.device, lambda: launch(A, d, None), lambda: aol_scale_gram_reference(A, d))


@aol_scale_gram_.register_fake
def _aol_scale_gram_fake(A, d) -> None:
    return None


@torch.library.custom_op("shardmuon::aol_fold_", mutates_args=("B",))
def aol_fold_(B: Tensor, d: Tensor, a: float) -> None:
    """``B <- (B + a I) D`` in place: ``fl(B[b, i, j] + a [i = j]) * d[b, j]`` in fp32,
    rounded once into ``B``'s dtype (contiguous bf16 or fp32 ``[B, m, m]``; ``d`` fp32
    ``[B, m]``). One Triton kernel on CUDA."""
    run_on_device(B.device, lambda: launch(B, d, a), lambda: aol_fold_reference(B, d, a))


@aol_fold_.register_fake
def _aol_fold_fake(B, d, a) -> None:
    return None
