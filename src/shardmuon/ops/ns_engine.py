"""The Newton–Schulz engine a step runs: the implementation by name, the iteration dtype,
Gram's restarts and the divergence guard, put together once per optimizer setting.

Every implementation returns bf16 (the exchange sends bf16 results): an fp16 or fp32
iteration is rounded to bf16 at the end, as the bf16 one is at every step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from shardmuon.ops.gram_newton_schulz import newton_schulz_gram
from shardmuon.ops.newton_schulz import (
    newton_schulz,
    newton_schulz_compiled,
    newton_schulz_per_matrix,
    newton_schulz_unfolded,
)
from shardmuon.ops.ns_guard import GuardVerdict, guarded

__all__ = [
    "AUTO_GRAM_MIN_ASPECT",
    "NS_CHOICES",
    "NS_DTYPES",
    "NS_IMPLEMENTATIONS",
    "Orthogonalizer",
    "auto_choice",
    "resolve_ns_dtype",
]

# The implementations ``Muon(newton_schulz_impl=...)`` chooses from, by name.
NS_IMPLEMENTATIONS: dict[str, Callable[..., Tensor]] = {
    "folded": newton_schulz,
    "unfolded": newton_schulz_unfolded,
    "compiled": newton_schulz_compiled,
    "per-matrix": newton_schulz_per_matrix,
    "gram": newton_schulz_gram,
}
# Every ``newton_schulz_impl`` accepted: the implementations and the rule that picks one.
NS_CHOICES = (*NS_IMPLEMENTATIONS, "auto")
# The iteration dtypes, by name; bf16 is the default (dion's).
NS_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Implementations that take an iteration dtype (the others are bf16 recipes).
_WITH_DTYPE = ("folded", "gram")
# ``"auto"``'s rule: Gram where it saves enough FLOPs to pay for its guard and the device
# runs it at GEMM speed (CUDA), the folded iteration elsewhere. A function of the shape and
# the device type only, so every rank of a group decides alike (the digest carries "auto").
AUTO_GRAM_MIN_ASPECT = 2.5


def auto_choice(shape: Sequence[int], device_type: str) -> str:
    """``"gram"`` or ``"folded"`` for one call on ``shape`` (``[..., m, n]``)."""
    m, n = sorted(shape[-2:])
    if device_type == "cuda" and m > 0 and n / m >= AUTO_GRAM_MIN_ASPECT:
        return "gram"
    return "folded"


def resolve_ns_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype or its name (``"bfloat16"``, ``"float16"``, ``"float32"``); ValueError else."""
    if isinstance(dtype, str) and dtype in NS_DTYPES:
        return NS_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in NS_DTYPES.values():
        return dtype
    raise ValueError(
        f"unknown newton_schulz_dtype {dtype!r}; accepted: torch.bfloat16, torch.float16, "
        "torch.float32 (or their names)"
    )


class Orthogonalizer:
    """``(X[B, m, n], coefficients, eps) -> bf16`` for one optimizer's settings, and the
    guard's verdicts of the calls it made (``last_verdicts``, read and cleared by a step)."""

    def __init__(
        self,
        impl: str,
        dtype: torch.dtype = torch.bfloat16,
        restarts: Sequence[int] | None = None,
        guard: bool = False,
    ) -> None:
        self.impl, self.dtype, self.guard = impl, dtype, guard
        if impl == "auto":
            self._choices = {
                name: Orthogonalizer(name, dtype, restarts, guard=guard or name == "gram")
                for name in ("gram", "folded")
            }
            self.verdicts = []
            return
        fn = NS_IMPLEMENTATIONS[impl]
        kwargs: dict = {}
        if impl in _WITH_DTYPE and dtype != torch.bfloat16:
            kwargs["dtype"] = dtype
        if impl == "gram":
            kwargs["restarts"] = restarts
        self._fn = functools.partial(fn, **kwargs) if kwargs else fn
        # Only the real folded iteration (a benchmark may have put another in the table).
        self.in_place = fn is newton_schulz and dtype == torch.bfloat16 and not guard
        self.verdicts: list[GuardVerdict] = []

    def __call__(self, X: Tensor, coefficients, eps: float) -> Tensor:
        if self.impl == "auto":
            chosen = self._choices[auto_choice(X.shape, X.device.type)]
            out = chosen(X, coefficients, eps)
            self.verdicts.extend(chosen.verdicts)
            chosen.verdicts.clear()
            return out

        def run(G: Tensor) -> Tensor:
            if self.in_place:
                # The pipeline owns every buffer it orthogonalizes: normalise in place.
                return newton_schulz(G, coefficients, eps, overwrite_input=True)
            return self._fn(G, coefficients, eps).to(torch.bfloat16)

        if not self.guard:
            return run(X)
        out, verdict = guarded(X, run, coefficients, eps)
        self.verdicts.append(verdict)
        return out
