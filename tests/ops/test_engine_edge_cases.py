"""Edge cases of the Newton–Schulz engines, the normalisation, AOL, the guard, the engine
settings, the workspace cost model and the CLI numbers (single process).

Each case is checked against an independent reference written here: a float64 iteration
(AOL included), the exact SVD, or a fresh optimizer built with the same settings. Cases
marked ``# Was an escape:`` once gave a wrong result and are fixed; every case is a
regression test.
"""

from __future__ import annotations

import math

import pytest
import torch
from checks import set_random_grads

from shardmuon import Muon
from shardmuon.bench.memory import gemm_scratch_bytes, measure_cpu_step
from shardmuon.config import MuonConfig
from shardmuon.ops.engines import ENGINES
from shardmuon.ops.newton_schulz import NS_PRESETS, iterate_folded, newton_schulz
from shardmuon.ops.newton_schulz import orthogonalize_with as ortho_with
from shardmuon.ops.newton_schulz_guard import GUARD_SLACK, band_high, guarded

ENGINE_NAMES = ["folded", "unfolded", "per-matrix", "gram"]  # "compiled": seconds to compile
DTYPES = ["bfloat16", "float16", "float32"]
TOL = {"bfloat16": 0.12, "float16": 0.12, "float32": 0.02}


def _ref(G: torch.Tensor, pre: str | None = None, eps: float = 1e-8) -> torch.Tensor:
    """fp64 Frobenius normalisation, AOL if asked, then the quintic, on ``[..., m, n]``."""
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    X = X.mT if tall else X
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + eps)
    if pre == "aol":
        d = (X @ X.mT).abs().sum(-1).clamp_min(1e-300).rsqrt()
        X = d.unsqueeze(-1) * X
    for a, b, c in NS_PRESETS["aol" if pre else "dion"]:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _step(G, pdtype=torch.float32, parts=None, **kw):
    """One step from zero weights with lr 1, no decay, no lr scaling: returns ``-p`` = NS(G)."""
    p = torch.nn.Parameter(torch.zeros(G.shape, dtype=pdtype))
    kw = dict(lr=1.0, weight_decay=0.0, adjust_lr=None, **kw)
    opt = Muon([p], matrix_partitions={p: parts} if parts else None, **kw)
    p.grad = G.to(pdtype)
    opt.step()
    return -p.detach().double(), opt.last_step_stats


# ------------------------------------------------------------------ non-finite, odd shapes


@pytest.mark.parametrize("pre", [None, "aol"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_only_the_non_finite_matrices_of_a_stack_are_skipped(engine, dtype, pre):
    G = torch.randn(4, 8, 24, generator=torch.Generator().manual_seed(1))
    G[1, 2, 3], G[3, 0, 0] = float("nan"), float("-inf")
    out, stats = _step(G, newton_schulz_impl=engine, newton_schulz_dtype=dtype,
                       newton_schulz_preconditioner=pre)  # fmt: skip
    assert stats.nonfinite_matrices == 2
    assert not out[1].any() and not out[3].any()
    for i in (0, 2):
        assert _rel(out[i], _ref(G[i], pre)) < TOL[dtype]


@pytest.mark.parametrize("pre", [None, "aol"])
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_nan_in_one_partition_block_skips_that_block_only(engine, pre):
    G = torch.randn(12, 20, generator=torch.Generator().manual_seed(2))
    G[5, 3] = float("nan")
    out, stats = _step(G, parts=(4, 4, 4), newton_schulz_impl=engine,
                       newton_schulz_preconditioner=pre)  # fmt: skip
    assert stats.nonfinite_matrices == 1 and not out[4:8].any()
    assert max(_rel(out[:4], _ref(G[:4], pre)), _rel(out[8:], _ref(G[8:], pre))) < 0.12


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_odd_shapes_layouts_and_param_dtypes_match_the_fp64_reference(engine):
    g = torch.Generator().manual_seed(3)
    for G, pdtype in [(torch.randn(1, 64, generator=g), torch.float32),
                      (torch.randn(64, 1, generator=g), torch.float32),
                      (torch.randn(2, 40, 8, generator=g), torch.float32),
                      (torch.randn(24, 8, generator=g).mT, torch.float32),  # non-contiguous
                      (torch.randn(8, 24, generator=g), torch.float16),
                      (torch.randn(8, 24, generator=g), torch.bfloat16),
                      (torch.randn(8, 24, generator=g) * 1e30, torch.float32),
                      (torch.randn(8, 24, generator=g), torch.float64)]:  # fmt: skip
        out, stats = _step(G, pdtype, newton_schulz_impl=engine, newton_schulz_dtype="float32")
        assert stats.nonfinite_matrices == 0
        assert _rel(out, _ref(G.to(pdtype).bfloat16())) < 0.02, (tuple(G.shape), pdtype)
    w = torch.randn(8, 3, 3, 3, generator=g).to(memory_format=torch.channels_last)
    out, _ = _step(w, flatten=True, newton_schulz_impl=engine, newton_schulz_dtype="float32")
    assert _rel(out.reshape(8, 27), _ref(w.reshape(8, 27).bfloat16())) < 0.02


# Was an escape: orthogonalize_per_matrix reshaped to [-1, 0, n] before its empty check.
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_step_with_an_empty_matrix_parameter(engine):
    for shape in [(0, 5), (5, 0), (2, 0, 3)]:
        empty, q = torch.nn.Parameter(torch.zeros(shape)), torch.nn.Parameter(torch.zeros(4, 6))
        opt = Muon([empty, q], lr=1.0, weight_decay=0.0, adjust_lr=None,
                   newton_schulz_impl=engine)  # fmt: skip
        empty.grad, q.grad = torch.zeros(shape), torch.randn(4, 6)
        grad = q.grad.clone()
        opt.step()
        assert _rel(-q.detach(), _ref(grad.bfloat16())) < 0.12


# ------------------------------------------------------------------ huge finite values


def test_huge_but_normable_and_all_zero_grads():
    for G in [torch.randn(3, 8, 24) * 1e37, torch.zeros(2, 6, 6), torch.full((4, 4), 1e-38)]:
        for engine in ENGINE_NAMES:
            out, stats = _step(G, newton_schulz_impl=engine)
            assert stats.nonfinite_matrices == 0 and torch.isfinite(out).all()
            if G.abs().max() > 1:
                assert _rel(out, _ref(G.bfloat16())) < 0.12
            else:  # eps dominates: the fp64 reference is ~0 too
                assert out.abs().max() <= _ref(G).abs().max() + 1e-6


# Was an escape: the fp32 norm of a finite matrix overflowed (entries ~1e38 in a 4x4:
# ||G||_F = 4e38) and the matrix was skipped as non-finite.
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_finite_matrix_whose_norm_exceeds_fp32_is_not_skipped(engine):
    G = torch.full((4, 4), 1e38)
    G[0, 0] = 5e37
    out, stats = _step(G, newton_schulz_impl=engine)
    assert stats.nonfinite_matrices == 0
    assert _rel(out, _ref(G.bfloat16())) < 0.12


# The documented limit (README, "Never a silent wrong update"): directions travel in bf16,
# so an entry above bf16's largest value (3.39e38: an fp32 grad at 3.4e38, an fp64 one at
# 1e100) is inf there; its matrix is skipped and counted, never applied.
@pytest.mark.parametrize(("pdtype", "peak"), [(torch.float32, 3.4e38), (torch.float64, 1e100)])
def test_grads_beyond_bf16_range_are_skipped_and_counted(pdtype, peak):
    G = torch.randn(6, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    G[2, 5] = peak
    out, stats = _step(G, pdtype)
    assert stats.nonfinite_matrices == 1
    assert not out.any()  # from zero weights, weight decay 0: nothing was applied


# ------------------------------------------------------------------ AOL


def _decoupled_tiny_row() -> torch.Tensor:
    """Row 0 touches only column 0, at 1e-4 of the rest: its Gram row is ~1e-10."""
    G = torch.zeros(8, 32)
    G[1:, 1:] = torch.randn(7, 31, generator=torch.Generator().manual_seed(5))
    G[0, 0] = 1e-4
    return G


# Was an escape (all but gram, whose default guard recomputed it in fp32): in fp16 the row's Gram
# entry underflows to 0, D = rsqrt(tiny) ~ 9e18 and the row overflows fp16: the whole update
# is NaN, written to the weight, and nonfinite_matrices stays 0.
@pytest.mark.parametrize("engine", ["gram", "folded", "unfolded", "per-matrix"])
def test_fp16_aol_on_a_row_whose_gram_entry_underflows(engine):
    G = _decoupled_tiny_row()
    out, _ = _step(G, newton_schulz_impl=engine, newton_schulz_dtype="float16",
                   newton_schulz_preconditioner="aol")  # fmt: skip
    assert torch.isfinite(out).all()
    assert _rel(out, _ref(G, "aol")) < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_aol_rows_and_shapes_match_the_fp64_aol_reference(dtype):
    g = torch.Generator().manual_seed(6)
    cases = [torch.randn(1, 6, 40, generator=g) * torch.tensor([1, 1, 0, 1, 0, 1.0])[:, None],
             torch.randn(1, 6, 40, generator=g) * torch.tensor([1e-20, 1, 1, 1e-6, 1, 1])[:, None],
             torch.randn(2, 16, 16, generator=g), torch.randn(1, 2, 500, generator=g),
             torch.randn(1, 500, 2, generator=g), _decoupled_tiny_row()[None]]  # fmt: skip
    for G in cases:
        ref = _ref(G, "aol")
        for engine in ENGINE_NAMES:
            run = ENGINES[engine].run
            out = run(G.clone(), NS_PRESETS["aol"], 1e-8, dtype=dtype, preconditioner="aol").X
            assert _rel(out, ref) < (1e-3 if dtype == torch.float32 else 0.1), engine


# ------------------------------------------------------------------ the guard


def _with_top_singular_value(shape, ratios, band, seed=7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    U, _, V = torch.linalg.svd(torch.randn(shape, generator=g, dtype=torch.float64),
                               full_matrices=False)  # fmt: skip
    s = torch.linspace(0.5, 1.0, shape[-2], dtype=torch.float64).flip(0)
    s = s * (torch.tensor(ratios, dtype=torch.float64) * band)[:, None]
    return ((U * s[:, None, :]) @ V).to(torch.bfloat16)


@pytest.mark.parametrize("pre", [None, "aol"])
def test_the_guard_recomputes_exactly_the_diverged_ones(pre):
    coeffs = NS_PRESETS["aol" if pre else "dion"]
    band = band_high(coeffs)
    G = torch.randn(5, 8, 32, generator=torch.Generator().manual_seed(8)).bfloat16()
    result = _with_top_singular_value((5, 8, 32), [1.10, 1.20, 0.9, 1.14, 3.0], band)
    result[2, 1, 1] = float("nan")
    out, verdict = guarded(G, lambda _: result.clone(), coeffs, 1e-8, preconditioner=pre)
    assert (verdict.checked, verdict.fallbacks) == (5, 3)
    for i in (0, 3):
        assert torch.equal(out[i], result[i])  # bitwise untouched
    for i in (1, 2, 4):
        safe = ortho_with(iterate_folded, G[i : i + 1].float(), coeffs, 1e-8,
                                  dtype=torch.float32, preconditioner=pre)  # fmt: skip
        assert torch.equal(out[i], safe.X[0].bfloat16())


# Was an escape: the guard's A = O O^T is a bf16 GEMM (rounded to bf16, not fp32): a result with
# sigma_max = 1.1501x the band is measured at 1.1485x and passes uncorrected.
def test_the_guard_passes_no_result_above_its_slack():
    band = band_high(NS_PRESETS["dion"])
    v = torch.tensor([0.03515625] * 48 + [0.034912109375] * 16, dtype=torch.float64)
    result = (torch.ones(1, 22, 1, dtype=torch.float64) @ v[None, None]).bfloat16()
    exact = float(torch.linalg.matrix_norm(result.double(), ord=2)) / band
    assert exact > GUARD_SLACK  # 1.1501: diverged by the guard's own rule
    _, verdict = guarded(torch.zeros(1, 22, 64).bfloat16(), lambda _: result.clone(),
                         "dion", 1e-8)  # fmt: skip
    assert verdict.fallbacks == 1


# ------------------------------------------------------------------ live settings


def _live_pair(**kw):
    p = torch.nn.Parameter(torch.zeros(16, 64))
    return p, Muon([p], lr=1.0, weight_decay=0.0, adjust_lr=None, **kw)


def _update(p, opt, G):
    with torch.no_grad():
        p.zero_()
        opt.state[p]["momentum"].zero_()
    p.grad = G.clone()
    opt.step()
    return p.detach().clone()


G_LIVE = torch.randn(16, 64, generator=torch.Generator().manual_seed(9))


PRE = "newton_schulz_preconditioner"


# ESCAPE (preconditioner): a live switch keeps the other mode's coefficients (dion's 5 steps
# with AOL turned on; the 4-step "aol" preset with AOL turned off), unlike the constructor.
@pytest.mark.parametrize(("start", "name", "value"), [
    ({}, "newton_schulz_impl", "gram"), ({}, "newton_schulz_dtype", "float32"),
    ({}, "newton_schulz_guard", True), ({"newton_schulz_impl": "gram"}, "newton_schulz_guard", False),
    ({}, PRE, "aol"), ({PRE: "aol"}, PRE, None),
])  # fmt: skip
def test_a_live_engine_setting_equals_the_constructor_with_it(start, name, value):
    p, opt = _live_pair(**start)
    _update(p, opt, G_LIVE)
    plan = opt.plan
    setattr(opt, name, value)
    live = _update(p, opt, G_LIVE)
    assert opt.plan is not plan  # the workspace cost model was rebuilt
    p2, opt2 = _live_pair(**{**start, name: value})
    assert torch.equal(live, _update(p2, opt2, G_LIVE))
    assert opt.plan.ns_cost == opt2.plan.ns_cost


# Was an escape: ``opt.coefficients = "dion"`` (a preset name, as the constructor takes) is measured
# with len("dion") == 4 steps: a valid Gram schedule is refused, and the cost model holds
# the string's characters as "triples" (keller: ('k',), ('e',), ...).
def test_a_live_preset_name_is_resolved_before_it_is_checked():
    p, opt = _live_pair(newton_schulz_impl="gram", newton_schulz_restarts=(2, 4))
    before = _update(p, opt, G_LIVE)
    opt.coefficients = "dion"
    assert torch.equal(_update(p, opt, G_LIVE), before)
    assert opt.plan.ns_cost.coefficients == NS_PRESETS["dion"]


# Was an escape: the config turns [True, 3] into restarts (1, 3); Muon itself refuses (True, 3).
def test_the_config_refuses_the_restarts_the_constructor_refuses():
    with pytest.raises(ValueError, match="step"):
        Muon([torch.nn.Parameter(torch.zeros(4, 8))], newton_schulz_impl="gram",
             newton_schulz_restarts=(True, 3))  # fmt: skip
    with pytest.raises(ValueError, match="newton_schulz_restarts"):
        MuonConfig(newton_schulz_impl="gram", newton_schulz_restarts=[True, 3])


# ------------------------------------------------------------------ workspace


def _transient(shapes, **kw):
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    opt = Muon(params, lr=0.02, nesterov=True, **kw)
    set_random_grads(params, 1)
    opt.step()
    set_random_grads(params, 2)
    return opt, measure_cpu_step(opt.step, 0).transient_bytes


@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("shapes", [[(1, 4096)] * 2, [(4096, 1)] * 2, [(3, 1, 512), (64, 64)]])
def test_odd_shapes_stay_within_the_estimate(engine, shapes):
    for dtype in ("bfloat16", "float32"):
        opt, measured = _transient(shapes, newton_schulz_impl=engine, newton_schulz_dtype=dtype,
                                   newton_schulz_guard=False, workspace_bytes=1)  # fmt: skip
        stats = opt.last_step_stats
        scratch = gemm_scratch_bytes(stats.ns_calls, {getattr(torch, dtype), torch.float32})
        # + 64: the [B] non-finite masks and their counts are not in the estimate.
        assert measured <= stats.workspace_peak_bytes + scratch + 64, (dtype, measured)


# Was an escape: aol_rescale_'s in-place mixed-dtype X.mul_(fp32) / A.mul_(fp32) allocate fp32 copies
# of X and A in fp16 (and bf16): 82 KB measured for a 49.7 KB estimate on one 64x64 matrix.
def test_fp16_aol_stays_within_the_estimate():
    opt, measured = _transient([(64, 64), (16, 200)], newton_schulz_dtype="float16",
                               newton_schulz_preconditioner="aol", workspace_bytes=1)  # fmt: skip
    stats = opt.last_step_stats
    scratch = gemm_scratch_bytes(stats.ns_calls, {torch.float16, torch.float32})
    assert measured <= stats.workspace_peak_bytes + scratch + 64


# Was an escape: the guard's A = O O^T is a bf16 bmm; on CPUs where oneDNN packs bf16 operands it
# allocates ~260 KB scratch for [1, 2, 2048] that no fp32/fp16 GEMM of the engine does.
def test_fp32_gram_with_its_guard_stays_within_the_estimate():
    X = newton_schulz(torch.randn(1, 2, 2048))
    if measure_cpu_step(lambda: torch.bmm(X, X.mT), 0).transient_bytes < 4096:
        pytest.skip("this CPU's bf16 bmm allocates no scratch: nothing to show")
    opt, measured = _transient([(2, 2048)] * 3, newton_schulz_impl="gram",
                               newton_schulz_dtype="float32", workspace_bytes=1)  # fmt: skip
    stats = opt.last_step_stats
    scratch = gemm_scratch_bytes(stats.ns_calls, {torch.float32})  # chain == iteration == fp32
    assert measured <= stats.workspace_peak_bytes + scratch + 64


# ------------------------------------------------------------------ CLI


@pytest.fixture
def no_work(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("work or processes were started before the arguments were checked")

    for target in ["torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
                   "shardmuon.bench.step.launch", "shardmuon.bench.ns.measure_shape",
                   "shardmuon.bench.ns.input_and_reference", "shardmuon.bench.ab._Setup",
                   "shardmuon.bench.plan.build_meta_model", "shardmuon.train.run.train_on_rank",
                   "shardmuon.train.run.spawn_training", "shardmuon.train.run.prepare_resume"]:  # fmt: skip
        monkeypatch.setattr(target, forbidden)
    monkeypatch.delenv("SHARDMUON_MAX_NPROC", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # A 2-core, 24 GiB machine: it holds 8 processes.
    monkeypatch.setattr("shardmuon.harness.processes.usable_cores", lambda: 2)
    monkeypatch.setattr("shardmuon.harness.processes.available_memory_bytes", lambda: 24 << 30)
    return monkeypatch


def _one_line_exit_2(argv, capsys) -> str:
    from shardmuon.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and "\n" not in err, (argv, code, err)
    return err


def _numeric_flags():
    import argparse

    from shardmuon.cli import build_parser
    from shardmuon.harness.cli_support import Number

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    for parser in parsers(build_parser()):
        for action in parser._actions:
            if action.option_strings and isinstance(action.type, Number):
                yield parser.prog.split()[1:], action.option_strings[0], action


def test_odd_number_spellings_parse_to_a_checked_value_or_one_line(no_work, capsys):
    from shardmuon.cli import build_parser

    for words, flag, action in _numeric_flags():
        kind = action.type
        for text in ["1e309", "-0", "0x10", " 3", "3.0", "+inf", "NaN", "1e-400", "-1", "9"]:
            try:
                value = getattr(build_parser().parse_args([*words, f"{flag}={text}"]), action.dest)
            except SystemExit as exc:
                err = capsys.readouterr().err.strip()
                assert exc.code == 2 and "\n" not in err and f"{flag} must be " in err, err
                continue
            assert type(value) is kind.kind and math.isfinite(value), (words, flag, text)
            assert kind.low is None or value >= kind.low, (words, flag, text, value)
            assert kind.high is None or value <= kind.high, (words, flag, text, value)


@pytest.mark.parametrize(("argv", "says"), [
    (["bench", "step", "--nproc", "0"], "--nproc must be an int >= 1, got 0"),
    (["bench", "step", "--nproc=-1"], "--nproc must be an int >= 1, got -1"),
    (["bench", "step", "--nproc", "9", "--layout", "fsdp"], "--nproc 9: more processes than"),
    (["train", "--nproc", "9", "--batch-size", "9"], "--nproc 9: more processes than"),
    (["train", "--nproc=-1"], "--nproc must be an int >= 1, got -1"),
])  # fmt: skip
def test_process_counts_are_refused_before_anything_starts(argv, says, no_work, capsys):
    assert says in _one_line_exit_2(argv, capsys)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "3.0", ""])
def test_a_bad_process_limit_is_refused_in_one_line(value, no_work, capsys):
    no_work.setenv("SHARDMUON_MAX_NPROC", value)
    assert "SHARDMUON_MAX_NPROC" in _one_line_exit_2(["bench", "step", "--nproc", "2"], capsys)


# Was an escape: a --shapes entry whose size overflows reaches the work: torch.randn raises
# "Storage size calculation overflowed" (RuntimeError, a traceback, exit 1), and any shape too
# large for memory is allocated for real.
def test_bench_ns_refuses_a_shape_that_cannot_be_allocated(no_work, capsys):
    _one_line_exit_2(["bench", "ns", "--device", "cpu", "--shapes", "99999999999x99999999999",
                      "--no-progress"], capsys)  # fmt: skip
