"""The guard's certificate on results of known spectrum: every matrix whose largest singular
value lies above the slack is recomputed, and none below it, on random sizes, spectra and
ratios close to the limit on either side (the Cholesky test against an SVD's answer). And
its cost in host synchronisations: one per call when nothing diverged, counted on the CPU
by the operators that read a tensor's value back to the host."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardmuon.ops.newton_schulz import NS_PRESETS, newton_schulz
from shardmuon.ops.newton_schulz_guard import GUARD_SLACK, GuardVerdict, band_high, guarded


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


# ------------------------------------------------------------------- host synchronisations


class HostSyncs(TorchDispatchMode):
    """Records every operator that makes the host wait for the device: a tensor's value read
    (``.item()``, ``bool()``, ``int()``, ``float()``, ``tolist()`` all go through
    ``_local_scalar_dense``), ``nonzero``, and indexing by a boolean mask (a ``nonzero``
    inside, on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func in (aten._local_scalar_dense.default, aten.nonzero.default):
            self.ops.append(str(func))
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
            if masks:
                self.ops.append(f"{func} (boolean mask)")
        return func(*args, **(kwargs or {}))


def _ordinary_results(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian inputs ``[B, m, n]`` of a random size (wide or tall) and their bf16 results
    of the standard iteration: well inside the band."""
    g = torch.Generator().manual_seed(seed)
    b, m, n = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((2, 7), (8, 48), (8, 96)))
    G = torch.randn(b, m, n, generator=g)
    return G, newton_schulz(G, "dion")


def _short_side_norms(results: torch.Tensor) -> float:
    """The largest norm of a row (of a column, for tall matrices) over the band: what the
    verdict reports for matrices that all passed."""
    dim = -1 if results.size(-2) <= results.size(-1) else -2
    return float(results.float().norm(dim=dim).amax()) / band_high(NS_PRESETS["dion"])


@pytest.mark.parametrize("seed", range(4))
def test_a_call_where_nothing_diverged_synchronises_once(seed: int) -> None:
    G, results = _ordinary_results(seed)
    band_high(NS_PRESETS["dion"])  # cached: its one read is not the call's
    with HostSyncs() as syncs:
        out, verdict = guarded(G, lambda X: results.clone(), "dion", 1e-8)
    assert syncs.ops == ["aten._local_scalar_dense.default"], syncs.ops
    # what is read of the verdict is read outside, and is the same as before
    assert (verdict.checked, verdict.fallbacks) == (G.size(0), 0)
    assert verdict.fallback_count.shape == verdict.worst_ratio_tensor.shape == ()
    assert verdict.worst_ratio == pytest.approx(_short_side_norms(results), rel=1e-5)
    assert torch.equal(out, results)


def test_a_call_with_diverged_matrices_still_recomputes_exactly_those() -> None:
    """Scaled past the slack, and non-finite: recomputed by the standard fp32 iteration, the
    others kept; the worst ratio exact (here: infinite, then the scaled one's)."""
    G, results = _ordinary_results(7)
    band = band_high(NS_PRESETS["dion"])
    bad = results.clone()
    bad[0] *= 1.5
    bad[-1, 0, 0] = float("nan")
    with HostSyncs() as syncs:
        out, verdict = guarded(G, lambda X: bad.clone(), "dion", 1e-8)
    assert syncs.ops[0] == "aten._local_scalar_dense.default"  # the verdict, then the rare path
    assert (verdict.checked, verdict.fallbacks, verdict.worst_ratio) == (G.size(0), 2, float("inf"))
    for i in (0, G.size(0) - 1):
        safe = newton_schulz(G[i : i + 1], "dion", dtype=torch.float32)[0]
        assert torch.equal(out[i], safe.to(torch.bfloat16)), i
    assert torch.equal(out[1:-1], results[1:-1])
    scaled = bad[:-1].clone()
    _, verdict = guarded(G[:-1], lambda X: scaled.clone(), "dion", 1e-8)
    exact = float(torch.linalg.svdvals(bad[0].double())[0]) / band
    assert verdict.fallbacks == 1
    assert verdict.worst_ratio == pytest.approx(exact, rel=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_the_verdict_matches_an_svd_on_random_spectra(seed: int) -> None:
    """Random ratios of the top singular value to the slack (either side, near it, far from
    it, some batches with none above) and now and then a non-finite result: the count is the
    matrices above the slack by an fp64 SVD; the worst ratio is exact when some matrix
    failed, and otherwise the largest row norm over the band (a lower bound)."""
    g = torch.Generator().manual_seed(100 + seed)
    band = band_high(NS_PRESETS["dion"])
    for trial in range(4):
        m = int(torch.randint(2, 64, (), generator=g))
        n = m + int(torch.randint(0, 96, (), generator=g))
        ratios = (0.5 + 0.7 * torch.rand(6, generator=g, dtype=torch.float64)).tolist()
        if trial == 0:
            ratios = [min(r, 0.99) for r in ratios]  # nothing above: the one-sync path
        results = torch.stack(
            [_with_top_singular_value(m, n, r * GUARD_SLACK * band, g) for r in ratios]
        ).float()
        if trial == 3:
            results[2, 1, 0] = float("inf")
        exact = torch.linalg.svdvals(results.double().nan_to_num(posinf=0.0))[:, 0] / band
        finite = torch.isfinite(results).flatten(1).all(dim=1)
        exact = torch.where(finite, exact, float("inf"))
        inputs = torch.randn(results.shape, generator=g)
        _, verdict = guarded(inputs, lambda X, r=results: r.clone(), "dion", 1e-8)
        above = int((exact > GUARD_SLACK).sum())
        assert verdict.fallbacks == above, (seed, trial, ratios)
        if above:
            assert verdict.worst_ratio == pytest.approx(float(exact.max()), rel=1e-4)
        else:
            rows = _short_side_norms(results)
            assert verdict.worst_ratio == pytest.approx(rows, rel=1e-5)
            assert verdict.worst_ratio <= float(exact.max()) * (1 + 1e-5)


def test_an_empty_call_and_a_default_verdict_read_as_zero() -> None:
    assert (GuardVerdict().checked, GuardVerdict().fallbacks) == (0, 0)
    assert GuardVerdict().worst_ratio == 0.0
    empty = torch.zeros(0, 8, 16)
    out, verdict = guarded(empty, lambda X: X.bfloat16(), "dion", 1e-8)
    assert out.shape == empty.shape
    assert (verdict.checked, verdict.fallbacks, verdict.worst_ratio) == (0, 0, 0.0)


def test_a_steps_guard_telemetry_is_read_with_one_synchronisation() -> None:
    """A real Gram step with several calls: the step keeps each call's verdict on the device,
    and reading the step's count or worst ratio reads them all at once."""
    from checks import set_random_grads

    from shardmuon import Muon

    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 48), (48, 16), (24, 72), (3, 8, 32)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]
    opt = Muon(ps, newton_schulz_impl="gram")
    set_random_grads(ps, 0)
    opt.step()
    stats = opt.last_step_stats
    calls = len(stats.ns_fallback_counts)
    assert calls == len(stats.ns_worst_ratios) >= 3
    assert stats.ns_checked == 6
    with HostSyncs() as syncs:
        fallbacks = stats.ns_fallbacks
    assert len(syncs.ops) == 1, syncs.ops
    with HostSyncs() as syncs:
        worst = stats.ns_worst_ratio
    assert len(syncs.ops) == 1, syncs.ops
    assert fallbacks == 0
    assert worst == max(float(r) for r in stats.ns_worst_ratios)
    assert 0.5 < worst < GUARD_SLACK
    assert f"{stats.ns_checked} checked, 0 recomputed, worst {worst:.3f}" in str(stats)
