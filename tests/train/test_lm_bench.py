"""``shardmuon bench lm``'s arithmetic (the steps to a loss, the best lrs, the targets) on
made-up runs, and tiny runs of the whole command (1 rank, a few steps: the sweep itself
is a benchmark, not a test), one with an lr that diverges."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from shardmuon.bench.lm_report import best_key, print_lm_tables, steps_to_reach, summarize
from shardmuon.cli import main


def _row(setting, lr, seed, losses, adamw_lr=None, step_seconds=1.0, diverged=False):
    evals = [{"step": 10 * i, "tokens": 1000 * i, "loss": v} for i, v in enumerate(losses)]
    return {"setting": setting, "optimizer": "adamw" if setting == "adamw" else "muon",
            "lr": lr, "adamw_lr": adamw_lr, "seed": seed, "eval": evals,
            "step_seconds": step_seconds, "max_logits": [1.0], "max_logits_after": [1.0],
            "clipped_heads": [0], "diverged": diverged}  # fmt: skip


def _strict_json(text: str):
    """``text`` parsed as JSON proper: a bare NaN or Infinity fails."""

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _tiny_argv(data, out, *grids: str) -> list[str]:
    return ["bench", "lm", "--nproc", "1", "--layers", "1", "--steps", "4", "--seeds", "1",
            *grids, "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--eval-every",
            "2", "--eval-sequences", "2", "--data", str(data), "--json", str(out),
            "--no-progress"]  # fmt: skip


@pytest.fixture
def data(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"f{i}.py").write_text(f"x{i} = {i}\n" * 60)
    return data


def test_steps_to_reach_interpolates_between_evaluations():
    evals = [{"step": 0, "loss": 5.0}, {"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.0}]
    assert steps_to_reach(evals, 2.5) == pytest.approx(15.0)
    assert steps_to_reach(evals, 3.0) == 10.0
    assert steps_to_reach(evals, 6.0) == 0.0
    assert steps_to_reach(evals, 1.0) is None


def test_the_summary_finds_the_best_lrs_and_checks_the_targets():
    rows = [
        _row("adamw", 0.001, 0, [5, 4, 3.5, 3.2]), _row("adamw", 0.001, 1, [5, 4, 3.4, 3.0]),
        _row("adamw", 0.002, 0, [5, 4, 3.6, 3.4]), _row("adamw", 0.002, 1, [5, 4, 3.6, 3.4]),
        _row("muon", 0.01, 0, [5, 3.2, 2.9, 2.5], 0.004),
        _row("muon", 0.01, 1, [5, 3.0, 2.8, 2.7], 0.004),
        _row("muon", 0.02, 0, [5, 4, 3.5, 3.3], 0.004),
        _row("muon", 0.02, 1, [5, 4, 3.5, 3.3], 0.004),
        _row("gram", 0.01, 0, [5, 3.2, 2.9, 2.6], 0.004),
        _row("gram", 0.01, 1, [5, 3.0, 2.8, 2.6], 0.004),
        _row("qk-clip", 0.01, 0, [5, 3.2, 3.0, 2.9], 0.004),
        _row("qk-clip", 0.01, 1, [5, 3.1, 3.0, 2.95], 0.004),
    ]  # fmt: skip
    assert best_key(rows, "adamw") == ("adamw", 0.001, None)
    assert best_key(rows, "muon") == ("muon", 0.01, 0.004)
    summary = summarize(rows, 15.0)
    assert summary["target_loss"] == pytest.approx(3.1)
    by_name = {s["setting"]: s for s in summary["settings"]}
    assert list(by_name) == ["adamw", "muon", "gram", "qk-clip"]
    assert by_name["adamw"]["steps_to_target"] == 30
    # Seed 0 crosses 3.1 a third of the way from step 10 to 20, seed 1 at 19/20 of the way
    # from step 0 to 10.
    assert by_name["muon"]["steps_to_target"] == pytest.approx((10 + 10 / 3 + 9.5) / 2)
    assert by_name["muon"]["final"]["half_range"] == pytest.approx(0.1)
    assert by_name["gram"]["within_default_spread"]
    assert not by_name["qk-clip"]["within_default_spread"]  # 2.9-2.95 against 2.5-2.7
    targets = summary["targets"]
    assert targets["muon_steps_ratio_met"] and targets["muon_lower_final_met"]
    assert not targets["engines_within_spread_met"]


@pytest.mark.slow
def test_a_tiny_run_of_the_command(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"f{i}.py").write_text(f"x{i} = {i}\n" * 60)
    out, png = tmp_path / "lm.json", tmp_path / "lm.png"
    argv = ["bench", "lm", "--nproc", "1", "--layers", "1", "--steps", "2", "--seeds", "1",
            "--adamw-lrs", "0.004", "--muon-lrs", "0.02", "--muon-adamw-lrs", "0.004",
            "--engines", "gram,qk-clip", "--batch-size", "2", "--seq-len", "16", "--warmup",
            "1", "--eval-every", "1", "--eval-sequences", "2", "--data", str(data),
            "--json", str(out), "--plot", str(png), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "held-out loss after 2 steps, by lr (1 seed)" in printed.out
    assert "targets: Muon needs" in printed.out
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "lm" and len(payload["runs"]) == 4
    assert [s["setting"] for s in payload["summary"]["settings"]] == [
        "adamw", "muon", "gram", "qk-clip",
    ]  # fmt: skip
    assert all(len(run["eval"]) == 3 for run in payload["runs"])
    for name in ("lm.png", "lm-engines.png", "lm-logits.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote max attention logits (PNG)" in printed.err


def test_diverged_runs_are_never_the_best_and_show_as_diverged(capsys):
    nan = math.nan
    rows = [
        _row("adamw", 0.001, 0, [5, 4, 3.5, 3.2]),
        # Listed first, and its loss was lower before it diverged: still not the best.
        _row("muon", 1e20, 0, [5, 2.0, nan], 0.004, diverged=True),
        _row("muon", 0.01, 0, [5, 3.2, 2.9, 2.5], 0.004),
        # One seed of two diverged: the lr diverged, although the other seed is the lowest.
        _row("muon", 0.02, 0, [5, 3.0, 2.0, 1.0], 0.004),
        _row("muon", 0.02, 1, [5, 3.0, nan], 0.004, diverged=True),
        _row("gram", 0.01, 0, [5, 3.0, nan], 0.004, diverged=True),
    ]  # fmt: skip
    assert best_key(rows, "muon") == ("muon", 0.01, 0.004)
    summary = summarize(rows, 15.0)
    grid = {(g["lr"], g["seeds"]): g for g in summary["grid"] if g["setting"] == "muon"}
    assert grid[1e20, 1]["diverged"] and grid[1e20, 1]["mean"] is None
    assert (grid[0.02, 2]["diverged"], grid[0.02, 2]["diverged_seeds"]) == (True, 1)
    assert not grid[0.01, 1]["diverged"] and grid[0.01, 1]["best"]
    gram = summary["settings"][-1]
    assert gram["diverged"] and gram["steps_to_target"] is None
    assert gram["within_default_spread"] is False
    assert summary["every_run_diverged"] == []
    print_lm_tables(summary, argparse.Namespace(seeds=2))
    out = capsys.readouterr().out
    assert "diverged (1 of 2 seeds)" in out and "nan" not in out


def test_an_optimizer_whose_every_run_diverged_has_no_best_lr(capsys):
    nan = math.nan
    rows = [
        _row("adamw", 0.001, 0, [5, 4, 3.5, 3.2]),
        _row("muon", 1e20, 0, [5, nan], 0.004, diverged=True),
        _row("muon", 1e21, 0, [5, 4, nan], 0.004),  # a non-finite loss says it too
    ]
    assert best_key(rows, "muon") is None
    summary = summarize(rows, 15.0)
    assert summary["muon"] is None and summary["every_run_diverged"] == ["muon"]
    assert [s["setting"] for s in summary["settings"]] == ["adamw"]
    assert not summary["targets"]["muon_lower_final_met"]
    print_lm_tables(summary, argparse.Namespace(seeds=1))
    assert "every Muon run diverged (lr 1e+20, 1e+21): it has no best lr" in capsys.readouterr().out


@pytest.mark.slow
def test_a_diverging_lr_is_recorded_and_the_sweep_goes_on(data, tmp_path, capsys):
    out = tmp_path / "lm.json"
    grids = ["--adamw-lrs", "0.004", "--muon-lrs", "1e20,0.02", "--muon-adamw-lrs",
             "0.004,0.008", "--engines", "gram"]  # fmt: skip
    assert main(_tiny_argv(data, out, *grids)) == 0
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    assert "muon, lr 1e+20, seed 0 diverged at step" in printed.err
    payload = _strict_json(out.read_text())
    runs = {(r["setting"], r["lr"], r["adamw_lr"]): r for r in payload["runs"]}
    assert list(runs) == [
        ("adamw", 0.004, None), ("muon", 1e20, 0.004), ("muon", 0.02, 0.004),
        ("muon", 0.02, 0.008), ("gram", 0.02, payload["summary"]["muon"][2]),
    ]  # fmt: skip
    diverged = runs["muon", 1e20, 0.004]
    assert diverged["diverged"] and 1 <= diverged["diverged_step"] <= 4
    assert diverged["diverged_reason"]
    assert not any(r["diverged"] for key, r in runs.items() if key[1] != 1e20)
    summary = payload["summary"]
    assert summary["muon"][1] == 0.02 and summary["every_run_diverged"] == []
    grid = {(g["setting"], g["lr"], g["adamw_lr"]): g for g in summary["grid"]}
    assert grid["muon", 1e20, 0.004]["diverged"] and grid["muon", 1e20, 0.004]["mean"] is None
    assert "diverged" in printed.out


@pytest.mark.slow
def test_every_run_of_both_optimizers_diverging_is_said_and_written(data, tmp_path, capsys):
    out, png = tmp_path / "lm.json", tmp_path / "lm.png"
    grids = ["--adamw-lrs", "1e20", "--muon-lrs", "1e20", "--muon-adamw-lrs", "0.004,0.008",
             "--engines", "gram", "--plot", str(png)]  # fmt: skip
    assert main(_tiny_argv(data, out, *grids)) == 0
    printed = capsys.readouterr()
    assert "every AdamW run diverged (lr 1e+20): it has no best lr" in printed.out
    assert "every Muon run diverged (lr 1e+20): it has no best lr" in printed.out
    assert "(no AdamW-group or engine runs)" in printed.err
    assert f"no plot written to {png}: every run diverged" in printed.err
    payload = _strict_json(out.read_text())
    assert [r["diverged"] for r in payload["runs"]] == [True, True]  # nothing ran at no best lr
    summary = payload["summary"]
    assert (summary["adamw"], summary["muon"], summary["settings"]) == (None, None, [])
    assert summary["every_run_diverged"] == ["adamw", "muon"] and summary["steps"] == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--adamw-lrs", "0.01,x"], "must be comma-separated numbers > 0"),
        (["--muon-lrs", "0"], "must be comma-separated numbers > 0"),
        (["--engines", "fast"], "unknown engine setting 'fast'; accepted: comma-separated"),
        (["--embedding-updates", "adamw,sgd"], "unknown embedding update 'sgd'; accepted:"),
    ],
)
def test_bad_grids_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "lm", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the usage: one line naming the flag
    assert last.startswith("shardmuon bench lm: error: ") and argv[0] in last and message in last
    assert "Traceback" not in err


@pytest.mark.slow
def test_embedding_updates_compare_sinkhorn_at_muons_best_pair(data, tmp_path, capsys):
    out = tmp_path / "lm.json"
    grids = ["--adamw-lrs", "0.004", "--muon-lrs", "0.02", "--muon-adamw-lrs", "0.004",
             "--embedding-updates", "adamw,sinkhorn", "--engines", "none"]  # fmt: skip
    assert main(_tiny_argv(data, out, *grids)) == 0
    payload = _strict_json(out.read_text())
    runs = {run["setting"]: run for run in payload["runs"]}
    assert list(runs) == ["adamw", "muon", "sinkhorn-embeddings"]
    assert [runs[s]["embedding_update"] for s in runs] == ["adamw", "adamw", "sinkhorn"]
    sinkhorn = runs["sinkhorn-embeddings"]
    assert (sinkhorn["lr"], sinkhorn["adamw_lr"]) == (0.02, 0.004)  # Muon's best pair
    assert not sinkhorn["diverged"] and len(sinkhorn["eval"]) == 3
    assert all(math.isfinite(v) for v in sinkhorn["losses"] + [e["loss"] for e in sinkhorn["eval"]])
    settings = [s["setting"] for s in payload["summary"]["settings"]]
    assert settings == ["adamw", "muon", "sinkhorn-embeddings"]
    assert "sinkhorn-embeddings" in capsys.readouterr().out


def test_the_first_embedding_update_is_every_muon_runs():
    from shardmuon.bench.lm import _base_config, sweep_configs
    from shardmuon.cli import build_parser

    args = build_parser().parse_args(["bench", "lm", "--nproc", "1", "--embedding-updates",
                                      "sinkhorn,adamw"])  # fmt: skip
    base = _base_config(args)
    assert base.embedding_update == "sinkhorn"
    (muon,) = sweep_configs(base, "muon", "muon", 0.01, 1)
    (adamw,) = sweep_configs(base, "adamw", "adamw", 0.002, 1)
    assert (muon.embedding_update, adamw.embedding_update) == ("sinkhorn", "adamw")
