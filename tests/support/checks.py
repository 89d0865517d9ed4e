"""The grad and bitwise helpers of the single-process tests (one home for all of them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter


def set_random_grads(params, seed: int, scale: float = 1.0) -> None:
    """Give every parameter a standard-normal grad (times ``scale``) in its dtype, drawn in
    order from one generator seeded ``seed``: the same grads for every run with that seed."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def grads_for(step: int, ps: list[Tensor]) -> list[Tensor]:
    """The gradients of step ``step`` for the parameters ``ps``: the same values for every
    run, drawn in float64 and cast to each parameter's dtype."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in ps]


def grads_for_shapes(shapes: list[tuple[int, ...]], seed: int) -> list[Tensor]:
    """The float32 gradients of step ``seed`` for tensors of ``shapes``: the same values
    for every run."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def set_grads(params, grads) -> None:
    """Give each parameter a copy of its grad in ``grads`` (in order)."""
    for p, g in zip(params, grads):
        p.grad = g.clone()


def set_named_grads(params: dict[str, Tensor], grads: dict[str, Tensor]) -> None:
    """Give each named parameter a (detached) copy of ``grads[name]``."""
    for n, p in params.items():
        p.grad = grads[n].detach().clone()


def clone_params(params) -> list[Parameter]:
    """New parameters holding copies of ``params``' values (a twin for a reference run)."""
    return [Parameter(p.detach().clone()) for p in params]


def snapshot(params) -> list[Tensor]:
    """Detached copies of the parameters' current values."""
    return [p.detach().clone() for p in params]


def snapshot_named(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detached copies of the named parameters' current values, by name."""
    return {n: p.detach().clone() for n, p in params.items()}


def differs(params_a, params_b) -> bool:
    """Whether any parameter of ``params_a`` differs in a bit from its twin in ``params_b``."""
    return any(not torch.equal(a.detach(), b.detach()) for a, b in zip(params_a, params_b))


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Same dtype and bits, NaN where the other is NaN whatever its payload (NaN payloads
    differ between platforms and kernels)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    both_nan = a.isnan() & b.isnan()
    return torch.equal(
        a.masked_fill(both_nan, 0).view(torch.uint8), b.masked_fill(both_nan, 0).view(torch.uint8)
    )


def assert_bitwise(a: Tensor, b: Tensor, what: str = "") -> None:
    """Same dtype, shape and bits; the message gives the largest difference."""
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
    )
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{what}: max |diff| {diff:.3g}")


def assert_all_bitwise(actual, expected, what: str = "param") -> None:
    """As many tensors, each with the same dtype, shape and bits as its twin."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} tensors vs {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise(a, e, f"{what} {i} (shape {tuple(a.shape)})")


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Recursive equality for state dicts and param groups: tensors compared bitwise (dtype
    and shape too), dicts by their keys, lists and tuples by type and length."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        assert isinstance(a, Tensor) and isinstance(b, Tensor), f"{path}: {a!r} vs {b!r}"
        assert_bitwise(a, b, path)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a)} vs {set(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def state_tensor_keys(opt, p: Tensor) -> list[str]:
    return sorted(k for k, v in opt.state[p].items() if isinstance(v, Tensor))


def params_of(opt) -> list[Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def assert_same_state(opt_a, opt_b) -> None:
    """Per-parameter state equal (:func:`assert_same`), matched by position (the optimizers
    hold different tensors)."""
    for i, (a, b) in enumerate(zip(params_of(opt_a), params_of(opt_b))):
        assert_same(opt_a.state[a], opt_b.state[b], f"state of param {i}")


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


def optimizer_snapshot(opt, params) -> tuple[list[Tensor], list[dict], list[Any]]:
    """Copies of the params, of every state tensor and of the groups' steps, for
    :func:`assert_unchanged`."""
    return (
        snapshot(params),
        [{k: opt.state[p][k].clone() for k in state_tensor_keys(opt, p)} for p in params],
        [g["step"] for g in opt.param_groups],
    )


def assert_unchanged(opt, params, snap) -> None:
    """Params, state tensors and group steps bitwise as :func:`optimizer_snapshot` saw them."""
    values, states, steps = snap
    for i, (p, v, s) in enumerate(zip(params, values, states)):
        assert_bitwise(p.detach(), v, f"param {i}")
        assert state_tensor_keys(opt, p) == sorted(s)
        for key, value in s.items():
            assert_bitwise(opt.state[p][key], value, f"param {i} {key}")
    assert [g["step"] for g in opt.param_groups] == steps
