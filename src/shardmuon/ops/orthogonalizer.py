"""The Newton–Schulz engine a step runs: an entry of :data:`shardmuon.ops.engines.ENGINES`
(or ``"auto"``'s rule), the iteration dtype, Gram's restarts and the divergence guard, put
together once per optimizer setting — and its cost model (:class:`EngineCost`), which the
workspace estimate and the owner balancing read.

Every engine returns bf16 (the exchange sends bf16 results): an fp16 or fp32 iteration is
rounded to bf16 at the end, as the bf16 one is at every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from shardmuon.ops.engines import (
    AUTO_CANDIDATES,
    ENGINES,
    NS_CHOICES,
    NS_DTYPES,
    chain_itemsize,
    effective_restarts,
    engines_of,
)
from shardmuon.ops.newton_schulz import Coefficients, resolve_coefficients
from shardmuon.ops.newton_schulz_guard import Branch, GuardVerdict, guarded, guarded_on_device
from shardmuon.ops.normalize import NORMALIZE_CHUNK_ELEMENTS

__all__ = [
    "NS_CHOICES",
    "NS_DTYPES",
    "EngineCost",
    "NewtonSchulzSettings",
    "Orthogonalizer",
    "auto_choice",
    "guard_enabled",
]

# ``"auto"``'s rule: Gram where it saves enough FLOPs to pay for its guard and the device
# runs it at GEMM speed (CUDA), the folded iteration elsewhere. A function of the shape and
# the device type only, so every rank of a group decides alike (the digest carries "auto").
AUTO_GRAM_MIN_ASPECT = 2.5
BF16, FP32 = 2, 4


def auto_choice(shape: Sequence[int], device_type: str) -> str:
    """``"gram"`` or ``"folded"`` for one call on ``shape`` (``[..., m, n]``)."""
    m, n = sorted(shape[-2:])
    # meta stands for CUDA (the accelerator path counted without one)
    if device_type in ("cuda", "meta") and m > 0 and n / m >= AUTO_GRAM_MIN_ASPECT:
        return "gram"
    return "folded"


def guard_enabled(engine: str, guard: bool | None) -> bool:
    """Whether the divergence guard checks ``engine``'s calls: ``newton_schulz_guard`` when
    given, else the engine's default (on for Gram). The one place this is decided."""
    return ENGINES[engine].guard_default if guard is None else bool(guard)


@dataclass(frozen=True)
class EngineCost:
    """What one optimizer's Newton–Schulz calls cost, from its settings: bytes per call and
    FLOPs per matrix (the default: dion's folded bf16 iteration, unguarded)."""

    impl: str = "folded"
    dtype: torch.dtype = torch.bfloat16
    restarts: tuple[int, ...] | None = None
    guard: bool | None = None
    coefficients: Coefficients = field(default_factory=lambda: resolve_coefficients(None))
    device_type: str = "cpu"
    preconditioner: str | None = None

    def _candidates(self, rows: int, cols: int) -> tuple[str, ...]:
        if self.impl != "auto":
            return (self.impl,)
        if rows == cols:
            return ("folded",)  # the calibration and the rule never pick Gram for a square
        # The plan is cut before "auto" is measured (and a loaded table may rule): whatever
        # the timings pick, the bytes are those of the costliest candidate.
        return AUTO_CANDIDATES

    def call_bytes(self, count: int, rows: int, cols: int) -> int:
        """Peak bytes one call on a bf16 ``[count, rows, cols]`` input allocates (the input
        excluded, its bf16 result included)."""
        if count * rows * cols == 0:
            return 0
        return max(
            self._engine_bytes(name, count, rows, cols) for name in self._candidates(rows, cols)
        )

    def _engine_bytes(self, name: str, count: int, rows: int, cols: int) -> int:
        engine = ENGINES[name]
        m, n = sorted((rows, cols))
        total, small = count * m * n, count * m * m
        size = self.dtype.itemsize
        chain = chain_itemsize(engine, self.dtype, self.device_type)
        # The normalisation: the normalised X, one fp32 slice and the norms; the rare path
        # re-reduces one matrix at a time (its input copy and fp32 copy).
        division = size * total + FP32 * min(total, NORMALIZE_CHUNK_ELEMENTS) + 2 * FP32 * count
        # The rare path: one suspect matrix's fp32 scaled copy at a time, beside X.
        rare = size * total + FP32 * m * n + 2 * FP32 * count
        iteration = engine.iteration_bytes(count, m, n, size, chain)
        cast = (size * total + BF16 * total) if size != BF16 else 0
        if self.preconditioner == "aol":
            # The fp32 row sums and scales, and one fp32 m x m at a time (A widened on a CPU
            # or the outer product of the scales elsewhere; then B widened for the fold);
            # fp16 scales X itself instead of folding, through an fp32 copy on a CPU, and
            # holds its rows' squares and diagonal in fp32. The norms, the floor and the
            # non-finite flags (9 bytes a matrix) live through the iteration.
            iteration += FP32 * small + 2 * FP32 * count * m + (2 * FP32 + 1) * count
            if self.dtype == torch.float16:
                iteration += FP32 * total + 2 * FP32 * count * m
        peak = max(division, rare, iteration, cast)
        if guard_enabled(name, self.guard):
            # O in fp32 and A = O O^T, its cleaned copy, the Cholesky test's input and factor;
            # a recompute: one matrix's fp32 input and standard iteration.
            check = BF16 * total + FP32 * total + 4 * FP32 * small
            fp32_one = FP32 * m * n
            recompute = (
                BF16 * total + 3 * fp32_one + ENGINES["folded"].iteration_bytes(1, m, n, FP32, FP32)
            )
            peak = max(peak, check, recompute)
        return peak

    def matrix_flops(self, rows: int, cols: int) -> int:
        """FLOPs of one ``[rows, cols]`` matrix's iteration (the engine's own count)."""
        name = auto_choice((rows, cols), self.device_type) if self.impl == "auto" else self.impl
        restarts = effective_restarts(self.restarts, len(self.coefficients))
        m, n = sorted((rows, cols))
        return ENGINES[name].flops(m, n, self.coefficients, restarts)


DEFAULT_COST = EngineCost()


class Orthogonalizer:
    """``(X[B, m, n], coefficients, eps) -> bf16`` for one optimizer's settings.

    After each call, :meth:`take_report` hands the caller what the call saw: the ``[B]``
    device mask of matrices with a non-finite entry (their result is zero) and the guard's
    verdict (``None`` when unguarded).
    """

    def __init__(
        self,
        impl: str,
        dtype: torch.dtype = torch.bfloat16,
        restarts: Sequence[int] | None = None,
        guard: bool | None = None,
        preconditioner: str | None = None,
        choices: dict[tuple[int, int], str] | None = None,
    ) -> None:
        self.impl, self.dtype, self.restarts = impl, dtype, restarts
        self.preconditioner = preconditioner
        # "auto"'s measured engine per (short, long) shape class (runtime/calibration.py);
        # a class it has not measured follows :func:`auto_choice`'s rule.
        self.choices = dict(choices or {})
        self.guards = {e.name: guard_enabled(e.name, guard) for e in engines_of(impl)}
        self._nonfinite: list[Tensor] = []
        self._verdicts: list[GuardVerdict] = []

    def _engine_for(self, shape: Sequence[int], device_type: str) -> str:
        if self.impl != "auto":
            return self.impl
        short, long = sorted(shape[-2:])
        measured = self.choices.get((short, long))
        return measured or auto_choice(shape, device_type)

    def take_report(self) -> tuple[list[Tensor], list[GuardVerdict]]:
        """The non-finite masks and guard verdicts of the calls since the last take (cleared)."""
        report = (self._nonfinite, self._verdicts)
        self._nonfinite, self._verdicts = [], []
        return report

    def engine_key(self, X: Tensor) -> tuple:
        """What a call on ``X`` computes besides ``X``, coefficients and eps: the engine it
        takes and the settings it runs with (a captured call is reused for the same key)."""
        name = self._engine_for(X.shape, X.device.type)
        return (name, self.dtype, self.restarts, self.preconditioner, self.guards[name])

    def is_guarded(self, X: Tensor) -> bool:
        """Whether a call on ``X`` is checked by the divergence guard."""
        return self.guards[self._engine_for(X.shape, X.device.type)]

    def __call__(self, X: Tensor, coefficients, eps: float, branch: Branch | None = None) -> Tensor:
        """Newton–Schulz on ``X[B, m, n]``, bf16 ``[B, m, n]`` out. ``branch``: where a
        guarded call decides to recompute (``None``: on the host, once a call; a CUDA
        graph's conditional node: on the device, :func:`guarded_on_device`)."""
        # A call that raised left its report behind; this call's report is its own.
        self._nonfinite, self._verdicts = [], []
        name = self._engine_for(X.shape, X.device.type)
        engine = ENGINES[name]
        coeffs = resolve_coefficients(coefficients)
        guard = self.guards[name]
        # The pipeline owns every buffer it orthogonalizes: an engine that can normalise in
        # place does (the guard needs the input intact for a recompute).
        in_place = engine.in_place and self.dtype == torch.bfloat16 and not guard

        def run(G: Tensor) -> Tensor:
            result = engine.run(
                G,
                coeffs,
                eps,
                dtype=self.dtype,
                restarts=self.restarts,
                overwrite_input=in_place,
                preconditioner=self.preconditioner,
            )
            self._nonfinite.append(result.nonfinite)
            return result.X.to(torch.bfloat16)

        if not guard:
            return run(X)
        if branch is not None:
            out, verdict = guarded_on_device(
                X, run, coeffs, eps, branch, preconditioner=self.preconditioner
            )
        else:
            out, verdict = guarded(X, run, coeffs, eps, preconditioner=self.preconditioner)
        self._verdicts.append(verdict)
        return out


@dataclass(frozen=True)
class NewtonSchulzSettings:
    """One optimizer's Newton–Schulz settings, resolved (the restarts checked, the dtype a
    torch dtype, the coefficients a tuple): what its engine, its cost model and ``"auto"``'s
    calibration key are built from, in one place."""

    impl: str
    dtype: torch.dtype
    restarts: tuple[int, ...] | None
    guard: bool | None
    preconditioner: str | None
    coefficients: Coefficients

    def orthogonalizer(
        self, choices: dict[tuple[int, int], str] | None = None, impl: str | None = None
    ) -> Orthogonalizer:
        """The engine these settings run (``impl``: one candidate of ``"auto"`` instead,
        with the restarts only if it takes them)."""
        name = impl or self.impl
        takes_restarts = any(e.takes_restarts for e in engines_of(name))
        return Orthogonalizer(
            name,
            self.dtype,
            self.restarts if takes_restarts else None,
            guard=self.guard,
            preconditioner=self.preconditioner,
            choices=choices,
        )

    def cost(self, device_type: str) -> EngineCost:
        """The cost model the plan's workspace estimate and owner balancing read."""
        return EngineCost(
            impl=self.impl,
            dtype=self.dtype,
            restarts=self.restarts,
            guard=self.guard,
            coefficients=self.coefficients,
            device_type=device_type,
            preconditioner=self.preconditioner,
        )

    def calibration_key(self, device: torch.device) -> tuple:
        """What ``"auto"``'s measured choices depend on (everything but the impl)."""
        return (
            str(device),
            str(self.dtype),
            self.preconditioner,
            self.coefficients,
            self.restarts,
            self.guard,
        )
