"""Finding the checkpoint to resume from, and repairing what killed saves leave behind.

A save (:func:`.checkpoint.save_checkpoint`) writes ``.tmp-step-N-<id>``, marks it complete,
then renames it to ``step-N``; re-saving an existing step first renames the old one to
``.old-step-N-<id>``. A process killed part-way leaves one of these states on disk:

- a ``.tmp-`` without the complete marker: a save that never finished; deleted;
- a complete ``.tmp-`` or an ``.old-`` while ``step-N`` exists: a save that finished but
  did not clean up (or never got renamed in); deleted, ``step-N`` is kept;
- a complete ``.tmp-`` and/or an ``.old-`` and no ``step-N``: killed between the two
  renames; the newest complete copy is renamed back to ``step-N``.

Checkpoints are ordered by step number (``step-1000000`` is newer than ``step-999999``).
A damaged newest checkpoint (unreadable ``.metadata``, a truncated shard, an invalid
``trainer_state.json``) makes a resume from a root fall back to the previous complete one,
with a warning; naming the damaged directory itself is an error that names the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from shardmuon.train.checkpoint import (
    COMPLETE_MARKER,
    DCP_METADATA,
    OLD_PREFIX,
    STEP_PREFIX,
    TMP_PREFIX,
    TRAINER_STATE,
    CheckpointError,
    CorruptCheckpointError,
    read_dcp_metadata,
    read_trainer_state,
)

__all__ = ["find_checkpoint", "repair_checkpoints", "step_checkpoints"]

_STEP_NAME = re.compile(re.escape(STEP_PREFIX) + r"(\d+)")
_LEFTOVER_NAME = re.compile(
    f"({re.escape(TMP_PREFIX)}|{re.escape(OLD_PREFIX)})({re.escape(STEP_PREFIX)}(\\d+))-[0-9a-f]+"
)


@dataclass
class Selection:
    """The checkpoint directory to resume from, and warnings about how it was chosen."""

    path: Path
    notes: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    chosen: dict[int, Path]  # step -> complete checkpoint dir (visible or a leftover)
    names: dict[int, str]  # step -> the visible name it has or gets
    stale: list[Path]  # leftovers to delete


def _is_complete_leftover(path: Path) -> bool:
    if (path / COMPLETE_MARKER).is_file():
        return True
    # An .old- directory was a visible, finished checkpoint before it was renamed aside
    # (saves from before the marker existed have none).
    is_old = path.name.startswith(OLD_PREFIX)
    return is_old and (path / DCP_METADATA).is_file() and (path / TRAINER_STATE).is_file()


def _newest_first(path: Path) -> tuple[int, float]:
    # The .tmp- copy is the newer save of the step (its old copy was being replaced).
    marker = path / COMPLETE_MARKER
    stamp = (marker if marker.is_file() else path).stat().st_mtime
    return (0 if path.name.startswith(TMP_PREFIX) else 1, -stamp)


def _plan(root: Path) -> _Plan:
    visible: dict[int, Path] = {}
    leftovers: dict[int, list[Path]] = defaultdict(list)
    names: dict[int, str] = {}
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if match := _STEP_NAME.fullmatch(entry.name):
            if (entry / DCP_METADATA).is_file():
                visible[int(match.group(1))] = entry
        elif match := _LEFTOVER_NAME.fullmatch(entry.name):
            step = int(match.group(3))
            leftovers[step].append(entry)
            names.setdefault(step, match.group(2))
    chosen = dict(visible)
    stale: list[Path] = []
    for step, entries in sorted(leftovers.items()):
        if step in chosen:
            stale.extend(entries)
            continue
        complete = sorted((e for e in entries if _is_complete_leftover(e)), key=_newest_first)
        if complete:
            chosen[step] = complete[0]
        stale.extend(e for e in entries if e not in complete[:1])
    names.update({step: path.name for step, path in visible.items()})
    return _Plan(chosen, names, stale)


def step_checkpoints(root: str | os.PathLike) -> dict[int, Path]:
    """Step -> complete checkpoint directory under ``root``, changing nothing on disk.

    Where a killed save left the only complete copy of a step in a hidden leftover, that
    leftover is the step's directory (:func:`repair_checkpoints` renames it into place).
    """
    return _plan(Path(root)).chosen


def repair_checkpoints(root: str | os.PathLike) -> list[str]:
    """Rename complete leftovers of killed saves into place, delete the rest.

    Returns one line per change. Call it from one process only, while no save into
    ``root`` is running (a run does it before it starts its ranks).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    plan = _plan(root)
    notes = []
    for step, path in sorted(plan.chosen.items()):
        final = root / plan.names[step]
        # An unfinished directory that holds the name is not ours to move: the complete
        # copy is then used where it is, as it is when the root cannot be written.
        if path == final or final.exists():
            continue
        try:
            os.rename(path, final)
        except OSError as err:
            notes.append(f"could not rename {path.name} to {final.name} ({err.strerror})")
            continue
        notes.append(f"recovered {final.name} from {path.name}, left by a killed save")
    for path in plan.stale:
        try:
            shutil.rmtree(path)
        except OSError as err:
            notes.append(f"could not remove {path.name}, left by a killed save ({err.strerror})")
            continue
        notes.append(f"removed {path.name}, left by a killed save")
    return notes


def verify_checkpoint(ckpt: Path) -> None:
    """Raise :class:`CorruptCheckpointError` naming the first missing or damaged file.

    Checks that ``.metadata`` and ``trainer_state.json`` parse, that every byte range DCP's
    metadata points at lies inside its shard file, and that the files listed by the
    complete marker still have their sizes. Bytes changed in place are only found by the
    load itself.
    """
    metadata = read_dcp_metadata(ckpt)
    read_trainer_state(ckpt)
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative, end in sorted(needed.items()):
        _check_size(ckpt / relative, end, "at least", "DCP's metadata points there")
    marker = ckpt / COMPLETE_MARKER
    if marker.is_file():
        try:
            files = json.loads(marker.read_text())["files"]
            sizes = {str(name): int(size) for name, size in files.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpointError(f"{marker} is damaged: {err!r}") from None
        for relative, size in sorted(sizes.items()):
            _check_size(ckpt / relative, size, "exactly", "when it was saved")


def _check_size(file: Path, expected: int, how: str, why: str) -> None:
    if not file.is_file():
        raise CorruptCheckpointError(f"{file} is missing ({why})")
    size = file.stat().st_size
    if size < expected or (how == "exactly" and size != expected):
        raise CorruptCheckpointError(
            f"{file} is damaged: {size} bytes, {how} {expected} expected ({why})"
        )


def find_checkpoint(path: str | os.PathLike, *, repair: bool) -> Selection:
    """The checkpoint ``--resume PATH`` means, checked with :func:`verify_checkpoint`.

    ``path`` is a checkpoint directory (used as is: damage is an error) or a root of
    ``step-*`` directories: the newest complete one by step number, or, when that one is
    damaged, the newest undamaged one before it (with a warning in ``notes``). With
    ``repair``, leftovers of killed saves are fixed first (:func:`repair_checkpoints`);
    without, the choice is the same but nothing on disk changes.
    """
    path = Path(path)
    notes: list[str] = []
    if not path.exists():
        path = _leftover_of(path, repair, notes)
    if path.is_file():
        raise CheckpointError(
            f"{str(path)!r} is a file; a DCP checkpoint is a directory (for a dion-format "
            "torch.save file use --resume-dion)"
        )
    if (path / DCP_METADATA).is_file() or _STEP_NAME.fullmatch(path.name):
        verify_checkpoint(path)
        return Selection(path, notes)
    if repair:
        notes.extend(repair_checkpoints(path))
    found = step_checkpoints(path)
    if not found:
        raise CheckpointError(
            f"no checkpoint in {str(path)!r}: expected a DCP directory (with {DCP_METADATA}) "
            f"or a root holding {STEP_PREFIX}NNNNNN directories"
        )
    damaged: list[CorruptCheckpointError] = []
    for step in sorted(found, reverse=True):
        try:
            verify_checkpoint(found[step])
        except CorruptCheckpointError as err:
            damaged.append(err)
            continue
        notes.extend(
            f"warning: {err}; resuming from the previous complete checkpoint, {found[step].name}"
            for err in damaged
        )
        return Selection(found[step], notes)
    raise CorruptCheckpointError(
        f"every checkpoint in {str(path)!r} is damaged: " + "; ".join(map(str, damaged))
    )


def _leftover_of(path: Path, repair: bool, notes: list[str]) -> Path:
    """``root/step-N`` that a save killed between its renames left only as a leftover."""
    match = _STEP_NAME.fullmatch(path.name)
    if match is None or not path.parent.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    if repair:
        notes.extend(repair_checkpoints(path.parent))
    found = step_checkpoints(path.parent).get(int(match.group(1)))
    if found is None:
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    return found
