"""One AdamW chunk's step: dion's AdamW on a group's local shards, resumable.

The parameters of the group that have grads are updated with ``_foreach`` runs whose fp32
temporaries fit the workspace budget (:func:`shardmuon.ops.adamw.adamw_update_`), or on
CUDA one fused kernel per parameter (:func:`shardmuon.ops.fused_adamw.adamw_into`); the
progress counts finished parameters, so that a chunk that raised resumes without updating
any twice. With offload the state comes staged on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from shardmuon.ops.adamw import adamw_scalars, adamw_temp_bytes, adamw_update_
from shardmuon.ops.fused_adamw import adamw_into, fused_adamw_available, takes_parameter
from shardmuon.planning.placements import local_tensor
from shardmuon.planning.plan import AdamWChunk, setting_float
from shardmuon.runtime.phases import StepContext

__all__ = ["AdamWProgress", "adamw_peak_bytes", "adamw_state_views", "step_adamw"]


@dataclass
class AdamWProgress:
    """How many parameters of an AdamW chunk were updated (to resume a failed chunk)."""

    done: int = 0


def adamw_params(ctx: StepContext, chunk: AdamWChunk) -> list[Tensor]:
    """The parameters of an AdamW chunk that have grads (the ones it steps)."""
    return [p for p in chunk.params_of(ctx.param_groups) if ctx.grad(p) is not None]


def adamw_state_views(ctx: StepContext, chunk: AdamWChunk) -> list[Tensor]:
    """The (host) local momenta, then variances, of the chunk's parameters with grads."""
    params = adamw_params(ctx, chunk)
    return [local_tensor(ctx.state[p][key]) for key in ("momentum", "variance") for p in params]


def step_adamw(
    ctx: StepContext,
    chunk: AdamWChunk,
    progress: AdamWProgress | None = None,
    staged: list[Tensor] | None = None,
) -> None:
    """AdamW on one group; ``progress`` counts the parameters done (for a resumed chunk);
    ``staged``: the state as :func:`adamw_state_views` lists it, on the device (offload)."""
    group = ctx.param_groups[chunk.group_index]
    params = adamw_params(ctx, chunk)
    state = staged if staged is not None else adamw_state_views(ctx, chunk)
    momenta, variances = state[: len(params)], state[len(params) :]
    start = progress.done if progress is not None else 0
    params, momenta, variances = params[start:], momenta[start:], variances[start:]

    def done(_: int) -> None:
        if progress is not None:
            progress.done += 1

    hyper: dict[str, Any] = dict(
        lr=setting_float(group["lr"]),
        beta1=setting_float(group["beta1"]),
        beta2=setting_float(group["beta2"]),
        weight_decay=setting_float(group["weight_decay"]),
        epsilon=setting_float(group["epsilon"]),
        step=int(group["step"]),
    )
    tensors = [local_tensor(p) for p in params]
    grads = [local_tensor(_grad(ctx, p)) for p in params]
    if fused_adamw_available(ctx.device):
        # One kernel per parameter, no temporaries: the same bits (ops.fused_adamw).
        args = adamw_scalars(**hyper).as_args()
        for i, (x, g, m, v) in enumerate(zip(tensors, grads, momenta, variances)):
            adamw_into(x, g, m, v, *args)
            done(i)
        return
    adamw_update_(
        tensors,
        grads,
        momenta,
        variances,
        **hyper,
        max_temp_bytes=ctx.workspace_bytes,
        on_param_done=done,
    )


def _grad(ctx: StepContext, param: Tensor) -> Tensor:
    grad = ctx.grad(param)
    assert grad is not None  # adamw_params keeps the parameters with grads
    return grad


def adamw_peak_bytes(ctx: StepContext) -> int:
    """The largest fp32 temporaries of the AdamW chunks' ``_foreach`` runs (where the fused
    kernel runs, those of the parameters it cannot take, which run the ``_foreach_`` ops
    one at a time)."""
    fused = fused_adamw_available(ctx.device)
    peak = 0
    for chunk in ctx.plan.adamw:
        tensors = [local_tensor(p) for p in chunk.params_of(ctx.param_groups)]
        if fused:
            sizes = [t.numel() for t in tensors if not takes_parameter(t)]
            peak = max(peak, adamw_temp_bytes(sizes, 1))  # one parameter a run
            continue
        peak = max(peak, adamw_temp_bytes([t.numel() for t in tensors], ctx.workspace_bytes))
    return peak
