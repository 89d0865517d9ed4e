"""Where the optimizer state lives, and its step counters.

Every parameter gets its state at construction (DCP needs the same keys on every rank):
dion's keys (``momentum``; ``momentum`` and ``variance`` under AdamW) laid out like the
parameter, in (pinned) host memory with ``offload="state"``, and a ``step`` counter — a 0-d
float32 CPU tensor, ``torch.optim``'s convention — that mirrors its group's ``step``. dion
keeps the count in the param group only, which a loader that writes checkpoint tensors in
place into ``state_dict()`` without ``load_state_dict`` (prime-rl's, through DCP) never
restores; through the counters, the count comes back. The pieces of a checked load
(``Muon.load_state_dict``: hooks, host placement, completing the groups) are here too.
"""

from __future__ import annotations

import contextlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from shardmuon.planning.placements import local_tensor
from shardmuon.runtime.offload import host_copy
from shardmuon.settings import MuonSettings

__all__ = [
    "adopt_loaded_counts",
    "adopt_loaded_groups",
    "advance_step_counters",
    "check_state_devices",
    "init_state",
    "load_groups_to_host",
    "load_hooks_held",
    "restore_fp32_state",
    "run_load_pre_hooks",
    "saved_settings",
]

# The state a parameter has under each algorithm (dion's keys).
STATE_KEYS = {"muon": ("momentum",), "sinkhorn": ("momentum",), "adamw": ("momentum", "variance")}
# State kept in float32 whatever the parameter's dtype (prime-rl's Sinkhorn momentum).
FP32_STATE = {"sinkhorn": ("momentum",)}


def init_state(
    param_groups: list[dict],
    state: dict,
    offloaded: bool,
    counted: dict[int, int],
    keep_placed: bool = False,
) -> None:
    """Create or re-place every parameter's state (see the module docstring).

    ``counted[g]``: the count group ``g``'s counters were last given; a group without one
    has its counters (re)written from its ``step`` and recorded. ``keep_placed`` (without
    offload): state that exists stays on its device (a trainer streaming each chunk's state
    to the device and back); missing state is made beside its parameter.
    """
    for index, group in enumerate(param_groups):
        last = counted.get(index)
        for p in group["params"]:
            entry = state[p]
            fp32 = FP32_STATE.get(group["algorithm"], ())
            for key in STATE_KEYS[group["algorithm"]]:
                value = entry.get(key)
                dtype = torch.float32 if key in fp32 else None
                if value is None:
                    value = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                elif dtype is not None and value.dtype != dtype:
                    value = value.to(dtype)
                if isinstance(p, DTensor) and not isinstance(value, DTensor):
                    value = _distribute_like(value, p)
                if offloaded or not keep_placed:
                    value = placed(value, p, offloaded)
                entry[key] = value
            counter = entry.get("step")
            if last is None or not _is_step_counter(counter):
                entry["step"] = _step_counter(group["step"], counter)
        if last is None:
            counted[index] = group["step"]


def restore_fp32_state(param_groups: list[dict], state: dict, loaded: dict) -> None:
    """torch's ``load_state_dict`` casts every floating state tensor to its parameter's
    dtype: state kept in float32 (:data:`FP32_STATE`, a bf16 table's Sinkhorn momentum) is
    taken again from the ``loaded`` dict, as float32 (no precision lost). Run right after
    torch's load, with the dict it loaded (its ``param_groups`` list ids in the order of
    ``param_groups``' parameters, as torch maps them)."""
    saved_state = loaded.get("state", {})
    saved_ids = [i for group in loaded.get("param_groups", []) for i in group["params"]]
    params = [(group, p) for group in param_groups for p in group["params"]]
    for saved_id, (group, p) in zip(saved_ids, params):
        keys = FP32_STATE.get(group["algorithm"], ())
        saved = saved_state.get(saved_id, {})
        for key in keys:
            value = saved.get(key)
            if isinstance(value, Tensor) and p.dtype != torch.float32:
                state[p][key] = value.detach().to(torch.float32, copy=True)


def adopt_loaded_counts(param_groups: list[dict], state: dict, counted: dict[int, int]) -> None:
    """A group whose first counter no longer holds what was last written was loaded in
    place: the loaded count becomes the group's ``step``. Otherwise the group's ``step``
    rules (perhaps set by hand). Run before a step, a state dict and a copy."""
    for index, group in enumerate(param_groups):
        counter = state[group["params"][0]].get("step") if group["params"] else None
        if index not in counted or not _is_step_counter(counter):
            continue
        # The count as a float32 holds it (2**24 + 1 reads back as 2**24).
        written = struct.unpack("f", struct.pack("f", float(counted[index])))[0]
        loaded = float(counter.item())
        if loaded != written:
            group["step"] = int(loaded)
            counted[index] = group["step"]


def advance_step_counters(param_groups: list[dict], state: dict, counted: dict[int, int]) -> None:
    """Every group's ``step`` and its parameters' counters advance by one (after
    :func:`adopt_loaded_counts`)."""
    adopt_loaded_counts(param_groups, state, counted)
    for index, group in enumerate(param_groups):
        counters = [state[p]["step"] for p in group["params"]]
        group["step"] += 1
        counted[index] = group["step"]
        if counters:
            torch._foreach_zero_(counters)
            torch._foreach_add_(counters, float(group["step"]))


def placed(value: Tensor, param: Tensor, offloaded: bool) -> Tensor:
    """State where it lives: in (pinned) contiguous host memory with offload, else with its
    parameter; laid out like the parameter."""
    local = local_tensor(value)
    device = local_tensor(param).device
    if offloaded:
        pinned = device.type == "cpu" or not torch.cuda.is_available() or local.is_pinned()
        if local.device.type == "cpu" and local.is_contiguous() and pinned:
            return value
        local = host_copy(local, device)
    elif local.device == device:
        return value
    else:
        local = local.to(device)
    if isinstance(param, DTensor):
        return _dtensor_like(local, param)
    return local


def host_state_entries(
    saved_state: dict, saved_ids: Iterable[int], params: Iterable[Tensor]
) -> dict[Tensor, dict[str, Any]]:
    """Saved state entries by parameter, cast to each parameter's dtype where they are
    (never moved to the parameters' device, as torch's load would: with offload that would
    need device memory for the whole state)."""
    by_id = dict(zip(saved_ids, params))
    entries = {}
    for saved_id, entry in saved_state.items():
        param = by_id.get(saved_id)
        if param is None or not isinstance(entry, dict):
            continue
        entries[param] = {
            key: value.to(dtype=param.dtype)
            if isinstance(value, Tensor) and key != "step" and param.is_floating_point()
            else value
            for key, value in entry.items()
        }
    return entries


def _distribute_like(value: Tensor, param: DTensor) -> DTensor:
    """A full (e.g. dion single-process) state tensor laid out like ``param``, no communication."""
    if value.shape != param.shape:
        raise ValueError(
            f"optimizer state of shape {tuple(value.shape)} does not fit a parameter of global "
            f"shape {tuple(param.shape)}"
        )
    return distribute_tensor(
        value.to(local_tensor(param).device),
        param.device_mesh,
        param.placements,
        src_data_rank=None,
    )


def _dtensor_like(local: Tensor, param: DTensor) -> DTensor:
    """A DTensor laid out like ``param`` around ``local``, wherever ``local`` lives.

    ``DTensor.from_local`` moves a host tensor to the mesh's device; offloaded state must stay
    in host memory (as FSDP2's CPU offload keeps its parameters), so the DTensor is built
    from its spec directly when the devices differ.
    """
    if local.device.type == param.device_mesh.device_type:
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape,
            stride=param.stride(), run_check=False,
        )  # fmt: skip
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(param.shape, param.stride(), local.dtype)
    spec = DTensorSpec(param.device_mesh, tuple(param.placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


def _is_step_counter(value: object) -> bool:
    """A 0-d float32 tensor, on any device (a trainer may move it with the rest of a
    chunk's state; it is kept and advanced where it is)."""
    return (
        isinstance(value, Tensor)
        and not isinstance(value, DTensor)
        and value.dtype == torch.float32
        and value.dim() == 0
    )


def check_state_devices(params: Iterable[Tensor], state: dict) -> None:
    """``Muon.step_chunk`` without offload: the state of a chunk's ``params`` must be on each
    parameter's device; raises ``ValueError`` naming the first that is not, before anything
    changes. The counters may be anywhere."""
    for param in params:
        device = local_tensor(param).device
        for key, value in state[param].items():
            if key == "step" or not isinstance(value, Tensor):
                continue
            where = local_tensor(value).device
            if where != device:
                raise ValueError(
                    f"step_chunk: the {key!r} state of a parameter of shape "
                    f"{tuple(param.shape)} is on {where}, the parameter on {device}; move the "
                    "chunk's state (optimizer.state[p] for p in chunk_info(chunk).params) to "
                    "its parameter's device before step_chunk and back after it, or use "
                    "offload='state'"
                )


def _step_counter(step: int, current: object) -> Tensor:
    """``current`` if it is a counter (given the value ``step``), else a new one."""
    if _is_step_counter(current):
        current.fill_(float(step))
        return current
    return torch.tensor(float(step), dtype=torch.float32)


def run_load_pre_hooks(optimizer: Optimizer, state_dict: dict) -> dict:
    """``state_dict`` after the optimizer's load pre-hooks (a hook may return another
    dict): run once, before validation, so that what is checked is what is loaded."""
    for hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        changed = hook(optimizer, state_dict)
        if changed is not None:
            state_dict = changed
    return state_dict


@contextlib.contextmanager
def load_hooks_held(optimizer: Optimizer) -> Iterator[list[Callable]]:
    """torch's ``load_state_dict`` with its hooks held back (the pre-hooks already ran; the
    post-hooks must see the finished load): yields the post-hooks for the caller to run."""
    pre = optimizer._optimizer_load_state_dict_pre_hooks
    post = optimizer._optimizer_load_state_dict_post_hooks
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    try:
        yield list(post.values())
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks = pre
        optimizer._optimizer_load_state_dict_post_hooks = post


def adopt_loaded_groups(
    param_groups: list[dict], state: dict, merged: list[dict], dropped: Iterable[str]
) -> None:
    """After torch's load: each group completed with the checked keys it lacked
    (``merged``), and the state keys shardmuon does not keep (``dropped``) removed."""
    for group, full in zip(param_groups, merged):
        for key, value in full.items():
            group.setdefault(key, value)
    for entry in state.values():
        if isinstance(entry, dict):
            for key in dropped:
                entry.pop(key, None)


def load_groups_to_host(
    optimizer: Optimizer, torch_load: Callable[[dict], None], state_dict: dict
) -> None:
    """With offload: torch's load of the groups only (it replaces ``optimizer.state`` and
    ``param_groups``); the state cast where it is, then placed in host memory
    (:func:`host_state_entries`)."""
    torch_load({**state_dict, "state": {}})
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    optimizer.state.update(host_state_entries(state_dict["state"], saved_ids, params))


# Where ``Muon.__getstate__`` puts the settings and what its runner was given.
SETTINGS_KEY = "_shardmuon_settings"


def saved_settings(saved: Any) -> tuple[MuonSettings, dict[str, Any]]:
    """What ``Muon.__getstate__`` saved under :data:`SETTINGS_KEY`: ``(settings, what the
    runner was given)``. A copy made by an earlier version saved a dict of attributes
    (``coefficients`` resolved, the same object as ``_default_coefficients`` while they were
    the default; ``warmup_setting``; the private ``_raw_partitions``, ``_ddp_ranks``,
    ``_auto_record``): read too, settings it did not have yet at their defaults."""
    if isinstance(saved, tuple):
        settings, given = saved
        return settings, given
    values = dict(saved)
    coefficients = values.pop("coefficients", None)
    default = values.pop("_default_coefficients", None)
    given_coefficients = None if coefficients is None or coefficients is default else coefficients
    values["newton_schulz_coefficients"] = given_coefficients
    values["warmup"] = values.pop("warmup_setting", None)
    given = {
        "partitions": values.pop("_raw_partitions", None) or {},
        "ddp_ranks": values.pop("_ddp_ranks", None),
        "auto_record": values.pop("_auto_record", None),
    }
    return MuonSettings.from_mapping(values), given


# Group settings that schedules change as training goes (an lr warm-up, a momentum cycle):
# dion's keys (AdamW's ``beta1``/``beta2``), and torch's ``betas`` pair where a group has one.
# ``state_dict()`` hands them out as 0-d float64 CPU tensors (``betas``: a pair of them), so
# that a checkpoint loaded *in place* into the tensors of ``state_dict()`` (DCP into the
# optimizer's own dict, without ``load_state_dict``) brings them back, as it does the
# per-parameter ``step`` counters: the next step adopts what changed.
SCHEDULED_KEYS = ("lr", "mu", "beta1", "beta2", "betas", "weight_decay")

# One handed-out setting: (group index, key, its tensors, the values written into them).
Handed = tuple[int, str, tuple[Tensor, ...], tuple[float, ...]]


def with_setting_tensors(state_dict: dict[str, Any], handed: list[Handed]) -> dict[str, Any]:
    """``state_dict`` (torch's, its groups copies of the live ones) with each float of
    :data:`SCHEDULED_KEYS` replaced by a float64 tensor holding it; ``handed`` records them
    (replacing the record of any earlier state dict). A tensor lr the caller set is left as
    it is: torch hands out the live tensor itself, which an in-place load already reaches."""
    handed.clear()
    for index, group in enumerate(state_dict["param_groups"]):
        for key in SCHEDULED_KEYS:
            value = group.get(key)
            if value is None or isinstance(value, (Tensor, bool)):
                continue
            pair = isinstance(value, (tuple, list))
            values = tuple(float(v) for v in value) if pair else (float(value),)
            tensors = tuple(torch.tensor(v, dtype=torch.float64) for v in values)
            group[key] = tensors if pair else tensors[0]
            handed.append((index, key, tensors, values))
    return state_dict


def adopt_loaded_settings(param_groups: list[dict], handed: list[Handed]) -> None:
    """A handed-out setting whose tensors no longer hold what was written was loaded in
    place: its group takes the loaded value (a float, or a pair for ``betas``). Otherwise
    the group's own value rules (a scheduler may have changed it since). Run before a step,
    a state dict and a copy."""
    for position, (index, key, tensors, values) in enumerate(handed):
        loaded = tuple(float(t) for t in tensors)
        if loaded == values or index >= len(param_groups):
            continue
        group = param_groups[index]
        group[key] = loaded if len(loaded) > 1 else loaded[0]
        handed[position] = (index, key, tensors, loaded)


def plain_settings(groups: list[dict], like: list[dict] | None = None) -> list[dict]:
    """Copies of state-dict ``groups`` with the tensors of :data:`SCHEDULED_KEYS` back as
    Python numbers (``betas``: a tuple), except where the matching group of ``like`` holds
    a tensor (a tensor lr the caller set). Other values as they are."""
    out = []
    for index, group in enumerate(groups):
        group = dict(group)
        current = like[index] if like is not None and index < len(like) else {}
        for key in SCHEDULED_KEYS:
            value = group.get(key)
            if isinstance(current.get(key), Tensor):
                continue
            if isinstance(value, Tensor) and value.numel() == 1:
                group[key] = float(value)
            elif isinstance(value, (tuple, list)) and any(isinstance(v, Tensor) for v in value):
                group[key] = tuple(float(v) for v in value)
        out.append(group)
    return out
