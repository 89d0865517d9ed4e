"""``workspace_bytes="auto"`` (the default): 512 MiB on a CPU; on CUDA the rule of
``device_workspace_bytes`` from the device's total and free memory, resolved once into an
int (what copies, checkpoints and the agreement check see)."""

from __future__ import annotations

import copy

import pytest
import torch

from shardmuon import Muon
from shardmuon.config import MuonConfig, build_optimizer
from shardmuon.planning.workspace import (
    DEFAULT_WORKSPACE_BYTES,
    WORKSPACE_GRANULE,
    device_workspace_bytes,
)

GiB = 2**30


@pytest.mark.parametrize(
    ("total", "free", "expected"),
    [
        (141 * 10**9, 120 * 10**9, 8 * GiB + 0 * WORKSPACE_GRANULE),  # H200: 141e9 / 16
        (80 * 10**9, 70 * 10**9, 4 * GiB + 2 * WORKSPACE_GRANULE),  # H100 80 GB: 4.5 GiB
        (141 * 10**9, 6 * GiB, 3 * GiB),  # little free: half of it
        (24 * GiB, 20 * GiB, DEFAULT_WORKSPACE_BYTES + 4 * WORKSPACE_GRANULE),  # 1.5 GiB
        (4 * GiB, 3 * GiB, DEFAULT_WORKSPACE_BYTES),  # a small GPU: never below 512 MiB
        (141 * 10**9, 0, DEFAULT_WORKSPACE_BYTES),
    ],
)
def test_the_rule(total: int, free: int, expected: int) -> None:
    got = device_workspace_bytes(total, free)
    assert got == expected
    assert got % WORKSPACE_GRANULE == 0
    assert got >= DEFAULT_WORKSPACE_BYTES
    # no more than a sixteenth of the device and half of what is free, unless the floor
    assert got == DEFAULT_WORKSPACE_BYTES or (got <= total // 16 and got <= free // 2)


def test_ranks_whose_free_memory_differs_a_little_agree() -> None:
    values = {
        device_workspace_bytes(80 * 10**9, free) for free in range(60 * 10**9, 61 * 10**9, 10**7)
    }
    assert values == {device_workspace_bytes(80 * 10**9, 60 * 10**9)}


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
    """The CUDA branch, with the device and its memory stood in for (no GPU needed)."""
    p = torch.nn.Parameter(torch.randn(8, 12))
    opt = Muon([p], workspace_bytes=4096)
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 100 * GiB, 141 * 10**9

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(Muon, "_device", lambda self: torch.device("cuda", 3))
    assert opt._auto_workspace_bytes() == 8 * GiB
    assert asked == [torch.device("cuda", 3)]


@pytest.mark.parametrize("value", ["big", "", 0, -1, 1.5, True, None])
def test_refused_values_say_what_is_accepted(value) -> None:
    p = torch.nn.Parameter(torch.randn(8, 12))
    with pytest.raises((TypeError, ValueError), match="an int > 0 \\(bytes\\) or 'auto'"):
        Muon([p], workspace_bytes=value)
    with pytest.raises(ValueError, match="an int > 0 \\(bytes\\) or 'auto'"):
        MuonConfig(workspace_bytes=value)
