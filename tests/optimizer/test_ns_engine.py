"""``Muon``'s Newton–Schulz engine settings: ``newton_schulz_impl="gram"``, the iteration
dtype, Gram's restarts and the divergence guard, against the pure functions they run."""

from __future__ import annotations

import pytest
import torch
from checks import set_random_grads

from shardmuon import Muon
from shardmuon.ops.newton_schulz import newton_schulz
from shardmuon.ops.newton_schulz_gram import newton_schulz_gram


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


def test_the_guard_counts_and_recomputes_a_diverged_result_in_the_step(monkeypatch) -> None:
    """The step's guard (on by default for gram) passes ordinary results unflagged, and a
    result above the band (here: Gram's made 1.5x too large) is recomputed by the standard
    fp32 iteration and counted in the step's stats."""
    import dataclasses

    from shardmuon.ops.engines import ENGINES
    from shardmuon.ops.normalize import Normalized

    ps = _params(((32, 128),))
    opt = Muon(ps, newton_schulz_impl="gram", lr=0.02)
    set_random_grads(ps, 0)
    opt.step()
    stats = opt.last_step_stats
    assert (stats.ns_checked, stats.ns_fallbacks) == (1, 0)
    assert 0 < stats.ns_worst_ratio < 1.15
    gram = ENGINES["gram"]

    def diverged(G, *args, **kwargs):
        out = gram.run(G, *args, **kwargs)
        return Normalized(out.X * 1.5, out.nonfinite)

    monkeypatch.setitem(ENGINES, "gram", dataclasses.replace(gram, run=diverged))
    U = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    (got,) = opt.orthogonalize_chunk(ps, [U])
    expected = newton_schulz(U.bfloat16().float(), dtype=torch.float32).to(torch.bfloat16)
    assert torch.equal(got, expected)
    set_random_grads(ps, 1)
    opt.step()
    stats = opt.last_step_stats
    assert (stats.ns_checked, stats.ns_fallbacks) == (1, 1), stats
    assert "divergence guard: 1 checked, 1 recomputed" in str(stats)


def test_an_explicit_false_turns_the_guard_off_under_auto_too() -> None:
    from shardmuon.ops.orthogonalizer import Orthogonalizer

    assert Orthogonalizer("auto", guard=False).guards == {"folded": False, "gram": False}
    assert Orthogonalizer("auto").guards == {"folded": False, "gram": True}
    assert Orthogonalizer("folded", guard=True).guards == {"folded": True}


@pytest.mark.parametrize(("guard", "checked"), [(None, 5), (False, 0), (True, 6)])
def test_a_muon_step_under_auto_guards_its_gram_calls_as_told(
    monkeypatch: pytest.MonkeyPatch, guard: bool | None, checked: int
) -> None:
    """The whole optimizer, not only the Orthogonalizer: with ``"auto"`` measured to pick
    Gram for every non-square class, ``newton_schulz_guard=False`` checks no matrix, the
    default checks every Gram result and ``True`` every result."""
    from shardmuon.runtime import calibration

    monkeypatch.setattr(calibration, "_CHOICES", {})
    monkeypatch.setattr(
        calibration, "time_engines", lambda *args, **kwargs: {"folded": 2.0, "gram": 1.0}
    )
    ps = _params()
    opt = Muon(ps, newton_schulz_impl="auto", newton_schulz_guard=guard)
    set_random_grads(ps, 0)
    opt.step()
    stats = opt.last_step_stats
    # 16x48, 48x16 and the 3 matrices of 3x8x32 run Gram; the square 24x24 runs folded.
    assert stats.ns_checked == checked, stats


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
        (
            dict(newton_schulz_impl="gram", newton_schulz_restarts=(0,)),
            ValueError,
            r"newton_schulz_restarts must be None or",
        ),
        (
            dict(newton_schulz_impl="gram", newton_schulz_restarts=2),
            ValueError,
            r"got 2 \(an int\); write a tuple of steps, e.g. \(2,\)",
        ),
        (
            dict(newton_schulz_impl="gram", newton_schulz_restarts="25"),
            ValueError,
            r"got '25' \(a str\)",
        ),
        (
            dict(newton_schulz_impl="gram", newton_schulz_restarts=(5,)),
            ValueError,
            r"names step 5, but the schedule has 5 steps",
        ),
        (
            dict(newton_schulz_impl="gram", newton_schulz_restarts=()),
            ValueError,
            r"leaves steps 1..5 of the 5-step schedule without a restart",
        ),
        (
            dict(newton_schulz_impl="gram", newton_schulz_restarts=(4,)),
            ValueError,
            r"leaves steps 1..4 of the 5-step schedule",
        ),
        (
            dict(newton_schulz_restarts=(2,)),
            ValueError,
            r"applies to newton_schulz_impl='gram' \(or 'auto'\), not 'folded'",
        ),
        (
            dict(newton_schulz_impl="gram", newton_schulz_restarts=(1.5,)),
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
    from shardmuon.ops.orthogonalizer import auto_choice

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
