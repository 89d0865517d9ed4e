"""The long commands' manners: a time estimate of their own work, one line and exit status
130 on Ctrl-C with their workers ended, ``--help`` in plain words, and ``bench ns``'s
warning when its timed repeats disagree.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_walk import all_parsers

from shardmuon.cli import build_parser, main
from shardmuon.harness import jobs

# How the Ctrl-C line gives the time the command ran.
ELAPSED = r"(\d+ h \d+ min|\d+ min \d+ s|\d+ s)"


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    # --threads sets torch's process-wide thread count; keep it from leaking into other tests.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ help


def test_no_help_shows_docstring_markup():
    parsers = list(all_parsers(build_parser()))
    assert {"shardmuon bench plan", "shardmuon bench lm", "shardmuon train plot"} <= {
        p.prog for p in parsers
    }
    marked = {
        p.prog: [m for m in ("``", ":func:", ":class:", ":mod:") if m in p.format_help()]
        for p in parsers
    }
    assert not any(marked.values()), marked


def test_plan_help_is_a_short_description_with_an_example(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "plan", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n", 1)[1].split("\noptions:", 1)[0]
    assert len(description.splitlines()) <= 15, description
    assert "Example:" in description and "shardmuon bench plan --model" in description


# ------------------------------------------------------------------------------ estimates


def test_durations_read_as_estimates():
    assert [jobs.format_duration(s) for s in (0.2, 40, 89, 90, 12 * 60, 5400, 9000)] == [
        "1 s", "40 s", "89 s", "2 min", "12 min", "1.5 h", "2.5 h",
    ]  # fmt: skip
    assert jobs.estimate_line("x", 5, "1 step measured") is None  # done before it is read
    assert jobs.estimate_line("x", float("nan"), "1 step measured") is None
    line = jobs.estimate_line("x", 720, "4 steps measured", left=True)
    assert line == "x: estimated 12 min left on this machine (4 steps measured)"


def test_the_training_estimate_counts_steps_and_evaluations():
    from shardmuon.train.config import task_config
    from shardmuon.train.loop import EstimatePlan, _estimate, evaluations

    config = task_config("lm", "muon", steps=150, eval_every=10)
    assert evaluations(config) == 15 and evaluations(config, 4) == 15
    assert evaluations(config, 145) == 1 and evaluations(config, 150) == 0
    # Step 1 (lazy state) is not counted; steps 2-4 take 1 s, an evaluation 2 s.
    line = _estimate(EstimatePlan("job"), config, 4, [9.0, 1.0, 1.0, 1.0], [2.0], took=10.0)
    # 10 s so far + 146 steps + 15 evaluations.
    assert line == (
        f"job: estimated {jobs.format_duration(10 + 146 + 30)} on this machine "
        "(3 steps and a held-out evaluation measured)"
    )
    later = EstimatePlan("job", later_steps=300, later_evals=32, basis="; more", left=True)
    line = _estimate(later, config, 4, [9.0, 1.0, 1.0, 1.0], [2.0], took=10.0)
    assert f"estimated {jobs.format_duration(10 + 446 + 94)} left" in line and "; more)" in line


def test_train_prints_its_estimate_once_measured(monkeypatch, capsys):
    monkeypatch.setattr(jobs, "ESTIMATE_MIN_SECONDS", 0.0)
    argv = ["train", "--model", "tiny-dense", "--layers", "1", "--batch-size", "4",
            "--max-len", "4", "--nproc", "1", "--steps", "6", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if "estimated" in x]
    assert len(lines) == 1, lines
    assert re.fullmatch(
        r"shardmuon train: estimated \d+ s on this machine \(3 steps measured\)", lines[0]
    ), lines


def test_a_short_train_run_says_nothing_about_its_length(capsys):
    argv = ["train", "--model", "tiny-dense", "--layers", "1", "--batch-size", "4",
            "--max-len", "4", "--nproc", "1", "--steps", "5", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "estimated" not in capsys.readouterr().err


def _ns_argv(*more: str) -> list[str]:
    return ["bench", "ns", "--shapes", "4x16x32,16x24", "--repeats", "3", "--threads", "1",
            "--device", "cpu", "--no-progress", *more]  # fmt: skip


def test_ns_estimates_from_its_first_shape(monkeypatch, capsys):
    monkeypatch.setattr(jobs, "ESTIMATE_MIN_SECONDS", 0.0)
    assert main(_ns_argv()) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if "estimated" in x]
    assert len(lines) == 1, lines
    assert lines[0].startswith("bench ns: estimated ")
    assert lines[0].endswith("(4x16x32 measured, the others scaled by their FLOPs)")


def test_lm_header_promises_an_estimate_and_the_first_run_gives_it(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"f{i}.py").write_text(f"x{i} = {i}\n" * 60)
    argv = ["bench", "lm", "--nproc", "1", "--layers", "1", "--steps", "4", "--seeds", "1",
            "--adamw-lrs", "0.001", "--muon-lrs", "0.01", "--muon-adamw-lrs", "0.004",
            "--engines", "none", "--batch-size", "2", "--seq-len", "16", "--warmup", "1",
            "--eval-every", "2", "--eval-sequences", "2", "--data", str(data),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert "their time is estimated after the first run's first steps" in err[0], err[0]
    estimates = [x for x in err if "estimated" in x][1:]
    assert len(estimates) == 1, err
    assert re.fullmatch(
        r"shardmuon bench lm: estimated \d+ s on this machine \(3 steps and a held-out "
        r"evaluation measured; Muon's steps counted at AdamW's cost until timed\)",
        estimates[0],
    ), estimates


# ------------------------------------------------------------------------------ bench ns timings


def test_ns_warns_when_timed_repeats_disagree(monkeypatch, tmp_path, capsys):
    from shardmuon.bench import ns_measure

    calls = []

    def stub_times(fn, device, repeats, warmup=1):
        # The first timed call (the folded iteration of the first shape) was disturbed.
        calls.append(repeats)
        return [0.009, 0.087, 0.010] if len(calls) == 1 else [0.010] * repeats

    monkeypatch.setattr(ns_measure, "repeat_times", stub_times)
    out = tmp_path / "ns.json"
    assert main(_ns_argv("--json", str(out))) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "bench ns: warning: timings of (4, 16, 32) (folded, dion) varied 9.0 ms - 87 ms: the "
        "machine was likely busy; rerun or raise --repeats"
    ), err
    assert [x for x in err if "warning" in x] == err[:1]
    data = json.loads(out.read_text())
    assert [r["unstable"] for r in data["results"]] == [True, False]
    assert data["results"][0]["unstable_calls_ms"] == {"folded": [9.0, 87.0]}
    assert not any(r["unstable"] for r in data["engines"])


def test_repeats_within_twice_each_other_are_stable(monkeypatch):
    from shardmuon.bench import ns_measure

    monkeypatch.setattr(ns_measure, "repeat_times", lambda *a, **k: [0.010, 0.020, 0.015])
    shape, preset = (2, 8, 16), "dion"
    row = ns_measure.measure_shape(shape, preset, torch.device("cpu"), 3, 0)
    assert row["unstable"] is False and row["unstable_calls_ms"] == {}


# ------------------------------------------------------------------------------ Ctrl-C


@pytest.fixture
def keep_other_workers(monkeypatch):
    """In this process, Ctrl-C's ending of workers would end other tests' gloo worlds;
    the commands run as subprocesses below check the ending itself."""
    monkeypatch.setattr(jobs, "end_child_processes", lambda: 0)


def test_interrupted_reports_what_the_job_did_and_where_its_results_are(keep_other_workers, capsys):
    job = jobs.start_job("shardmuon bench lm")
    job.done = lambda: "3 of 30 runs"
    job.partial = lambda: "lm.json (3 of 30 runs)"
    try:
        assert jobs.interrupted("shardmuon bench lm") == 130
    finally:
        jobs.finish_job()
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"interrupted: shardmuon bench lm stopped after 3 of 30 runs \({ELAPSED}\); partial "
        r"results in lm\.json \(3 of 30 runs\)",
        line,
    ), line


def test_lm_interrupted_between_sweeps_writes_the_finished_runs(
    keep_other_workers, monkeypatch, tmp_path, capsys
):
    from shardmuon.bench import lm

    real_run_all = lm._run_all

    def run_then_stop(configs, sweep=None):
        if sweep.rows:
            raise KeyboardInterrupt  # Ctrl-C during the second sweep
        return real_run_all(configs, sweep)

    monkeypatch.setattr(lm, "_run_all", run_then_stop)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"f{i}.py").write_text(f"x{i} = {i}\n" * 60)
    out = tmp_path / "lm.json"
    argv = ["bench", "lm", "--nproc", "1", "--layers", "1", "--steps", "2", "--seeds", "1",
            "--adamw-lrs", "0.001,0.002", "--muon-lrs", "0.01", "--muon-adamw-lrs", "0.004",
            "--engines", "none", "--batch-size", "2", "--seq-len", "16", "--warmup", "1",
            "--eval-sequences", "2", "--data", str(data), "--json", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"interrupted: shardmuon bench lm stopped after 2 of 3 runs \({ELAPSED}\); partial "
        rf"results in {re.escape(str(out))} \(2 of 3 runs\)",
        last,
    ), last
    written = json.loads(out.read_text())
    assert written["interrupted"] is True
    assert [(r["setting"], r["lr"]) for r in written["runs"]] == [
        ("adamw", 0.001),
        ("adamw", 0.002),
    ]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (fork-server workers are its grandchildren)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _interrupt(argv: list[str], started, cwd: Path) -> tuple[int, str, list[int]]:
    """Start ``shardmuon argv``, send SIGINT to it (only) once ``started(descendants)``,
    return its exit status, stderr and the processes it had below it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardmuon", *argv],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not started(_descendants(proc.pid)):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the command never got going"
            time.sleep(0.2)
        below = _descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err, below


def _gone(pids: list[int], within: float = 15.0) -> list[int]:
    deadline = time.monotonic() + within
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if _running(p)]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_stops_training_with_one_line_and_ends_its_ranks(tmp_path):
    ck = tmp_path / "ck"
    argv = ["train", "--nproc", "2", "--model", "tiny-dense", "--layers", "1",
            "--batch-size", "4", "--max-len", "4", "--steps", "100000", "--checkpoint-dir",
            str(ck), "--checkpoint-every", "2", "--no-progress"]  # fmt: skip
    rc, err, below = _interrupt(argv, lambda _: any(ck.glob("step-*")), tmp_path)
    assert rc == 130, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"interrupted: shardmuon train stopped after step \d+ of 100000 \({ELAPSED}\); partial "
        rf"results in {re.escape(str(ck))} \(step-\d+; --resume {re.escape(str(ck))} continues\)",
        last,
    ), err
    assert len(below) >= 2, below  # the two ranks (and the fork server) were running
    assert _gone(below) == []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_stops_bench_step_and_ends_its_workers(tmp_path):
    argv = ["bench", "step", "--nproc", "2", "--model", "tiny-dense", "--layers", "1",
            "--steps", "100000", "--no-progress"]  # fmt: skip
    # Both workers are up (spawned: children of the command itself); give them a moment.
    first_seen: list[float] = []

    def started(below: list[int]) -> bool:
        if len(below) >= 2 and not first_seen:
            first_seen.append(time.monotonic())
        return bool(first_seen) and time.monotonic() - first_seen[0] > 3

    rc, err, below = _interrupt(argv, started, tmp_path)
    assert rc == 130, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"interrupted: shardmuon bench step stopped after {ELAPSED}", last), err
    assert _gone(below) == []
