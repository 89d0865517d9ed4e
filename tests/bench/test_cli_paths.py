"""Output paths are checked before any work: ``--json``, ``--plot``, ``--csv``, ``--dion-out``
and ``--checkpoint-dir`` of every command fail at once, with exit status 2 and one line that
names the flag, the path and why, instead of after the benchmark or the training.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from shardmuon.cli import main
from shardmuon.harness import cli_support
from shardmuon.harness.cli_support import check_output_dir, check_output_file, check_outputs
from shardmuon.train import TrainConfig, run_training
from shardmuon.train import run as train_run
from shardmuon.train.cli import main as train_main


@pytest.fixture
def a_file(tmp_path):
    """A regular file, used where a directory is expected (like /etc/hostname)."""
    path = tmp_path / "hostname"
    path.write_text("host\n")
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Make every benchmark and training body fail loudly if it is ever reached."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the work started although an output path was bad")

    import shardmuon.bench.ab as ab
    import shardmuon.bench.ns as ns
    import shardmuon.bench.step as step

    monkeypatch.setattr(step, "launch", forbidden)
    monkeypatch.setattr(ns, "measure_shape", forbidden)
    monkeypatch.setattr(ab, "_Setup", forbidden)
    monkeypatch.setattr(train_run, "train_on_rank", forbidden)
    monkeypatch.setattr(train_run, "prepare_resume", forbidden)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert "Traceback" not in err
    return err


# ---------------------------------------------------------------------------- the checks


def test_file_under_a_file_is_refused(a_file):
    with pytest.raises(ValueError) as exc:
        check_output_file(a_file / "x.json", "--json")
    assert str(exc.value) == f"--json {a_file / 'x.json'}: {a_file} is a file, not a directory"
    # Deeper: the nearest existing ancestor is the file.
    with pytest.raises(ValueError, match=f"{a_file} is a file, not a directory"):
        check_output_file(a_file / "sub" / "x.json", "--json")


def test_directory_given_as_a_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--plot .*: is a directory; give a file path"):
        check_output_file(tmp_path, "--plot")


def test_missing_directories_are_fine_and_not_created(tmp_path):
    target = tmp_path / "a" / "b" / "x.json"
    assert check_output_file(target, "--json") == target
    assert (
        check_output_dir(tmp_path / "ck" / "run1", "--checkpoint-dir") == tmp_path / "ck" / "run1"
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "ck").exists()
    # The probe file that tests writability is gone again.
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_checkpoint_dir_that_is_a_file_is_refused(a_file):
    with pytest.raises(ValueError, match=f"--checkpoint-dir {a_file}: is a file, not a directory"):
        check_output_dir(a_file, "--checkpoint-dir")


def test_unwritable_directory_is_refused(tmp_path, monkeypatch):
    # Tests run as root here, where chmod does not take write access away: simulate what
    # os.access says to an ordinary user on a read-only directory.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        cli_support.os,
        "access",
        lambda path, mode: False if os.fspath(path) == str(locked) else real_access(path, mode),
    )
    with pytest.raises(ValueError, match=f"--json {locked / 'x.json'}: directory {locked} is not"):
        check_output_file(locked / "x.json", "--json")
    with pytest.raises(ValueError, match=f"directory {locked} is not writable"):
        check_output_dir(locked / "ck", "--checkpoint-dir")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_directory_where_no_file_can_be_created_is_refused():
    # /proc accepts no new files even from root; only the probe file can tell.
    with pytest.raises(ValueError, match="directory /proc is not writable"):
        check_output_file("/proc/x.json", "--json")


def test_two_outputs_on_one_path_are_refused(tmp_path):
    same = str(tmp_path / "out.png")
    with pytest.raises(ValueError, match=r"--json and --plot both name .*out\.png"):
        check_outputs({"--json": same, "--plot": same, "--csv": None})


# ---------------------------------------------------------------------------- bench


@pytest.mark.parametrize("command", [["step"], ["ns"], ["ab"]])
def test_bench_refuses_a_json_under_a_file_before_running(command, a_file, no_work, capsys):
    assert main(["bench", *command, "--json", str(a_file / "x.json"), "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert (
        err == f"shardmuon: error: --json {a_file / 'x.json'}: {a_file} is a file, not a directory"
    )


@pytest.mark.parametrize("command", [["step"], ["ns"], ["ab"]])
def test_bench_refuses_a_plot_that_is_a_directory(command, tmp_path, no_work, capsys):
    assert main(["bench", *command, "--plot", str(tmp_path), "--no-progress"]) == 2
    assert "--plot" in _one_line_error(capsys)


def test_console_script_refuses_the_path_without_traceback(a_file):
    proc = subprocess.run(
        [sys.executable, "-m", "shardmuon", "bench", "step", "--json", str(a_file / "x.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"shardmuon: error: --json {a_file / 'x.json'}: {a_file} is a file, not a directory"
    ]


# ---------------------------------------------------------------------------- train


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("--json", "json_out"),
        ("--csv", "csv_out"),
        ("--plot", "plot_out"),
        ("--dion-out", "dion_out"),
    ],
)
def test_train_refuses_bad_output_files_before_training(flag, field, a_file, no_work, capsys):
    bad = str(a_file / "out.x")
    assert train_main(["--nproc", "1", "--steps", "2", flag, bad, "--no-progress"]) == 2
    assert _one_line_error(capsys) == (
        f"shardmuon train: error: {flag} {bad}: {a_file} is a file, not a directory"
    )
    # The library call checks the same, before training.
    with pytest.raises(ValueError, match=f"{flag} .*is a file, not a directory"):
        run_training(TrainConfig(nproc=1, steps=2, quiet=True, **{field: bad}))


def test_train_refuses_a_checkpoint_dir_that_is_a_file(a_file, no_work, capsys):
    argv = ["--nproc", "1", "--checkpoint-dir", str(a_file), "--checkpoint-every", "1"]
    assert train_main(argv) == 2
    assert _one_line_error(capsys).endswith(
        f"--checkpoint-dir {a_file}: is a file, not a directory"
    )


def test_train_plot_refuses_its_output_before_reading_runs(tmp_path, capsys):
    missing_run = str(tmp_path / "nope.json")
    assert train_main(["plot", missing_run, "--plot", str(tmp_path)]) == 2
    assert "--plot" in _one_line_error(capsys)


def test_config_validation_checks_paths_last(a_file):
    # A bad value is still reported as such, not hidden behind the path check.
    config = dataclasses.replace(TrainConfig(optim={"lr": 0.0}), json_out=str(a_file / "x.json"))
    with pytest.raises(ValueError, match="lr must be a finite number"):
        config.validate()
