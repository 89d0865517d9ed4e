"""``shardmuon bench ns``'s measurements: one (shape, preset) row of the folded and the
unfolded iteration against fp64 and a plain GEMM, one (shape, preset, dtype) row of the
standard and the Gram iteration per input kind, and the exact FLOP counts they use."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from shardmuon.bench.common import relative_difference
from shardmuon.bench.matrices import INPUT_KINDS, make_inputs, relative_error
from shardmuon.bench.report import repeat_times
from shardmuon.harness.machine import DTYPE_NAMES
from shardmuon.ops.newton_schulz import (
    NS_PRESETS,
    newton_schulz,
    newton_schulz_reference,
    newton_schulz_unfolded,
)
from shardmuon.ops.newton_schulz_gram import (
    default_restarts,
    gram_flops,
    newton_schulz_gram,
    standard_flops,
)
from shardmuon.ops.newton_schulz_guard import guarded

__all__ = [
    "input_and_reference",
    "kind_inputs",
    "measure_engine",
    "measure_shape",
    "newton_schulz_flops",
]


# Timed repeats of one call further apart than this (slowest over fastest) were disturbed:
# another job had the cores or the GPU for part of them, so the median may not be this
# machine's speed. Undisturbed repeats of these calls agree within a few tens of percent.
UNSTABLE_RATIO = 2.0


def _median_time(
    name: str,
    fn: Callable[[], Any],
    device: torch.device,
    repeats: int,
    unstable: dict[str, list[float]],
) -> float:
    """Median seconds of ``fn()`` over ``repeats`` timed calls; when they disagree by more
    than :data:`UNSTABLE_RATIO`, ``unstable[name]`` gets their ``[fastest, slowest]`` in ms."""
    times = repeat_times(fn, device, repeats)
    fastest, slowest = min(times), max(times)
    if slowest > UNSTABLE_RATIO * fastest:
        unstable[name] = [fastest * 1e3, slowest * 1e3]
    return statistics.median(times)


def _dims(shape: tuple[int, ...]) -> tuple[int, int, int]:
    batch = shape[0] if len(shape) == 3 else 1
    m, n = sorted(shape[-2:])
    return batch, m, n


def _best_gemm_seconds(
    G: torch.Tensor, device: torch.device, repeats: int, unstable: dict[str, list[float]]
) -> float:
    """The fastest plain ``X X^T`` on ``G``'s shape this machine does: bf16 and fp32, the
    transpose contiguous or a view, each a median over ``repeats``. One layout or dtype can
    take a slow path (bf16 on a CPU without AVX-512 ran 30x slower than fp32), which would
    make a call that avoids it look faster than the GEMM it is measured against."""
    best = float("inf")
    for dtype in (torch.bfloat16, torch.float32):
        X = G.to(dtype).reshape(-1, G.size(-2), G.size(-1))
        if X.size(-2) > X.size(-1):
            X = X.mT
        X = X.contiguous()
        Xt = X.mT.contiguous()
        for layout, other in (("contiguous", Xt), ("view", X.mT)):
            name = f"gemm-{str(dtype).removeprefix('torch.')}-{layout}"

            def gemm(a: torch.Tensor = X, b: torch.Tensor = other) -> torch.Tensor:
                return torch.bmm(a, b)

            best = min(best, _median_time(name, gemm, device, repeats, unstable))
    return best


def newton_schulz_flops(shape: tuple[int, ...], iterations: int) -> float:
    """FLOPs of one call: per matrix ``[m, n]`` with ``m <= n``, ``4 m^2 n + 2 m^3`` per iteration.

    (``X X^T``: ``2 m^2 n``; ``A A``: ``2 m^3``; ``B X``: ``2 m^2 n``; the adds are ignored.)
    """
    batch, m, n = _dims(shape)
    return float(batch) * standard_flops(m, n, iterations)


def gemm_flops(shape: tuple[int, ...]) -> float:
    """FLOPs of the Gram GEMM ``X X^T`` (``2 m^2 n`` per matrix), the reference GEMM here."""
    batch, m, n = _dims(shape)
    return 2.0 * batch * m * m * n


def input_and_reference(
    shape: tuple[int, ...], preset: str, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded fp32 Gaussian input of ``shape`` and its fp64 Newton-Schulz result."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    G = torch.randn(shape, generator=gen, dtype=torch.float32).to(device)
    return G, newton_schulz_reference(G, preset)


def measure_shape(
    shape: tuple[int, ...],
    preset: str,
    device: torch.device,
    repeats: int,
    seed: int,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """All figures of one (shape, preset) row; see the module docstring. ``reference``:
    :func:`input_and_reference`'s pair, when the caller has it already."""
    G, ref = reference or input_and_reference(shape, preset, device, seed)
    iterations = len(NS_PRESETS[preset])
    unstable: dict[str, list[float]] = {}
    folded_s = _median_time("folded", lambda: newton_schulz(G, preset), device, repeats, unstable)
    unfolded_s = _median_time(
        "unfolded", lambda: newton_schulz_unfolded(G, preset), device, repeats, unstable
    )
    gemm_s = _best_gemm_seconds(G, device, repeats, unstable)
    flops = newton_schulz_flops(shape, iterations)
    gemm_rate = gemm_flops(shape) / gemm_s
    folded_rate = flops / folded_s
    return {
        "shape": list(shape),
        "preset": preset,
        "iterations": iterations,
        "folded_ms": folded_s * 1e3,
        "unfolded_ms": unfolded_s * 1e3,
        "speedup": unfolded_s / folded_s,
        "folded_tflops": folded_rate / 1e12,
        "unfolded_tflops": flops / unfolded_s / 1e12,
        "gemm_tflops": gemm_rate / 1e12,
        "fraction_of_gemm": folded_rate / gemm_rate,
        "rel_error_folded": relative_difference(newton_schulz(G, preset), ref),
        "rel_error_unfolded": relative_difference(newton_schulz_unfolded(G, preset), ref),
        "unstable": bool(unstable),
        "unstable_calls_ms": unstable,
    }


def kind_inputs(
    shape: tuple[int, ...], preset: str, device: torch.device, seed: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per input kind (:data:`INPUT_KINDS`): an fp32 batch of ``shape`` on ``device`` and
    its fp64 Newton-Schulz result with ``preset``."""
    out = {}
    for kind in INPUT_KINDS:
        G = make_inputs(kind, shape, seed, device)
        out[kind] = (G.float(), newton_schulz_reference(G, preset))
    return out


def measure_engine(
    shape: tuple[int, ...],
    preset: str,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    seed: int,
    kinds: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """The standard and the Gram iteration (its default restarts) in ``dtype`` on one
    (shape, preset): time on a Gaussian input, exact FLOPs, and per input kind the error of
    both against fp64 and the guard's verdict on Gram. ``kinds``: :func:`kind_inputs`'s,
    when the caller has them already."""
    kinds = kinds or kind_inputs(shape, preset, device, seed)
    G = kinds["gaussian"][0]
    iterations = len(NS_PRESETS[preset])
    batch, m, n = _dims(shape)
    restarts = default_restarts(iterations)
    unstable: dict[str, list[float]] = {}
    standard_s = _median_time(
        "standard", lambda: newton_schulz(G, preset, dtype=dtype), device, repeats, unstable
    )
    gram_s = _median_time(
        "gram", lambda: newton_schulz_gram(G, preset, dtype=dtype), device, repeats, unstable
    )
    errors = []
    for kind, (X, ref) in kinds.items():
        gram_out = newton_schulz_gram(X, preset, dtype=dtype)

        def computed(_: torch.Tensor, out: torch.Tensor = gram_out) -> torch.Tensor:
            return out

        _, verdict = guarded(X, computed, preset, 1e-8)
        errors.append(
            {
                "kind": kind,
                "standard": relative_error(newton_schulz(X, preset, dtype=dtype), ref),
                "gram": relative_error(gram_out, ref),
                "guard_checked": verdict.checked,
                "guard_fallbacks": verdict.fallbacks,
                "guard_worst_ratio": verdict.worst_ratio,
            }
        )
    return {
        "shape": list(shape),
        "preset": preset,
        "dtype": DTYPE_NAMES[dtype],
        "standard_ms": standard_s * 1e3,
        "gram_ms": gram_s * 1e3,
        "gram_restarts": list(restarts),
        "gram_time_ratio": gram_s / standard_s,
        "standard_flops": standard_flops(m, n, iterations) * batch,
        "gram_flops": gram_flops(m, n, iterations, restarts) * batch,
        "gram_flops_ratio": gram_flops(m, n, iterations, restarts)
        / standard_flops(m, n, iterations),
        "errors": errors,
        "unstable": bool(unstable),
        "unstable_calls_ms": unstable,
    }
