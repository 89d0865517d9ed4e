"""Processes of the multi-process launchers of ``shardmuon bench`` and ``shardmuon train``:
ports, threads per rank, and ending a spawned worker safely.

Ending a worker: a gloo worker thread destroys a finished collective's ``Work`` (and
decrefs its Python tensors, which takes the GIL) some time after the caller has seen it
complete. If the
process is already in interpreter finalisation then, the thread is torn down while
unwinding and the process aborts ("terminate called without an active exception",
SIGABRT) even though all work succeeded. Seen intermittently after a final
``gather_object`` on torch 2.13 CPU. A worker whose results are already written therefore
leaves without finalising the interpreter.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

__all__ = ["exit_worker", "free_port", "threads_per_rank"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def threads_per_rank(world: int, threads: int | None = None) -> int:
    """Torch threads for each of ``world`` processes sharing this machine's cores.

    ``threads`` when given; otherwise cores // processes, at least 1: without this each
    process would start one thread per core and they would thrash.
    """
    if threads is not None:
        return threads
    return max(1, (os.cpu_count() or 1) // world)


def exit_worker(code: int = 0) -> None:
    """Flush stdio and leave the process at once, skipping interpreter finalisation."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
