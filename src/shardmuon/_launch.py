"""What the multi-process launchers of ``shardmuon bench`` and ``shardmuon train`` share."""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "threads_per_rank"]


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
