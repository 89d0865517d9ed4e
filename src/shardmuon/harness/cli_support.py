"""Pieces shared by ``shardmuon bench`` and ``shardmuon train``: output-path checks made
before any work, the argument parser (no abbreviations, "did you mean" for a typo), the
checked number types of every numeric flag, the ``--help`` formatter, flag aliases and the
one-line "wrote" notes.

Every numeric flag of every command takes one of the :class:`Number` types below
(``type=positive_int``, ``type=positive_float``, ...), never a bare ``int`` or ``float``:
``nan``, ``inf``, a value out of range or a word is refused while the arguments are parsed,
before any work, with one line naming the flag, what was given and what is accepted.

Every command checks its output paths (``--json``, ``--plot``, ``--csv``, ``--dion-out``,
``--checkpoint-dir``) first, so that a path that cannot be written fails in a second with a
one-line message instead of after the whole run. The checks raise ``ValueError``, which the
commands report as ``error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shardmuon.config import NumberRange

if TYPE_CHECKING:
    pass

__all__ = [
    "LAYERS_HELP",
    "ArgumentParser",
    "HelpFormatter",
    "Number",
    "add_hidden_alias",
    "check_output_dir",
    "check_output_file",
    "check_outputs",
    "int_at_least",
    "nonnegative_int",
    "note",
    "note_written",
    "positive_float",
    "positive_int",
    "seed_int",
]


class Number:
    """An argparse ``type=`` for a number in a range: an ``int`` or a finite ``float``.

    ``low``/``high`` bound it (``None``: unbounded), inclusive unless ``low_open`` /
    ``high_open``. A value that is not a number of that kind, or out of range, raises
    ``argparse.ArgumentTypeError`` saying ``must be <accepted>, got <value>``;
    :class:`ArgumentParser` prefixes the flag and reports it in one line.
    """

    def __init__(
        self,
        kind: type,
        low: float | None = None,
        high: float | None = None,
        *,
        low_open: bool = False,
        high_open: bool = False,
        accepted: str | None = None,
    ) -> None:
        if kind not in (int, float):
            raise TypeError(f"Number takes int or float, got {kind!r}")
        self.kind = kind
        self.range = NumberRange(low, high, low_open, high_open)
        self.low, self.high = low, high
        self.low_open, self.high_open = low_open, high_open
        self.accepted = accepted or self._describe()
        # argparse names a type by its __name__ in some messages.
        self.__name__ = kind.__name__

    def _describe(self) -> str:
        what = "an int" if self.kind is int else "a finite number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            inside = f"in {left}{self.low:g}, {self.high:g}{right}"
            return f"an int {inside}" if self.kind is int else inside
        if self.low is not None:
            return f"{what} {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{what} {'<' if self.high_open else '<='} {self.high:g}"
        return what

    def __call__(self, text: str):
        try:
            value = self.kind(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self.accepted}, got {text!r}") from None
        shown = repr(value)
        if self.kind is float and not math.isfinite(value):
            if text.strip().lstrip("+-").lower() not in ("inf", "infinity", "nan"):
                shown = f"{text} (overflows to {value!r})"
            raise argparse.ArgumentTypeError(f"must be {self.accepted}, got {shown}")
        if not self.accepts(value):
            raise argparse.ArgumentTypeError(f"must be {self.accepted}, got {shown}")
        return value

    def accepts(self, value) -> bool:
        """Whether ``value`` (a finite number of this kind) is in the range. A subclass may
        hand the decision to the check that owns the range (``shardmuon train``'s optimizer
        flags: ``MuonConfig``'s validators)."""
        return value in self.range

    def __repr__(self) -> str:
        return f"Number({self.accepted})"


positive_int = Number(int, 1)
nonnegative_int = Number(int, 0)
# torch's generators take seeds up to 2**64 - 1 (and negatives, which nothing here needs).
seed_int = Number(int, 0, 2**64 - 1, accepted="an int in [0, 2**64)")
positive_float = Number(float, 0, low_open=True)


def int_at_least(minimum: int) -> Number:
    """The ``type=`` of an int flag that must be ``>= minimum`` (``--steps``: 2)."""
    return Number(int, minimum)


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


# What --layers does, in bench and train alike.
LAYERS_HELP = (
    "build the preset with only its first N decoder layers (dense and MoE layers as the "
    "preset orders them; embeddings, final norm and head unchanged)"
)

# Where the innermost (sub-)command that was given unrecognized arguments records itself,
# for ArgumentParser.parse_args to let it report them.
_UNRECOGNIZED_BY = "_shardmuon_unrecognized_by"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser without abbreviated flags, and with "did you mean" for a typo.

    ``allow_abbrev`` is off: ``--lay`` is neither ``--layers`` nor ``--layout``, and an
    abbreviation accepted today would change meaning the day a flag with the same start is
    added. An unrecognized argument is reported by the (sub-)command it was given to, with
    that command's usage line, naming what was given and the closest accepted flags (or all
    of them when none is close). Sub-commands added through ``add_subparsers`` are of this
    class too (argparse makes them of the parent's class).
    """

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(namespace, _UNRECOGNIZED_BY):
            # A sub-command parses before its parent returns: the first to record is the
            # innermost, the one whose flags the user was writing.
            setattr(namespace, _UNRECOGNIZED_BY, (self, list(extras)))
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser, own = getattr(namespace, _UNRECOGNIZED_BY, (self, extras))
            parser.error(parser.unrecognized_message(own))
        return namespace

    def _get_value(self, action: argparse.Action, arg_string: str):
        if not isinstance(action.type, Number):
            return super()._get_value(action, arg_string)
        try:
            return action.type(arg_string)
        except argparse.ArgumentTypeError as err:
            # A bad number is a bad value, not a misuse of the command: one line, no usage.
            self._bad_value = True
            flag = argparse._get_action_name(action)
            raise argparse.ArgumentError(None, f"{flag} {err}") from None

    def _check_value(self, action: argparse.Action, value) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as err:
            self._invalid_choice = value
            close = close_choices(str(value), [str(c) for c in action.choices])
            if not close:
                raise
            self._suggested_choice = True
            raise argparse.ArgumentError(
                action, f"{err.message}; did you mean {_or(close)}?"
            ) from None

    def error(self, message: str):
        if getattr(self, "_bad_value", False):
            self.exit(2, f"{self.prog}: error: {message}\n")
        # "train --nprocs 2": argparse skips the unknown flag and takes its value "2" for a
        # sub-command; the flag is what to report. A mistyped sub-command ("bench stpe
        # --no-progress") is reported as such.
        unknown = self._unknown_flags()
        if (
            unknown
            and not getattr(self, "_suggested_choice", False)
            and self._follows_unknown_flag(getattr(self, "_invalid_choice", None))
            and any(
                message.startswith(f"argument {argparse._get_action_name(action)}: invalid choice")
                for action in self._actions
                if isinstance(action, argparse._SubParsersAction)
            )
        ):
            message = self.unrecognized_message(unknown)
        super().error(message)

    def _follows_unknown_flag(self, value: object) -> bool:
        """Whether ``value`` was given right after a flag this parser does not know."""
        given = getattr(self, "_given", [])
        known = self._option_string_actions
        return any(
            arg == value and self._looks_like_flag(prev) and prev.split("=", 1)[0] not in known
            for prev, arg in itertools.pairwise(given)
        )

    def _unknown_flags(self) -> list[str]:
        """The flags among the arguments being parsed that no option of this parser has."""
        known = self._option_string_actions
        return [
            arg
            for arg in getattr(self, "_given", [])
            if self._looks_like_flag(arg) and arg.split("=", 1)[0] not in known
        ]

    def _looks_like_flag(self, arg: str) -> bool:
        # "-1" is a value, "--" the end of the options.
        return arg[:1] in self.prefix_chars and arg != "--" and len(arg) > 1 and not _is_number(arg)

    def visible_flags(self) -> list[str]:
        """The option strings ``--help`` lists, in its order (hidden aliases left out)."""
        return [
            flag
            for action in self._actions
            if action.help is not argparse.SUPPRESS
            for flag in action.option_strings
        ]

    def suggest_flags(self, given: str) -> list[str]:
        """Accepted flags ``given`` may have meant: those it abbreviates, else close ones."""
        flags = self.visible_flags()
        name = given.split("=", 1)[0]
        prefixed = [f for f in flags if f.startswith(name) and name.startswith("--")]
        if prefixed:
            return prefixed
        # Compared without the dashes, which every flag shares and which would make
        # "--nprc" look close to "--lr".
        by_name = {f.lstrip(self.prefix_chars): f for f in reversed(flags)}
        close = difflib.get_close_matches(
            name.lstrip(self.prefix_chars), list(by_name), n=3, cutoff=0.75
        )
        return [by_name[c] for c in close]

    def unrecognized_message(self, extras: list[str]) -> str:
        """The error for ``extras`` (arguments this parser did not recognize)."""
        flags = [a for a in extras if self._looks_like_flag(a)]
        if not flags:
            s = "s" if len(extras) > 1 else ""
            return f"unrecognized argument{s}: {' '.join(extras)}"
        parts = []
        for flag in flags:
            name = flag.split("=", 1)[0]
            suggestions = self.suggest_flags(name)
            if suggestions:
                parts.append(f"unrecognized argument {name}; did you mean {_or(suggestions)}?")
            else:
                accepted = ", ".join(self.visible_flags())
                parts.append(f"unrecognized argument {name}; accepted: {accepted}")
        return "; ".join(parts)


def close_choices(given: str, choices: Sequence[str]) -> list[str]:
    """The ``choices`` a mistyped ``given`` may have meant: those it begins, else close ones."""
    prefixed = [c for c in choices if given and c.startswith(given)]
    return prefixed or difflib.get_close_matches(given, list(choices), n=3, cutoff=0.6)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _or(items: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


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
