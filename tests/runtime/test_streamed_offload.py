"""A trainer that streams each chunk's state to the device and back itself (prime-rl's
loop over ``chunks()`` / ``step_chunk``): bitwise ``step()``, state left where the caller
keeps it, no other chunk's state touched, step counters kept wherever they are, AdamW one
parameter per chunk on request. One process here; 2 ranks in ``dist_offload_cases``; on a
GPU, the memory bound in ``tests/optimizer/test_cuda.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from streaming import ParkedState, streamed_step
from torch import nn

from shardmuon import Muon


def _params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(40, 16), (16, 40), (24, 16), (24, 16), (3, 8, 16), (16,), (24,)]
    return [nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]


def _optimizer(params, **kwargs) -> Muon:
    groups = [
        dict(params=params[:2], algorithm="sinkhorn", lr=0.05),
        dict(params=params[2:5]),
        dict(params=params[5:], algorithm="adamw"),
    ]
    return Muon(groups, lr=0.02, weight_decay=0.1, workspace_bytes=16 * 1024, **kwargs)


def _grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _same(a_params, a, b_params, b) -> None:
    for x, y in zip(a_params, b_params):
        assert torch.equal(x.detach(), y.detach())
        for key, value in a.state[x].items():
            assert torch.equal(value, b.state[y][key]), key


@pytest.mark.parametrize("adamw_chunks", ["group", "parameter"])
def test_streamed_loop_is_bitwise_the_step_and_touches_no_other_chunk(adamw_chunks) -> None:
    ref_params = _params()
    reference = _optimizer(ref_params)
    params = _params()
    opt = _optimizer(params, adamw_chunks=adamw_chunks)
    parked = ParkedState(opt)
    parked.park_all()
    for step in range(4):
        _grads(ref_params, step)
        reference.step()
        _grads(params, step)
        held = streamed_step(opt, parked)
    adamw_held = [n for n, c in zip(held, opt.chunks()) if opt.chunk_info(c).kind == "adamw"]
    assert adamw_held == ([1, 1] if adamw_chunks == "parameter" else [2])
    parked.unpark([p for p in params if id(p) in parked.store])
    _same(ref_params, reference, params, opt)
    # The counters the caller "moved" (new tensors) were kept and advanced, not replaced.
    assert all(float(opt.state[p]["step"]) == 4 for p in params)
    assert all(g["step"] == 4 for g in opt.param_groups)


def test_a_chunk_whose_state_is_elsewhere_is_refused_before_anything_changes() -> None:
    params = _params()
    opt = _optimizer(params)
    parked = ParkedState(opt)
    parked.park_all()
    _grads(params, 0)
    chunk = opt.chunks()[0]
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="is on meta, the parameter on cpu"):
        opt.step_chunk(chunk)  # its state still parked
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    parked.unpark(opt.chunk_info(chunk).params)
    opt.step_chunk(chunk)  # the same round goes on once the state is back


def test_counters_loaded_in_place_into_moved_tensors_are_adopted() -> None:
    """prime-rl's in-place load writes the saved counts into the tensors the optimizer holds
    now; those may be the caller's moved copies."""
    params = _params()
    opt = _optimizer(params)
    for step in range(3):
        _grads(params, step)
        opt.step()
    for p in params:  # the caller moves every counter (a new tensor each)
        opt.state[p]["step"] = opt.state[p]["step"].clone()
    for p in params:
        opt.state[p]["step"].fill_(7.0)  # an in-place load of a step-7 checkpoint
    _grads(params, 3)
    for chunk in opt.chunks():
        opt.step_chunk(chunk)
    assert [g["step"] for g in opt.param_groups] == [8, 8, 8]
    assert all(float(opt.state[p]["step"]) == 8 for p in params)


def test_step_still_brings_every_state_to_its_parameter() -> None:
    """``step()`` (not chunked) steps every chunk: it places all the state itself."""
    params = _params()
    opt = _optimizer(params)
    twin = copy.deepcopy(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for p in params:
        opt.state[p]["momentum"] = opt.state[p]["momentum"].clone()
    _grads(params, 0)
    _grads(twin_params, 0)
    opt.step()
    twin.step()
    _same(twin_params, twin, params, opt)


def test_adamw_chunks_is_checked_planned_and_kept_by_copies() -> None:
    with pytest.raises(ValueError, match="adamw_chunks"):
        _optimizer(_params(), adamw_chunks="tensor")
    opt = _optimizer(_params())
    kinds = [opt.chunk_info(c).kind for c in opt.chunks()]
    assert kinds.count("adamw") == 1
    opt.adamw_chunks = "parameter"
    assert [opt.chunk_info(c).kind for c in opt.chunks()].count("adamw") == 2
    assert copy.deepcopy(opt).adamw_chunks == "parameter"
    assert opt.state_dict()["param_groups"][2]["algorithm"] == "adamw"
