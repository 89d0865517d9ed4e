"""The workspace budget: the schedule keeps the estimated bytes in flight under it, the
measured transient memory of a step stays under it, and the bits do not depend on it.

Memory is measured with the CPU profiler (``shardmuon.bench.memory.measure_cpu_step``: every
allocation and free of the step, summed in time order), independently of the estimate.
Multi-process cases (gloo, 2 ranks) are in ``dist_workspace_cases``.
"""

from __future__ import annotations

import importlib

import dist_workspace_cases
import pytest
import torch
from checks import set_random_grads
from dist_harness import WorldPlan

from shardmuon import Muon
from shardmuon.bench.memory import gemm_scratch_bytes, measure_cpu_step
from shardmuon.ops.newton_schulz import newton_schulz, resolve_coefficients
from shardmuon.planning.workspace import (
    BatchBytes,
    newton_schulz_bytes,
    schedule,
    workspace_peak_bytes,
)

# Shapes of a small model: local matrices only (one process), several of each shape so
# that stacks can be cut, and a partitioned (fused) matrix.
SHAPES = [(96, 64)] * 6 + [(64, 160)] * 4 + [(4, 48, 80)] * 2 + [(128, 64)]
MiB = 2**20


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in SHAPES]


def _optimizer(params, budget: int, max_in_flight: int = 3) -> Muon:
    fused = params[-1]
    return Muon(
        params,
        lr=0.02,
        nesterov=True,
        weight_decay=0.1,
        workspace_bytes=budget,
        max_in_flight=max_in_flight,
        matrix_partitions={fused: (32, 96)},
    )


def _textbook_newton_schulz(G: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The folded iteration written plainly: whole fp32 copy, fresh tensors every line."""
    transposed = G.size(-2) > G.size(-1)
    X = G.mT if transposed else G
    X32 = X.float()
    X = (X32 / (torch.linalg.vector_norm(X32, dim=(-2, -1), keepdim=True) + eps)).bfloat16()
    shape = X.shape
    X = X.reshape(-1, X.size(-2), X.size(-1))
    one = X.size(0) == 1
    if one:
        X = X[0]
    mm, mm_add = (torch.mm, torch.addmm) if one else (torch.bmm, torch.baddbmm)
    for a, b, c in resolve_coefficients("dion"):
        A = mm(X, X.mT)
        B = mm_add(A, A, A, beta=b, alpha=c)
        X = mm_add(X, B, X, beta=a, alpha=1.0)
    X = X.reshape(shape)
    return X.mT if transposed else X


# ------------------------------------------------------------------ the schedule


def _check_schedule(sizes: list[BatchBytes], budget: int, max_in_flight: int) -> int:
    """Every batch goes prepare < compute < finish once, computes in order; returns the peak."""
    ops = schedule(sizes, budget, max_in_flight)
    assert sorted(ops) == sorted(
        (ph, i) for i in range(len(sizes)) for ph in ("prepare", "compute", "finish")
    )
    position = {op: k for k, op in enumerate(ops)}
    for i in range(len(sizes)):
        assert position[("prepare", i)] < position[("compute", i)] < position[("finish", i)]
    computes = [i for ph, i in ops if ph == "compute"]
    prepares = [i for ph, i in ops if ph == "prepare"]
    assert computes == prepares == sorted(computes), "every rank must run collectives in order"
    held = peak = waiting = 0
    for ph, i in ops:
        if ph == "prepare":
            held += sizes[i].held
            waiting += 1
            assert waiting <= max_in_flight
        elif ph == "compute":
            waiting -= 1
        peak = max(peak, held + sizes[i].peak)
        if ph == "finish":
            held -= sizes[i].held
    return peak


@pytest.mark.parametrize("max_in_flight", [1, 2, 3, 5])
@pytest.mark.parametrize("budget", [10, 40, 100, 10**9])
def test_schedule_stays_under_budget_unless_one_batch_is_bigger(budget, max_in_flight) -> None:
    g = torch.Generator().manual_seed(budget + max_in_flight)
    sizes = [
        BatchBytes(held=int(h), peak=int(p))
        for h, p in torch.randint(1, 30, (12, 2), generator=g).tolist()
    ]
    peak = _check_schedule(sizes, budget, max_in_flight)
    largest = max(s.held + s.peak for s in sizes)
    assert peak <= max(budget, largest)
    # the same function the optimizer reports, on the same sizes
    assert peak >= largest


def test_unlimited_budget_keeps_max_in_flight_batches_waiting() -> None:
    sizes = [BatchBytes(1, 1)] * 6
    ops = schedule(sizes, 10**9, 3)
    assert ops[:4] == [("prepare", 0), ("prepare", 1), ("prepare", 2), ("compute", 0)]
    # a batch finishes after the next one was computed (its return overlaps that compute)
    assert ops.index(("finish", 0)) > ops.index(("compute", 1))


def test_tight_budget_runs_one_batch_at_a_time() -> None:
    sizes = [BatchBytes(10, 5)] * 4
    ops = schedule(sizes, 15, 3)
    expected = [(ph, i) for i in range(4) for ph in ("prepare", "compute", "finish")]
    assert ops == expected


# ------------------------------------------------------------------ Newton–Schulz memory


@pytest.mark.parametrize("shape", [(1, 256, 512), (3, 128, 256), (1, 384, 128)])
def test_newton_schulz_is_bitwise_the_textbook_iteration(shape) -> None:
    G = torch.randn(shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(newton_schulz(G), _textbook_newton_schulz(G))


@pytest.mark.parametrize("shape", [(1, 256, 512), (3, 128, 256), (1, 384, 128)])
def test_newton_schulz_in_place_is_bitwise_and_saves_a_copy(shape) -> None:
    G = torch.randn(shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    expected = newton_schulz(G)
    own = G.clone()
    assert torch.equal(newton_schulz(own, overwrite_input=True), expected)
    if shape[-2] <= shape[-1]:  # a wide contiguous input is normalised where it lies
        fresh = measure_cpu_step(lambda: newton_schulz(G), 0).transient_bytes
        in_place = measure_cpu_step(
            lambda: newton_schulz(G.clone(), overwrite_input=True), 0
        ).transient_bytes
        # in_place includes the clone (2 bytes/element): the in-place run saves at least that
        assert in_place <= fresh


def test_newton_schulz_normalisation_in_slices_is_bitwise(monkeypatch) -> None:
    ns_module = importlib.import_module("shardmuon.ops.normalize")

    G = torch.randn(2, 96, 200, generator=torch.Generator().manual_seed(4)).bfloat16()
    whole = newton_schulz(G)
    for chunk in (1000, 96 * 200 + 7, 300):  # rows of one matrix, whole matrices, both
        monkeypatch.setattr(ns_module, "NORMALIZE_CHUNK_ELEMENTS", chunk)
        assert torch.equal(newton_schulz(G), whole)


def test_newton_schulz_memory_is_within_its_estimate_and_holds_no_fp32_copy() -> None:
    rows, cols = 512, 1024
    G = torch.randn(1, rows, cols).bfloat16()
    measured = measure_cpu_step(lambda: newton_schulz(G), 0).transient_bytes
    estimate = newton_schulz_bytes(1, rows, cols)  # the bf16 output included
    # The bound: shardmuon's buffers plus one GEMM's library scratch (measured here: none
    # on an AVX2 CPU, a packing buffer on AVX-512 ones).
    assert measured <= estimate + gemm_scratch_bytes([(1, rows, cols)])
    # The textbook iteration keeps an fp32 copy and an fp32 quotient alive together.
    textbook = measure_cpu_step(lambda: _textbook_newton_schulz(G), 0).transient_bytes
    assert textbook >= 8 * rows * cols
    assert measured < textbook


# ------------------------------------------------------------------ one process, measured


def _step_memory(budget: int, max_in_flight: int = 3):
    params = _params()
    opt = _optimizer(params, budget, max_in_flight)
    set_random_grads(params, 100)
    opt.step()
    set_random_grads(params, 101)
    memory = measure_cpu_step(opt.step, 0)
    return opt, params, memory


@pytest.mark.parametrize("budget", [160 * 1024, 400 * 1024, 4 * MiB])
def test_measured_transient_stays_under_the_budget(budget) -> None:
    opt, _, memory = _step_memory(budget)
    estimate = opt.last_step_stats.workspace_peak_bytes
    # At most one GEMM runs at a time: the library's scratch comes on top of the estimate
    # once (measured for this step's own Newton–Schulz calls, on this machine).
    scratch = gemm_scratch_bytes(opt.last_step_stats.ns_calls)
    assert memory.transient_bytes <= budget + scratch, (memory.transient_bytes, budget, scratch)
    assert memory.transient_bytes <= estimate + scratch, (memory.transient_bytes, estimate)
    assert estimate <= budget


def test_a_larger_budget_holds_more_in_flight() -> None:
    _, _, small = _step_memory(160 * 1024)
    _, _, large = _step_memory(64 * MiB)
    assert large.transient_bytes > small.transient_bytes


def test_local_stacks_are_cut_to_fit_the_budget() -> None:
    params = _params()
    small = _optimizer(params, 160 * 1024)
    large = _optimizer(params, 64 * MiB)
    assert len(small.chunks()) > len(large.chunks())
    peak = workspace_peak_bytes(small.chunks(), 160 * 1024, 3)
    assert peak <= 160 * 1024


def test_the_budget_does_not_change_the_bits() -> None:
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bmm and mm agree per matrix with one thread
    try:
        results = []
        for budget in (160 * 1024, 64 * MiB):
            params = _params()
            opt = _optimizer(params, budget)
            for step in range(3):
                set_random_grads(params, 100 + step)
                opt.step()
            results.append(([p.detach().clone() for p in params], opt.state_dict()))
    finally:
        torch.set_num_threads(torch_threads)
    (a, sa), (b, sb) = results
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for key in sa["state"]:
        assert torch.equal(sa["state"][key]["momentum"], sb["state"][key]["momentum"])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1G", None])
def test_bad_budget_is_refused(bad) -> None:
    with pytest.raises((TypeError, ValueError), match="workspace_bytes must be an int > 0"):
        _optimizer(_params(), bad)


def test_budget_is_live_and_replans() -> None:
    params = _params()
    opt = _optimizer(params, 64 * MiB)
    before = len(opt.chunks())
    opt.workspace_bytes = 160 * 1024
    assert len(opt.chunks()) > before
    with pytest.raises(ValueError, match="workspace_bytes"):
        opt.workspace_bytes = 0  # refused at the assignment: the budget stays
    assert opt.workspace_bytes == 160 * 1024


# ------------------------------------------------------------------ two ranks, measured

WORLDS = WorldPlan("dist_workspace_cases:CASES", lambda _: list(dist_workspace_cases.CASES), (2,))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(dist_workspace_cases.CASES))
def test_distributed(worlds, name) -> None:
    worlds[2].check(name)


# ------------------------------------------------------------------ AdamW runs


def test_adamw_runs_fit_the_budget_and_do_not_change_the_bits() -> None:
    from shardmuon.ops.adamw import TEMP_BYTES_PER_ELEMENT, _runs, adamw_update_

    sizes = [100, 30, 500, 20, 20]
    runs = _runs(sizes, 160 * TEMP_BYTES_PER_ELEMENT)
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    for run in runs:  # within the budget, or a single parameter larger than it
        assert len(run) == 1 or sum(sizes[i] for i in run) <= 160
    assert runs == [[0, 1], [2], [3, 4]]

    def state(seed: int):
        g = torch.Generator().manual_seed(seed)
        return [[torch.randn(n, generator=g) for n in sizes] for _ in range(4)]

    results = []
    for budget in (None, 160 * TEMP_BYTES_PER_ELEMENT, 1):
        X, G, M, V = state(0)
        V = [v.abs() for v in V]
        for step in (1, 2):
            adamw_update_(
                X, G, M, V, lr=0.01, beta1=0.9, beta2=0.95, weight_decay=0.1,
                epsilon=1e-8, step=step, max_temp_bytes=budget,
            )  # fmt: skip
        results.append(X + M + V)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
