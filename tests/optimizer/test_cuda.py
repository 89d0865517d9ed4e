"""GPU checks: the same numerics on CUDA (run by ``scripts/gpu-check.sh`` on a GPU machine).

These need a CUDA device and are skipped elsewhere; the CPU suite covers the same code
paths. On CUDA, cuBLAS may choose different kernels for different batch sizes, so results
are compared with fp64 and with the CPU within bf16 tolerances rather than bitwise.
"""

from __future__ import annotations

import pytest
import torch

from shardmuon import Muon, newton_schulz, newton_schulz_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (4, 96, 64), (768, 2048), (3, 1408, 512)])
def test_newton_schulz_on_cuda_is_close_to_fp64(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(shape, generator=gen)
    out = newton_schulz(G.cuda())
    ref = newton_schulz_reference(G)
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert out.dtype == torch.bfloat16 and out.shape == G.shape
    assert err < 0.0075, f"shape {shape}: {err:.4f} from fp64"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(8, 256, 1024), (4, 352, 1024), (512, 1408)])
def test_gram_on_cuda_meets_the_error_targets_without_the_guard_firing(shape, dtype) -> None:
    """cuBLAS kernels, not the CPU's: Gram in fp16, and in bf16 (its GEMMs in fp16 on CUDA),
    at most the standard bf16 error; the guard quiet on Gaussian inputs."""
    from shardmuon.ops.newton_schulz_gram import newton_schulz_gram
    from shardmuon.ops.newton_schulz_guard import guarded

    G = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    ref = newton_schulz_reference(G)

    def error(out: torch.Tensor) -> float:
        return float((out.cpu().double() - ref).norm() / ref.norm())

    standard = error(newton_schulz(G.cuda()))
    gram = newton_schulz_gram(G.cuda(), "dion", dtype=dtype)
    assert error(gram) <= standard
    _, verdict = guarded(
        G.cuda(), lambda X: newton_schulz_gram(X, "dion", dtype=dtype), "dion", 1e-8
    )
    assert verdict.fallbacks == 0, verdict


def test_the_guard_synchronises_once_per_call_when_nothing_diverged() -> None:
    """The device's own count: under ``set_sync_debug_mode("warn")`` every operation that
    makes the host wait warns; a guarded call that passes every matrix makes one (its
    verdict's reading of whether any failed), the count and worst ratio stay on the GPU."""
    import warnings

    from shardmuon.ops.newton_schulz_guard import guarded

    G = torch.randn(8, 128, 384, generator=torch.Generator().manual_seed(3)).cuda()
    result = newton_schulz(G, "dion")
    guarded(G, lambda X: result, "dion", 1e-8)  # first call: lazy library loads, probes
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, verdict = guarded(G, lambda X: result, "dion", 1e-8)
    finally:
        torch.cuda.set_sync_debug_mode(before)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
    assert verdict.fallback_count.is_cuda and verdict.worst_ratio_tensor.is_cuda
    assert (verdict.checked, verdict.fallbacks) == (8, 0)
    assert 0.5 < verdict.worst_ratio < 1.15
    assert out is result


def test_muon_step_on_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = [(64, 32), (32, 64), (4, 48, 32), (32,)]
    init = [torch.randn(s, generator=gen) * 0.05 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    results = []
    for device in ("cpu", "cuda"):
        # clone: on the CPU .to() returns the same tensor, and the step would update init too
        ps = [torch.nn.Parameter(t.to(device).clone()) for t in init]
        opt = Muon(
            [dict(params=ps[:3]), dict(params=ps[3:], algorithm="adamw")],
            lr=0.02,
            weight_decay=0.1,
            nesterov=True,
        )
        for step_grads in grads:
            for p, g in zip(ps, step_grads):
                p.grad = g.to(device)
            opt.step()
        results.append([p.detach().cpu() for p in ps])
    for (cpu, gpu), x0 in zip(zip(*results), init):
        delta = (cpu - x0).norm()
        assert (cpu - gpu).norm() / delta < 0.03, f"shape {tuple(x0.shape)}"


def _offload_run(offload: str | None, steps: int = 3):
    gen = torch.Generator().manual_seed(2)
    shapes = [(256, 128)] * 4 + [(8, 128, 96), (128,)]
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).cuda()) for s in shapes]
    opt = Muon(
        [dict(params=params[:5]), dict(params=params[5:], algorithm="adamw")],
        lr=0.02,
        weight_decay=0.1,
        nesterov=True,
        offload=offload,
        offload_prefetch=2,
    )
    peaks = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
    return params, opt, peaks


def test_offload_on_cuda_is_bitwise_with_pinned_host_state() -> None:
    plain, plain_opt, _ = _offload_run(None)
    params, opt, peaks = _offload_run("state")
    for p, q in zip(plain, params):
        assert torch.equal(p, q)
        for key, value in plain_opt.state[p].items():
            host = opt.state[q][key]
            # a 0-dim step counter stays a plain CPU scalar in both runs (nothing to stream)
            assert host.device.type == "cpu" and (host.dim() == 0 or host.is_pinned()), key
            assert torch.equal(value.cpu(), host)  # state_dict-level reads wait for stores
    infos = [opt.chunk_info(c) for c in opt.chunks()]
    largest = max(i.state_bytes for i in infos)
    stats = opt.last_step_stats
    assert stats.offload_workspace_peak_bytes <= 2 * largest
    # device memory of a step: its workspace plus at most two chunks of state
    assert max(peaks[1:]) <= stats.workspace_peak_bytes + 2 * largest


def test_the_overlapped_step_on_cuda_is_bitwise_the_sequential_one() -> None:
    """``overlap="forward"`` on CUDA (issue #32): the worker's own stream, one event per
    chunk, the hooks making the forward's stream wait; 10 steps of a small MLP, the same
    losses and weights as the sequential step (the same kernels on the same device)."""
    from torch import nn

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()

    losses, weights = [], []
    for overlap in (None, "forward"):
        model = build()
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        opt = Muon([{"params": matrices}, {"params": others, "algorithm": "adamw"}],
                   lr=0.02, overlap=overlap)  # fmt: skip
        if overlap:
            opt.overlap_with(model)
        gen = torch.Generator(device="cuda").manual_seed(3)
        run = []
        for _ in range(10):
            loss = model(torch.randn(16, 32, device="cuda", generator=gen)).square().mean()
            loss.backward()
            run.append(loss.item())
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        losses.append(run)
        weights.append([p.detach().cpu() for p in model.parameters()])
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def _overlapped_pair(device: str):
    from torch import nn

    torch.manual_seed(0)
    make = lambda: nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(4))).to(device)  # noqa: E731
    model, reference_model = make(), make()
    reference_model.load_state_dict(model.state_dict())
    opt = Muon(model.parameters(), lr=0.02, overlap="forward")
    reference = Muon(reference_model.parameters(), lr=0.02)
    opt.overlap_with(model)
    return model, opt, reference_model, reference


def test_the_overlapped_step_with_a_slow_worker_stream_is_bitwise_the_sequential(monkeypatch):
    """``torch.cuda._sleep`` on the worker's stream before each chunk is marked: the next
    forward's kernels must wait on the events (a host-side wait alone would not order the
    streams), so the outputs and weights are bitwise the sequential run's on this GPU."""
    import shardmuon.runtime.overlap as overlap_module

    mark = overlap_module.OverlappedStep._mark

    def slow(self, key):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time on the worker's stream
        mark(self, key)

    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", slow)
    model, opt, reference_model, reference = _overlapped_pair("cuda")
    x = torch.randn(8, 256, device="cuda")
    outs = {}
    for m, o in ((reference_model, reference), (model, opt)):
        for _ in range(5):
            out = m(x)
            outs.setdefault(id(m), []).append(out.detach().clone())
            out.square().mean().backward()
            o.step()
            m.zero_grad(set_to_none=False)  # in place, right after step(): the copy holds
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs[id(model)], outs[id(reference_model)]))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference_model.parameters()))


def test_overlapped_steps_reuse_one_worker_stream_and_hold_memory_flat():
    """One worker stream per device (the allocator caches freed blocks per stream): the
    memory reserved after 40 overlapped steps is what it was after 5."""
    model, opt, _, _ = _overlapped_pair("cuda")
    x = torch.randn(8, 256, device="cuda")
    reserved = []
    for step in range(40):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step in (4, 39):
            opt.synchronize()
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    assert reserved[1] <= reserved[0], reserved


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_the_worker_runs_on_the_parameters_device():
    """Parameters on cuda:1: the worker thread sets its device (a new thread's is 0), so its
    stream and events are on cuda:1 and no context is made on cuda:0 by the step."""
    import shardmuon.runtime.overlap as overlap_module

    seen = []
    run = overlap_module.OverlappedStep._run

    def record(self, work, device):
        def wrapped(done):
            seen.append(torch.cuda.current_device())
            return work(done)

        return run(self, wrapped, device)

    overlap_module.OverlappedStep._run = record
    try:
        model, opt, _, _ = _overlapped_pair("cuda:1")
        model(torch.ones(2, 256, device="cuda:1")).sum().backward()
        opt.step()
        opt.synchronize()
    finally:
        overlap_module.OverlappedStep._run = run
    assert seen == [1]


def _slow_stores(monkeypatch) -> None:
    """Every offload store queued behind ~5 ms of GPU time on the store stream: a read of
    host state that does not wait for the stores' event meets the old values."""
    from shardmuon.runtime.offload import StateStager

    store = StateStager.store

    def slow(self, key):
        if self.cuda and key in self._resident:
            self._store_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._store_stream):
                torch.cuda._sleep(10_000_000)
        store(self, key)

    monkeypatch.setattr(StateStager, "store", slow)


def test_offload_with_slow_stores_is_bitwise_across_a_prefetch_change_and_a_copy(monkeypatch):
    """Slowed stores: a changed ``offload_prefetch`` (a new stager, whose loads must wait for
    the old one's stores) and a ``deepcopy`` of the optimizer right after a step (which must
    wait for them) both see exactly the state of a run without offload."""
    import copy

    _slow_stores(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    shapes = [(256, 128)] * 3 + [(128,)]
    init = [torch.randn(s, generator=gen) * 0.05 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    runs = []
    for offload in (None, "state"):
        params = [torch.nn.Parameter(t.cuda()) for t in init]
        opt = Muon(
            [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw")],
            lr=0.02, weight_decay=0.1, offload=offload, offload_prefetch=2,
        )  # fmt: skip
        copies = []
        for step, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.cuda()
            opt.step()
            copies.append(copy.deepcopy(opt))  # right after the step: its stores in flight
            if step == 1:
                opt.offload_prefetch = 1  # a new stager at the next step
        states = [[{k: v.cpu() for k, v in c.state[q].items()} for q in c.state] for c in copies]
        runs.append(([p.detach().cpu() for p in params], states))
    (plain, plain_states), (offloaded, offloaded_states) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    for a_step, b_step in zip(plain_states, offloaded_states):
        for a, b in zip(a_step, b_step):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_an_overlapped_step_on_cuda_1_makes_no_context_on_cuda_0(tmp_path):
    """In a fresh process whose parameters live on cuda:1: after overlapped steps, no primary
    CUDA context exists on cuda:0 (the worker thread sets its device; a context on another
    GPU costs every rank hundreds of MiB there)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import torch
        from torch import nn
        from shardmuon import Muon
        model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(3))).to("cuda:1")
        opt = Muon(model.parameters(), lr=0.02, overlap="forward")
        opt.overlap_with(model)
        for _ in range(3):
            model(torch.ones(4, 64, device="cuda:1")).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        torch.cuda.synchronize("cuda:1")
        print("context on cuda:0:", torch._C._cuda_hasPrimaryContext(0))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "context on cuda:0: False" in done.stdout, done.stdout


def _streamed_model(seed: int = 0) -> list[torch.nn.Parameter]:
    """24 Muon matrices 2048x2048, a Sinkhorn table and head (4096x1024), two biases."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4096, 1024), (4096, 1024)] + [(2048, 2048)] * 24 + [(1024,)] * 2
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).cuda()) for s in shapes]


def _streamed_optimizer(params) -> Muon:
    groups = [
        dict(params=params[:2], algorithm="sinkhorn", lr=0.02),
        dict(params=params[2:26]),
        dict(params=params[26:], algorithm="adamw"),
    ]
    return Muon(groups, lr=0.02, workspace_bytes=8 * 2**20, adamw_chunks="parameter")


def _move_state(opt: Muon, params, device, counters: bool = True) -> None:
    for p in params:
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and (counters or key != "step"):
                moved = value.to(device, non_blocking=True)
                opt.state[p][key] = moved.pin_memory() if device == "cpu" else moved


@pytest.mark.parametrize("counters_on_gpu", [False, True], ids=["counters-cpu", "counters-gpu"])
def test_a_caller_streamed_offload_holds_one_chunk_above_the_model(counters_on_gpu) -> None:
    """prime-rl's loop on a GPU: each chunk's state (counters too) moved to the device for its
    step_chunk and back. The update is bitwise the plain step's; the device holds at most one
    chunk's state plus the step's transients above the model and its grads (the whole state
    would be several times that); counters kept on the GPU are read and advanced there."""
    reference_params, params = _streamed_model(), _streamed_model()
    reference, opt = _streamed_optimizer(reference_params), _streamed_optimizer(params)
    _move_state(opt, params, "cpu")
    if counters_on_gpu:
        for p in params:
            opt.state[p]["step"] = opt.state[p]["step"].cuda()
    infos = [opt.chunk_info(c) for c in opt.chunks()]
    whole = sum(i.state_bytes for i in infos)
    largest = max(i.state_bytes for i in infos)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen).cuda() for p in params]
        for p, q, g in zip(reference_params, params, grads):
            p.grad, q.grad = g.clone(), g
        reference.step()
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for chunk in opt.chunks():
            chunk_params = opt.chunk_info(chunk).params
            _move_state(opt, chunk_params, "cuda", counters=not counters_on_gpu)
            opt.step_chunk(chunk)
            _move_state(opt, chunk_params, "cpu", counters=not counters_on_gpu)
        torch.cuda.synchronize()
        above = torch.cuda.max_memory_allocated() - baseline
        # Transients: the step's own estimate of its workspace, or one Sinkhorn chunk's two
        # fp32 buffers, with room for the allocator's rounding.
        estimate = opt.last_step_stats.workspace_peak_bytes
        transients = max(estimate, 2 * 4 * 4096 * 1024) * 3 // 2
        bound = largest + transients + 4 * 2**20
        assert above <= bound, (above, largest, estimate)
        assert whole > 2 * bound, (whole, bound)
    _move_state(opt, params, "cuda")
    for p, q in zip(reference_params, params):
        assert torch.equal(p, q)
        assert torch.equal(reference.state[p]["momentum"], opt.state[q]["momentum"])
        assert float(opt.state[q]["step"]) == 3
    assert all(g["step"] == 3 for g in opt.param_groups)


def test_sinkhorn_on_cuda_matches_fp64_and_a_slow_overlapped_step(monkeypatch) -> None:
    """A Sinkhorn table and head on the GPU: the update within 1e-4 of the dense fp64
    algorithm; the overlapped step, its worker slowed with ``torch.cuda._sleep`` before each
    chunk is marked, bitwise the sequential step (the next reads wait on its events)."""
    import shardmuon.runtime.overlap as overlap_module
    from shardmuon.ops.sinkhorn import SINKHORN_DEFAULTS, sinkhorn_reference

    gen = torch.Generator().manual_seed(4)
    shapes = [(512, 128), (128, 512), (128, 128)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]

    def run(**kwargs):
        params = [torch.nn.Parameter(w.clone().cuda()) for w in weights]
        groups = [dict(params=params[:2], algorithm="sinkhorn", lr=0.05), dict(params=params[2:])]
        opt = Muon(groups, lr=0.02, **kwargs)
        if kwargs:
            opt.overlap_with(torch.nn.Module())
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.cuda()
            opt.step()
            opt.synchronize()
        return params

    sequential = run()
    mark = overlap_module.OverlappedStep._mark

    def slow(self, key):
        torch.cuda._sleep(20_000_000)
        mark(self, key)

    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", slow)
    overlapped = run(overlap="forward")
    for a, b in zip(sequential, overlapped):
        assert torch.equal(a, b)
    keys = ("sinkhorn_iters", "sinkhorn_tau", "sinkhorn_eps", "sinkhorn_lr_scale")
    settings = dict(zip(("iters", "tau", "eps", "lr_scale"), (SINKHORN_DEFAULTS[k] for k in keys)))
    ref_w, ref_m = weights[0].double(), torch.zeros(shapes[0], dtype=torch.float64)
    for step in grads:
        ref_w, ref_m = sinkhorn_reference(ref_w, step[0], ref_m, lr=0.05, beta=0.95, **settings)
    got = sequential[0].detach().cpu().double() - weights[0].double()
    want = ref_w - weights[0].double()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max() * 3
