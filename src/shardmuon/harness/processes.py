"""Processes of the multi-process launchers of ``shardmuon bench`` and ``shardmuon train``:
how many this machine holds, ports, threads per rank, and ending a spawned worker safely.

How many: every launcher checks its process count with :func:`check_process_count` before
it starts any (``--nproc 100000`` once took a 2-core machine down). Up to 8 always start;
more only where both the cores (4 processes per core) and the available memory (~512 MiB
per rank: a gloo rank that has imported torch and transformers holds about 350 MiB before
any work) allow them: ``max(8, min(4 x cores, available memory / 512 MiB))``, 8 on a
2-core, 24 GiB machine. The floor keeps a moment of low memory (another job's peak) from
refusing the few ranks a test or a small run needs; the point is to stop a runaway count.
``SHARDMUON_MAX_NPROC=N`` replaces the limit with ``N``. Threads per process are bounded by
the cores alike (:func:`check_thread_count`).

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
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "NPROC_RULE",
    "available_memory_bytes",
    "check_process_count",
    "check_thread_count",
    "exit_worker",
    "free_port",
    "process_limit",
    "threads_per_rank",
    "usable_cores",
]

MAX_NPROC_ENV = "SHARDMUON_MAX_NPROC"
# What one rank is assumed to hold, with headroom over the ~350 MiB of the imports alone.
RANK_MEMORY_BYTES = 512 * 2**20
PROCESSES_PER_CORE = 4
# Up to this many always start: the tests run 8 gloo ranks on 2 cores, slowly but fine.
MIN_PROCESS_LIMIT = 8
# The rule in the words of the commands' --help.
NPROC_RULE = (
    f"at most max({MIN_PROCESS_LIMIT}, min({PROCESSES_PER_CORE} per core, 1 per 512 MiB of "
    f"available memory)); {MAX_NPROC_ENV}=N allows N"
)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory_bytes() -> int | None:
    """Memory available for new processes (``MemAvailable``), ``None`` where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


@dataclass(frozen=True)
class ProcessLimit:
    """The most processes to start here, and what it comes from (see the module doc)."""

    limit: int
    cores: int
    by_cores: int
    available_bytes: int | None
    by_memory: int | None
    forced: bool = False

    def machine(self) -> str:
        """``"2 cores, 21.5 GiB available memory"``: what the limit was made of."""
        memory = (
            "unknown available memory"
            if self.available_bytes is None
            else f"{self.available_bytes / 2**30:.1f} GiB available memory"
        )
        return f"{self.cores} core{'' if self.cores == 1 else 's'}, {memory}"


def process_limit(
    cores: int | None = None,
    available_bytes: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ProcessLimit:
    """The limit :func:`check_process_count` applies (this machine's when not given).

    Raises ``ValueError`` for a ``SHARDMUON_MAX_NPROC`` that is not an int >= 1.
    """
    cores = usable_cores() if cores is None else cores
    if available_bytes is None:
        available_bytes = available_memory_bytes()
    by_cores = PROCESSES_PER_CORE * cores
    by_memory = None if available_bytes is None else available_bytes // RANK_MEMORY_BYTES
    limit = max(MIN_PROCESS_LIMIT, by_cores if by_memory is None else min(by_cores, by_memory))
    forced = (os.environ if environ is None else environ).get(MAX_NPROC_ENV)
    if forced is None:
        return ProcessLimit(limit, cores, by_cores, available_bytes, by_memory)
    try:
        value = int(forced)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{MAX_NPROC_ENV}={forced!r}: accepted: an int >= 1, the most processes to start"
        )
    return ProcessLimit(value, cores, by_cores, available_bytes, by_memory, forced=True)


def check_process_count(nproc: int, flag: str = "--nproc", limit: ProcessLimit | None = None):
    """Raise ``ValueError`` (one line) if starting ``nproc`` processes would swamp this machine.

    Called by every launcher before it starts anything. The message names what was asked
    (``flag nproc``), what the machine has and allows, and how to force it
    (``SHARDMUON_MAX_NPROC``). ``limit``: :func:`process_limit`'s, when the caller has it.
    """
    limit = process_limit() if limit is None else limit
    if nproc <= limit.limit:
        return
    if limit.forced:
        raise ValueError(
            f"{flag} {nproc}: more processes than {MAX_NPROC_ENV}={limit.limit} allows; "
            f"raise it to {nproc} to start them ({limit.machine()})"
        )
    by_cores = f"{limit.by_cores} by cores at {PROCESSES_PER_CORE} per core"
    allowed = (
        by_cores
        if limit.by_memory is None
        else f"min({by_cores}, {limit.by_memory} by memory at ~512 MiB each)"
    )
    raise ValueError(
        f"{flag} {nproc}: more processes than this machine holds ({limit.machine()}: at most "
        f"{limit.limit} = max({MIN_PROCESS_LIMIT}, {allowed})); give {flag} {limit.limit} or "
        f"fewer, or set {MAX_NPROC_ENV}={nproc} to start them anyway"
    )


def check_thread_count(threads: int | None, flag: str = "--threads", cores: int | None = None):
    """Raise ``ValueError`` for more threads per process than ``max(8, 4 x cores)``.

    More threads than that never run faster, and an unbounded count has the OpenMP pool
    start them all. ``None`` (the default count) passes.
    """
    if threads is None:
        return
    cores = usable_cores() if cores is None else cores
    most = max(MIN_PROCESS_LIMIT, PROCESSES_PER_CORE * cores)
    if threads > most:
        raise ValueError(
            f"{flag} {threads}: more threads than this machine's {cores} core"
            f"{'' if cores == 1 else 's'} can use; accepted: 1 to {most} "
            f"(max({MIN_PROCESS_LIMIT}, {PROCESSES_PER_CORE} per core))"
        )


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
