"""What a long command says besides its results: how long it will take, and, when Ctrl-C
stops it, what it had done.

The estimate: a command that can run for minutes (``shardmuon train``, ``bench lm``,
``bench ns``) times the first units of its own work (training steps after the first, one
shape) and prints, once, ``<command>: estimated 12 min on this machine (3 steps
measured)``, saying what it measured. No extra work is run to make it. A job estimated at
under :data:`ESTIMATE_MIN_SECONDS` says nothing: it is done before the line is read.

Ctrl-C: the command line catches ``KeyboardInterrupt`` around the command and calls
:func:`interrupted`, which ends the worker processes this process started
(:func:`end_child_processes`), asks the running :class:`Job` what it had done and where its
partial results are, and prints one line::

    interrupted: shardmuon train stopped after step 37 of 150 (41 s); partial results in ck

with exit status 130 (128 + SIGINT, the shell's convention) and no traceback. A command
registers itself with :func:`start_job` and keeps ``done`` and ``partial`` current.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "ESTIMATE_MIN_SECONDS",
    "current_job",
    "end_child_processes",
    "estimate_line",
    "finish_job",
    "format_duration",
    "interrupted",
    "start_job",
]

# A job estimated under this is done before anyone reads a line about its length.
ESTIMATE_MIN_SECONDS = 20.0
# 128 + SIGINT: what a shell reports for a command Ctrl-C stopped.
INTERRUPTED_EXIT_CODE = 130
# How long an ended worker gets to exit on SIGTERM before it is killed.
_END_GRACE_SECONDS = 5.0


def format_duration(seconds: float) -> str:
    """``"40 s"``, ``"12 min"``, ``"1.5 h"``: as precise as an estimate deserves."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def estimate_line(
    label: str,
    seconds: float,
    basis: str,
    *,
    left: bool = False,
    min_seconds: float | None = None,
) -> str | None:
    """``"<label>: estimated 12 min on this machine (<basis>)"``, or ``None`` for a job
    estimated under ``min_seconds`` (default :data:`ESTIMATE_MIN_SECONDS`; 0 where a
    header promised the line). ``left``: the time still to run, not the whole job's."""
    if min_seconds is None:
        min_seconds = ESTIMATE_MIN_SECONDS
    if not (math.isfinite(seconds) and seconds >= min_seconds):
        return None
    still = " left" if left else ""
    return f"{label}: estimated {format_duration(seconds)}{still} on this machine ({basis})"


@dataclass
class Job:
    """The command running in this process, as :func:`interrupted` reports it.

    ``done()``: what it has done so far (``"step 37 of 150"``); ``None`` or an empty
    string reports the time only. ``partial()``: where partial results are (written by
    it, if it writes them then), or ``None``. Both are called once, after the workers
    have ended.
    """

    name: str
    done: Callable[[], str] | None = None
    partial: Callable[[], str | None] | None = None
    began: float = field(default_factory=time.monotonic)


_current: Job | None = None


def start_job(name: str) -> Job:
    """Register the command ``name`` as this process's running job and return it."""
    global _current
    _current = Job(name)
    return _current


def current_job() -> Job | None:
    """The running job (``None`` outside a command: library calls estimate nothing)."""
    return _current


def finish_job() -> None:
    """The command has returned: no job runs in this process any more."""
    global _current
    _current = None


def end_child_processes(grace: float = _END_GRACE_SECONDS) -> int:
    """End every worker this process started with ``multiprocessing`` (``torch``'s spawn
    and fork-server starts included): SIGTERM, up to ``grace`` seconds to exit, then
    SIGKILL. Returns how many were running.

    Without this a stopped command would wait at exit for workers that are still
    training, or leave them running: multiprocessing joins non-daemon children at exit.
    """
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        with contextlib.suppress(OSError, ValueError):
            child.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        with contextlib.suppress(OSError, ValueError):
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()
                child.join(1.0)
    return len(children)


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def _ask(what: Callable[[], str | None] | None) -> str | None:
    if what is None:
        return None
    try:
        return what()
    except Exception as err:  # the line must come out whatever the job's state
        return f"(unknown: {type(err).__name__}: {err})"


def interrupted(command: str) -> int:
    """Report a Ctrl-C: end the workers, print the one line (see the module doc) on stderr,
    return :data:`INTERRUPTED_EXIT_CODE`. ``command`` names the job when none registered.

    A second Ctrl-C while this runs is ignored, so that the workers are ended and the
    partial results written rather than left half-way.
    """
    previous = None
    with contextlib.suppress(ValueError):  # signal.signal works in the main thread only
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        end_child_processes()
        job = _current or Job(command)
        elapsed = _elapsed(time.monotonic() - job.began)
        done = _ask(job.done)
        line = f"interrupted: {job.name} stopped after " + (
            f"{done} ({elapsed})" if done else elapsed
        )
        partial = _ask(job.partial)
        if partial:
            line += f"; partial results in {partial}"
        print(line, file=sys.stderr, flush=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return INTERRUPTED_EXIT_CODE
