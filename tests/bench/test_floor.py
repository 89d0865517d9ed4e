"""The step's floor (``bench/floor.py``): its byte model against a hand count, its FLOPs the
engine's own, its seconds the FLOPs at the rates it measured plus the bytes at the
bandwidth it measured, and a real optimizer's parameters read as the model says."""

from __future__ import annotations

import pytest
import torch

import shardmuon.bench.floor as floor_module
from shardmuon import Muon
from shardmuon.bench.floor import measure_floor, optimizer_params, step_bytes
from shardmuon.ops.orthogonalizer import EngineCost


def test_the_byte_model_by_hand() -> None:
    # fp32 Muon matrix, bf16 grad, fp32 momentum: 8 + 2 + 6 + 8 per element; a bf16 one
    # with bf16 momentum: 4 + 2 + 6 + 4; fp32 AdamW: 16 + 4 + 8; bf16 Sinkhorn with fp32
    # grads and state: 8 + 4 + 4.
    entries = [
        ("muon", 10, 4, 2, 4),
        ("muon", 7, 2, 2, 2),
        ("adamw", 3, 4, 4, 4),
        ("sinkhorn", 5, 2, 4, 4),
    ]
    assert step_bytes(entries) == 10 * 24 + 7 * 16 + 3 * 28 + 5 * 16
    assert step_bytes([]) == 0


def test_the_floor_is_the_flops_at_the_measured_rates_plus_the_bytes(monkeypatch) -> None:
    measured = []

    def rate(shape, device, repeats=5):
        measured.append(tuple(shape))
        return 1e9 * shape[1]  # a different rate per shape

    monkeypatch.setattr(floor_module, "gemm_rate", rate)
    monkeypatch.setattr(floor_module, "memory_bandwidth", lambda d, b, repeats=5: 2e9)
    cost = EngineCost()
    calls = [(3, 16, 32), (2, 48, 16), (3, 16, 32)]
    got = measure_floor(calls, cost, [("muon", 100, 4, 4, 4)], torch.device("cpu"))
    assert measured == [(3, 16, 32), (2, 16, 48)]  # each shape once, wide
    flops = [
        3 * cost.matrix_flops(16, 32),
        2 * cost.matrix_flops(48, 16),
        3 * cost.matrix_flops(16, 32),
    ]
    assert got.ns_flops == sum(flops)
    assert got.ns_seconds == pytest.approx(flops[0] / 16e9 + flops[1] / 16e9 + flops[2] / 16e9)
    assert got.state_bytes == 100 * 26 and got.memory_seconds == pytest.approx(2600 / 2e9)
    assert got.seconds == pytest.approx(got.ns_seconds + got.memory_seconds)
    assert got.as_dict()["seconds"] == got.seconds
    assert (got.gemm_tflops_min, got.gemm_tflops_max) == (16e9 / 1e12, 16e9 / 1e12)


def test_rates_are_measured_for_real_on_this_device() -> None:
    got = measure_floor([(2, 8, 16)], EngineCost(), [("muon", 64, 4, 4, 4)],
                        torch.device("cpu"), copy_bytes=1 << 20, repeats=2)  # fmt: skip
    assert got.gemm_tflops_max > 0 and got.bandwidth_gbs > 0
    assert got.ns_seconds > 0 and got.memory_seconds > 0


def test_a_real_optimizers_parameters() -> None:
    w = torch.nn.Parameter(torch.randn(8, 12))
    b = torch.nn.Parameter(torch.randn(12, dtype=torch.bfloat16))
    idle = torch.nn.Parameter(torch.randn(4, 4))  # no grad: not stepped
    opt = Muon([{"params": [w, idle]}, {"params": [b], "algorithm": "adamw"}])
    w.grad, b.grad = torch.randn(8, 12), torch.randn(12, dtype=torch.bfloat16)
    opt.step()
    assert sorted(e[:4] for e in optimizer_params(opt)) == [("adamw", 12, 2, 2), ("muon", 96, 4, 4)]
    state = {a: s for a, _, _, _, s in optimizer_params(opt)}  # the state's own dtype
    assert state["muon"] == opt.state[w]["momentum"].element_size()
    assert state["adamw"] == opt.state[b]["momentum"].element_size()
