"""Pieces shared by ``shardmuon bench`` and ``shardmuon train``: output-path checks made
before any work, the ``--help`` formatter, flag aliases and the one-line "wrote" notes.

Every command checks its output paths (``--json``, ``--plot``, ``--csv``, ``--dion-out``,
``--checkpoint-dir``) first, so that a path that cannot be written fails in a second with a
one-line message instead of after the whole run. The checks raise ``ValueError``, which the
commands report as ``error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "HelpFormatter",
    "add_hidden_alias",
    "check_output_dir",
    "check_output_file",
    "check_outputs",
    "note",
    "note_written",
]


def _is_writable_dir(directory: Path) -> bool:
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    # os.access says yes to root on directories no one can create files in (/proc, some
    # network mounts); creating a file there is the only sure test.
    try:
        fd, probe = tempfile.mkstemp(prefix=".shardmuon-write-test-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _check_creatable(path: Path, flag: str) -> None:
    """``path`` does not exist yet: its nearest existing ancestor must be a writable dir."""
    ancestor = path.parent
    while True:
        try:
            exists = ancestor.exists()
        except OSError as err:
            raise ValueError(f"{flag} {path}: cannot check {ancestor}: {err.strerror}") from None
        if exists:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {path}: {ancestor} is a file, not a directory")
    if not _is_writable_dir(ancestor):
        raise ValueError(f"{flag} {path}: directory {ancestor} is not writable")


def _existing(path: str | os.PathLike, flag: str) -> tuple[Path, bool]:
    """``path`` as a Path and whether it exists; ValueError for an empty or unreadable path."""
    out = Path(path)
    if not str(path):
        raise ValueError(f"{flag}: the path is empty")
    try:
        return out, out.exists()
    except OSError as err:
        raise ValueError(f"{flag} {out}: cannot check it: {err.strerror}") from None


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """Raise ``ValueError`` unless a file can be written at ``path`` (missing dirs are fine).

    The message names ``flag``, the path and why: the path is a directory, a parent is a
    file, or the directory (or the existing file) is not writable.
    """
    out, exists = _existing(path, flag)
    if exists:
        if out.is_dir():
            raise ValueError(f"{flag} {out}: is a directory; give a file path")
        if not os.access(out, os.W_OK):
            raise ValueError(f"{flag} {out}: the file exists and is not writable")
        if not _is_writable_dir(out.parent):
            raise ValueError(f"{flag} {out}: directory {out.parent} is not writable")
        return out
    _check_creatable(out, flag)
    return out


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """Raise ``ValueError`` unless ``path`` is (or can be created as) a writable directory."""
    out, exists = _existing(path, flag)
    if exists:
        if not out.is_dir():
            raise ValueError(f"{flag} {out}: is a file, not a directory")
        if not _is_writable_dir(out):
            raise ValueError(f"{flag} {out}: directory is not writable")
        return out
    _check_creatable(out, flag)
    return out


def check_outputs(
    files: Mapping[str, str | os.PathLike | None],
    dirs: Mapping[str, str | os.PathLike | None] | None = None,
) -> None:
    """Check every given output (``flag -> path``, ``None`` = not given) before any work.

    Also refuses two flags naming the same path, where one output would overwrite the other.
    """
    seen: dict[Path, str] = {}
    for kind, mapping in (("file", files), ("dir", dirs or {})):
        for flag, path in mapping.items():
            if path is None:
                continue
            checked = (check_output_file if kind == "file" else check_output_dir)(path, flag)
            key = checked.resolve()
            if key in seen:
                raise ValueError(f"{seen[key]} and {flag} both name {path}; give two paths")
            seen[key] = flag


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default, and descriptions printed as written.

    Defaults that say nothing (``None``, ``False``) are left out; choices are shown by
    argparse itself as ``{a,b,c}``.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or action.option_strings == []
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_hidden_alias(
    parser: argparse.ArgumentParser, alias: str, dest: str, **kwargs: object
) -> None:
    """Accept the old flag ``alias`` for ``dest`` without listing it in ``--help``."""
    parser.add_argument(
        alias, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs
    )


def note(text: str) -> None:
    """A one-line note on stderr (stdout is kept for results)."""
    print(text, file=sys.stderr)


def note_written(path: str | os.PathLike, what: str) -> None:
    """Say, in one line on stderr, that ``what`` was written to ``path``."""
    note(f"wrote {what}: {path}")
