"""The processes of a multi-rank run: one per rank, forked from a preloaded fork server,
with the process group set up (gloo on CPU, NCCL on GPUs, one GPU per rank)."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from shardmuon.harness.processes import (
    check_process_count,
    exit_worker,
    free_port,
    threads_per_rank,
)
from shardmuon.train.config import TrainConfig, TrainResult
from shardmuon.train.loop import train_on_rank

__all__ = ["spawn_training"]


def _worker(
    rank: int,
    config: TrainConfig,
    resume_from: str | None,
    world: int,
    port: int,
    result_file: str,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads_per_rank(world))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = train_on_rank(config, rank, world, resume_from)
        if rank == 0:
            Path(result_file).write_text(json.dumps(dataclasses.asdict(result)))
    except ValueError as err:
        # Config / checkpoint errors hit every rank alike; hand the message to the parent.
        if rank == 0:
            Path(result_file).write_text(json.dumps({"error": str(err)}))
        raise
    finally:
        dist.destroy_process_group()
    exit_worker()


# Modules the fork server imports once; each rank then forks from it instead of importing
# torch and transformers again (seconds per rank on a small CPU machine).
_PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "shardmuon.train.loop",
    "shardmuon.train.run",
    "shardmuon.train.launch",
    "shardmuon.optimizer",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.llama.modeling_llama",
)


def _start_method() -> str:
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # A fork server that has never run a torch op is safe to fork from (unlike this
    # process, whose OpenMP pool may be live).
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_PRELOAD))
    return "forkserver"


def spawn_training(config: TrainConfig, resume_from: str | None) -> TrainResult:
    """Run :func:`.loop.train_on_rank` on ``config.nproc`` processes; rank 0's result.

    A ``ValueError`` on the ranks (a bad checkpoint, say) is re-raised here with its message;
    so is :func:`~shardmuon.harness.processes.check_process_count`'s, before any is started.
    """
    import torch.multiprocessing as mp

    check_process_count(config.nproc)

    with tempfile.TemporaryDirectory(prefix="shardmuon-train-") as tmp:
        result_file = os.path.join(tmp, "result.json")
        try:
            mp.start_processes(
                _worker,
                args=(config, resume_from, config.nproc, free_port(), result_file),
                nprocs=config.nproc,
                join=True,
                start_method=_start_method(),
            )
        except mp.ProcessRaisedException:
            if os.path.exists(result_file):
                payload = json.loads(Path(result_file).read_text())
                if "error" in payload:
                    raise ValueError(payload["error"]) from None
            raise
        payload = json.loads(Path(result_file).read_text())
    for key in (
        "losses",
        "max_logits",
        "max_logits_after",
        "clipped_heads",
    ):  # JSON made the step keys strings
        payload[key] = {int(k): v for k, v in payload[key].items()}
    return TrainResult(**payload)
