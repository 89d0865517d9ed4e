"""Issue #19's escapes that one process can reproduce: validation after load pre-hooks, the
shape of ``orthogonalize_chunk``'s directions, huge and non-finite gradients, offloaded
state that cannot be viewed, batch-independent Newton–Schulz bits, ``bench plan`` sizes.

Each is compared with an independent reference: the same optimizer without the hazard, or
a float64 Newton–Schulz.
"""

from __future__ import annotations

import copy

import pytest
import torch
from checks import set_random_grads
from torch import nn

from shardmuon import Muon
from shardmuon.bench.plan import MAX_WORLD_SIZE, parse_world_sizes
from shardmuon.ops.newton_schulz import (
    newton_schulz,
    newton_schulz_per_matrix,
    newton_schulz_reference,
)

SHAPES = [(6, 4), (5, 13), (3, 8, 6)]


def _params(seed: int = 0, shapes=SHAPES) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


_grads = set_random_grads


# ------------------------------------------------------------------ load pre-hooks (class 6)


def _stepped_once() -> tuple[list[nn.Parameter], Muon, dict]:
    """A Muon after one step, and its state dict."""
    params = _params()
    opt = Muon(params, lr=0.02)
    _grads(params, 1)
    opt.step()
    return params, opt, opt.state_dict()


def test_a_pre_hooks_returned_state_dict_is_validated_before_anything_changes() -> None:
    params, opt, saved = _stepped_once()

    def wrong_shape(optimizer, state_dict):
        bad = copy.deepcopy(state_dict)
        bad["state"][0]["momentum"] = torch.zeros(4, 6)  # the parameter is (6, 4)
        return bad

    opt.register_load_state_dict_pre_hook(wrong_shape)
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    steps = [g["step"] for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"\(4, 6\)"):
        opt.load_state_dict(saved)
    assert [g["step"] for g in opt.param_groups] == steps
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in before.items())
    _grads(params, 2)
    opt.step()  # still steps (nothing half-loaded)


def test_a_pre_hook_runs_once_and_its_result_is_what_loads() -> None:
    _, _, saved = _stepped_once()
    calls = []

    def halve(optimizer, state_dict):
        calls.append(1)
        edited = copy.deepcopy(state_dict)
        edited["state"][0]["momentum"] = edited["state"][0]["momentum"] / 2
        return edited

    for offload in (None, "state"):
        calls.clear()
        fresh = Muon(_params(), lr=0.02, offload=offload)
        fresh.register_load_state_dict_pre_hook(halve)
        fresh.load_state_dict(saved)
        assert len(calls) == 1
        got = fresh.state_dict()["state"][0]["momentum"]
        assert torch.equal(got, saved["state"][0]["momentum"] / 2)


# ------------------------------------------------------------------ orthogonalize_chunk (7)


@pytest.mark.parametrize("shape", [(4, 6), (24,), (5, 4), (6, 4, 1)])
def test_orthogonalize_chunk_refuses_directions_not_shaped_like_the_parameter(shape) -> None:
    params = _params()
    opt = Muon(params)
    with pytest.raises(ValueError, match=r"U\[0\] has local shape .* \(6, 4\)"):
        opt.orthogonalize_chunk([params[0]], [torch.randn(shape)])


def test_orthogonalize_chunk_is_newton_schulz_of_each_direction() -> None:
    params = _params()
    opt = Muon(params)
    U = torch.randn(6, 4)
    (out,) = opt.orthogonalize_chunk([params[0]], [U])
    assert torch.equal(out, newton_schulz(U.bfloat16()))  # directions travel in bf16


# ------------------------------------------------------------------ huge grads (class 8)


@pytest.mark.parametrize("scale", [2.0**60, 2.0**100, 1e18, 1e30])
def test_huge_gradients_give_the_update_of_the_same_direction(scale) -> None:
    """The direction is normalised: a grad scaled by 1e18 must move the weights as the
    unscaled grad does (it used to overflow to an all-zero update)."""
    small, huge = _params(), _params()
    opt_small = Muon(small, lr=0.02, mu=0.0, weight_decay=0.0)
    opt_huge = Muon(huge, lr=0.02, mu=0.0, weight_decay=0.0)
    _grads(small, 5)
    _grads(huge, 5, scale)
    opt_small.step()
    opt_huge.step()
    for a, b, p0 in zip(small, huge, _params()):
        moved = (a - p0).abs().max()
        assert moved > 0
        # Powers of two scale exactly: the same bits; other scales round the direction
        # to bf16 differently (one bf16 ulp of the direction).
        if scale in (2.0**60, 2.0**100):
            assert torch.equal(a, b)
        else:
            assert (a - b).abs().max() <= 0.02 * moved


def test_huge_direction_matches_float64_newton_schulz() -> None:
    G = torch.randn(48, 80, dtype=torch.float64)
    want = newton_schulz_reference(G)
    for scale in (1.0, 1e18, 1e30):
        got = newton_schulz((G * scale).float()).double()
        assert (got - want).norm() / want.norm() < 0.02, scale


def test_a_non_finite_gradient_skips_that_matrix_and_is_counted() -> None:
    clean, dirty = _params(), _params()
    opt_clean = Muon(clean, lr=0.02, weight_decay=0.1)
    opt_dirty = Muon(dirty, lr=0.02, weight_decay=0.1)
    _grads(clean, 5)
    _grads(dirty, 5)
    dirty[0].grad[2, 1] = float("nan")
    dirty[2].grad[1, 0, 0] = float("inf")  # one matrix of the stack
    opt_clean.step()
    opt_dirty.step()
    p0 = _params()
    assert opt_dirty.last_step_stats.nonfinite_matrices == 2
    assert opt_clean.last_step_stats.nonfinite_matrices == 0
    # skipped: only the decoupled weight decay applied (lr * wd = 0.002)
    assert torch.equal(dirty[0], p0[0] * (1 - 0.02 * 0.1))
    assert torch.equal(dirty[2][1], p0[2][1] * (1 - 0.02 * 0.1))
    # everything else is exactly the clean step
    assert torch.equal(dirty[1], clean[1])
    assert torch.equal(dirty[2][0], clean[2][0]) and torch.equal(dirty[2][2], clean[2][2])
    assert all(torch.isfinite(p).all() for p in dirty)


# ------------------------------------------------------------------ offload (class 4)


def _run(params, opt, steps: int = 3, seed: int = 10) -> None:
    for step in range(steps):
        _grads(params, seed + step)
        opt.step()


CONV = [(6, 3, 2, 2), (5, 4)]


@pytest.mark.parametrize("offload_later", [False, True])
def test_offloaded_momentum_that_cannot_be_viewed_is_really_updated(offload_later) -> None:
    """A channels_last momentum put in by the user, or offload switched on after
    construction: the same bits as plain state, the momentum really updated."""
    ref_params, params = _params(shapes=CONV), _params(shapes=CONV)
    ref = Muon(ref_params, lr=0.02, flatten=True)
    opt = Muon(params, lr=0.02, flatten=True, offload=None if offload_later else "state")
    _run(ref_params, ref, 1)
    _run(params, opt, 1)
    for p in params:  # the user replaces the state with a non-viewable copy
        m = opt.state[p]["momentum"]
        if m.dim() == 4:
            opt.state[p]["momentum"] = m.clone().to(memory_format=torch.channels_last)
    if offload_later:
        opt.offload = "state"
    _run(ref_params, ref, 2, seed=20)
    _run(params, opt, 2, seed=20)
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)
        assert torch.equal(ref.state[a]["momentum"], opt.state[b]["momentum"])
        assert opt.state[b]["momentum"].is_contiguous()
    assert opt.last_step_stats.offload_bytes_loaded > 0


def test_offload_switched_off_after_construction_keeps_the_bits() -> None:
    ref_params, params = _params(), _params()
    ref = Muon(ref_params, lr=0.02)
    opt = Muon(params, lr=0.02, offload="state")
    _run(ref_params, ref, 1)
    _run(params, opt, 1)
    opt.offload = None
    _run(ref_params, ref, 2, seed=20)
    _run(params, opt, 2, seed=20)
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)
    assert opt.last_step_stats.offload_bytes_loaded == 0


# ------------------------------------------------------------------ batch invariance (9)


def test_per_matrix_bits_do_not_depend_on_the_batch() -> None:
    """``newton_schulz_per_matrix``: a matrix's bits are the same alone and in any batch,
    on many random small shapes (the batched kernels need not be: see the docs)."""
    g = torch.Generator().manual_seed(9)
    for _ in range(150):
        m, n, b = (int(v) for v in torch.randint(1, 24, (3,), generator=g))
        G = torch.randn(b + 1, m, n, generator=g)
        whole = newton_schulz_per_matrix(G)
        for i in range(b + 1):
            assert torch.equal(newton_schulz_per_matrix(G[i : i + 1])[0], whole[i])
            assert torch.equal(newton_schulz(G[i]), whole[i])


def test_per_matrix_steps_equal_folded_within_rounding() -> None:
    a, b = _params(), _params()
    opt_a = Muon(a, lr=0.02)
    opt_b = Muon(b, lr=0.02, newton_schulz_impl="per-matrix")
    _run(a, opt_a, 2)
    _run(b, opt_b, 2)
    for x, y in zip(a, b):
        assert (x - y).abs().max() <= 1e-3


# ------------------------------------------------------------------ bench plan (class 10)


def test_bench_plan_refuses_world_sizes_it_cannot_lay_out_in_reasonable_time() -> None:
    assert parse_world_sizes(f"8,{MAX_WORLD_SIZE}") == [8, MAX_WORLD_SIZE]
    with pytest.raises(ValueError, match=f"1000003 .* 1 to {MAX_WORLD_SIZE}"):
        parse_world_sizes("8,1000003")


def test_a_refusal_names_the_first_field_that_differs_and_each_ranks_value() -> None:
    """``first_difference`` (what every rank's agreement error says, issue #19 class 5)."""
    from shardmuon.runtime.agreement import first_difference

    same = ("settings", (("lr", 0.01), ("mu", 0.95)))
    lr = ("settings", (("lr", 0.02), ("mu", 0.95)))
    batch = ("batch 1 (6x5 matrices, as a replica)", (("owners", (0,)),))
    assert first_difference([[same], [same], [lr]], [0, 4, 2]) == (
        "settings: lr (ranks 0, 4: 0.01; rank 2: 0.02)"
    )
    message = first_difference([[same, batch], [same, ("end", ())]], [0, 1])
    assert message.startswith("item 1 of the step: rank 0: 'batch 1 (6x5")
    assert "rank 1: 'end'" in message
    assert first_difference([[same], [same, batch]], [0, 1]) == (
        "the number of batches (rank 0: 0; rank 1: 1)"
    )
    many = first_difference([[("s", (("x", i),))] for i in range(7)], list(range(7)))
    assert many.endswith("rank 3: 3; 3 more values)")
