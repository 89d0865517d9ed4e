"""Warming the step's groups up (``runtime/warmup.py``): when it is on by default, which
groups it runs on and how often; the collectives themselves run in the gloo worlds
(``dist_cases`` "warmup_every_group", ``dist_overlap_cases``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardmuon import Muon
from shardmuon.runtime import warmup as warmup_module
from shardmuon.runtime.warmup import GroupWarmup, wants_warmup, warm_up


@pytest.mark.parametrize(
    ("setting", "backend", "device", "expected"),
    [
        (None, "nccl", "cuda", True),  # the default on a GPU job: on
        (None, "gloo", "cuda", False),
        (None, "nccl", "cpu", False),
        (True, "gloo", "cpu", True),
        (False, "nccl", "cuda", False),
    ],
)
def test_warmup_is_on_by_default_where_nccl_runs_the_collectives(
    monkeypatch, setting, backend, device, expected
):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(warmup_module, "backend_serving", lambda group, kind: backend)
    assert wants_warmup(setting, object(), torch.device(device)) is expected


def test_each_group_object_is_warmed_once_and_again_for_larger_messages(monkeypatch):
    """Two groups over the same ranks (a mesh's and the overlapped step's) are two
    communicators: both warmed; a second call for the same sizes warms nothing; a plan with
    a larger piece warms again, for the larger of the two needs."""
    monkeypatch.setattr(warmup_module, "_WARMED", {})
    runs = []
    monkeypatch.setattr(
        warmup_module, "_run", lambda group, ranks, need, device: runs.append((group, need))
    )
    mesh_group, step_group, other = object(), object(), object()
    groups = {(0, 1): [mesh_group, step_group], (2, 3): [other]}
    sizes = {(0, 1): GroupWarmup(piece=100), (2, 3): GroupWarmup(broadcast=7)}
    assert warm_up(groups, sizes, torch.device("cpu")) == 3
    assert [g for g, _ in runs] == [mesh_group, step_group, other]
    assert warm_up(groups, sizes, torch.device("cpu")) == 0
    larger = {(0, 1): GroupWarmup(piece=50, broadcast=9)}
    assert warm_up({(0, 1): [step_group]}, larger, torch.device("cpu")) == 1
    assert runs[-1] == (step_group, GroupWarmup(piece=100, broadcast=9))


def test_a_warmup_setting_other_than_a_bool_or_none_is_refused():
    with pytest.raises(TypeError, match="warmup must be True, False or None"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], warmup="yes")
