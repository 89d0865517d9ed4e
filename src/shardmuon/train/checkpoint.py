"""Checkpoints: model + optimizer through ``torch.distributed.checkpoint`` (DCP), plus the
trainer state (step, seed, data position, RNG) and dion-format optimizer state_dicts.

Layout of a checkpoint root::

    root/step-000050/.metadata, __*.distcp   DCP: {"model": ..., "optim": ...}, sharded
    root/step-000050/trainer_state.json      step, seed, config, world size
    root/step-000050/rng/rank{r}.pt          torch RNG state of each rank
    root/step-000050/.complete               written last: every file above with its size

The optimizer state dict is the FQN-keyed, flattened one from
``get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))``, so DCP can
reshard DTensor state to another world size. A save goes to a temporary directory that is
renamed into place only once every rank has written, so a failed save never touches what is
already on disk; :mod:`.recovery` picks up what a save killed at any point leaves behind.
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
DCP_METADATA = ".metadata"
# Written last into a finished save: its presence marks the directory complete, and its
# file sizes let a resume spot a file truncated since.
COMPLETE_MARKER = ".complete"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
_LIST_LIMIT = 6


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed by this run (missing, from another model, ...)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files are missing or damaged; the message names the file."""


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


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of checkpoint directory ``ckpt`` (with an integer ``step``).

    Raises :class:`CorruptCheckpointError` naming the file when it is missing or invalid.
    """
    file = ckpt / TRAINER_STATE
    if not file.is_file():
        raise CorruptCheckpointError(
            f"checkpoint {str(ckpt)!r} has no {TRAINER_STATE} (step, seed and data position); "
            "it was not written by shardmuon train, or the file was lost"
        )
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"{file} is damaged: not valid JSON ({err})") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptCheckpointError(f"{file} is damaged: no integer 'step' in it")
    return state


def read_dcp_metadata(ckpt: Path):
    """DCP's ``Metadata`` of ``ckpt``; :class:`CorruptCheckpointError` naming the file if bad."""
    from torch.distributed.checkpoint import FileSystemReader

    file = ckpt / DCP_METADATA
    if not file.is_file():
        raise CorruptCheckpointError(f"{file} is missing: {str(ckpt)!r} is not a DCP checkpoint")
    try:
        return FileSystemReader(str(ckpt)).read_metadata()
    except Exception as err:  # pickle raises many types for a damaged file
        raise CorruptCheckpointError(
            f"{file} is damaged: cannot read it ({type(err).__name__}: {err})"
        ) from None


def _summarise(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_LIMIT])
    more = len(names) - _LIST_LIMIT
    return shown + (f" and {more} more" if more > 0 else "")


def check_compatible(ckpt: Path, expected: Mapping[str, tuple[int, ...] | None]) -> None:
    """Raise :class:`CheckpointError` naming what ``ckpt`` lacks or holds in another shape.

    ``expected`` comes from :func:`expected_entries` of this run's model and optimizer.
    """
    from torch.distributed.checkpoint import TensorStorageMetadata

    stored = read_dcp_metadata(ckpt).state_dict_metadata
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

    Writes into ``root/.tmp-step-NNNNNN-<id>``, marks it complete (:data:`COMPLETE_MARKER`,
    last) once all ranks are done, then renames it to ``root/step-NNNNNN``. An existing
    checkpoint of that step is renamed aside first and deleted after. On any failure the
    temporary directory is removed and the error re-raised, leaving existing checkpoints
    untouched; if the process is killed instead, :func:`.recovery.repair_checkpoints`
    finishes or undoes the save on the next run.
    """
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    final = step_dir(root, step)
    # Rank 0 picks the name so that every rank writes into the same directory.
    tmp_name = f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp = Path(_broadcast_str(str(root / tmp_name)))
    if _rank() == 0:
        tmp.mkdir(parents=True)
    _barrier()
    try:
        dcp.save(training_state_dict(model, optimizer), checkpoint_id=str(tmp))
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(torch.get_rng_state(), tmp / "rng" / f"rank{_rank()}.pt")
        _barrier()  # every rank's files are written
        if _rank() == 0:
            _write_durably(tmp / TRAINER_STATE, json.dumps(dict(trainer_state), indent=2))
            _write_durably(tmp / COMPLETE_MARKER, json.dumps(_manifest(tmp), indent=1))
            _fsync_dir(tmp)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if _rank() == 0:
        _replace_dir(tmp, final)
    _barrier()
    return final


def _manifest(ckpt: Path) -> dict[str, Any]:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)
    return {"files": {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in files}}


def _write_durably(path: Path, text: str) -> None:
    # fsync, so that after a power cut the marker never exists without the data it vouches for.
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(new: Path, final: Path) -> None:
    # os.rename of a directory is atomic. An older checkpoint of the same step is moved
    # aside first and only deleted once the new one is in place; a kill between the two
    # renames leaves both complete copies, which recovery puts back.
    old = None
    if final.exists():
        old = final.with_name(f"{OLD_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(new, final)
    _fsync_dir(final.parent)
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
    try:
        dcp.load(state, checkpoint_id=str(ckpt))
    except Exception as err:
        # Damage that the checks before loading cannot see (bytes changed, not truncated).
        raise CorruptCheckpointError(
            f"cannot load checkpoint {str(ckpt)!r}: {type(err).__name__}: {err}"
        ) from err
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
        try:
            rng_state = torch.load(rng_file, weights_only=True)
        except Exception as err:
            raise CorruptCheckpointError(f"{rng_file} is damaged: {err}") from err
        torch.set_rng_state(rng_state)
