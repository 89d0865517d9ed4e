"""``workspace_bytes="auto"`` (the default): 512 MiB on a CPU; on CUDA the rule of
``device_workspace_bytes`` from the GPU's memory, resolved once into an int (what copies,
checkpoints and the agreement check see), wherever the budget is first read."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from shardmuon import Muon
from shardmuon.config import MuonConfig, build_optimizer
from shardmuon.planning.workspace import (
    DEFAULT_WORKSPACE_BYTES,
    WORKSPACE_GRANULE,
    device_workspace_bytes,
)
from shardmuon.runtime.stepper import StepRunner

GiB = 2**30


@pytest.mark.parametrize(
    ("total", "expected"),
    [
        (141 * 10**9, 8 * GiB),  # H200: 141e9 / 16 = 8.2 GiB
        (80 * 10**9, 4 * GiB + 2 * WORKSPACE_GRANULE),  # H100 80 GB: 4.66 GiB -> 4.5 GiB
        (24 * GiB, DEFAULT_WORKSPACE_BYTES + 4 * WORKSPACE_GRANULE),  # 1.5 GiB
        (4 * GiB, DEFAULT_WORKSPACE_BYTES),  # a small GPU: never below 512 MiB
    ],
)
def test_the_rule(total: int, expected: int) -> None:
    got = device_workspace_bytes(total)
    assert got == expected
    assert got % WORKSPACE_GRANULE == 0
    assert got == DEFAULT_WORKSPACE_BYTES or got <= total // 16


def test_auto_resolves_once_on_a_cpu_and_stays_an_int() -> None:
    p = torch.nn.Parameter(torch.randn(8, 12))
    opt = Muon([p])
    assert opt.workspace_bytes == DEFAULT_WORKSPACE_BYTES
    assert copy.deepcopy(opt).workspace_bytes == DEFAULT_WORKSPACE_BYTES
    assert Muon([p], workspace_bytes=4096).workspace_bytes == 4096
    opt.workspace_bytes = "auto"  # set again later: resolved at the next step
    p.grad = torch.randn(8, 12)
    opt.step()
    assert opt.workspace_bytes == DEFAULT_WORKSPACE_BYTES
    assert MuonConfig().workspace_bytes == "auto"
    built = build_optimizer(torch.nn.Sequential(torch.nn.Linear(12, 8)), MuonConfig())
    assert built.workspace_bytes == DEFAULT_WORKSPACE_BYTES


def test_auto_on_cuda_reads_the_device_memory(monkeypatch) -> None:
    """The CUDA branch, with the device and its memory stood in for (no GPU needed): the
    budget follows the GPU's size, not its free memory (ranks differ there), and little free
    memory is warned about, without changing the budget."""
    p = torch.nn.Parameter(torch.randn(8, 12))
    opt = Muon([p], workspace_bytes=4096)
    asked = []
    free = [100 * GiB]

    def mem_get_info(device):
        asked.append(device)
        return free[0], 141 * 10**9

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(StepRunner, "device", lambda self: torch.device("cuda", 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.runner.auto_workspace_bytes() == 8 * GiB
    assert asked == [torch.device("cuda", 3)]
    for little in (15 * GiB, 6 * GiB + 1, 6 * GiB - 1):  # around any step: the same
        free[0] = little
        with pytest.warns(UserWarning, match="but .* GiB is free on it now"):
            assert opt.runner.auto_workspace_bytes() == 8 * GiB


def test_auto_set_after_construction_is_resolved_wherever_the_budget_is_read() -> None:
    """Was a bug: load_state_dict planned with the string before a step resolved it."""
    p = torch.nn.Parameter(torch.randn(8, 12))
    opt = Muon([p], workspace_bytes=4096)
    p.grad = torch.randn(8, 12)
    opt.step()
    saved = opt.state_dict()
    opt.workspace_bytes = "auto"
    opt.load_state_dict(saved)
    assert opt.workspace_bytes == DEFAULT_WORKSPACE_BYTES
    opt.workspace_bytes = "auto"
    assert opt.chunks() and opt.workspace_bytes == DEFAULT_WORKSPACE_BYTES


@pytest.mark.parametrize("value", ["big", "", 0, -1, 1.5, True, None])
def test_refused_values_say_what_is_accepted(value) -> None:
    p = torch.nn.Parameter(torch.randn(8, 12))
    with pytest.raises((TypeError, ValueError), match="an int > 0 \\(bytes\\) or 'auto'"):
        Muon([p], workspace_bytes=value)
    with pytest.raises(ValueError, match="an int > 0 \\(bytes\\) or 'auto'"):
        MuonConfig(workspace_bytes=value)
