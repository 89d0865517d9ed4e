"""The ``shardmuon`` command line: ``shardmuon bench [step|ns|ab]`` and, when the training
package provides it, ``shardmuon train``. ``shardmuon --version`` prints the package's
version and torch's.

Bad arguments exit with status 2 and a one-line message (argparse's convention), never a
traceback: the commands raise ``ValueError`` for invalid values and :func:`main` reports it;
a bad number (``--lr nan``) is refused while parsing, by the flag's checked type
(:class:`shardmuon.harness.cli_support.Number`). Flags are never abbreviated, and a
mistyped flag or sub-command gets "did you mean"
(:class:`shardmuon.harness.cli_support.ArgumentParser`). No command starts more processes
than the machine holds (:func:`shardmuon.harness.processes.check_process_count`).
Ctrl-C stops a command with one line saying what it had done, its workers ended, and exit
status 130 (:mod:`shardmuon.harness.jobs`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from shardmuon.harness.cli_support import ArgumentParser, HelpFormatter
from shardmuon.harness.jobs import finish_job, interrupted, start_job

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available sub-command registered."""
    from shardmuon.bench import add_parser as add_bench

    parser = ArgumentParser(
        prog="shardmuon",
        allow_abbrev=False,
        description="Muon for PyTorch that distributes its work from DTensor placements.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=_version_line(),
        help="print shardmuon's version and torch's, then exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="{bench,train}")
    add_bench(sub)
    _add_train(sub)
    return parser


def _version_line() -> str:
    """``shardmuon <version> (torch <version>)``: what ``--version`` prints."""
    import torch

    import shardmuon

    return f"shardmuon {shardmuon.__version__} (torch {torch.__version__})"


def _add_train(subparsers) -> None:
    # The training command lives in its own package (shardmuon.train.cli) and registers
    # itself with add_parser(subparsers); the CLI works without it.
    try:
        module = importlib.import_module("shardmuon.train.cli")
    except ModuleNotFoundError as err:
        if err.name not in ("shardmuon.train", "shardmuon.train.cli"):
            raise
        return
    module.add_parser(subparsers)


def _default_bench_command(argv: list[str]) -> list[str]:
    """``shardmuon bench [options]`` means ``shardmuon bench step [options]``.

    Only options (or nothing) after ``bench`` select ``step``: a bare word that is not a
    sub-command (``bench stpe``) is left for argparse, which lists the sub-commands and
    names the closest ("did you mean step?").
    """
    if argv and argv[0] == "bench":
        rest = argv[1:]
        if not rest or (rest[0].startswith("-") and rest[0] not in ("-h", "--help")):
            return ["bench", "step", *rest]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    argv = _default_bench_command(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # recorded with the results
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    # A command that says what it has done replaces this job with its own (harness.jobs).
    name = " ".join(["shardmuon", *_command_words(args)])
    start_job(name)
    try:
        return int(func(args) or 0)
    except ValueError as err:
        # Validation of user input raises ValueError: report it the way argparse reports
        # its own errors, without a traceback.
        print(f"shardmuon: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C: one line, the workers ended, exit status 130; a traceback would only say
        # where the main process happened to be waiting.
        return interrupted(name)
    finally:
        finish_job()


def _command_words(args: argparse.Namespace) -> list[str]:
    """``["bench", "lm"]``: the (sub-)command words ``args`` were parsed for."""
    words = [getattr(args, "command", None)]
    words.append(getattr(args, "bench_command", None) or getattr(args, "train_command", None))
    return [w for w in words if w]


if __name__ == "__main__":
    sys.exit(main())
