"""A parameter's AdamW step as one Triton kernel on CUDA.

:func:`shardmuon.ops.adamw.adamw_update_` runs dion's AdamW as twelve ``_foreach_`` passes
(two lerps, a square, a square root, a division, two adds/multiplies, a quotient, two
state copies, the decay and the subtraction) with 16 bytes of fp32 temporaries per
element. :func:`adamw_into` does the same operations per element in one pass: the grad, the
two moments and the parameter read once, the moments and the parameter written once, no
temporaries. Each operation rounds as the torch op does (compiled without floating-point
contraction; the square root and the divisions correctly rounded; bf16 rounded to nearest
even by hand). Two roundings are the build's choice, not torch's API: ``lerp`` is one fused multiply-add on
the CPU (``fma(w, end - start, start)`` for ``|w| < 0.5``, else ``fma(w - 1, end - start,
end)``), and the CPU's ``_foreach_mul_`` of a bf16 list rounds its scalar to bf16 first.
Before its first use on a CUDA device the kernel checks its forms (:class:`KernelForm`)
against torch's ``_foreach_`` ops on that device (:func:`fused_adamw_available`) and keeps
the one that reproduces them bit for bit; where none does, the ``_foreach_`` path runs.

A ``torch.library`` custom op, ``shardmuon::adamw_into``: one call in a dispatch trace, a
fake implementation for meta tensors (``bench step --kernels``), the kernel on CUDA and the
torch ops elsewhere.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from shardmuon.ops.adamw import AdamWScalars, foreach_adamw_
from shardmuon.ops.fused_momentum import _GRAD_KINDS
from shardmuon.ops.fused_normalize import _triton, kernels_enabled, run_on_device

__all__ = ["adamw_into", "adamw_into_reference", "fused_adamw_available", "takes_parameter"]

_BLOCK = 2048


@functools.cache
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def adamw_kernel(
        X, G, M, V, numel, w1, w2, bias2_sqrt, eps, step_size, decay,
        GRAD_KIND: tl.constexpr, PARAM_BF16: tl.constexpr, FMA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = i < numel
        if GRAD_KIND == 1:  # bf16 widened by its bits (exact)
            raw_g = tl.load(G + i, mask=inside, other=0).to(tl.uint16, bitcast=True)
            g = (raw_g.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            g = tl.load(G + i, mask=inside, other=0.0).to(tl.float32)
        m = tl.load(M + i, mask=inside, other=0.0)
        v = tl.load(V + i, mask=inside, other=0.0)
        square = g * g
        # torch's lerp: the weight's small branch below 0.5, the large one above.
        if FMA:
            m = tl.fma(
                tl.where(tl.abs(w1) < 0.5, w1, w1 - 1.0), g - m, tl.where(tl.abs(w1) < 0.5, m, g)
            )
            v = tl.fma(
                tl.where(tl.abs(w2) < 0.5, w2, w2 - 1.0),
                square - v,
                tl.where(tl.abs(w2) < 0.5, v, square),
            )
        else:
            m = tl.where(tl.abs(w1) < 0.5, m + w1 * (g - m), g - (g - m) * (1.0 - w1))
            v = tl.where(
                tl.abs(w2) < 0.5, v + w2 * (square - v), square - (square - v) * (1.0 - w2)
            )
        denom = tl.math.div_rn(tl.math.sqrt_rn(v), bias2_sqrt) + eps
        quotient = tl.math.div_rn(m, denom) * step_size
        tl.store(M + i, m, mask=inside)
        tl.store(V + i, v, mask=inside)
        if PARAM_BF16:
            raw_x = tl.load(X + i, mask=inside, other=0).to(tl.uint16, bitcast=True)
            x = (raw_x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            # bf16 rounded to nearest even by hand (the interpreter's own cast truncates);
            # NaN as the quiet NaN.
            x = x * decay
            raw = x.to(tl.uint32, bitcast=True)
            raw = tl.where(x != x, 0x7FC0, (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16)
            x = (raw << 16).to(tl.float32, bitcast=True) - quotient
            raw = x.to(tl.uint32, bitcast=True)
            raw = tl.where(x != x, 0x7FC0, (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16)
            bits = raw.to(tl.uint16).to(tl.int16, bitcast=True)
            tl.store(X + i, bits, mask=inside)
        else:
            x = tl.load(X + i, mask=inside, other=0.0) * decay
            tl.store(X + i, x - quotient, mask=inside)

    return adamw_kernel


def takes_parameter(X: Tensor) -> bool:
    """Whether the kernel can take a parameter like ``X`` (fp32 or bf16, contiguous; its
    moments are laid out like it): the others run the ``_foreach_`` ops, with their
    temporaries."""
    return X.dtype in (torch.float32, torch.bfloat16) and X.is_contiguous()


def supported(X: Tensor, G: Tensor, M: Tensor, V: Tensor) -> bool:
    """Whether the kernel takes these tensors: fp32 or bf16 ``X``, fp32/bf16/fp16 ``G``,
    fp32 moments, all of one shape and contiguous."""
    return (
        X.dtype in (torch.float32, torch.bfloat16)
        and G.dtype in _GRAD_KINDS
        and M.dtype == V.dtype == torch.float32
        and X.shape == G.shape == M.shape == V.shape
        and all(t.is_contiguous() for t in (X, G, M, V))
    )


@dataclass(frozen=True)
class KernelForm:
    """How the device's torch ops round where torch leaves it to the build: ``lerp`` as one
    fused multiply-add (``fma``), and a bf16 parameter's decay by a scalar first rounded to
    bf16 (``bf16_decay``: the CPU's ``_foreach_mul_`` does that)."""

    fma: bool = True
    bf16_decay: bool = False


# The forms tried, in order, before the first use on a CUDA device.
_FORMS = [KernelForm(fma, bf16) for fma in (True, False) for bf16 in (False, True)]


def launch(
    X: Tensor, G: Tensor, M: Tensor, V: Tensor, s: AdamWScalars, form: KernelForm = KernelForm()
) -> None:
    """The kernel on tensors :func:`supported` takes; runs where they live (CUDA; a CPU
    under ``TRITON_INTERPRET=1``), rounding as ``form`` says."""
    numel = X.numel()
    if numel == 0:
        return
    decay = s.decay
    if form.bf16_decay and X.dtype == torch.bfloat16:
        decay = float(torch.tensor(decay).to(torch.bfloat16))
    params = X.view(torch.int16) if X.dtype == torch.bfloat16 else X
    grads = G.view(torch.int16) if G.dtype == torch.bfloat16 else G
    _kernel()[(math.ceil(numel / _BLOCK),)](
        params, grads, M, V, numel,
        float(s.one_minus_beta1), float(s.one_minus_beta2), float(s.bias2_sqrt),
        float(s.epsilon), float(s.step_size), float(decay),
        GRAD_KIND=_GRAD_KINDS[G.dtype], PARAM_BF16=X.dtype == torch.bfloat16, FMA=form.fma,
        BLOCK=_BLOCK, enable_fp_fusion=False,
    )  # fmt: skip


def adamw_into_reference(X: Tensor, G: Tensor, M: Tensor, V: Tensor, s: AdamWScalars) -> None:
    """:func:`adamw_into` in torch ops: :func:`shardmuon.ops.adamw.foreach_adamw_` on the
    one parameter (the ops and bits of the ``_foreach_`` path it replaces)."""
    foreach_adamw_([X], [G], [M], [V], s)


# The form each CUDA device's torch ops were found to use, or None where none reproduced
# them (the device keeps the _foreach_ path).
_FORM_OF: dict[torch.device, KernelForm | None] = {}


def _probe_inputs(device: torch.device, param_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(20261205)
    n = 3 * _BLOCK + 17  # several programs and a ragged tail
    X = (torch.randn(n, generator=gen) * 0.3).to(param_dtype)
    G = torch.randn(n, generator=gen) * 3.0
    M = torch.randn(n, generator=gen) * 0.5
    V = torch.rand(n, generator=gen) * 2.0
    # Edge values (no NaN: its payload is no value): zeros, subnormals, a square that
    # overflows, a tiny second moment.
    X[0], G[1], V[2], G[3], M[4], V[5] = 0.0, 1e-40, 0.0, 3e38, 1e-42, 1e-44
    return [t.to(device) for t in (X, G, M, V)]


def _probe_scalars() -> list[AdamWScalars]:
    # Both lerp branches (weights below and above 0.5), a large step and a decay.
    return [
        AdamWScalars(0.1, 0.001, 0.031622775, 1e-8, 0.0123, 0.999),
        AdamWScalars(0.6, 0.75, 0.8660254, 1e-6, 0.5, 0.97),
    ]


def _matches(device: torch.device, form: KernelForm) -> bool:
    for param_dtype in (torch.float32, torch.bfloat16):
        for s in _probe_scalars():
            X, G, M, V = _probe_inputs(device, param_dtype)
            want = [t.clone() for t in (X, G, M, V)]
            adamw_into_reference(want[0], want[1], want[2], want[3], s)
            launch(X, G, M, V, s, form)
            for got, ref in zip((X, M, V), (want[0], want[2], want[3])):
                if not torch.equal(got.view(torch.uint8), ref.view(torch.uint8)):
                    return False
    return True


def _form(device: torch.device) -> KernelForm | None:
    """The form that reproduces the torch ops' bits on this CUDA device (checked once, on a
    few thousand random elements per dtype and lerp branch: a host sync at the first step)."""
    if device not in _FORM_OF:
        found = None
        try:
            with torch.cuda.device(device):
                found = next((form for form in _FORMS if _matches(device, form)), None)
        except Exception as err:  # a kernel that does not compile: the torch ops
            warnings.warn(
                f"shardmuon's fused AdamW kernel failed on {device} ({err!r}); the "
                "_foreach_ ops run instead (same results, more passes)",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            if found is None:
                warnings.warn(
                    f"shardmuon's fused AdamW kernel does not reproduce torch's AdamW ops "
                    f"bit for bit on {device}; the _foreach_ ops run instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _FORM_OF[device] = found
    return _FORM_OF[device]


def fused_adamw_available(device: torch.device) -> bool:
    """Whether AdamW runs :func:`adamw_into` on ``device``: CUDA with Triton, where the kernel
    reproduces the torch ops (checked once per device), and ``meta`` where Triton imports
    (a launch count on meta tensors counts what CUDA would launch)."""
    if device.type == "meta":
        return kernels_enabled()
    if device.type != "cuda" or not kernels_enabled():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _form(torch.device("cuda", index)) is not None


def _kernel_or_reference(X: Tensor, G: Tensor, M: Tensor, V: Tensor, s: AdamWScalars) -> None:
    form = _form(X.device)
    if form is None:
        adamw_into_reference(X, G, M, V, s)
        return
    run_on_device(
        X.device,
        lambda: launch(X, G, M, V, s, form),
        lambda: adamw_into_reference(X, G, M, V, s),
    )


@torch.library.custom_op("shardmuon::adamw_into", mutates_args=("X", "M", "V"))
def adamw_into(
    X: Tensor,
    G: Tensor,
    M: Tensor,
    V: Tensor,
    one_minus_beta1: float,
    one_minus_beta2: float,
    bias2_sqrt: float,
    epsilon: float,
    step_size: float,
    decay: float,
) -> None:
    """One parameter's AdamW step in place, per element (``X`` fp32 or bf16, ``G`` fp32,
    bf16 or fp16, ``M``/``V`` fp32, one shape, contiguous)::

        M = lerp(M, G, 1 - beta1);  V = lerp(V, G*G, 1 - beta2)
        X = X * decay - (M / (sqrt(V) / bias2_sqrt + epsilon)) * step_size

    with dion's roundings (:func:`adamw_into_reference`). One Triton kernel on CUDA."""
    s = AdamWScalars(one_minus_beta1, one_minus_beta2, bias2_sqrt, epsilon, step_size, decay)
    if X.device.type == "cuda" and supported(X, G, M, V):
        _kernel_or_reference(X, G, M, V, s)
    else:
        adamw_into_reference(X, G, M, V, s)


@adamw_into.register_fake
def _adamw_into_fake(X, G, M, V, *scalars) -> None:
    return None
