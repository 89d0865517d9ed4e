"""``Muon``'s Newton–Schulz engine settings: ``newton_schulz_impl="gram"``, the iteration
dtype, Gram's restarts and the divergence guard, against the pure functions they run."""

from __future__ import annotations

import pytest
import torch
from checks import set_random_grads

from shardmuon import Muon
from shardmuon.ops.gram_newton_schulz import newton_schulz_gram
from shardmuon.ops.newton_schulz import newton_schulz


def _params(shapes=((16, 48), (48, 16), (24, 24), (3, 8, 32))):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(newton_schulz_impl="gram"), lambda u: newton_schulz_gram(u)),
        (
            dict(newton_schulz_impl="gram", newton_schulz_restarts=(1, 3)),
            lambda u: newton_schulz_gram(u, restarts=(1, 3)),
        ),
        (
            dict(newton_schulz_impl="gram", newton_schulz_dtype=torch.float16),
            lambda u: newton_schulz_gram(u, dtype=torch.float16).to(torch.bfloat16),
        ),
        (
            dict(newton_schulz_dtype="float32"),
            lambda u: newton_schulz(u, dtype=torch.float32).to(torch.bfloat16),
        ),
        (dict(newton_schulz_guard=True), lambda u: newton_schulz(u)),
    ],
)
def test_the_engine_runs_what_its_settings_say(kwargs, expected) -> None:
    """``orthogonalize_chunk`` returns exactly the pure function's bf16 result."""
    ps = _params()
    opt = Muon(ps, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for p in ps:
        u = torch.randn(p.shape, generator=gen)
        (got,) = opt.orthogonalize_chunk([p], [u])
        want = expected(u.to(torch.bfloat16).reshape(-1, *p.shape[-2:])).reshape(p.shape)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want), (kwargs, tuple(p.shape))


def test_the_guard_counts_and_recomputes_gram_without_restarts_on_low_rank_grads() -> None:
    """Gram in fp16 without restarts on a rank-2 direction diverges; the guard (on by default
    for gram) recomputes it and says so in the step's stats; ordinary grads pass unflagged.
    (bf16 Gram's fp32 GEMMs on a CPU do not diverge there: ``ops`` tests cover that.)"""
    ps = _params(((32, 128),))
    opt = Muon(
        ps,
        newton_schulz_impl="gram",
        newton_schulz_dtype="float16",
        newton_schulz_restarts=(),
        lr=0.02,
    )
    set_random_grads(ps, 0)
    opt.step()
    stats = opt.last_step_stats
    assert (stats.ns_checked, stats.ns_fallbacks) == (1, 0)
    assert 0 < stats.ns_worst_ratio < 1.15
    gen = torch.Generator().manual_seed(2)
    low_rank = torch.randn(32, 2, generator=gen) @ torch.randn(2, 128, generator=gen)
    ps[0].grad = low_rank + 1e-3 * torch.randn(32, 128, generator=gen)
    opt.state[ps[0]]["momentum"].zero_()
    opt.step()
    stats = opt.last_step_stats
    assert (stats.ns_checked, stats.ns_fallbacks) == (1, 1), stats
    assert "divergence guard: 1 checked, 1 recomputed" in str(stats)


def test_the_guard_is_off_by_default_for_the_standard_iteration() -> None:
    ps = _params()
    opt = Muon(ps)
    set_random_grads(ps, 0)
    opt.step()
    assert opt.last_step_stats.ns_checked == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(newton_schulz_dtype="float64"), ValueError, r"unknown newton_schulz_dtype 'float64'"),
        (
            dict(newton_schulz_dtype=torch.int8),
            ValueError,
            r"accepted: torch.bfloat16, torch.float16",
        ),
        (dict(newton_schulz_restarts=(0,)), ValueError, r"newton_schulz_restarts must be None or"),
        (
            dict(newton_schulz_restarts=(1.5,)),
            ValueError,
            r"a sequence of steps >= 1, got \(1.5,\)",
        ),
        (dict(newton_schulz_guard="yes"), TypeError, r"newton_schulz_guard must be None, True or"),
        (dict(newton_schulz_impl="gramm"), ValueError, r"accepted: 'folded', .*'gram'"),
    ],
)
def test_bad_engine_settings_are_refused(kwargs, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        Muon(_params(), **kwargs)


def test_the_engine_settings_survive_a_copy_and_enter_the_config() -> None:
    import copy

    from shardmuon.config import MuonConfig, build_optimizer

    opt = Muon(_params(), newton_schulz_impl="gram", newton_schulz_dtype="float16",
               newton_schulz_restarts=[2, 4], newton_schulz_guard=False)  # fmt: skip
    twin = copy.deepcopy(opt)
    assert (twin.newton_schulz_impl, twin.newton_schulz_dtype) == ("gram", "float16")
    assert (twin.newton_schulz_restarts, twin.newton_schulz_guard) == ((2, 4), False)
    config = MuonConfig(newton_schulz_impl="gram", newton_schulz_restarts=[2])
    model = torch.nn.Sequential(torch.nn.Linear(8, 16))
    built = build_optimizer(model, config)
    assert (built.newton_schulz_impl, built.newton_schulz_restarts) == ("gram", (2,))


def test_auto_picks_by_a_rule_of_shape_and_device_alone() -> None:
    """The rule every rank applies alike: Gram for aspect >= 2.5 on CUDA, folded otherwise
    (on this CPU: folded everywhere, which the measurements support)."""
    from shardmuon.ops.ns_engine import auto_choice

    assert auto_choice((8, 128, 512), "cuda") == "gram"
    assert auto_choice((8, 512, 128), "cuda") == "gram"
    assert auto_choice((8, 256, 512), "cuda") == "folded"
    assert auto_choice((8, 128, 512), "cpu") == "folded"
    ps = _params()
    opt = Muon(ps, newton_schulz_impl="auto")
    gen = torch.Generator().manual_seed(1)
    for p in ps:
        u = torch.randn(p.shape, generator=gen)
        (got,) = opt.orthogonalize_chunk([p], [u])
        want = newton_schulz(u.to(torch.bfloat16).reshape(-1, *p.shape[-2:])).reshape(p.shape)
        assert torch.equal(got, want)
