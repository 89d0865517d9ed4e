"""Byte-level language-model data for ``shardmuon train --task lm``: text files read as bytes,
split into training and held-out text by file, sampled into batches that depend only on
``(seed, step)``.

The default corpus is the source of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), which every Python install has. A directory is read
recursively for :data:`DATA_SUFFIXES` files; hidden directories, ``__pycache__`` and
installed packages (``site-packages``, ``dist-packages``) are skipped, so that the default
is the standard library alone. Only regular files are read: a FIFO, socket or device with a
text file's name, a broken symbolic link or an unreadable file is refused in one line
naming it, and nothing but a regular file is ever opened (opening a FIFO waits for a
writer). Files are taken in the order of a hash of their path relative to the root (a
fixed shuffle, the same on every machine and file system), up to the byte cap, and dealt
out so that about :data:`HELD_OUT_FRACTION` of the bytes are held out, whole files at a
time: nothing held out is ever trained on. A single file cannot be split by file; its last
tenth is held out.

Each text becomes its bytes followed by :data:`END_OF_TEXT`, so the vocabulary is the 256
byte values and that one separator. Everything here is planned from file sizes alone
(:func:`plan_corpus`, cheap, for the checks before a run) and read by :func:`read_corpus`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DATA_SUFFIXES",
    "END_OF_TEXT",
    "VOCAB_SIZE",
    "Corpus",
    "CorpusPlan",
    "default_data_path",
    "plan_corpus",
    "read_corpus",
]

DATA_SUFFIXES = (".py", ".md", ".txt", ".rst")
# Directories a walk never enters (besides hidden ones): byte code and installed packages.
SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
END_OF_TEXT = 256
VOCAB_SIZE = 257
HELD_OUT_FRACTION = 0.1


def default_data_path() -> str:
    """The running interpreter's standard library directory (the default ``--data``)."""
    return sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of one file."""

    path: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class CorpusPlan:
    """Which bytes of which files train and which are held out (read nothing yet)."""

    root: str
    train: tuple[Piece, ...]
    held_out: tuple[Piece, ...]

    def tokens(self, pieces: tuple[Piece, ...]) -> int:
        """Tokens ``pieces`` become: their bytes and one separator each."""
        return sum(p.size + 1 for p in pieces)


def _refuse(path: str | os.PathLike, why: str) -> ValueError:
    return ValueError(f"data {str(path)!r}: {why}")


def _walk_text_files(root: Path) -> list[Path]:
    """Every :data:`DATA_SUFFIXES` entry under ``root``; unreadable directories refused."""
    found = []

    def fail(err: OSError) -> None:
        raise _refuse(err.filename, f"cannot be read ({err.strerror or err})")

    for folder, dirs, files in os.walk(root, onerror=fail):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS]
        found += [Path(folder, f) for f in files if f.endswith(DATA_SUFFIXES)]
    return found


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    """What a non-regular file is, for a refusal."""
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def _stat(path: Path) -> os.stat_result:
    """``path``'s status (through symbolic links); refused naming it when there is none,
    a broken link naming its target."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        if os.path.islink(path):
            target = os.readlink(path)
            raise _refuse(path, f"is a broken symbolic link (to {target!r})") from None
        raise _refuse(path, "does not exist") from None
    except OSError as err:
        raise _refuse(path, f"cannot be read ({err.strerror or err})") from None


def _open_regular(path: str | os.PathLike):
    """``path`` opened for reading in binary, refused naming it unless it is a regular file.

    Callers check the kind first, with :func:`_stat`; the open does not block (``O_NONBLOCK``)
    and the kind is checked again on the open file, so that a file replaced by a FIFO in
    between is refused rather than waited on.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags | getattr(os, "O_NOCTTY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, f"is {_kind(mode)}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_size(path: Path) -> int:
    """Size of a readable regular file; refused naming it otherwise (nothing else is opened)."""
    status = _stat(path)
    if not stat.S_ISREG(status.st_mode):
        raise _refuse(path, f"is {_kind(status.st_mode)}, not a regular file")
    if not os.access(path, os.R_OK):
        raise _refuse(path, "cannot be read (permission denied)")
    try:
        with _open_regular(path) as f:
            return os.fstat(f.fileno()).st_size
    except OSError as err:
        raise _refuse(path, f"cannot be read ({err.strerror or err})") from None


def _shuffle_key(root: Path, path: Path) -> str:
    return hashlib.sha1(path.relative_to(root).as_posix().encode()).hexdigest()


def plan_corpus(
    path: str | os.PathLike | None = None,
    max_bytes: int | None = None,
    held_out_fraction: float = HELD_OUT_FRACTION,
) -> CorpusPlan:
    """Plan the training and held-out text of ``path`` (default: :func:`default_data_path`).

    ``max_bytes`` caps the bytes taken (the last file taken is cut). Raises ``ValueError``
    in one line naming the path when it is missing, a broken link, unreadable, empty, not a
    regular file or directory, or holds no text file; or naming a file under it that is
    not a readable regular file.
    """
    root = Path(default_data_path() if path is None else path)
    mode = _stat(root).st_mode
    if stat.S_ISREG(mode):
        size = _file_size(root)
        if max_bytes is not None:
            size = min(size, max_bytes)
        if size < 2:
            raise _refuse(root, f"holds {size} byte(s); a corpus needs text to train on")
        cut = size - max(1, round(size * held_out_fraction))
        return CorpusPlan(str(root), (Piece(str(root), 0, cut),), (Piece(str(root), cut, size),))
    if not stat.S_ISDIR(mode):
        raise _refuse(root, f"is {_kind(mode)}, neither a regular file nor a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise _refuse(root, "cannot be read (permission denied)")
    files = sorted(_walk_text_files(root), key=lambda p: _shuffle_key(root, p))
    if not files:
        accepted = ", ".join(DATA_SUFFIXES)
        raise _refuse(root, f"holds no {accepted} file (read recursively)")
    pieces, taken = [], 0
    for file in files:
        size = _file_size(file)
        if max_bytes is not None:
            size = min(size, max_bytes - taken)
        if size > 0:
            pieces.append(Piece(str(file), 0, size))
            taken += size
        if max_bytes is not None and taken >= max_bytes:
            break
    if not pieces:
        raise _refuse(root, f"its {len(files)} text file(s) are all empty")
    if len(pieces) == 1:
        return plan_corpus(pieces[0].path, pieces[0].size, held_out_fraction)
    train, held_out, held_bytes, dealt = [], [], 0, 0
    for piece in pieces:
        # Deal whole files: hold one out whenever the held-out share is below its target.
        dealt += piece.size
        if held_bytes < held_out_fraction * dealt:
            held_out.append(piece)
            held_bytes += piece.size
        else:
            train.append(piece)
    return CorpusPlan(str(root), tuple(train), tuple(held_out))


def _read_stream(pieces: tuple[Piece, ...]) -> torch.Tensor:
    """The pieces' bytes, each followed by :data:`END_OF_TEXT`, as one int16 tensor."""
    parts = []
    separator = torch.tensor([END_OF_TEXT], dtype=torch.int16)
    for piece in pieces:
        try:
            with _open_regular(piece.path) as f:
                f.seek(piece.start)
                data = f.read(piece.size)
        except OSError as err:
            raise _refuse(piece.path, f"cannot be read ({err.strerror or err})") from None
        parts += [torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16), separator]
    return torch.cat(parts)


@dataclass(frozen=True)
class Corpus:
    """The token streams of a :class:`CorpusPlan` (int16: bytes and the separator)."""

    plan: CorpusPlan
    train: torch.Tensor
    held_out: torch.Tensor


def read_corpus(plan: CorpusPlan) -> Corpus:
    """Read what ``plan`` names."""
    return Corpus(plan, _read_stream(plan.train), _read_stream(plan.held_out))
