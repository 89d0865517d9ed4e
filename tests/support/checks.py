"""The grad and bitwise helpers of the single-process tests (one home for all of them)."""

from __future__ import annotations

import torch
from torch import Tensor


def set_random_grads(params, seed: int, scale: float = 1.0) -> None:
    """Give every parameter a standard-normal grad (times ``scale``) in its dtype, drawn in
    order from one generator seeded ``seed``: the same grads for every run with that seed."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def assert_bitwise(a: Tensor, b: Tensor, what: str = "") -> None:
    """Same dtype, shape and bits; the message gives the largest difference."""
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
    )
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{what}: max |diff| {diff:.3g}")


def state_tensor_keys(opt, p: Tensor) -> list[str]:
    return sorted(k for k, v in opt.state[p].items() if isinstance(v, Tensor))


def assert_same_optimizers(opt_a, params_a, opt_b, params_b) -> None:
    """Params, every state tensor (step counters included) and the groups' steps bitwise
    equal. (``state_dict()`` first: with offload it waits for stores still in flight.)"""
    opt_a.state_dict()
    opt_b.state_dict()
    for i, (pa, pb) in enumerate(zip(params_a, params_b)):
        assert_bitwise(pa.detach(), pb.detach(), f"param {i}")
        assert state_tensor_keys(opt_a, pa) == state_tensor_keys(opt_b, pb), f"param {i}"
        for key in state_tensor_keys(opt_a, pa):
            assert_bitwise(opt_a.state[pa][key], opt_b.state[pb][key], f"param {i} {key}")
    steps_a = [g["step"] for g in opt_a.param_groups]
    assert steps_a == [g["step"] for g in opt_b.param_groups], "group steps differ"
