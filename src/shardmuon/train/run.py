"""``shardmuon train``'s driver: resume checks, then one process (``--nproc 1``) or the
spawned ranks (:mod:`shardmuon.train.launch`), each running :func:`shardmuon.train.loop.train_on_rank`."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shardmuon.harness.cli_support import note
from shardmuon.harness.jobs import current_job
from shardmuon.harness.processes import threads_per_rank
from shardmuon.train import checkpoint as ckpt_io
from shardmuon.train import dion_format, recovery
from shardmuon.train.config import EXPERT_MESH_NAME, TrainConfig, TrainResult
from shardmuon.train.launch import Counter, new_counter, spawn_training
from shardmuon.train.loop import EstimatePlan, build_optimizer, build_training_model, train_on_rank
from shardmuon.train.resume import recorded_settings, settings_conflicts
from shardmuon.train.tasks import task_vocab_size

__all__ = [
    "prepare_resume",
    "run_training",
]


def prepare_resume(config: TrainConfig) -> str | None:
    """Choose and check what ``config`` resumes from, before any process starts.

    Repairs the leftovers of killed saves, picks the checkpoint (a damaged newest one is
    skipped with a warning), refuses optimizer settings that differ from the checkpoint's
    (:mod:`.resume`), and checks its tensors against an unsharded copy of this run's model
    and optimizer. Returns the checkpoint directory or dion-format file, or ``None``.
    """
    dion_path = config.resume_dion or (
        config.resume if config.resume and Path(config.resume).is_file() else None
    )
    if dion_path:
        dion_format.read_dion_file(dion_path)
        _refuse_changed_settings(config, recorded_settings(config))
        return dion_path
    if not config.resume:
        return None
    selection = recovery.find_checkpoint(config.resume, repair=True)
    for line in selection.notes:
        note(f"shardmuon train: {line}")
    path = selection.path
    _refuse_changed_settings(config, recorded_settings(config, path))
    model = build_training_model(config, task_vocab_size(config.task))
    optimizer = build_optimizer(config, model, EXPERT_MESH_NAME if config.layout == "ep" else None)
    expected = ckpt_io.expected_entries(ckpt_io.training_state_dict(model, optimizer))
    ckpt_io.check_compatible(path, expected)
    return str(path)


def _refuse_changed_settings(config: TrainConfig, recorded: dict[str, Any]) -> None:
    conflicts = settings_conflicts(config, recorded)
    if conflicts:
        raise ValueError(
            "a resume continues with the checkpoint's optimizer settings; these differ: "
            + ", ".join(conflicts)
            + ". Leave them out (they are taken from the checkpoint) or give its values"
        )


def run_training(config: TrainConfig) -> TrainResult:
    """Validate ``config``, train on ``config.nproc`` processes, write the requested outputs.

    Raises ValueError (a :class:`~.checkpoint.CheckpointError` for checkpoints) for bad input,
    before any training.
    """
    config.validate()
    if config.checkpoint_dir:
        for line in recovery.repair_checkpoints(config.checkpoint_dir):
            note(f"shardmuon train: {line}")
    resume_from = prepare_resume(config)
    counter = new_counter(shared=config.nproc > 1)
    # Under a command (not a library call): the time estimate, and what Ctrl-C reports.
    job = current_job()
    estimate = None
    if job is not None:
        estimate = EstimatePlan(job.name)
        job.done = lambda: _steps_done(config, counter)
        job.partial = lambda: _last_checkpoint(config)
    if config.nproc == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(1))
        try:
            result = train_on_rank(
                config, 0, 1, resume_from, estimate=estimate, on_step=partial(_record, counter)
            )
        finally:
            torch.set_num_threads(threads)
    else:
        result = spawn_training(config, resume_from, estimate, counter)
    if config.json_out:
        write_losses(config.json_out, result, config)
    if config.csv_out:
        write_losses(config.csv_out, result, config, csv=True)
    if config.plot_out:
        from shardmuon.train.plot import plot_result

        label = Path(config.json_out).stem if config.json_out else "this run"
        plot_result(result, config, label, config.plot_out)
    return result


def _record(counter: Counter, step: int) -> None:
    counter[1] = step


def _steps_done(config: TrainConfig, counter: Counter) -> str:
    step = counter[1]
    return f"step {step} of {config.steps}" if step else "before its first step finished"


def _last_checkpoint(config: TrainConfig) -> str | None:
    """``"ck (step-000040; --resume ck continues)"``: the newest complete checkpoint."""
    if not config.checkpoint_dir:
        return None
    found = recovery.step_checkpoints(config.checkpoint_dir)
    if not found:
        return None
    newest = found[max(found)]
    return f"{config.checkpoint_dir} ({newest.name}; --resume {config.checkpoint_dir} continues)"


def write_losses(
    path: str | os.PathLike, result: TrainResult, config: TrainConfig, *, csv: bool = False
) -> None:
    """Per-step losses as JSON (with config and range means) or, with ``csv``, ``step,loss``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if csv:
        lines = ["step,loss"] + [f"{s},{v!r}" for s, v in sorted(result.losses.items())]
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text(json.dumps(result.to_json(config), indent=2))
