"""A parameter's decay and Muon update as one Triton kernel on CUDA.

:func:`shardmuon.ops.update.weight_update_` forms ``lr*scale*R`` in fp32 (a cast and a
multiply), decays the parameter (a multiply) and adds (an add): four kernels per parameter,
about 450 of a step's 1,900 on a 4-layer MoE. :func:`update_into` does the three roundings
of the same three operations per element in one launch (``step = fl(fl(R) * c)``,
``P = fl(P * d)``, ``P = fl(P + step)``, compiled without floating-point contraction so that
no FMA merges two of them): the same bits (tested under Triton's interpreter,
``tests/ops/test_fused_update.py``).

A ``torch.library`` custom op, ``shardmuon::update_into``: one call in a dispatch trace, a
fake implementation for meta tensors (``bench step --kernels``), the kernel on CUDA and the
torch ops elsewhere.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from shardmuon.ops.fused_normalize import _triton, kernels_enabled, run_on_device

__all__ = ["fused_update_available", "update_into", "update_into_reference"]

_BLOCK = 2048


def fused_update_available(device: torch.device) -> bool:
    """Whether the update runs :func:`update_into` on ``device`` (CUDA, or ``meta`` for a
    launch count, where Triton imports)."""
    return device.type in ("cuda", "meta") and kernels_enabled()


@functools.cache
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def update_kernel(
        P, R, step_factor, decay, n, numel,
        sp_b, sp_r, sp_c, sr_b, sr_r, sr_c,
        RESULT_BF16: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(1).to(tl.int64)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < numel
        row = i // n
        col = i - row * n
        where_p = P + b * sp_b + row * sp_r + col * sp_c
        where_r = R + b * sr_b + row * sr_r + col * sr_c
        if RESULT_BF16:
            raw = tl.load(where_r, mask=inside, other=0).to(tl.uint16, bitcast=True)
            o = (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            o = tl.load(where_r, mask=inside, other=0.0).to(tl.float32)
        step = o * step_factor
        p = tl.load(where_p, mask=inside, other=0.0)
        p = p * decay
        tl.store(where_p, p + step, mask=inside)

    return update_kernel


def launch(P: Tensor, R: Tensor, step_factor: float, decay: float) -> None:
    """The kernel: fp32 ``P[B, r, c]`` (any strides) updated in place from ``R`` of its
    shape (fp32, bf16 or fp16, any strides). Runs where the tensors live (CUDA; a CPU under
    ``TRITON_INTERPRET=1``)."""
    batch, rows, cols = P.shape
    numel = rows * cols
    if batch == 0 or numel == 0:
        return
    source = R.view(torch.int16) if R.dtype == torch.bfloat16 else R
    grid = (math.ceil(numel / _BLOCK), batch)
    _kernel()[grid](
        P, source, float(step_factor), float(decay), cols, numel, *P.stride(), *R.stride(),
        RESULT_BF16=R.dtype == torch.bfloat16, BLOCK=_BLOCK, enable_fp_fusion=False,
    )  # fmt: skip


def update_into_reference(P: Tensor, R: Tensor, step_factor: float, decay: float) -> None:
    """:func:`update_into` in torch ops: ``weight_update_``'s for one range of rows."""
    step = R * step_factor if R.dtype == torch.float32 else R.to(torch.float32).mul_(step_factor)
    if decay != 1.0:
        P.mul_(decay)
    P.add_(step)


@torch.library.custom_op("shardmuon::update_into", mutates_args=("P",))
def update_into(P: Tensor, R: Tensor, step_factor: float, decay: float) -> None:
    """``P = fl(fl(P * decay) + fl(fl32(R) * step_factor))`` per element, in place: an fp32
    ``[B, r, c]`` parameter's decay (``decay = 1 - lr*wd``) and Muon update
    (``step_factor = -lr*scale``) from its Newton–Schulz result ``R``. One Triton kernel on
    CUDA."""
    run_on_device(
        P.device,
        lambda: launch(P, R, step_factor, decay),
        lambda: update_into_reference(P, R, step_factor, decay),
    )


@update_into.register_fake
def _update_into_fake(P, R, step_factor, decay) -> None:
    return None
