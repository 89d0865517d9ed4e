"""``bench lm --budget equal`` (``bench/lm_tune.py``): the two grids hold as many
configurations or are refused; the significance rule on hand-made curves (where the margin
is met, missed, and reached part-way); the sweep chooses each best from its own runs and
reruns it on the seeds; a resume log skips the runs it holds (a cut-off last line is run
again); and the command end to end on a tiny budget, twice (the second run trains nothing)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from shardmuon.bench.lm_tune import (
    Candidate,
    ResumeLog,
    compare,
    grids,
    run_equal_budget,
    run_key,
)


def test_the_grids_hold_as_many_configurations_or_are_refused() -> None:
    adamw, muon = grids(
        (1e-3, 2e-3), (0.95, 0.99), (0.0,), (20,), (0.01,), (4e-3, 8e-3), (0.0, 0.1)
    )
    assert len(adamw) == len(muon) == 4
    assert {c.beta2 for c in adamw} == {0.95, 0.99} and {c.weight_decay for c in muon} == {0, 0.1}
    with pytest.raises(ValueError, match=r"AdamW's grid has 4 .* Muon's 2"):
        grids((1e-3, 2e-3), (0.95, 0.99), (0.0,), (20,), (0.01,), (4e-3,), (0.0, 0.1))


def _row(losses: list[float], every: int = 10, diverged: bool = False) -> dict:
    return {
        "eval": [{"step": every * (i + 1), "loss": loss} for i, loss in enumerate(losses)],
        "diverged": diverged,
        "steps": every * len(losses),
    }


def test_the_rule_on_hand_made_curves() -> None:
    adamw = [_row([3.0, 2.5, 2.0]), _row([3.0, 2.5, 2.02]), _row([3.0, 2.5, 1.98])]
    # Muon: 2.0 - 1.9 = 0.1 at the end; at step 20 its mean is 1.999: (2.0-1.999)*sqrt(3)=0.0017
    muon = [_row([2.5, 1.999, 1.9]), _row([2.5, 1.998, 1.91]), _row([2.5, 2.0, 1.89])]
    c = compare(adamw, muon)
    assert c["adamw"]["mean"] == pytest.approx(2.0) and c["muon"]["mean"] == pytest.approx(1.9)
    assert c["score"] == pytest.approx(0.1 * math.sqrt(3)) and c["ends_lower"]
    assert c["steps_share"] == pytest.approx(1.0)  # step 20 misses the margin, step 30 meets it
    close = [_row([2.5, 2.1, 1.999])] * 3  # ends 0.001 lower: 0.0017 < 0.004
    c = compare(adamw, close)
    assert not c["ends_lower"] and c["steps_share"] is None
    c = compare(adamw, [_row([2.5, 2.0, math.nan], diverged=True), *muon[1:]])
    assert c["score"] is None and c["muon"]["mean"] is None and c["diverged"] == ["muon"]
    # AdamW's mean is an estimate: the share where it is one standard error either way.
    spread = [_row([3.0, 2.5, 2.1]), _row([3.0, 2.5, 2.0]), _row([3.0, 2.5, 1.9])]
    curve = [_row([2.3, 2.1, 2.03, 1.99, 1.93])] * 3  # every 10 steps, 50 in all
    c = compare(spread, curve)
    error = 0.1 / math.sqrt(3)
    assert c["adamw"]["standard_error"] == pytest.approx(error)
    assert c["steps_share"] == pytest.approx(40 / 50)  # 1.99 <= 2.0 - 0.004/sqrt(3)
    assert c["steps_share_range"] == [pytest.approx(30 / 50), pytest.approx(50 / 50)]


def test_the_sweep_chooses_from_its_runs_and_reruns_the_best_on_seeds(tmp_path) -> None:
    adamw, muon = grids((1e-3, 2e-3), (0.95,), (0.0,), (20,), (0.01, 0.02), (4e-3,), (0.0,))

    # The final loss is a function of the configuration and seed: AdamW 2e-3 and Muon 0.02
    # are best; one Muon configuration diverges.
    def loss(c: Candidate, seed: int) -> float:
        base = {1e-3: 2.5, 2e-3: 2.4, 0.01: math.nan, 0.02: 2.0}[c.lr]
        return base + 0.01 * seed

    calls = []

    def run(jobs):
        calls.append(list(jobs))
        return [
            _row([3.0, loss(c, seed)], every=steps // 2, diverged=math.isnan(loss(c, seed)))
            for c, seed, steps in jobs
        ]

    log = ResumeLog(tmp_path / "runs.jsonl")
    result = run_equal_budget(
        adamw, muon, sweep_steps=20, steps=60, final_seeds=3, log=log, run=run
    )
    assert [len(jobs) for jobs in calls] == [1] * 10  # one run at a time, each logged
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 10
    assert result["best"]["adamw"]["lr"] == 2e-3 and result["best"]["muon"]["lr"] == 0.02
    finals = {(c.lr, seed, steps) for jobs in calls[4:7] for c, seed, steps in jobs}
    assert finals == {(2e-3, s, 60) for s in range(3)}
    assert result["comparison"]["ends_lower"]
    # Again with the log: nothing trains, the same result.
    calls.clear()
    again = run_equal_budget(
        adamw, muon, sweep_steps=20, steps=60, final_seeds=3,
        log=ResumeLog(tmp_path / "runs.jsonl"), run=run,
    )  # fmt: skip
    assert calls == [] and again["comparison"] == result["comparison"]


def test_a_cut_off_last_line_is_run_again_and_a_bad_line_elsewhere_refused(tmp_path) -> None:
    path = tmp_path / "runs.jsonl"
    c = Candidate("adamw", 1e-3, 0.0, beta2=0.95, warmup=20)
    good = json.dumps({**_row([2.0]), "key": run_key(c, 0, 10)})
    path.write_text(good + "\n" + good[: len(good) // 2])
    log = ResumeLog(path)
    assert log.get(run_key(c, 0, 10)) is not None and len(log.rows) == 1
    # The next run lands on a line of its own, and both survive two more loads.
    other = Candidate("adamw", 2e-3, 0.0, beta2=0.95, warmup=20)
    log.add(run_key(other, 0, 10), _row([1.9]))
    for _ in range(2):
        assert len(ResumeLog(path).rows) == 2
    path.write_text(good[:10] + "\n" + good + "\n")
    with pytest.raises(ValueError, match=r"runs\.jsonl:1 is not a JSON line"):
        ResumeLog(path)


@pytest.mark.exhaustive  # trains 8 tiny runs twice
def test_the_command_end_to_end_and_resumed(tmp_path) -> None:
    log, out = tmp_path / "runs.jsonl", tmp_path / "out.json"
    command = [
        sys.executable, "-m", "shardmuon", "bench", "lm", "--budget", "equal",
        "--adamw-lrs", "0.002", "--adamw-beta2s", "0.95", "--adamw-weight-decays", "0",
        "--adamw-warmups", "2", "--muon-lrs", "0.01", "--muon-adamw-lrs", "0.008",
        "--muon-weight-decays", "0", "--sweep-steps", "4", "--steps", "6", "--final-seeds", "3",
        "--nproc", "1", "--eval-every", "2", "--eval-sequences", "4", "--data-bytes", "200000",
        "--batch-size", "4", "--seq-len", "64", "--warmup", "2", "--resume", str(log),
        "--json", str(out), "--plot", str(tmp_path / "equal.png"), "--no-progress",
    ]  # fmt: skip
    first = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(log.read_text().splitlines()) == 1 + 8  # the setup, then the 8 runs
    result = json.loads(out.read_text())
    assert result["budget"] == {"adamw": 1, "muon": 1}
    assert len(result["final_runs"]["muon"]) == 3 and "rule:" in first.stdout
    assert (tmp_path / "equal.png").stat().st_size > 10_000
    second = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "8 found in" in second.stderr
    assert "seed 0, 4 steps" not in second.stderr  # nothing trained again
    assert json.loads(out.read_text())["comparison"] == result["comparison"]


def test_an_interrupted_sweep_keeps_its_finished_runs(tmp_path) -> None:
    adamw, muon = grids((1e-3, 2e-3), (0.95,), (0.0,), (20,), (0.01, 0.02), (4e-3,), (0.0,))
    trained = []

    def run(jobs, fail_at=None):
        (job,) = jobs
        if len(trained) == fail_at:
            raise KeyboardInterrupt
        trained.append(job)
        return [_row([3.0, 2.0 + job[0].lr], every=job[2] // 2)]

    path = tmp_path / "runs.jsonl"
    with pytest.raises(KeyboardInterrupt):
        run_equal_budget(
            adamw, muon, sweep_steps=20, steps=40, final_seeds=3, log=ResumeLog(path),
            run=lambda jobs: run(jobs, fail_at=3),
        )  # fmt: skip
    assert len(path.read_text().splitlines()) == 3
    done, trained[:] = list(trained), []
    run_equal_budget(
        adamw, muon, sweep_steps=20, steps=40, final_seeds=3, log=ResumeLog(path), run=run
    )
    assert not set(trained) & set(done) and len(done) + len(trained) == 10


def test_a_log_of_another_setup_is_refused(tmp_path) -> None:
    path = tmp_path / "runs.jsonl"
    c = Candidate("adamw", 1e-3, 0.0, beta2=0.95, warmup=20)
    ResumeLog(path, {"batch_size": 16, "seq_len": 256}).add(run_key(c, 0, 10), _row([2.0]))
    assert path.read_text().splitlines()[0] == '{"setup": {"batch_size": 16, "seq_len": 256}}'
    again = ResumeLog(path, {"batch_size": 16, "seq_len": 256})
    assert again.get(run_key(c, 0, 10)) is not None
    with pytest.raises(ValueError, match="batch_size 16 then, 8 now"):
        ResumeLog(path, {"batch_size": 8, "seq_len": 256})
    headless = tmp_path / "old.jsonl"
    headless.write_text(json.dumps({**_row([2.0]), "key": run_key(c, 0, 10)}) + "\n")
    with pytest.raises(ValueError, match="records no setup"):
        ResumeLog(headless, {"batch_size": 16})
