"""Newton–Schulz calls replayed as CUDA graphs (``runtime/graphs.py``, ``cuda_graphs=True``).

On a CPU a stand-in capture plays the graph's part with its semantics: a capture records
(here: runs) the call and hands out static outputs, which every replay overwrites in place
from the static input. Against it: every call's result and report are the eager call's bits
on many keys and inputs, a result held while later calls of its key replay is not touched,
a refused capture runs eagerly, and ``Muon(cuda_graphs=True)`` steps bitwise like eager.
What a capture requires of a call (no host synchronisation, hence no data-dependent shape)
is checked on ``meta`` tensors, which take CUDA's branches, for every engine and setting a
step can capture, the guard's recompute included. The guard's device-decided form gives the
host-decided guard's bits. On a GPU (skipped without one) the real capture is held to the
eager call's bits, with no synchronisation on a replayed call, on the caller's stream."""

from __future__ import annotations

import pytest
import torch
from checks import same_bits

import shardmuon.runtime.stepper as stepper_module
from shardmuon import Muon
from shardmuon.bench.kernels import count_step
from shardmuon.ops.newton_schulz import NS_PRESETS
from shardmuon.ops.newton_schulz_guard import (
    GUARD_SLACK,
    band_high,
    guarded,
    guarded_on_device,
    host_branch,
)
from shardmuon.ops.orthogonalizer import Orthogonalizer
from shardmuon.runtime import graphs
from shardmuon.runtime.graphs import GraphCache, GraphedOrthogonalizer, _always, _tensors


class StandInCapture:
    """A CUDA graph's semantics on a CPU: ``capture`` hands out static outputs (poisoned:
    a capture computes nothing), ``replay`` recomputes them in place from the static input."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.captures, self.replays, self.warms = refuse, 0, 0, 0

    def warm(self, fn):
        self.warms += 1
        return fn()

    def capture(self, fn):
        if self.refuse:
            raise RuntimeError("operation not permitted when stream is capturing (injected)")
        self.captures += 1
        static = fn(host_branch)
        for t in _tensors(static):
            t.fill_(float("nan") if t.is_floating_point() else -7)

        def replay() -> None:
            self.replays += 1
            for target, value in zip(_tensors(static), _tensors(fn(host_branch)), strict=True):
                target.copy_(value)

        return static, replay


ENGINES = [  # (impl, dtype, guard, preconditioner): what a step may run
    ("folded", torch.bfloat16, None, None),
    ("folded", torch.float16, None, None),
    ("folded", torch.float32, None, None),
    ("folded", torch.bfloat16, None, "aol"),
    ("gram", torch.bfloat16, None, None),  # guarded by default
    ("gram", torch.bfloat16, None, "aol"),
    ("gram", torch.bfloat16, False, None),
    ("unfolded", torch.bfloat16, None, None),
    ("per-matrix", torch.bfloat16, None, None),
]


def _engine(impl, dtype, guard, preconditioner) -> Orthogonalizer:
    return Orthogonalizer(impl, dtype, guard=guard, preconditioner=preconditioner)


def _inputs(seed: int, shape: tuple[int, int, int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(shape, generator=gen) * (
        10.0 ** float(torch.randint(-3, 3, (1,), generator=gen))
    )
    if seed % 3 == 0:
        X[0] = torch.outer(
            torch.randn(shape[1], generator=gen), torch.randn(shape[2], generator=gen)
        )
    if seed % 3 == 1:
        X[-1, 0, 0] = float("nan")  # a non-finite matrix: zero result, flagged
    return X.to(torch.bfloat16)


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: "-".join(map(str, e)))
def test_replayed_calls_give_the_eager_bits_and_reports(engine) -> None:
    capture = StandInCapture()
    graphed = GraphedOrthogonalizer(_engine(*engine), GraphCache(capture=capture))
    eager = _engine(*engine)
    shapes = [(3, 8, 24), (2, 24, 8), (3, 8, 24), (1, 16, 16)]
    held, reports = [], []
    for call in range(12):
        X = _inputs(call, shapes[call % len(shapes)])
        got = graphed(X.clone(), NS_PRESETS["dion"], 1e-7)
        want = eager(X.clone(), NS_PRESETS["dion"], 1e-7)
        assert same_bits(got, want), call
        reports.append((graphed.take_report(), eager.take_report()))
        held.append((got, got.clone()))
    # Reports are read at the end of a step: later replays must not have changed them.
    for (got_masks, got_verdicts), (want_masks, want_verdicts) in reports:
        assert all(torch.equal(a, b) for a, b in zip(got_masks, want_masks, strict=True))
        for a, b in zip(got_verdicts, want_verdicts, strict=True):
            assert a.checked == b.checked and a.fallbacks == b.fallbacks
    # Results handed out earlier are not overwritten by later replays of their key.
    assert all(same_bits(result, copy) for result, copy in held)
    assert capture.warms == 3 and capture.captures == 3  # one warm-up and capture per key
    assert capture.replays == 12 - 3


def test_a_refused_capture_runs_eagerly_with_one_warning() -> None:
    cache = GraphCache(capture=StandInCapture(refuse=True))
    graphed = GraphedOrthogonalizer(_engine("folded", torch.bfloat16, None, None), cache)
    eager = _engine("folded", torch.bfloat16, None, None)
    X = _inputs(5, (2, 8, 16))
    graphed(X.clone(), NS_PRESETS["dion"], 1e-7)  # the warm-up call
    with pytest.warns(RuntimeWarning, match="could not capture"):
        got = graphed(X.clone(), NS_PRESETS["dion"], 1e-7)
    assert same_bits(got, eager(X.clone(), NS_PRESETS["dion"], 1e-7))
    assert len(cache.refused) == 1 and "injected" in next(iter(cache.refused.values()))
    graphed.take_report()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphed(X.clone(), NS_PRESETS["dion"], 1e-7)  # eager, no second warning


def test_beyond_max_graphs_calls_run_eagerly(monkeypatch) -> None:
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    capture = StandInCapture()
    cache = GraphCache(capture=capture)
    graphed = GraphedOrthogonalizer(_engine("folded", torch.bfloat16, None, None), cache)
    for rows in (4, 4, 6, 6, 8, 8, 8):
        graphed(_inputs(rows, (2, rows, 12)), NS_PRESETS["dion"], 1e-7)
    assert len(cache.graphs) == 2 and capture.captures == 2
    assert any("more than 2" in why for why in cache.refused.values())


def test_the_static_buffers_stay_within_their_budget() -> None:
    """Each capture keeps its input and output: a call whose two would pass the budget runs
    eagerly (the same bits); the ones that fit are captured."""
    small, large = (2, 8, 12), (4, 16, 24)
    budget = 2 * 2 * (2 * 8 * 12) + 2 * 2 * (4 * 16 * 24) - 1  # both but one byte
    capture = StandInCapture()
    cache = GraphCache(capture=capture, max_static_bytes=budget)
    graphed = GraphedOrthogonalizer(_engine("folded", torch.bfloat16, None, None), cache)
    eager = _engine("folded", torch.bfloat16, None, None)
    for shape in (small, small, small, large, large, large):
        X = _inputs(len(cache.graphs), shape)
        assert same_bits(
            graphed(X.clone(), NS_PRESETS["dion"], 1e-7),
            eager(X.clone(), NS_PRESETS["dion"], 1e-7),
        )
    assert len(cache.graphs) == 1 and cache.static_bytes == 2 * 2 * (2 * 8 * 12) <= budget


def _with_top_singular_value(m: int, n: int, top: float, g: torch.Generator) -> torch.Tensor:
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    s = 0.6 + (top - 0.6) * torch.rand(m, generator=g, dtype=torch.float64) * 0.95
    s[: int(torch.randint(1, 4, (), generator=g))] = top
    return (U * s) @ V.mT


@pytest.mark.parametrize("seed", range(5))
def test_the_device_decided_guard_gives_the_host_guards_bits(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    band = band_high(NS_PRESETS["dion"])
    m = int(torch.randint(2, 40, (), generator=g))
    n = m + int(torch.randint(0, 60, (), generator=g))
    ratios = [[0.5, 0.99, 1.01, 3.0], [0.4, 0.9], [2.0, 1.5, 0.8]][seed % 3]
    results = torch.stack(
        [_with_top_singular_value(m, n, r * GUARD_SLACK * band, g) for r in ratios]
    ).to(torch.bfloat16)
    if seed == 4:
        results[0, 0, 0] = float("inf")
    inputs = torch.randn(results.shape, generator=g).to(torch.bfloat16)
    want, want_verdict = guarded(inputs, lambda X: results.clone(), "dion", 1e-8)
    for branch in (host_branch, _always):  # decided, or recorded as a capture records it
        got, verdict = guarded_on_device(inputs, lambda X: results.clone(), "dion", 1e-8, branch)
        assert same_bits(got, want)
        assert (
            verdict.fallbacks
            == want_verdict.fallbacks
            == sum(r > 1 for r in ratios) + (seed == 4 and ratios[0] <= 1)
        )
        # a failed matrix's ratio is its upper bound: never below the exact one
        assert verdict.worst_ratio >= want_verdict.worst_ratio * (1 - 1e-6)


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: "-".join(map(str, e)))
def test_a_captured_call_reads_nothing_back_to_the_host(engine) -> None:
    """On ``meta`` (CUDA's branches), the call as a capture records it, the guard's
    recompute included: no host read, so no shape or branch that depends on the data."""
    ortho = _engine(*engine)
    X = torch.empty(4, 24, 40, dtype=torch.bfloat16, device="meta")
    report = count_step(lambda: ortho(X, NS_PRESETS["dion"], 1e-7, branch=_always), "accelerator")
    assert report.total.syncs == 0, dict(report.sync_sites)
    assert report.total.kernels > 0


def test_muon_with_cuda_graphs_steps_bitwise_like_eager(monkeypatch) -> None:
    """The optimizer's path: ``cuda_graphs=True`` wraps the step's Newton–Schulz (here with
    the stand-in capture on a CPU) and four steps give eager's parameters and momenta."""
    capture = StandInCapture()
    monkeypatch.setattr(stepper_module, "graphs_available", lambda device: True)
    monkeypatch.setattr(graphs.GraphCache, "wrap", _wrap_with(capture))

    def run(cuda_graphs: bool):
        gen = torch.Generator().manual_seed(11)
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=gen))
            for shape in [(4, 16, 24), (16, 24), (24, 16), (32, 8)]
        ]
        opt = Muon(params, lr=0.02, cuda_graphs=cuda_graphs, newton_schulz_impl="gram")
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * 0.01
            opt.step()
        assert opt.last_step_stats.ns_checked > 0  # guarded Gram ran
        return [p.detach().clone() for p in params] + [
            s["momentum"].clone() for s in opt.state.values()
        ]

    got, want = run(True), run(False)
    assert capture.captures > 0 and capture.replays > 0
    assert all(same_bits(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("impl", ["folded", "gram"])
def test_by_default_only_the_guarded_calls_are_captured(monkeypatch, impl) -> None:
    """``cuda_graphs=None`` (the default): the guarded calls (Gram's) replayed from graphs,
    the others eager; the same bits either way."""
    capture = StandInCapture()
    monkeypatch.setattr(stepper_module, "graphs_available", lambda device: True)
    monkeypatch.setattr(graphs.GraphCache, "wrap", _wrap_with(capture))
    results = []
    for cuda_graphs in (None, False):
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(3, 16, 24, generator=gen))]
        opt = Muon(params, lr=0.02, cuda_graphs=cuda_graphs, newton_schulz_impl=impl)
        for _ in range(3):
            params[0].grad = torch.randn(params[0].shape, generator=gen) * 0.01
            opt.step()
        results.append(params[0].detach().clone())
    assert same_bits(*results)
    assert (capture.captures > 0) == (impl == "gram")


def _wrap_with(capture):
    def wrap(self, orthogonalizer, device, guarded_only=False, max_static_bytes=None):
        self.capture, self.max_static_bytes = capture, max_static_bytes
        return GraphedOrthogonalizer(orthogonalizer, self, guarded_only)

    return wrap


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: "-".join(map(str, e)))
def test_on_cuda_replays_give_the_eager_bits_without_a_sync(engine) -> None:
    device = torch.device("cuda")
    graphed = GraphCache().wrap(_engine(*engine), device)
    eager = _engine(*engine)
    for call in range(6):
        X = _inputs(call, (6, 64, 96)).to(device)
        if call >= 2:  # warmed and captured: a replay makes no host synchronisation
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = graphed(X.clone(), NS_PRESETS["dion"], 1e-7)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = eager(X.clone(), NS_PRESETS["dion"], 1e-7)
        assert same_bits(got, want), call
        for a, b in zip(graphed.take_report()[0], eager.take_report()[0], strict=True):
            assert torch.equal(a, b)


@needs_cuda
def test_on_cuda_a_replay_reads_the_input_the_callers_stream_wrote() -> None:
    """The caller's stream writes the input after a delay (``torch.cuda._sleep``): the
    replay on that stream reads what it wrote (a replay on another stream would race)."""
    device = torch.device("cuda")
    graphed = GraphCache().wrap(_engine("gram", torch.bfloat16, None, None), device)
    eager = _engine("gram", torch.bfloat16, None, None)
    X = _inputs(3, (4, 64, 96)).to(device)
    for _ in range(2):
        graphed(X.clone(), NS_PRESETS["dion"], 1e-7)  # warm-up, capture
    fresh = _inputs(8, (4, 64, 96)).to(device)
    buffer = torch.zeros_like(fresh)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        buffer.copy_(fresh)
        got = graphed(buffer, NS_PRESETS["dion"], 1e-7)
    side.synchronize()
    assert same_bits(got, eager(fresh.clone(), NS_PRESETS["dion"], 1e-7))


@needs_cuda
def test_on_cuda_muon_with_cuda_graphs_steps_bitwise_like_eager() -> None:
    def run(cuda_graphs: bool):
        gen = torch.Generator().manual_seed(11)
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=gen).cuda())
            for shape in [(8, 64, 96), (64, 96), (96, 64), (128, 32)]
        ]
        opt = Muon(params, lr=0.02, cuda_graphs=cuda_graphs, newton_schulz_impl="gram")
        for _ in range(4):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 0.01).cuda()
            opt.step()
        return [p.detach().clone() for p in params]

    assert all(same_bits(a, b) for a, b in zip(run(True), run(False), strict=True))


class FailingOnce(StandInCapture):
    """A stand-in whose first warm-up (or capture) raises ``error``."""

    def __init__(self, error: BaseException, where: str) -> None:
        super().__init__()
        self.error, self.where = error, where

    def warm(self, fn):
        if self.where == "warm" and self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().warm(fn)

    def capture(self, fn):
        if self.where == "capture" and self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().capture(fn)


def test_a_failed_warm_up_warms_again_and_an_out_of_memory_capture_is_retried() -> None:
    engine = ("folded", torch.bfloat16, None, None)
    eager = _engine(*engine)
    X = _inputs(2, (2, 8, 16))
    want = eager(X.clone(), NS_PRESETS["dion"], 1e-7)
    capture = FailingOnce(RuntimeError("out of memory (injected)"), "warm")
    graphed = GraphedOrthogonalizer(_engine(*engine), GraphCache(capture=capture))
    with pytest.raises(RuntimeError, match="injected"):
        graphed(X.clone(), NS_PRESETS["dion"], 1e-7)
    assert same_bits(graphed(X.clone(), NS_PRESETS["dion"], 1e-7), want)  # warmed now
    assert capture.warms == 1 and capture.captures == 0
    capture = FailingOnce(torch.OutOfMemoryError("CUDA out of memory (injected)"), "capture")
    cache = GraphCache(capture=capture)
    graphed = GraphedOrthogonalizer(_engine(*engine), cache)
    graphed(X.clone(), NS_PRESETS["dion"], 1e-7)
    with pytest.raises(torch.OutOfMemoryError):
        graphed(X.clone(), NS_PRESETS["dion"], 1e-7)
    assert not cache.refused  # memory is not a refusal: the retry captures
    assert same_bits(graphed(X.clone(), NS_PRESETS["dion"], 1e-7), want)
    assert capture.captures == 1 and len(cache.graphs) == 1


def test_a_new_device_starts_the_cache_afresh(monkeypatch) -> None:
    monkeypatch.setattr(graphs, "CudaCapture", lambda device: StandInCapture())
    cache = GraphCache()
    ortho = _engine("folded", torch.bfloat16, None, None)
    X = _inputs(4, (2, 8, 16))
    for _ in range(3):
        cache.wrap(ortho, torch.device("cpu"))(X.clone(), NS_PRESETS["dion"], 1e-7)
    assert len(cache.graphs) == 1 and cache.warmed
    first = cache.capture
    cache.wrap(ortho, torch.device("cpu"))
    assert cache.capture is first  # the same device keeps its captures
    cache.wrap(ortho, torch.device("meta"))
    assert cache.capture is not first and not cache.graphs and not cache.warmed


def test_the_key_follows_the_process_wide_gemm_settings() -> None:
    ortho = _engine("folded", torch.bfloat16, None, None)
    X = _inputs(1, (2, 8, 16))
    matmul = torch.backends.cuda.matmul
    before = graphs.call_key(ortho, X, NS_PRESETS["dion"], 1e-7)
    saved = matmul.allow_bf16_reduced_precision_reduction
    try:
        matmul.allow_bf16_reduced_precision_reduction = not saved
        assert graphs.call_key(ortho, X, NS_PRESETS["dion"], 1e-7) != before
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved
    assert graphs.call_key(ortho, X, NS_PRESETS["dion"], 1e-7) == before


def test_a_call_that_raised_leaves_nothing_in_the_next_calls_report(monkeypatch) -> None:
    """A guarded call that raised after its engine reported: the next call's report is its
    own (a retried chunk counted a non-finite matrix twice)."""
    import shardmuon.ops.orthogonalizer as orthogonalizer_module

    ortho = _engine("gram", torch.bfloat16, None, None)
    X = _inputs(1, (3, 8, 24))  # one non-finite matrix
    real = orthogonalizer_module.guarded

    def failing(G, run, *args, **kwargs):
        run(G)  # the engine reports its mask
        raise RuntimeError("injected")

    monkeypatch.setattr(orthogonalizer_module, "guarded", failing)
    with pytest.raises(RuntimeError, match="injected"):
        ortho(X.clone(), NS_PRESETS["dion"], 1e-7)
    monkeypatch.setattr(orthogonalizer_module, "guarded", real)
    ortho(X.clone(), NS_PRESETS["dion"], 1e-7)
    masks, verdicts = ortho.take_report()
    assert len(masks) == 1 and len(verdicts) == 1 and int(masks[0].sum()) == 1


@needs_cuda
def test_on_cuda_a_refused_capture_leaves_the_callers_stream_current() -> None:
    device = torch.device("cuda")
    caller = torch.cuda.Stream(device)
    capture = graphs.CudaCapture(device)

    def refused(branch):
        return torch.ones(3, device=device).sum().item()  # a host read: capture refuses

    with torch.cuda.stream(caller):
        with pytest.raises(RuntimeError):  # torch's capture error (AcceleratorError is one)
            capture.capture(refused)
        assert torch.cuda.current_stream(device) == caller


@needs_cuda
def test_on_cuda_replays_from_two_streams_do_not_race() -> None:
    """Two streams replay the same captured call on different inputs, the first delayed:
    each gets its own input's result (the event orders the static buffers)."""
    device = torch.device("cuda")
    graphed = GraphCache().wrap(_engine("folded", torch.bfloat16, None, None), device)
    eager = _engine("folded", torch.bfloat16, None, None)
    inputs = [_inputs(seed, (4, 64, 96)).to(device) for seed in (20, 21)]
    for _ in range(2):
        graphed(inputs[0].clone(), NS_PRESETS["dion"], 1e-7)  # warm-up, capture
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    results = []
    for k, (stream, X) in enumerate(zip(streams, inputs)):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            if k == 0:
                torch.cuda._sleep(50_000_000)
            results.append(graphed(X.clone(), NS_PRESETS["dion"], 1e-7))
    torch.cuda.synchronize(device)
    for got, X in zip(results, inputs):
        assert same_bits(got, eager(X.clone(), NS_PRESETS["dion"], 1e-7))
