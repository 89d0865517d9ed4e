"""Run a benchmark body on ``nproc`` processes: spawned here, or under ``torchrun``.

``launch(body, config, nproc)`` calls ``body(ctx, config)`` on every rank, with the process
group set up (gloo on CPU, NCCL on CUDA), and returns rank 0's return value in the calling
process. Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) it runs in place and returns
``None`` on the other ranks.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardmuon.harness.processes import (
    check_process_count,
    exit_worker,
    free_port,
    threads_per_rank,
)

__all__ = ["RankContext", "launch", "torchrun_world_size"]


@dataclass(frozen=True)
class RankContext:
    """Where a benchmark body runs: rank, world size, device, and threads per process."""

    rank: int
    world_size: int
    device: torch.device
    threads: int
    distributed: bool

    def barrier(self) -> None:
        """Barrier across ranks (no-op in a single process)."""
        if self.distributed:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any] | None:
        """``obj`` of every rank as a list on rank 0, ``None`` on the others."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def torchrun_world_size() -> int | None:
    """The world size set by ``torchrun`` (``WORLD_SIZE`` with ``RANK``), else ``None``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _setup(rank: int, world_size: int, local_rank: int, threads: int | None, distributed: bool):
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    n_threads = threads_per_rank(world_size, threads)
    torch.set_num_threads(n_threads)
    if distributed and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            device_id=device if device.type == "cuda" else None,
        )
    return RankContext(rank, world_size, device, n_threads, distributed)


def _quiet() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _spawned(
    rank: int, world_size: int, port: int, body: Callable, config: Any, threads, result_path: str
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    _quiet()
    ctx = _setup(rank, world_size, rank, threads, distributed=True)
    try:
        result = body(ctx, config)
        if rank == 0:
            Path(result_path).write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_worker()


def launch(
    body: Callable[[RankContext, Any], Any],
    config: Any,
    nproc: int,
    *,
    threads: int | None = None,
    needs_process_group: bool = True,
) -> Any:
    """Run ``body(ctx, config)`` on ``nproc`` ranks; return rank 0's result (see module doc).

    ``body`` and ``config`` must be picklable (a module-level function and a dataclass).
    With ``nproc == 1`` and ``needs_process_group=False`` the body runs in this process
    with no process group. More processes than the machine holds raise ``ValueError``
    before any is started (:func:`shardmuon.harness.processes.check_process_count`).
    """
    _quiet()
    world = torchrun_world_size()
    if world is not None:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        ctx = _setup(rank, world, local_rank, threads, distributed=True)
        result = body(ctx, config)
        return result if rank == 0 else None
    if nproc == 1 and not needs_process_group:
        ctx = _setup(0, 1, 0, threads, distributed=False)
        return body(ctx, config)
    check_process_count(nproc)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="shardmuon-bench-") as tmp:
        result_path = os.path.join(tmp, "result.pkl")
        mp.spawn(
            _spawned,
            args=(nproc, free_port(), body, config, threads, result_path),
            nprocs=nproc,
            join=True,
        )
        return pickle.loads(Path(result_path).read_bytes())
