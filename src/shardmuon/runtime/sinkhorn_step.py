"""One Sinkhorn chunk's step: :func:`shardmuon.ops.sinkhorn.sinkhorn_update_` on one
parameter's local shard, its row and column statistics summed over the groups its
placements split it over (``planning/placements.py``'s ``SinkhornLayout``).

Every member of those groups steps the chunk at the same point of the step (Sinkhorn
chunks run first, in plan order), so their all-reduces pair up. A parameter without a grad
is skipped (on all of its ranks: the agreement check compares grad presence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from shardmuon.ops.sinkhorn import sinkhorn_apply_, sinkhorn_momentum_, sinkhorn_temp_bytes
from shardmuon.planning.groups import ShardGroup
from shardmuon.planning.placements import local_tensor
from shardmuon.planning.plan import SinkhornChunk, setting_float
from shardmuon.runtime.phases import StepContext

__all__ = [
    "SinkhornProgress",
    "sinkhorn_peak_bytes",
    "sinkhorn_state_views",
    "step_sinkhorn",
]


@dataclass
class SinkhornProgress:
    """How far a Sinkhorn chunk got (``Muon.step_chunk`` resumes a chunk that raised):
    its momentum updated; its all-reduces begun (then it cannot be replayed)."""

    momentum_done: bool = False
    communicated: bool = False


def sinkhorn_param(ctx: StepContext, chunk: SinkhornChunk) -> Tensor:
    return ctx.param_groups[chunk.group_index]["params"][chunk.param_index]


def sinkhorn_state_views(ctx: StepContext, chunk: SinkhornChunk) -> list[Tensor]:
    """The (host) local momentum of the chunk's parameter, if it has a grad (else none)."""
    param = sinkhorn_param(ctx, chunk)
    if ctx.grad(param) is None:
        return []
    return [local_tensor(ctx.state[param]["momentum"])]


def _summed_over(ctx: StepContext, groups: Sequence[ShardGroup], progress: SinkhornProgress):
    """An in-place sum over ``groups``; ``None`` if there are none (nothing to sum)."""
    if not groups:
        return None
    process_groups = [ctx.process_group(group) for group in groups]

    def reduce(tensor: Tensor) -> None:
        for process_group in process_groups:
            # From the first all-reduce on, a retry would pair with the peers' next one.
            progress.communicated = True
            dist.all_reduce(tensor, group=process_group)

    return reduce


def step_sinkhorn(
    ctx: StepContext,
    chunk: SinkhornChunk,
    progress: SinkhornProgress | None = None,
    staged: list[Tensor] | None = None,
) -> None:
    """The Sinkhorn update of one parameter; ``progress``: how far an earlier try got (the
    momentum is updated once); ``staged``: its momentum on the device (offload), as
    :func:`sinkhorn_state_views` lists it."""
    param = sinkhorn_param(ctx, chunk)
    grad = ctx.grad(param)
    if grad is None:
        return
    progress = SinkhornProgress() if progress is None else progress
    group = ctx.param_groups[chunk.group_index]
    momentum = staged[0] if staged else local_tensor(ctx.state[param]["momentum"])
    beta = setting_float(group["mu"])
    if not progress.momentum_done:
        sinkhorn_momentum_(momentum, local_tensor(grad), beta)
        progress.momentum_done = True
    layout = chunk.layout
    skipped = sinkhorn_apply_(
        local_tensor(param),
        local_tensor(grad),
        momentum,
        lr=setting_float(group["lr"]),
        beta=beta,
        iters=int(group["sinkhorn_iters"]),
        tau=setting_float(group["sinkhorn_tau"]),
        eps=setting_float(group["sinkhorn_eps"]),
        lr_scale=setting_float(group["sinkhorn_lr_scale"]),
        shape=(layout.rows, layout.cols),
        sum_across_cols=_summed_over(ctx, layout.col_groups, progress),
        sum_across_rows=_summed_over(ctx, layout.row_groups, progress),
    )
    # Kept on the device, read with the Muon matrices' counts (one synchronisation).
    ctx.stats.nonfinite_counts.append(skipped)


def sinkhorn_peak_bytes(chunks: Sequence[SinkhornChunk]) -> int:
    """The largest transient bytes of one Sinkhorn chunk."""
    return max(
        (sinkhorn_temp_bytes(c.layout.local_rows, c.layout.local_cols) for c in chunks),
        default=0,
    )
