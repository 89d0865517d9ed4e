"""Checkpoints: model + optimizer through ``torch.distributed.checkpoint`` (DCP), plus the
trainer state (step, seed, data position, RNG) and dion-format optimizer state_dicts.

Layout of a checkpoint root::

    root/step-000050/.metadata, __*.distcp   DCP: {"model": ..., "optim": ...}, sharded
    root/step-000050/trainer_state.json      step, seed, config, world size
    root/step-000050/rng/rank{r}.pt          torch RNG state of each rank

The optimizer state dict is the FQN-keyed, flattened one from
``get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))``, so DCP can
reshard DTensor state to another world size. A save goes to a temporary directory that is
renamed into place only once every rank has written, so a failed save never touches what is
already on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEP_PREFIX = "step-"
TRAINER_STATE = "trainer_state.json"
_DCP_METADATA = ".metadata"
_LIST_LIMIT = 6


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed by this run (missing, from another model, ...)."""


def _state_dict_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def training_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as DCP saves and loads it (DTensors stay sharded)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_dict_options())
    return {"model": model_sd, "optim": optim_sd}


def expected_entries(state: Mapping[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """DCP key -> global shape (``None`` for non-tensor values) of a :func:`training_state_dict`."""
    out: dict[str, tuple[int, ...] | None] = {}
    for top, sub in state.items():
        for key, value in sub.items():
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            out[f"{top}.{key}"] = shape
    return out


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """Directory of the checkpoint taken after ``step`` optimizer steps."""
    return Path(root) / f"{STEP_PREFIX}{step:06d}"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A DCP checkpoint directory: ``path`` itself, or the newest ``step-*`` inside ``path``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    if path.is_file():
        raise CheckpointError(
            f"{str(path)!r} is a file; a DCP checkpoint is a directory (for a dion-format "
            "torch.save file use --resume-dion)"
        )
    if (path / _DCP_METADATA).is_file():
        return path
    steps = sorted(
        p for p in path.glob(f"{STEP_PREFIX}*") if (p / _DCP_METADATA).is_file() and p.is_dir()
    )
    if not steps:
        raise CheckpointError(
            f"no checkpoint in {str(path)!r}: expected a DCP directory (with {_DCP_METADATA}) "
            f"or a root holding {STEP_PREFIX}NNNNNN directories"
        )
    return steps[-1]


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of checkpoint directory ``ckpt``."""
    file = ckpt / TRAINER_STATE
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} has no {TRAINER_STATE} (step, seed and data position); "
            "it was not written by shardmuon train"
        )
    return json.loads(file.read_text())


def _summarise(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_LIMIT])
    more = len(names) - _LIST_LIMIT
    return shown + (f" and {more} more" if more > 0 else "")


def check_compatible(ckpt: Path, expected: Mapping[str, tuple[int, ...] | None]) -> None:
    """Raise :class:`CheckpointError` naming what ``ckpt`` lacks or holds in another shape.

    ``expected`` comes from :func:`expected_entries` of this run's model and optimizer.
    """
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    problems: list[str] = []
    missing_model = [
        k[len("model.") :] for k in expected if k.startswith("model.") and k not in stored
    ]
    extra_model = [
        k[len("model.") :] for k in stored if k.startswith("model.") and k not in expected
    ]
    if missing_model or extra_model:
        text = "checkpoint was written for another model:"
        if missing_model:
            text += f" missing params {_summarise(missing_model)};"
        if extra_model:
            text += f" params this model does not have {_summarise(extra_model)};"
        problems.append(text.rstrip(";"))
    shape_diffs = []
    for key, shape in expected.items():
        meta = stored.get(key)
        is_tensor = shape is not None and isinstance(meta, TensorStorageMetadata)
        if is_tensor and tuple(meta.size) != shape:
            shape_diffs.append(f"{key} {tuple(meta.size)} (this run: {shape})")
    if shape_diffs:
        problems.append(f"shapes differ: {_summarise(shape_diffs)}")
    for prefix, what in (
        ("optim.state.", "optimizer state"),
        ("optim.param_groups.", "optimizer param-group settings"),
    ):
        missing = [k[len(prefix) :] for k in expected if k.startswith(prefix) and k not in stored]
        if missing:
            problems.append(f"missing {what}: {_summarise(missing)}")
    if problems:
        raise CheckpointError(f"cannot resume from {str(ckpt)!r}: " + "; ".join(problems))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_str(value: str) -> str:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: Mapping[str, Any],
) -> Path:
    """Save after ``step`` optimizer steps (collective: every rank calls it); returns the dir.

    Writes into ``root/.tmp-step-NNNNNN-<id>`` and renames it to ``root/step-NNNNNN`` once all
    ranks are done; on any failure the temporary directory is removed and the error re-raised,
    leaving existing checkpoints untouched.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final = step_dir(root, step)
    # Rank 0 picks the name so that every rank writes into the same directory.
    tmp = Path(_broadcast_str(str(root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}")))
    if _rank() == 0:
        tmp.mkdir(parents=True)
    _barrier()
    try:
        dcp.save(training_state_dict(model, optimizer), checkpoint_id=str(tmp))
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(torch.get_rng_state(), tmp / "rng" / f"rank{_rank()}.pt")
        if _rank() == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps(dict(trainer_state), indent=2))
        _barrier()
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _rank() == 0:
        _replace_dir(tmp, final)
    _barrier()
    return final


def _replace_dir(new: Path, final: Path) -> None:
    # os.rename of a directory is atomic; an older checkpoint of the same step is moved
    # aside first and only deleted once the new one is in place.
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(new, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model + optimizer from DCP directory ``ckpt`` into this run's (sharded) objects.

    Call :func:`check_compatible` first for a readable error. The torch RNG state is restored
    when the checkpoint holds one for this rank and the world size is unchanged.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = training_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(ckpt))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_state_dict_options(),
    )
    saved_world = read_trainer_state(ckpt).get("world_size")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = ckpt / "rng" / f"rank{_rank()}.pt"
    if saved_world == world and rng_file.is_file():
        torch.set_rng_state(torch.load(rng_file, weights_only=True))
