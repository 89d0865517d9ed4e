"""AOL preconditioning (``newton_schulz_preconditioner="aol"``) against an independent fp64
reference, on every engine, and its wiring: the 4-step default, the guard's recompute, the
agreement digest, ``MuonConfig`` and both CLIs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardmuon import Muon
from shardmuon.bench.matrices import make_inputs
from shardmuon.config import MuonConfig
from shardmuon.ops.engines import ENGINES
from shardmuon.ops.newton_schulz import (
    NS_PRESETS,
    aol_rescale_,
    newton_schulz,
    newton_schulz_reference,
)
from shardmuon.ops.normalize import Normalized
from shardmuon.validation import AGREED_SETTINGS

KINDS = ("gaussian", "logspaced", "lowrank")


def _reference(G: torch.Tensor, coefficients) -> torch.Tensor:
    """AOL then the quintic, written out in fp64 (``G[B, m, n]``, either side short)."""
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True)
    A = X @ X.mT
    d = A.abs().sum(dim=-1).rsqrt()
    X = X * d[..., :, None]
    for a, b, c in coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(3, 24, 24), (2, 16, 80), (2, 80, 16)])
def test_the_scaled_matrix_has_spectral_norm_at_most_one(kind, shape) -> None:
    G = make_inputs(kind, shape, seed=3)
    X = G if shape[-2] <= shape[-1] else G.mT
    X = X.contiguous().clone()
    A = X @ X.mT
    expected_gram = None
    aol_rescale_(X, A)
    expected_gram = X @ X.mT
    assert torch.linalg.matrix_norm(X, ord=2).max() <= 1 + 1e-12
    torch.testing.assert_close(A, expected_gram, rtol=1e-12, atol=1e-14)


def test_a_zero_row_stays_zero() -> None:
    X = torch.randn(1, 6, 20, dtype=torch.float64)
    X[0, 2] = 0
    A = X @ X.mT
    aol_rescale_(X, A)
    assert torch.isfinite(X).all() and not X[0, 2].any() and not A[0, 2].any()


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("kind", KINDS)
def test_every_engine_runs_aol_as_the_fp64_reference_does(engine, kind) -> None:
    G = make_inputs(kind, (3, 16, 64), seed=1).float()
    coefficients = NS_PRESETS["aol"]
    ref = _reference(G, coefficients)
    run = ENGINES[engine].run
    fp32 = run(G, coefficients, 0.0, dtype=torch.float32, preconditioner="aol").X
    bf16 = run(G, coefficients, 0.0, dtype=torch.bfloat16, preconditioner="aol").X
    assert _relative(fp32, ref) < 1e-4
    # bf16 rounding costs AOL about what it costs the default schedule (0.5-1.4x here).
    plain_bf16 = run(G, "dion", 0.0, dtype=torch.bfloat16).X
    assert _relative(bf16, ref) < 1.6 * _relative(plain_bf16, newton_schulz_reference(G, "dion"))
    # Without the preconditioner the same 4 steps land elsewhere: the option is applied.
    plain = run(G, coefficients, 0.0, dtype=torch.float32).X
    assert _relative(plain, ref) > 1e-2


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_aol_keeps_the_non_finite_promise(engine) -> None:
    G = torch.randn(3, 16, 40)
    G[1, 3, 5] = float("nan")
    out = ENGINES[engine].run(
        G, NS_PRESETS["aol"], 1e-8, dtype=torch.bfloat16, preconditioner="aol"
    )
    assert out.nonfinite.tolist() == [False, True, False]
    assert not out.X[1].any() and torch.isfinite(out.X).all()


def test_the_optimizer_runs_four_aol_steps_unless_told_otherwise() -> None:
    p = torch.nn.Parameter(torch.randn(32, 96))
    opt = Muon([p], newton_schulz_preconditioner="aol")
    assert opt.coefficients == NS_PRESETS["aol"] and len(opt.coefficients) == 4
    assert (
        Muon(
            [p], newton_schulz_preconditioner="aol", newton_schulz_coefficients="dion"
        ).coefficients
        == NS_PRESETS["dion"]
    )
    assert Muon([p]).coefficients == NS_PRESETS["dion"]  # the default stays dion's numerics
    U = torch.randn(32, 96)
    (got,) = opt.orthogonalize_chunk([p], [U])
    want = newton_schulz(U.bfloat16(), NS_PRESETS["aol"], preconditioner="aol")
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"unknown newton_schulz_preconditioner 'AOL'; accepted"):
        Muon([p], newton_schulz_preconditioner="AOL")


def test_the_guard_recomputes_with_aol_too(monkeypatch) -> None:
    gram = ENGINES["gram"]

    def diverged(G, *args, **kwargs):
        out = gram.run(G, *args, **kwargs)
        return Normalized(out.X * 1.5, out.nonfinite)

    monkeypatch.setitem(ENGINES, "gram", dataclasses.replace(gram, run=diverged))
    p = torch.nn.Parameter(torch.randn(32, 128))
    opt = Muon([p], newton_schulz_impl="gram", newton_schulz_preconditioner="aol")
    U = torch.randn(32, 128)
    (got,) = opt.orthogonalize_chunk([p], [U])
    safe = newton_schulz(U.bfloat16().float(), "aol", dtype=torch.float32, preconditioner="aol")
    assert torch.equal(got, safe.to(torch.bfloat16))


def test_the_preconditioner_enters_the_digest_the_config_and_a_copy() -> None:
    import copy

    assert "newton_schulz_preconditioner" in AGREED_SETTINGS
    p = torch.nn.Parameter(torch.randn(8, 16))
    a = Muon([p], newton_schulz_preconditioner="aol")
    b = Muon([p])
    settings = [{k: getattr(o, k) for k in AGREED_SETTINGS} for o in (a, b)]
    assert (
        settings[0]["newton_schulz_preconditioner"] != settings[1]["newton_schulz_preconditioner"]
    )
    assert copy.deepcopy(a).newton_schulz_preconditioner == "aol"
    config = MuonConfig(newton_schulz_preconditioner="aol")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16))
    from shardmuon.config import build_optimizer

    built = build_optimizer(model, config)
    assert built.newton_schulz_preconditioner == "aol" and len(built.coefficients) == 4
    with pytest.raises(ValueError, match="newton_schulz_preconditioner"):
        MuonConfig(newton_schulz_preconditioner="spectral")


def test_both_clis_take_the_preconditioner() -> None:
    from shardmuon.bench.step_worker import StepConfig
    from shardmuon.cli import build_parser
    from shardmuon.train.cli import _config_from_args

    parser = build_parser()
    args = parser.parse_args(["bench", "step", "--ns-preconditioner", "aol"])
    assert args.ns_preconditioner == "aol" and args.coefficients is None
    cfg = StepConfig("tiny-moe", None, None, "none", None, 1, ("shardmuon",), "aol", 0.02, 0,
                     False, ns_preconditioner="aol")  # fmt: skip
    assert cfg.ns_options() == {"newton_schulz_preconditioner": "aol"}
    train = parser.parse_args(["train", "--ns-preconditioner", "aol", "--ns-impl", "gram"])
    optim = _config_from_args(train).optim
    assert (
        optim.newton_schulz_preconditioner,
        optim.newton_schulz_coefficients,
        optim.newton_schulz_impl,
    ) == ("aol", "aol", "gram")
    explicit = _config_from_args(
        parser.parse_args(["train", "--ns-preconditioner", "aol", "--coefficients", "keller"])
    )
    assert explicit.optim.newton_schulz_coefficients == "keller"
