"""The processes of a multi-rank run: one per rank, forked from a preloaded fork server,
with the process group set up (gloo on CPU, NCCL on GPUs, one GPU per rank).

:func:`spawn_training` runs one training; :func:`spawn_runs` runs several one after the
other on the same ranks (a sweep pays the start of the processes once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, MutableSequence, Sequence
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
from shardmuon.train.loop import EstimatePlan, train_on_rank

__all__ = ["ANNOUNCE", "new_counter", "run_sequentially", "spawn_runs", "spawn_training"]

# A config whose extra holds this key has its value printed (by rank 0, on stderr) before it
# runs, with its place in the sequence and the time since the first started.
ANNOUNCE = "announce"


Run = tuple[TrainConfig, "str | None"]
# Where a sequence of runs stands, for the main process to say what was done when Ctrl-C
# stops it: [runs finished, the last finished step of the current run].
Counter = MutableSequence[int]


def new_counter(shared: bool) -> Counter:
    """A :data:`Counter` at ``[0, 0]``: in shared memory that spawned ranks write (rank 0
    does) when ``shared``, else a list."""
    if not shared:
        return [0, 0]
    import multiprocessing

    return multiprocessing.RawArray("q", 2)


def run_sequentially(
    runs: Sequence[Run],
    rank: int,
    world: int,
    estimates: Mapping[int, EstimatePlan] | None = None,
    counter: Counter | None = None,
) -> list[TrainResult]:
    """:func:`.loop.train_on_rank` for each ``(config, resume_from)`` of ``runs`` in turn,
    each announced. ``estimates``: run index -> the time estimate that run prints once
    measured; ``counter``: kept current by rank 0 (:func:`new_counter`)."""
    began = time.perf_counter()
    results = []

    def record_step(step: int) -> None:
        counter[1] = step

    on_step = record_step if counter is not None and rank == 0 else None
    for index, (config, resume_from) in enumerate(runs):
        line = config.extra.get(ANNOUNCE)
        if line and rank == 0:
            minutes, seconds = divmod(int(time.perf_counter() - began), 60)
            print(
                f"[{index + 1}/{len(runs)}, {minutes}:{seconds:02d}] {line}",
                file=sys.stderr,
                flush=True,
            )
        estimate = (estimates or {}).get(index)
        results.append(
            train_on_rank(config, rank, world, resume_from, estimate=estimate, on_step=on_step)
        )
        if on_step is not None:
            counter[0], counter[1] = index + 1, 0
    return results


def _worker(
    rank: int,
    runs: list[Run],
    world: int,
    port: int,
    result_file: str,
    estimates: Mapping[int, EstimatePlan] | None = None,
    counter: Counter | None = None,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads_per_rank(world))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        results = run_sequentially(runs, rank, world, estimates, counter)
        if rank == 0:
            payload = [dataclasses.asdict(result) for result in results]
            Path(result_file).write_text(json.dumps(payload))
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


def spawn_runs(
    configs: Sequence[TrainConfig],
    estimates: Mapping[int, EstimatePlan] | None = None,
    counter: Counter | None = None,
) -> list[TrainResult]:
    """Train each of ``configs`` (fresh runs, all with the same ``nproc``) on one set of
    spawned ranks, in turn; rank 0's results. A resume goes through
    :func:`shardmuon.train.run.run_training`, which checks the checkpoint first.
    ``estimates`` and ``counter``: as :func:`run_sequentially`'s (a shared ``counter``).

    A ``ValueError`` on the ranks is re-raised here with its message; so is
    :func:`~shardmuon.harness.processes.check_process_count`'s, before any is started.
    """
    resuming = [c for c in configs if c.resume or c.resume_dion]
    if resuming:
        raise ValueError(
            f"spawn_runs trains from scratch; {resuming[0].resume or resuming[0].resume_dion!r} "
            "is a resume: run it with run_training, which checks the checkpoint first"
        )
    return _spawn([(config, None) for config in configs], estimates, counter)


def _spawn(
    runs: Sequence[Run],
    estimates: Mapping[int, EstimatePlan] | None = None,
    counter: Counter | None = None,
) -> list[TrainResult]:
    import torch.multiprocessing as mp

    worlds = sorted({config.nproc for config, _ in runs})
    if len(worlds) != 1:
        raise ValueError(f"spawn_runs takes configs of one nproc, got nproc {worlds}")
    check_process_count(worlds[0])
    with tempfile.TemporaryDirectory(prefix="shardmuon-train-") as tmp:
        result_file = os.path.join(tmp, "result.json")
        try:
            mp.start_processes(
                _worker,
                args=(list(runs), worlds[0], free_port(), result_file, estimates, counter),
                nprocs=worlds[0],
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
    return [_result_from_json(item) for item in payload]


def _result_from_json(payload: dict) -> TrainResult:
    for key in ("losses", "max_logits", "max_logits_after", "clipped_heads"):
        payload[key] = {int(k): v for k, v in payload[key].items()}  # JSON made them strings
    return TrainResult(**payload)


def spawn_training(
    config: TrainConfig,
    resume_from: str | None,
    estimate: EstimatePlan | None = None,
    counter: Counter | None = None,
) -> TrainResult:
    """Run :func:`.loop.train_on_rank` on ``config.nproc`` processes from ``resume_from``
    (chosen and checked by :func:`~shardmuon.train.run.prepare_resume`); rank 0's result
    (errors as :func:`spawn_runs`; ``estimate`` and ``counter`` as :func:`run_sequentially`'s)."""
    estimates = None if estimate is None else {0: estimate}
    return _spawn([(config, resume_from)], estimates, counter)[0]
