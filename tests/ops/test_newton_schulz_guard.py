"""The guard's certificate on results of known spectrum: every matrix whose largest singular
value lies above the slack is recomputed, and none below it, on random sizes, spectra and
ratios close to the limit on either side (the Cholesky test against an SVD's answer)."""

from __future__ import annotations

import pytest
import torch

from shardmuon.ops.newton_schulz import NS_PRESETS
from shardmuon.ops.newton_schulz_guard import GUARD_SLACK, band_high, guarded


def _with_top_singular_value(m: int, n: int, top: float, g: torch.Generator) -> torch.Tensor:
    """A random ``[m, n]`` fp32 matrix with singular values in ``[0.6, top]``, ``top`` held
    by one or a cluster of up to four (clusters defeat power estimates)."""
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    s = 0.6 + (top - 0.6) * torch.rand(m, generator=g, dtype=torch.float64) * 0.95
    cluster = int(torch.randint(1, 5, (), generator=g))
    s[:cluster] = top
    return (U * s) @ V.mT


@pytest.mark.parametrize("seed", range(6))
def test_the_guard_recomputes_exactly_the_results_above_the_slack(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    band = band_high(NS_PRESETS["dion"])
    m = int(torch.randint(2, 200, (), generator=g))
    n = m + int(torch.randint(0, 300, (), generator=g))
    # ratios to the slack on both sides, down to 0.2% from it
    ratios = [0.5, 0.9, 0.99, 0.998, 1.002, 1.01, 1.1, 3.0]
    results = torch.stack(
        [_with_top_singular_value(m, n, r * GUARD_SLACK * band, g) for r in ratios]
    ).float()
    exact = torch.linalg.svdvals(results.double())[:, 0] / band
    expected = int((exact > GUARD_SLACK).sum())
    assert expected == sum(r > 1 for r in ratios)
    inputs = torch.randn(results.shape, generator=g)
    out, verdict = guarded(inputs, lambda X: results.clone(), "dion", 1e-8)
    assert verdict.fallbacks == expected
    kept = torch.tensor([r <= 1 for r in ratios])
    assert torch.equal(out[kept], results[kept])
    # the verdict's worst ratio is exact for the recomputed ones
    assert verdict.worst_ratio == pytest.approx(float(exact.max()), rel=1e-4)


def _fast_gemm_forced(monkeypatch, failure: BaseException | None):
    """The guard's fp32-output GEMM path forced on CPU tensors, its bmm failing with
    ``failure`` when asked for ``out_dtype`` (None: the path's result is the fp32 GEMM's)."""
    from shardmuon.ops import newton_schulz_guard as guard

    real_bmm = torch.bmm

    def bmm(a, b, *args, out_dtype=None, **kwargs):
        if out_dtype is None:
            return real_bmm(a, b, *args, **kwargs)
        if failure is not None:
            raise failure
        return real_bmm(a.float(), b.float())

    monkeypatch.setattr(guard, "_NO_FP32_OUTPUT", set())
    monkeypatch.setattr(
        guard,
        "_fp32_output_gemm_allowed",
        lambda X: (X.device.type, X.dtype) not in guard._NO_FP32_OUTPUT,
    )
    monkeypatch.setattr(torch, "bmm", bmm)
    return guard


def test_a_refused_fp32_output_gemm_falls_back_once_per_device_and_dtype(monkeypatch) -> None:
    guard = _fast_gemm_forced(monkeypatch, RuntimeError("no kernel for out_dtype"))
    result = torch.randn(3, 8, 20, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = guard._gram_fp32(result)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.bmm(result.float(), result.float().mT))
    refused = guard._NO_FP32_OUTPUT
    assert refused == {("cpu", torch.bfloat16)}  # fp16 not condemned with it


def test_an_out_of_memory_error_in_the_guard_is_raised_not_cached(monkeypatch) -> None:
    guard = _fast_gemm_forced(monkeypatch, torch.OutOfMemoryError("out of memory"))
    result = torch.randn(2, 8, 20).bfloat16()
    with pytest.raises(torch.OutOfMemoryError):
        guard._gram_fp32(result)
    refused = guard._NO_FP32_OUTPUT
    assert refused == set()  # the fast path stays on after a recovered OOM
