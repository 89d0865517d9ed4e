"""``shardmuon bench lm``'s arithmetic (the steps to a loss, the best lrs, the targets) on
made-up runs, and one tiny run of the whole command (1 rank, a few steps: the sweep itself
is a benchmark, not a test)."""

from __future__ import annotations

import json

import pytest

from shardmuon.bench.lm_report import best_key, steps_to_reach, summarize
from shardmuon.cli import main


def _row(setting, lr, seed, losses, adamw_lr=None, step_seconds=1.0):
    evals = [{"step": 10 * i, "tokens": 1000 * i, "loss": v} for i, v in enumerate(losses)]
    return {"setting": setting, "optimizer": "adamw" if setting == "adamw" else "muon",
            "lr": lr, "adamw_lr": adamw_lr, "seed": seed, "eval": evals,
            "step_seconds": step_seconds, "max_logits": [1.0], "max_logits_after": [1.0],
            "clipped_heads": [0]}  # fmt: skip


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--adamw-lrs", "0.01,x"], "must be comma-separated numbers > 0"),
        (["--muon-lrs", "0"], "must be comma-separated numbers > 0"),
        (["--engines", "fast"], "unknown engine setting 'fast'; accepted: comma-separated"),
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
