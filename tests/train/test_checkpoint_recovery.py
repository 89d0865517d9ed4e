"""Checkpoints never lose the last good state: the newest by step number, recovery of what a
killed save leaves, damaged checkpoints named and skipped, and optimizer flags on a resume.

Crashes are simulated by putting the directories a save goes through into the state a kill
at that moment leaves; damage by writing garbage into the files of real checkpoints. The
end-to-end runs use one process (no FSDP), which resumes bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from shardmuon.train import CheckpointError, TrainConfig, run_training
from shardmuon.train import checkpoint as ckpt_io
from shardmuon.train.checkpoint import COMPLETE_MARKER, CorruptCheckpointError, step_dir
from shardmuon.train.cli import main as train_main
from shardmuon.train.config import optim_settings
from shardmuon.train.recovery import find_checkpoint, repair_checkpoints, step_checkpoints

TINY = TrainConfig(
    model="tiny-dense",
    num_layers=1,
    steps=4,
    batch_size=4,
    min_len=2,
    max_len=4,
    nproc=1,
    quiet=True,
)


def _save(root: Path, step: int, fill: float) -> Path:
    """A real checkpoint of a small model whose weights are all ``fill``."""
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return ckpt_io.save_checkpoint(root, step, model, optimizer, {"step": step, "world_size": 1})


def _weight_fill(ckpt: Path) -> float:
    """The ``fill`` a checkpoint written by :func:`_save` was saved with."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"weight": torch.empty(3, 4), "bias": torch.empty(3)}}
    dcp.load(state, checkpoint_id=str(ckpt))
    return float(state["model"]["weight"][0, 0])


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ---------------------------------------------------------------------------- newest by number


def test_newest_checkpoint_is_chosen_by_step_number(tmp_path):
    _save(tmp_path, 999_999, 1.0)
    _save(tmp_path, 1_000_000, 2.0)
    # By name "step-999999" sorts after "step-1000000".
    assert _names(tmp_path) == ["step-1000000", "step-999999"]
    assert find_checkpoint(tmp_path, repair=False).path.name == "step-1000000"
    assert sorted(step_checkpoints(tmp_path)) == [999_999, 1_000_000]


# ---------------------------------------------------------------------------- killed saves


def _killed_between_renames(root: Path, step: int) -> tuple[Path, Path]:
    """Disk state of a re-save of ``step`` killed after its first rename: the old copy
    (fill 1.0) renamed aside, the new complete one (fill 2.0) not yet renamed in."""
    old = _save(root / "first", step, 1.0)
    new = _save(root / "second", step, 2.0)
    aside = root / f".old-{old.name}-0000aaaa"
    pending = root / f".tmp-{new.name}-0000bbbb"
    os.rename(old, aside)
    os.rename(new, pending)
    shutil.rmtree(root / "first")
    shutil.rmtree(root / "second")
    return aside, pending


def test_killed_between_the_two_renames_is_recovered(tmp_path):
    aside, pending = _killed_between_renames(tmp_path, 5)
    assert _names(tmp_path) == [aside.name, pending.name]  # nothing visible
    # Read-only: the complete new copy is found where it is, nothing moves.
    assert find_checkpoint(tmp_path, repair=False).path == pending
    assert _names(tmp_path) == [aside.name, pending.name]
    selection = find_checkpoint(tmp_path, repair=True)
    assert selection.path == step_dir(tmp_path, 5)
    assert _names(tmp_path) == ["step-000005"]
    assert _weight_fill(selection.path) == 2.0  # the newer save won
    assert any("recovered step-000005" in line for line in selection.notes)


def test_only_the_old_copy_left_is_recovered(tmp_path):
    _aside, pending = _killed_between_renames(tmp_path, 5)
    (pending / COMPLETE_MARKER).unlink()  # the new copy never finished
    assert find_checkpoint(tmp_path, repair=True).path == step_dir(tmp_path, 5)
    assert _names(tmp_path) == ["step-000005"]
    assert _weight_fill(step_dir(tmp_path, 5)) == 1.0


def test_an_explicit_step_dir_lost_in_a_rename_is_recovered(tmp_path):
    _killed_between_renames(tmp_path, 5)
    selection = find_checkpoint(tmp_path / "step-000005", repair=True)
    assert selection.path == tmp_path / "step-000005"
    assert _weight_fill(selection.path) == 2.0


def test_a_root_that_cannot_be_written_is_read_in_place(tmp_path, monkeypatch):
    import shardmuon.train.recovery as recovery

    _aside, pending = _killed_between_renames(tmp_path, 5)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(recovery.os, "rename", refuse)
    monkeypatch.setattr(recovery.shutil, "rmtree", refuse)
    selection = find_checkpoint(tmp_path, repair=True)
    assert selection.path == pending
    assert f"could not rename {pending.name} to step-000005 (Permission denied)" in selection.notes


def test_leftovers_of_killed_saves_are_cleaned(tmp_path):
    _save(tmp_path, 4, 1.0)
    kept = _save(tmp_path, 8, 3.0)
    unfinished = tmp_path / ".tmp-step-000012-0000cccc"  # killed while writing
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"half")
    stale_old = tmp_path / ".old-step-000008-0000dddd"  # killed before deleting it
    shutil.copytree(kept, stale_old)
    notes = repair_checkpoints(tmp_path)
    assert _names(tmp_path) == ["step-000004", "step-000008"]
    assert _weight_fill(kept) == 3.0
    assert sorted(notes) == [
        f"removed {stale_old.name}, left by a killed save",
        f"removed {unfinished.name}, left by a killed save",
    ]
    assert repair_checkpoints(tmp_path) == []


def test_save_is_marked_complete_last_and_leaves_nothing_else(tmp_path):
    ckpt = _save(tmp_path, 3, 1.0)
    _save(tmp_path, 3, 2.0)  # re-save of the same step
    assert _names(tmp_path) == ["step-000003"]
    manifest = json.loads((ckpt / COMPLETE_MARKER).read_text())["files"]
    assert set(manifest) == {".metadata", "__0_0.distcp", "trainer_state.json", "rng/rank0.pt"}
    assert manifest["__0_0.distcp"] == (ckpt / "__0_0.distcp").stat().st_size
    assert _weight_fill(ckpt) == 2.0


# ---------------------------------------------------------------------------- damage


@pytest.fixture
def two_steps(tmp_path):
    _save(tmp_path, 2, 1.0)
    newest = _save(tmp_path, 4, 2.0)
    return tmp_path, newest


def _garbage_metadata(ckpt: Path) -> Path:
    (ckpt / ".metadata").write_bytes(b"\x00garbage\xff" * 3)
    return ckpt / ".metadata"


def _truncated_shard(ckpt: Path) -> Path:
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    return shard


def _invalid_trainer_state(ckpt: Path) -> Path:
    (ckpt / "trainer_state.json").write_text('{"step": 4, "world')
    return ckpt / "trainer_state.json"


def _truncated_rng(ckpt: Path) -> Path:
    rng = ckpt / "rng" / "rank0.pt"
    rng.write_bytes(rng.read_bytes()[:10])
    return rng


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (_garbage_metadata, "is damaged: cannot read it"),
        (_truncated_shard, "is damaged: 100 bytes, at least"),
        (_invalid_trainer_state, "is damaged: not valid JSON"),
        (_truncated_rng, "is damaged: 10 bytes, exactly"),
    ],
)
def test_damaged_newest_checkpoint_is_named_and_skipped(two_steps, damage, why):
    root, newest = two_steps
    file = damage(newest)
    # Named explicitly: an error naming the file, no fallback.
    with pytest.raises(CorruptCheckpointError) as exc:
        find_checkpoint(newest, repair=False)
    assert str(file) in str(exc.value) and why in str(exc.value)
    # A root: the previous complete checkpoint, with a warning naming the damaged file.
    selection = find_checkpoint(root, repair=True)
    assert selection.path == step_dir(root, 2)
    assert len(selection.notes) == 1
    assert str(file) in selection.notes[0] and "resuming from" in selection.notes[0]
    assert selection.notes[0].endswith("step-000002")


def test_every_checkpoint_damaged_is_an_error(two_steps):
    root, newest = two_steps
    _garbage_metadata(newest)
    _truncated_shard(step_dir(root, 2))
    with pytest.raises(CorruptCheckpointError, match=r"every checkpoint in .* is damaged"):
        find_checkpoint(root, repair=True)


def test_missing_metadata_in_a_step_dir_is_named(two_steps):
    _, newest = two_steps
    (newest / ".metadata").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"step-000004/\.metadata is missing"):
        find_checkpoint(newest, repair=False)


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_training_resumes_past_a_killed_save_and_a_damaged_checkpoint(tmp_path, capsys):
    root = tmp_path / "ck"
    full = run_training(dataclasses.replace(TINY, steps=6))
    run_training(dataclasses.replace(TINY, checkpoint_dir=str(root), checkpoint_every=2))
    assert _names(root) == ["step-000002", "step-000004"]
    # A re-save of step 4 killed between its renames, a save of step 6 killed while
    # writing, and step 2 damaged: only the hidden copy of step 4 is good.
    os.rename(root / "step-000004", root / ".old-step-000004-0000aaaa")
    (root / ".tmp-step-000006-0000bbbb").mkdir()
    _invalid_trainer_state(root / "step-000002")
    out = tmp_path / "resumed.json"
    argv = ["--model", "tiny-dense", "--layers", "1", "--batch-size", "4", "--max-len", "4",
            "--nproc", "1", "--steps", "6", "--resume", str(root), "--json", str(out),
            "--no-progress"]  # fmt: skip
    assert train_main(argv) == 0
    err = capsys.readouterr().err
    assert "recovered step-000004 from .old-step-000004-0000aaaa" in err
    assert "removed .tmp-step-000006-0000bbbb" in err
    result = json.loads(out.read_text())
    assert result["start_step"] == 4
    assert result["resumed_from"] == str(root / "step-000004")
    resumed = {item["step"]: item["loss"] for item in result["losses"]}
    assert resumed == {5: full.losses[5], 6: full.losses[6]}


@pytest.mark.slow
def test_resume_takes_optimizer_settings_from_the_checkpoint(tmp_path, capsys):
    root = tmp_path / "ck"
    lr = 0.02  # not the default (0.01)
    tuned = dataclasses.replace(TINY, optim=optim_settings(TINY.optim, lr=lr, mu=0.9))
    full = run_training(tuned)
    run_training(dataclasses.replace(tuned, steps=2, checkpoint_dir=str(root), checkpoint_every=2))
    common = ["--model", "tiny-dense", "--layers", "1", "--batch-size", "4", "--max-len", "4",
              "--nproc", "1", "--steps", "4", "--resume", str(root), "--no-progress"]  # fmt: skip

    # A flag that differs from the checkpoint is refused, naming it and both values.
    assert train_main([*common, "--lr", "0.03", "--mu", "0.9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "these differ: --lr 0.03 (checkpoint: 0.02)" in err
    assert "--mu" not in err.split("differ:")[1]  # --mu 0.9 equals the checkpoint's

    # Left out, the checkpoint's settings are used and recorded; the run is the same as
    # the uninterrupted one.
    out = tmp_path / "resumed.json"
    assert train_main([*common, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    optim = result["config"]["optim"]
    assert (optim["lr"], optim["mu"]) == (lr, 0.9)
    resumed = {item["step"]: item["loss"] for item in result["losses"]}
    assert resumed == {3: full.losses[3], 4: full.losses[4]}

    # The library call does not guess: a config that differs is refused.
    with pytest.raises(ValueError, match=r"--lr 0\.01 \(checkpoint: 0\.02\), --mu 0\.95"):
        run_training(dataclasses.replace(TINY, resume=str(root)))


@pytest.mark.slow
def test_dion_format_resume_refuses_other_group_settings(tmp_path, capsys):
    dion_file = tmp_path / "step2.pt"
    optim = optim_settings(TINY.optim, lr=0.02)
    run_training(dataclasses.replace(TINY, steps=2, optim=optim, dion_out=str(dion_file)))
    common = ["--model", "tiny-dense", "--layers", "1", "--batch-size", "4", "--max-len", "4",
              "--nproc", "1", "--steps", "3", "--resume-dion", str(dion_file), "--no-progress"]  # fmt: skip
    assert train_main([*common, "--lr", "0.05"]) == 2
    assert "--lr 0.05 (checkpoint: 0.02)" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert train_main([*common, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["optim"]["lr"] == 0.02


def test_resume_from_nothing_is_still_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        find_checkpoint(tmp_path, repair=True)
    with pytest.raises(CheckpointError, match="does not exist"):
        find_checkpoint(tmp_path / "step-000003", repair=True)
