"""A segment's momentum update and its bf16 direction as one Triton kernel on CUDA.

Without it the step updates every fp32 momentum with two ``_foreach_`` passes
(``M = fl(M * mu)``, then ``M = fl(M + G)``) and each batch then casts its momenta (or,
with Nesterov, ``fl(fl(M * mu) + G)``) to the bf16 directions: the momentum is read three
times and written twice. :func:`momentum_direction_into` does the same roundings per element
in one pass (``M`` and ``G`` read once, ``M`` and the direction written once; compiled
without floating-point contraction, bf16 rounded to nearest even by hand): the same bits
(tested under Triton's interpreter, ``tests/ops/test_fused_momentum.py``).

A ``torch.library`` custom op, ``shardmuon::momentum_direction_into``: one call in a
dispatch trace, a fake implementation for meta tensors (``bench step --kernels``), the
kernel on CUDA and the torch ops elsewhere.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from shardmuon.ops.fused_normalize import _triton, run_on_device

__all__ = ["momentum_direction_into", "momentum_direction_into_reference"]

_BLOCK = 2048
_GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def momentum_kernel(
        M, G, D, mu, n, numel, sg_b, sg_r, sg_c,
        GRAD_KIND: tl.constexpr, NESTEROV: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(1).to(tl.int64)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < numel
        row = i // n
        col = i - row * n
        where_g = G + b * sg_b + row * sg_r + col * sg_c
        if GRAD_KIND == 1:  # bf16 widened by its bits (exact)
            raw_g = tl.load(where_g, mask=inside, other=0).to(tl.uint16, bitcast=True)
            g = (raw_g.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            g = tl.load(where_g, mask=inside, other=0.0).to(tl.float32)
        where_m = M + b * numel + i
        m = tl.load(where_m, mask=inside, other=0.0)
        m = m * mu
        m = m + g
        tl.store(where_m, m, mask=inside)
        if NESTEROV:
            d = m * mu
            d = d + g
        else:
            d = m
        # bf16 rounded to nearest even by hand (the interpreter's own cast truncates); NaN
        # as the quiet NaN.
        raw = d.to(tl.uint32, bitcast=True)
        rounded = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
        rounded = tl.where(d != d, 0x7FC0, rounded)
        tl.store(D + b * numel + i, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=inside)

    return momentum_kernel


def launch(M: Tensor, G: Tensor, mu: float, nesterov: bool, D: Tensor) -> None:
    """The kernel: the contiguous fp32 momentum ``M[B, r, c]`` updated in place from ``G``
    of its shape (fp32, bf16 or fp16, any strides), the direction written into the
    contiguous bf16 ``D``. Runs where the tensors live (CUDA; a CPU under
    ``TRITON_INTERPRET=1``)."""
    batch, rows, cols = M.shape
    numel = rows * cols
    if batch == 0 or numel == 0:
        return
    grads = G.view(torch.int16) if G.dtype == torch.bfloat16 else G
    grid = (math.ceil(numel / _BLOCK), batch)
    _kernel()[grid](
        M, grads, D.view(torch.int16), float(mu), cols, numel, *G.stride(),
        GRAD_KIND=_GRAD_KINDS[G.dtype], NESTEROV=bool(nesterov), BLOCK=_BLOCK,
        enable_fp_fusion=False,  # no FMA: each operation rounds as the torch op does
    )  # fmt: skip


def momentum_direction_into_reference(
    M: Tensor, G: Tensor, mu: float, nesterov: bool, D: Tensor
) -> None:
    """:func:`momentum_direction_into` in torch ops (``momentum_update_``, ``direction`` and
    the cast the step makes)."""
    grad = G.to(M.dtype)
    M.mul_(mu).add_(grad)
    D.copy_(M.mul(mu).add_(grad) if nesterov else M)


@torch.library.custom_op("shardmuon::momentum_direction_into", mutates_args=("M", "D"))
def momentum_direction_into(M: Tensor, G: Tensor, mu: float, nesterov: bool, D: Tensor) -> None:
    """``M = fl(fl(M * mu) + G)`` in place and ``D = bf16(M)`` (Nesterov:
    ``bf16(fl(fl(M * mu) + G))``) per element of a contiguous fp32 ``M[B, r, c]``, ``G`` of
    its shape (fp32, bf16 or fp16), ``D`` a contiguous bf16 ``[B, r, c]``. One Triton kernel
    on CUDA."""
    run_on_device(
        M.device,
        lambda: launch(M, G, mu, nesterov, D),
        lambda: momentum_direction_into_reference(M, G, mu, nesterov, D),
    )


@momentum_direction_into.register_fake
def _momentum_direction_into_fake(M, G, mu, nesterov, D) -> None:
    return None
