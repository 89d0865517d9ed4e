"""AOL preconditioning (``newton_schulz_preconditioner="aol"``) against an independent fp64
reference, on every engine, at every scale of gradient (its bound and the normalisation's
eps floor), and its wiring: the 4-step default, the guard's recompute, the agreement
digest, ``MuonConfig`` and both CLIs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardmuon import Muon
from shardmuon.bench.matrices import make_inputs
from shardmuon.config import MuonConfig
from shardmuon.ops import engines as engines_module
from shardmuon.ops import newton_schulz_gram as gram_module
from shardmuon.ops import normalize as normalize_module
from shardmuon.ops.engines import ENGINES
from shardmuon.ops.newton_schulz import (
    NS_PRESETS,
    aol_rescale_,
    newton_schulz,
    newton_schulz_reference,
)
from shardmuon.ops.newton_schulz_guard import GUARD_SLACK, band_high
from shardmuon.ops.normalize import Normalized

KINDS = ("gaussian", "logspaced", "lowrank")


def _reference(G: torch.Tensor, coefficients, eps: float = 0.0) -> torch.Tensor:
    """AOL then the quintic, written out in fp64 (``G[B, m, n]``, either side short): the
    rows of ``X = G / (||G|| + eps)`` scaled by ``||X||_F / sqrt(sum_j |X X^T|_ij)``, AOL's
    ``D`` times the eps floor ``||X||_F = ||G|| / (||G|| + eps)`` (1 for ``eps=0``), so
    that a gradient far below ``eps`` is damped as without AOL. A zero row stays zero."""
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    A = X @ X.mT
    row_sums = A.abs().sum(dim=-1)
    floor = X.norm(dim=(-2, -1))[..., None]
    d = torch.where(row_sums > 0, floor / row_sums.clamp_min(1e-300).sqrt(), 0.0)
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


SCALES = (1e-45, 1e-30, 1e-27, 1e-11, 1e-8, 1.0, 1e4, 1e30)
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in ENGINES["folded"].dtypes]
# Distance of a result to its fp64 iteration where the default path is close to its own
# (as tests/ops/test_engine_promises.py's TOLERANCE).
TOLERANCE = {torch.bfloat16: 0.05, torch.float16: 0.01, torch.float32: 1e-4}


def _errors(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest per-matrix ``||out - ref|| / ||ref||`` (fp64); a zero reference wants a
    zero result (error 0, else inf)."""
    out = out.double()
    diff, size = (out - ref).norm(dim=(-2, -1)), ref.norm(dim=(-2, -1))
    zero = size == 0
    errors = torch.where(zero, torch.where(diff == 0, 0.0, torch.inf), diff / size)
    return float(errors.max())


def _check_every_scale(engine: str, dtype: torch.dtype) -> None:
    """AOL on ``engine`` in ``dtype`` at every scale of :data:`SCALES`: finite, unflagged,
    within the guard's limit, and as close to :func:`_reference` (eps floor kept) as the
    default path is to its own fp64 iteration on the same input (1.6x, the bf16 ratio of
    the test above; at least :data:`TOLERANCE`)."""
    run = ENGINES[engine].run
    coefficients = NS_PRESETS["aol"]
    limit = GUARD_SLACK * band_high(coefficients)  # what the guard lets through
    for kind in ("gaussian", "lowrank"):
        base = make_inputs(kind, (3, 16, 64), seed=1)
        for scale in SCALES:
            where = f"{kind} x {scale:g}"
            G = (base * scale).float()  # 1e-45: fp32 subnormals (or zeros)
            out = run(G, coefficients, 1e-8, dtype=dtype, preconditioner="aol")
            X = out.X.double()
            assert not out.nonfinite.any() and torch.isfinite(X).all(), where
            assert torch.linalg.matrix_norm(X, ord=2).max() <= limit, where
            plain = run(G, "dion", 1e-8, dtype=dtype).X
            plain_error = _errors(plain, newton_schulz_reference(G, "dion", 1e-8))
            error = _errors(X, _reference(G, coefficients, 1e-8))
            assert error <= max(TOLERANCE[dtype], 1.6 * plain_error), (where, error, plain_error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_aol_keeps_its_bound_and_the_eps_floor_at_every_scale(engine, dtype) -> None:
    """Was a bug: ``G / (||G|| + eps)`` of a small gradient has a Gram matrix that
    underflows in the iteration's dtype; the row sums lost their off-diagonal terms and D its
    bound: NaN or inf results (fp16 at 1e-11, Gram's fp16 included; bf16 at 1e-27), never
    flagged, and a direction 21% (1e-30) to 100% (1e-11) off; and AOL's scaling undid the eps
    floor (a full-size update from a gradient far below eps). Now: finite, within the
    engine's band at every scale, and as close to the fp64 AOL-then-NS (eps floor kept) as
    the default path is to its own fp64 iteration, on the same inputs."""
    _check_every_scale(engine, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("engine", ["folded", "gram"])
def test_aol_at_every_scale_on_the_accelerator_branch(engine, dtype, monkeypatch) -> None:
    """The same on what an accelerator runs, here on CPU tensors: the normalisation and
    AOL's Gram-ready input without a host check (fp64 norm), and Gram's bf16 GEMMs in fp16
    (CUDA's rule). Was a bug: AOL handed Gram's fp16 chain an unscaled X (overflow,
    subnormals: wrong updates, NaN)."""
    monkeypatch.setattr(normalize_module, "_decides_on_host", lambda device: False)

    original = gram_module.gram_gemm_dtype

    def cuda_rule(dtype, device_type):
        return original(dtype, "cuda")

    monkeypatch.setattr(engines_module, "gram_gemm_dtype", cuda_rule)
    monkeypatch.setattr(gram_module, "gram_gemm_dtype", cuda_rule)
    _check_every_scale(engine, dtype)


@pytest.mark.parametrize("engine", sorted(set(ENGINES) - {"compiled"}))  # compiling: seconds
def test_fp16_aol_keeps_its_bound_on_small_correlated_rows(engine) -> None:
    """Three parallel rows at 1e-6 of the others: in fp16 their mutual Gram entries underflow
    to 0, their row sums kept only their own squares and D scaled each to norm 1, sqrt(3)
    together: a direction 72-111% off, NaN from Gram. The row sums now add what rounding in
    fp16's subnormal range may have lost (2^-25 an entry): what is left is the rows' own
    fp16 rounding (3% here; bf16 1.3%)."""
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(2, 16, 64, generator=gen)
    row = torch.randn(64, generator=gen) * 1e-6
    G[:, 0], G[:, 1], G[:, 2] = row, 0.9 * row, 1.1 * row
    coefficients = NS_PRESETS["aol"]
    out = ENGINES[engine].run(G, coefficients, 1e-8, dtype=torch.float16, preconditioner="aol")
    X = out.X.double()
    assert not out.nonfinite.any() and torch.isfinite(X).all()
    assert torch.linalg.matrix_norm(X, ord=2).max() <= GUARD_SLACK * band_high(coefficients)
    assert _errors(X, _reference(G, coefficients, 1e-8)) < 0.05


@pytest.mark.parametrize("impl", ["folded", "gram"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_tiny_gradient_under_aol_moves_the_weights_by_the_reference(impl, dtype) -> None:
    """The optimizer's end of the bug: a 1e-11 gradient under fp16 AOL gave NaN weights
    (Gram) or a direction 100% off (folded), with ``nonfinite_matrices == 0``. Now the
    update is the fp64 AOL-then-NS of the bf16 direction, eps floor included."""
    W = make_inputs("gaussian", (32, 96), seed=2).float()
    grad = make_inputs("lowrank", (32, 96), seed=3).float() * 1e-11
    p = torch.nn.Parameter(W.clone())
    opt = Muon([p], lr=0.1, mu=0.0, weight_decay=0.0, adjust_lr=None,
               newton_schulz_preconditioner="aol", newton_schulz_impl=impl,
               newton_schulz_dtype=dtype)  # fmt: skip
    p.grad = grad.clone()
    opt.step()
    assert torch.isfinite(p).all() and opt.last_step_stats.nonfinite_matrices == 0
    moved = (W - p.detach()).double() / 0.1
    want = _reference(grad.bfloat16()[None], NS_PRESETS["aol"], 1e-8)[0]
    assert _errors(moved, want) < 0.05


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

    p = torch.nn.Parameter(torch.randn(8, 16))
    a = Muon([p], newton_schulz_preconditioner="aol")
    b = Muon([p])
    settings = [o.settings.agreed() for o in (a, b)]
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
