"""Ending spawned worker processes safely.

A gloo worker thread destroys a finished collective's ``Work`` (and decrefs its Python
tensors, which takes the GIL) some time after the caller has seen it complete. If the
process is already in interpreter finalisation then, the thread is torn down while
unwinding and the process aborts ("terminate called without an active exception",
SIGABRT) even though all work succeeded. Seen intermittently after a final
``gather_object`` on torch 2.13 CPU. A worker whose results are already written therefore
leaves without finalising the interpreter.
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["exit_worker"]


def exit_worker(code: int = 0) -> None:
    """Flush stdio and leave the process at once, skipping interpreter finalisation."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
