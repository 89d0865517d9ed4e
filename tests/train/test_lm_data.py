"""``shardmuon train --task lm``'s data (issue #31): the directory walk, the split by file,
held-out text never in a training batch, the byte cap, the refusals, and the lr schedule.
Fast: small corpora written here, no training."""

from __future__ import annotations

import itertools
import math
import os
import re
import socket
import stat
import sysconfig
import threading
from pathlib import Path

import pytest
import torch

from shardmuon.cli import main as shardmuon_main
from shardmuon.train.cli import main as train_main
from shardmuon.train.config import task_config
from shardmuon.train.lm_data import (
    END_OF_TEXT,
    VOCAB_SIZE,
    default_data_path,
    plan_corpus,
    read_corpus,
)
from shardmuon.train.schedule import MIN_LR_FRACTION, lr_factor
from shardmuon.train.tasks import LanguageModelTask, check_corpus


def _corpus(root: Path, files: int = 30, size: int = 400) -> dict[str, str]:
    """``files`` text files under ``root`` (some nested), each filled with its own marker;
    returns relative path -> marker."""
    markers = {}
    for i in range(files):
        rel = f"pkg{i % 3}/sub/file{i}{('.py', '.md', '.txt', '.rst')[i % 4]}"
        marker = f"<<marker-{i:03d}>>"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((marker + " ") * (size // (len(marker) + 1)))
        markers[rel] = marker
    return markers


def _text(ids: torch.Tensor) -> str:
    return bytes(int(i) for i in ids.flatten().tolist() if i != END_OF_TEXT).decode("latin-1")


def test_the_walk_takes_text_files_only_and_skips_hidden_dirs_and_packages(tmp_path):
    markers = _corpus(tmp_path)
    for skipped in (".git/x.py", "__pycache__/y.py", "site-packages/z.py", "dist-packages/w.md"):
        (tmp_path / skipped).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / skipped).write_text("skipped " * 50)
    (tmp_path / "data.json").write_text("{}" * 100)
    plan = plan_corpus(tmp_path)
    taken = {Path(p.path).relative_to(tmp_path).as_posix() for p in plan.train + plan.held_out}
    assert taken == set(markers)


def test_the_split_is_by_file_deterministic_and_about_a_tenth(tmp_path):
    _corpus(tmp_path, files=60)
    plan = plan_corpus(tmp_path)
    train = {p.path for p in plan.train}
    held_out = {p.path for p in plan.held_out}
    assert train and held_out and not train & held_out
    assert all(p.start == 0 and p.stop == Path(p.path).stat().st_size for p in plan.held_out)
    share = sum(p.size for p in plan.held_out) / sum(p.size for p in plan.train + plan.held_out)
    assert 0.05 < share < 0.15, share
    # The order is a hash of the relative paths: the same plan from a copy elsewhere.
    copy = tmp_path.parent / "copy"
    _corpus(copy, files=60)
    again = plan_corpus(copy)
    assert [Path(p.path).relative_to(copy) for p in again.held_out] == [
        Path(p.path).relative_to(tmp_path) for p in plan.held_out
    ]


def test_held_out_text_is_never_in_a_training_batch(tmp_path):
    markers = _corpus(tmp_path, files=40)
    plan = plan_corpus(tmp_path)
    corpus = read_corpus(plan)
    held_out = {markers[Path(p.path).relative_to(tmp_path).as_posix()] for p in plan.held_out}
    task = LanguageModelTask(corpus, seq_len=64, seed=3, eval_sequences=8)
    seen = ""
    for step in range(1, 60):
        batch = task.batch(step, 16)
        assert batch["input_ids"].shape == (16, 64)
        assert torch.equal(batch["input_ids"], batch["labels"])
        assert int(batch["input_ids"].max()) < VOCAB_SIZE
        seen += "|".join(_text(row) for row in batch["input_ids"])
    assert not any(marker in seen for marker in held_out)
    assert sum(marker in seen for marker in markers.values()) > len(markers) // 2
    # The held-out batch is the held-out text only, the same every time.
    evaluated = _text(task.held_out_batch()["input_ids"])
    assert any(marker in evaluated for marker in held_out)
    assert not any(m in evaluated for m in set(markers.values()) - held_out)
    assert torch.equal(task.held_out_batch()["input_ids"], task.held_out_batch()["input_ids"])


def test_batches_depend_only_on_seed_and_step(tmp_path):
    _corpus(tmp_path)
    corpus = read_corpus(plan_corpus(tmp_path))
    a = LanguageModelTask(corpus, 32, seed=1, eval_sequences=4)
    b = LanguageModelTask(read_corpus(plan_corpus(tmp_path)), 32, seed=1, eval_sequences=4)
    assert torch.equal(a.batch(7, 8)["input_ids"], b.batch(7, 8)["input_ids"])
    assert not torch.equal(a.batch(7, 8)["input_ids"], a.batch(8, 8)["input_ids"])
    other = LanguageModelTask(corpus, 32, seed=2, eval_sequences=4)
    assert not torch.equal(a.batch(7, 8)["input_ids"], other.batch(7, 8)["input_ids"])


def test_the_byte_cap_takes_exactly_that_many_bytes(tmp_path):
    _corpus(tmp_path, files=30, size=400)
    plan = plan_corpus(tmp_path, max_bytes=1000)
    assert sum(p.size for p in plan.train + plan.held_out) == 1000
    corpus = read_corpus(plan)
    # Each piece's bytes, then one separator.
    assert corpus.train.numel() + corpus.held_out.numel() == 1000 + len(plan.train + plan.held_out)
    assert int((corpus.train == END_OF_TEXT).sum()) == len(plan.train)


def test_a_single_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(32, 127)) * 20)
    plan = plan_corpus(path)
    (train,), (held_out,) = plan.train, plan.held_out
    assert (train.start, train.stop, held_out.stop) == (0, held_out.start, path.stat().st_size)
    assert held_out.size == round(path.stat().st_size * 0.1)


def test_the_default_is_this_pythons_standard_library_without_installed_packages():
    assert default_data_path() == sysconfig.get_paths()["stdlib"]
    plan = plan_corpus(max_bytes=200_000)
    paths = [p.path for p in plan.train + plan.held_out]
    assert all(p.startswith(default_data_path()) for p in paths)
    assert not any("site-packages" in p or "dist-packages" in p for p in paths)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: _touch(root / "empty.txt"), r"holds 0 byte\(s\)"),
        (lambda root: _mkdir(root / "none", "x.json"), r"holds no \.py, \.md, \.txt, \.rst file"),
        (
            lambda root: _mkdir(root / "blank", "a.py", "b.md"),
            r"its 2 text file\(s\) are all empty",
        ),
    ],
)
def test_bad_paths_are_refused_in_one_line_naming_the_path(tmp_path, capsys, make, why):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"data '{path}': ") + why):
        plan_corpus(path)
    argv = ["--task", "lm", "--nproc", "1", "--steps", "1", "--data", str(path), "--no-progress"]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardmuon train: error: data ") and str(path) in err
    assert "\n" not in err and "Traceback" not in err


def test_an_unreadable_file_is_refused_naming_it(tmp_path, monkeypatch):
    _corpus(tmp_path, files=4)
    locked = tmp_path / "pkg1/sub/file1.md"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    expected = re.escape(f"data '{locked}': cannot be read (permission denied)")
    with pytest.raises(ValueError, match=expected):
        plan_corpus(tmp_path)


def _without_hanging(call, fifo: Path | None = None, seconds: float = 30.0):
    """``call()``'s result or exception, in a thread given ``seconds``. A call still running
    then is blocked on opening ``fifo`` (it waits for a writer): a writer is opened, to let
    it go, and the test fails."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the test thread
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(seconds)
        pytest.fail(f"still running after {seconds:g} s: a non-regular file was opened")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# Non-regular files with a text file's name, under a directory walked: each is refused in
# one line naming it, as an unreadable file is, and never opened.
def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _socket(path: Path) -> Path:
    server = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(path.parent)  # a relative name: a socket's path is limited to about 100 bytes
    try:
        server.bind(path.name)  # the file stays after the socket is closed
    finally:
        os.chdir(cwd)
        server.close()
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (_fifo, "a FIFO (named pipe)"),  # opening it would wait for a writer for ever
        (_socket, "a socket"),
    ],
)
def test_a_non_regular_file_in_a_directory_is_refused_unopened(tmp_path, capsys, make, kind):
    _corpus(tmp_path / "data", files=4)
    special = make(tmp_path / "data" / "pkg0" / "special.txt")
    fifo = special if stat.S_ISFIFO(special.stat().st_mode) else None
    expected = re.escape(f"data '{special}': is {kind}, not a regular file")
    with pytest.raises(ValueError, match=expected):
        _without_hanging(lambda: plan_corpus(tmp_path / "data"), fifo)
    argv = ["--task", "lm", "--nproc", "1", "--steps", "1", "--no-progress"]
    assert _without_hanging(lambda: train_main([*argv, "--data", str(tmp_path)]), fifo) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"shardmuon train: error: data '{special}': is {kind}, not a regular file"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_bench_lm_refuses_a_fifo_in_its_data_before_any_run(tmp_path, capsys):
    _corpus(tmp_path, files=4)
    fifo = _fifo(tmp_path / "pkg1" / "pipe.py")
    argv = ["bench", "lm", "--nproc", "1", "--steps", "1", "--seeds", "1", "--no-progress"]
    assert _without_hanging(lambda: shardmuon_main([*argv, "--data", str(tmp_path)]), fifo) == 2
    err = capsys.readouterr().err.strip()
    assert f"data '{fifo}': is a FIFO (named pipe), not a regular file" in err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_a_fifo_given_as_the_data_is_refused_unopened(tmp_path):
    fifo = _fifo(tmp_path / "pipe.txt")
    expected = re.escape(f"data '{fifo}': is a FIFO (named pipe), neither a regular file nor")
    with pytest.raises(ValueError, match=expected):
        _without_hanging(lambda: plan_corpus(fifo), fifo)


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_a_broken_symbolic_link_is_named_with_its_target(tmp_path):
    _corpus(tmp_path / "data", files=4)
    target = tmp_path / "gone" / "notes.md"
    link = tmp_path / "data" / "pkg2" / "notes.md"
    link.symlink_to(target)
    why = f"is a broken symbolic link (to {str(target)!r})"
    with pytest.raises(ValueError, match=re.escape(f"data '{link}': {why}")):
        plan_corpus(tmp_path / "data")
    # Given as the data itself, too.
    with pytest.raises(ValueError, match=re.escape(f"data '{link}': {why}")):
        plan_corpus(link)
    # A link to a regular file is read as that file.
    target.parent.mkdir()
    target.write_text("linked text " * 20)
    assert str(link) in {p.path for p in plan_corpus(tmp_path / "data").train} | {
        p.path for p in plan_corpus(tmp_path / "data").held_out
    }


def test_a_corpus_smaller_than_one_batch_is_refused(tmp_path):
    _corpus(tmp_path, files=10, size=100)
    plan = plan_corpus(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"data '{tmp_path}': ") + ".* fewer than one"):
        check_corpus(plan, batch_size=64, seq_len=256)
    with pytest.raises(ValueError, match="fewer than one batch"):
        task_config("lm", nproc=1, data=str(tmp_path), batch_size=64).validate()
    with pytest.raises(ValueError, match=r"held-out text is .* shorter than one sequence"):
        check_corpus(plan, batch_size=1, seq_len=200)


def test_flags_of_the_other_task_are_refused(capsys):
    assert train_main(["--data", "x", "--nproc", "1"]) == 2
    assert "--data is a --task lm flag; this run is --task reverse" in capsys.readouterr().err
    assert train_main(["--task", "lm", "--max-len", "4", "--nproc", "1"]) == 2
    assert "--max-len is a --task reverse flag" in capsys.readouterr().err


def test_the_schedule_warms_up_then_decays_to_its_floor():
    assert [lr_factor(s, 100, 4, "constant") for s in (1, 2, 4, 5, 100)] == [0.25, 0.5, 1, 1, 1]
    assert lr_factor(4, 100, 4, "cosine") == 1.0
    assert lr_factor(100, 100, 4, "cosine") == pytest.approx(MIN_LR_FRACTION)
    assert lr_factor(52, 100, 4, "cosine") == pytest.approx((1 + MIN_LR_FRACTION) / 2)
    values = [lr_factor(s, 100, 4, "cosine") for s in range(5, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values)) and math.isfinite(values[-1])
    with pytest.raises(ValueError, match="schedule 'linear' unknown; accepted: constant, cosine"):
        lr_factor(1, 10, 0, "linear")


def test_lm_defaults_and_the_adamw_lr(tmp_path):
    muon = task_config("lm")
    assert (muon.model, muon.schedule, muon.adamw_lr is not None) == ("lm-llama", "cosine", True)
    adamw = task_config("lm", "adamw")
    assert adamw.adamw_lr is None and adamw.optim.betas == (0.9, 0.95)
    with pytest.raises(ValueError, match=r"adamw_lr 0\.01 is the lr of Muon's AdamW group"):
        task_config("lm", "adamw", adamw_lr=0.01, nproc=1).validate()


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _mkdir(path: Path, *names: str) -> Path:
    path.mkdir()
    for name in names:
        (path / name).write_bytes(b"")
    return path
