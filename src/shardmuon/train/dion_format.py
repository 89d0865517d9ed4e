"""dion-format checkpoints: a ``torch.save`` of ``{"model", "optimizer", "step"}`` where
``optimizer`` is a plain ``optimizer.state_dict()`` with dion's keys (integer param ids in
group order, ``momentum`` / ``variance`` state, dion's param-group keys), as a single-process
dion (or shardmuon) run writes it.

Loading maps the integer ids onto this run's param groups (prime-rl routing gives the same
group order as dion) and slices each full tensor to the local shard of its DTensor, so the
file resumes at any world size and layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardmuon.planning.placements import local_slice
from shardmuon.runtime.state import plain_settings
from shardmuon.train.checkpoint import CheckpointError


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, Tensor):
        return value.detach().cpu().clone()
    return value


def _like(full: Tensor, ref: Tensor) -> Tensor:
    """``full`` laid out like ``ref`` (the local shard when ``ref`` is a DTensor)."""
    from torch.distributed.tensor import DTensor

    full = full.to(device=ref.device, dtype=ref.dtype)
    if isinstance(ref, DTensor):
        # Every rank holds the whole file: each keeps its slice, no scatter needed. Sliced as
        # FSDP2 lays a tensor out (distribute_tensor cuts some uneven _StridedShards otherwise).
        local = local_slice(full, ref)
        return DTensor.from_local(
            local,
            ref.device_mesh,
            ref.placements,
            run_check=False,
            shape=ref.shape,
            stride=ref.stride(),
        )
    return full


def dion_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    """Full (unsharded, CPU) ``{"model", "optimizer", "step"}`` in dion's format.

    Collective under torch.distributed (every rank calls it; DTensors are gathered).
    """
    model_sd = {name: _full(p) for name, p in model.named_parameters()}
    optim_sd = optimizer.state_dict()
    # dion's keys only: shardmuon's per-parameter ``step`` counter repeats the group's.
    state = {
        idx: {key: _full(value) for key, value in per_param.items() if key != "step"}
        for idx, per_param in sorted(optim_sd["state"].items())
    }
    groups = plain_settings(optim_sd["param_groups"])  # dion's floats, not handed-out tensors
    return {"model": model_sd, "optimizer": {"state": state, "param_groups": groups}, "step": step}


def save_dion_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """Write :func:`dion_state_dict` to ``path`` with ``torch.save`` (rank 0 writes)."""
    blob = dion_state_dict(model, optimizer, step)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        torch.save(blob, tmp)
        os.replace(tmp, path)


def read_dion_file(path: str | os.PathLike) -> dict:
    """Load and shape-check the top level of a dion-format file; raises CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"dion checkpoint {str(path)!r} is not a file")
    try:
        blob = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"cannot read {str(path)!r} with torch.load: {err}") from err
    if not isinstance(blob, dict):
        raise CheckpointError(f"{str(path)!r} holds a {type(blob).__name__}, not a dict")
    if "state" in blob and "param_groups" in blob:
        raise CheckpointError(
            f"{str(path)!r} holds an optimizer state_dict only; a resume also needs the model "
            "weights: save {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), "
            "'step': step}"
        )
    missing = [k for k in ("model", "optimizer") if k not in blob]
    if missing:
        raise CheckpointError(
            f"{str(path)!r} lacks {missing}; a dion-format checkpoint is a dict with 'model' "
            f"(name -> tensor), 'optimizer' (optimizer.state_dict()) and optionally 'step'; "
            f"found keys {sorted(map(str, blob))}"
        )
    return blob


def dion_step(blob: dict) -> int:
    """Optimizer steps taken when ``blob`` was written (``step``, else the groups' ``step``)."""
    if blob.get("step") is not None:
        return int(blob["step"])
    groups = blob["optimizer"].get("param_groups") or [{}]
    if "step" not in groups[0]:
        raise CheckpointError("dion checkpoint has neither 'step' nor param_groups[0]['step']")
    return int(groups[0]["step"])


def load_dion_checkpoint(blob: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a dion-format ``blob`` (from :func:`read_dion_file`) into this run's objects.

    Raises CheckpointError naming the params, groups or state entries that do not match.
    """
    _load_model(blob["model"], model)
    names = {id(p): n for n, p in model.named_parameters()}
    ours = optimizer.state_dict()
    saved = blob["optimizer"]
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(ours["param_groups"]):
        raise CheckpointError(
            f"dion checkpoint has {len(saved_groups)} param groups "
            f"({[g.get('algorithm') for g in saved_groups]}), this run has "
            f"{len(ours['param_groups'])} ({[g.get('algorithm') for g in ours['param_groups']]})"
        )
    new_state: dict[int, dict[str, Any]] = {}
    new_groups = []
    for gi, (mine, theirs, live) in enumerate(
        zip(ours["param_groups"], saved_groups, optimizer.param_groups)
    ):
        if mine.get("algorithm") != theirs.get("algorithm"):
            raise CheckpointError(
                f"param group {gi}: checkpoint algorithm {theirs.get('algorithm')!r}, "
                f"this run {mine.get('algorithm')!r}"
            )
        if len(mine["params"]) != len(theirs["params"]):
            raise CheckpointError(
                f"param group {gi} ({mine.get('algorithm')}): checkpoint has "
                f"{len(theirs['params'])} params, this run {len(mine['params'])}"
            )
        for my_id, their_id, param in zip(mine["params"], theirs["params"], live["params"]):
            name = names.get(id(param), f"param {my_id}")
            their_state = saved["state"].get(their_id)
            wanted = ours["state"].get(my_id, {})
            # The step counter is shardmuon's own: dion's group ``step`` makes it.
            lacking = [
                k for k in wanted if k != "step" and (their_state is None or k not in their_state)
            ]
            if lacking:
                raise CheckpointError(
                    f"dion checkpoint has no optimizer state {lacking} for {name} (id {their_id})"
                )
            new_state[my_id] = {}
            for key, ref in wanted.items():
                if their_state is None or key not in their_state:
                    continue
                value = their_state[key]
                if isinstance(ref, Tensor) and isinstance(value, Tensor):
                    if tuple(value.shape) != tuple(ref.shape):
                        raise CheckpointError(
                            f"optimizer state {key} of {name}: checkpoint shape "
                            f"{tuple(value.shape)}, this run {tuple(ref.shape)}"
                        )
                    value = _like(value, ref)
                new_state[my_id][key] = value
        # Keep this optimizer's own keys (dion lacks some) but take dion's values.
        new_groups.append({**mine, **theirs, "params": mine["params"]})
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})


def _load_model(weights: dict, model: nn.Module) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    extra = sorted(set(weights) - set(params))
    if missing or extra:
        raise CheckpointError(
            "dion checkpoint was written for another model: "
            f"missing params {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
            f"unexpected params {extra[:6]}{' ...' if len(extra) > 6 else ''}"
        )
    with torch.no_grad():
        for name, param in params.items():
            full = weights[name]
            if tuple(full.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"param {name}: checkpoint shape {tuple(full.shape)}, "
                    f"this model {tuple(param.shape)}"
                )
            local = _like(full, param)
            target = param.to_local() if hasattr(param, "to_local") else param
            target.copy_(local.to_local() if hasattr(local, "to_local") else local)
