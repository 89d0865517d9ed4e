"""dion's and prime-rl's call sites: their positional and keyword arguments are accepted (and
step like the plain constructor) or refused by name; the default ``adjust_lr``; dion's
``cautious_wd`` refused at construction, on load and at the step, changing nothing.

Single process, CPU; compared bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from checks import (
    assert_same,
    assert_same_optimizers,
    assert_unchanged,
    differs,
    grads_for_shapes,
    optimizer_snapshot,
    set_grads,
)
from fidelity_setup import param, step_with
from torch import nn

from shardmuon import Muon
from shardmuon.config import MuonConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _one_matrix(seed: int = 0) -> list[nn.Parameter]:
    return [param((16, 8), seed), param((8, 16), seed + 1)]


@pytest.mark.parametrize(
    ("args", "kwargs", "same_as"),
    [
        ((), dict(world_mesh=None, fsdp_mesh_dim=0), {}),
        ((), dict(world_mesh=None, fsdp_mesh_dim="dp_shard"), {}),
        ((None, 0.02), {}, dict(lr=0.02)),  # dion: (params, distributed_mesh, lr, ...)
        ((None, 0.02, 0.9), {}, dict(lr=0.02, mu=0.9)),
        ((), dict(use_triton=True), {}),
        ((), dict(distributed_mesh=None), {}),
    ],
)
def test_dion_call_sites_are_accepted(args: tuple, kwargs: dict, same_as: dict) -> None:
    params, ref_params = _one_matrix(), _one_matrix()
    opt = Muon(params, *args, **kwargs)
    ref = Muon(ref_params, **same_as)
    for key, value in same_as.items():
        assert opt.defaults[key] == value
    for s in range(2):
        step_with(opt, params, s)
        step_with(ref, ref_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            dict(world_mesh="x"),
            TypeError,
            r"world_mesh must be None, a DeviceMesh or a ProcessGroup, got str",
        ),
        (dict(distributed_mesh="x"), TypeError, r"distributed_mesh must be None, a DeviceMesh"),
        (
            dict(fsdp_mesh_dim=1.5),
            TypeError,
            r"fsdp_mesh_dim must be None, an int or a mesh dim name, got 1\.5",
        ),
        (dict(use_triton="yes"), TypeError, r"use_triton must be True or False, got 'yes'"),
        (
            dict(newton_schulz_func=lambda x: x),
            ValueError,
            r"newton_schulz_func \(dion's custom orthogonalization\) is not supported",
        ),
    ],
)
def test_dion_call_site_refusals(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        Muon(_one_matrix(), **kwargs)


def test_default_adjust_lr_is_spectral_norm() -> None:
    assert Muon(_one_matrix()).defaults["adjust_lr"] == "spectral_norm"
    runs = {}
    for name, kwargs in (
        ("default", {}),
        ("spectral", dict(adjust_lr="spectral_norm")),
        ("rms", dict(adjust_lr="rms_norm")),
    ):
        params = _one_matrix()
        opt = Muon(params, **kwargs)
        for s in range(2):
            step_with(opt, params, s)
        runs[name] = (opt, params)
    assert_same_optimizers(*runs["default"], *runs["spectral"])
    assert differs(runs["default"][1], runs["rms"][1])


def test_config_default_adjust_lr_is_rms_norm() -> None:
    assert MuonConfig().adjust_lr == "rms_norm"


def test_cautious_wd_is_refused_at_construction_and_on_load() -> None:
    with pytest.raises(ValueError, match=r"param group 0 has cautious_wd=True"):
        Muon([dict(params=_one_matrix(), cautious_wd=True)])
    params, ref_params = _one_matrix(), _one_matrix()
    opt = Muon([dict(params=params, cautious_wd=False)])
    ref = Muon([dict(params=ref_params)])
    step_with(opt, params, 0)
    step_with(ref, ref_params, 0)
    assert_same_optimizers(opt, params, ref, ref_params)
    before = copy.deepcopy(opt.state_dict())
    sd = copy.deepcopy(before)
    sd["param_groups"][0]["cautious_wd"] = True
    with pytest.raises(ValueError, match=r"state dict: param group 0 has cautious_wd=True"):
        opt.load_state_dict(sd)
    assert_same(opt.state_dict(), before)
    opt.param_groups[0]["cautious_wd"] = True
    snap = optimizer_snapshot(opt, params)
    set_grads(params, grads_for_shapes([(16, 8), (8, 16)], 1))
    with pytest.raises(ValueError, match=r"param group 0 has cautious_wd=True"):
        opt.step()
    assert_unchanged(opt, params, snap)


# ------------------------------------------------------------- prime-rl's call site today


def test_max_concurrent_tasks_is_max_in_flight():
    """prime-rl passes ``max_concurrent_tasks`` (its Muon's name for dion's task count):
    taken as ``max_in_flight``, read back under both names, and agreed across ranks as that
    setting (it is the same attribute the agreement digest reads)."""
    weight = torch.nn.Parameter(torch.randn(8, 6))
    opt = Muon([weight], lr=0.02, max_concurrent_tasks=2)
    assert opt.max_in_flight == opt.max_concurrent_tasks == 2
    opt.max_concurrent_tasks = 5
    assert opt.max_in_flight == 5
    assert Muon([weight], lr=0.02).max_in_flight == 3
    assert Muon([weight], lr=0.02, max_in_flight=4, max_concurrent_tasks=4).max_in_flight == 4
    with pytest.raises(ValueError, match="max_in_flight=4 and max_concurrent_tasks=2 disagree"):
        Muon([weight], lr=0.02, max_in_flight=4, max_concurrent_tasks=2)
    with pytest.raises(TypeError, match="max_in_flight"):
        Muon([weight], lr=0.02, max_concurrent_tasks=0.5)


def test_a_state_offloader_is_refused_before_anything_changes():
    """prime-rl's ``step(closure, state_offloader=...)`` is refused with a message naming
    what to use instead; nothing was stepped."""
    weight = torch.nn.Parameter(torch.randn(8, 6))
    weight.grad = torch.randn(8, 6)
    before = weight.detach().clone()
    opt = Muon([weight], lr=0.02)

    class StreamingOffloader:
        pass

    with pytest.raises(TypeError, match=r"offload='state'.*step_chunk"):
        opt.step(state_offloader=StreamingOffloader())
    assert (
        torch.equal(weight, before) and not opt.state[weight].get("momentum", torch.zeros(1)).any()
    )
