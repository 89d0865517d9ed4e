"""The DTensor boundary of QK-clip: which heads a rank's attention computes, and scaling a
parameter's rows in place on whatever shard of it this rank holds.

Rows are scaled one by one, so any row split works — FSDP2's ``Shard(0)`` cutting a head in
two, HSDP, tensor parallel, FSDP2 over TP's ``_StridedShard``, a fused QKV cut across its
Q/K/V boundary: each local row is multiplied by its global row's factor
(:func:`shardmuon.planning.placements.local_indices`, FSDP2's own reading of uneven
shards). ``Partial`` is not a layout of data and is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial

from shardmuon.planning.placements import local_indices, local_tensor, placed_ambiguously

__all__ = ["check_scalable", "head_offset", "scale_rows_", "scale_whole_"]


def check_scalable(name: str, param: Tensor) -> None:
    """``ValueError`` naming ``name`` when its layout cannot be scaled row by row."""
    if isinstance(param, DTensor) and any(isinstance(p, Partial) for p in param.placements):
        raise ValueError(
            f"{name} has placements {tuple(param.placements)}: a Partial tensor holds "
            "summands, not rows, so QK-clip cannot scale its rows locally"
        )
    if isinstance(param, DTensor) and placed_ambiguously(param, 0):
        ranks = param.device_mesh.mesh.tolist()
        raise ValueError(
            f"{name} has its rows sharded over a mesh that lists its ranks out of order "
            f"({ranks}): a shard placed by mesh coordinate (distribute_tensor(..., "
            "src_data_rank=None)) holds other rows than one placed by group rank (FSDP2, "
            "distribute_tensor's scatter), and no rank can tell which, so QK-clip would scale "
            "the wrong rows; build the mesh with the ranks of every dim in ascending order"
        )


def _local_rows(param: Tensor) -> Tensor | None:
    if not isinstance(param, DTensor):
        return None
    index = local_indices(param, 0)
    if index is None:
        return None
    return torch.tensor(index, dtype=torch.long, device=local_tensor(param).device)


@torch.no_grad()
def scale_rows_(param: Tensor, factors: Tensor) -> None:
    """Multiply row ``i`` of ``param`` (global numbering; ``[rows, ...]``, DTensor or plain)
    by ``factors[i]`` (``[rows]``), in place on the local shard; computed in float32 (or the
    parameter's dtype if wider) and rounded once."""
    local = local_tensor(param)
    rows = _local_rows(param)
    f = factors if rows is None else factors[rows.to(factors.device)]
    wide = torch.promote_types(local.dtype, torch.float32)
    f = f.to(device=local.device, dtype=wide).view(-1, *([1] * (local.ndim - 1)))
    torch.mul(local, f, out=local)


@torch.no_grad()
def scale_whole_(param: Tensor, factor: float) -> None:
    """Multiply every element of ``param``'s local shard by ``factor`` (float32 or wider)."""
    local = local_tensor(param)
    wide = torch.promote_types(local.dtype, torch.float32)
    torch.mul(local, torch.tensor(factor, dtype=wide, device=local.device), out=local)


def head_offset(name: str, weight: Tensor, row_start: int, head_dim: int, local_heads: int) -> int:
    """The global index of the first query head a rank's attention computes.

    ``weight``: the query projection as the forward pass sees it (under tensor parallel a
    DTensor sharded on its rows over ``tp``; FSDP2 has gathered its own shards by then);
    ``row_start``: where its query rows begin. ``ValueError`` when the local heads are not
    one contiguous block of whole heads of it.
    """
    rows = _local_rows(weight)
    if rows is None:
        raise ValueError(
            f"{name}: the attention computed {local_heads} heads, but its query weight is whole "
            "on this rank; a head split that is not a row split of a DTensor cannot be mapped"
        )
    rows = rows.tolist()
    first = rows[0] - row_start if rows else 0
    expected = list(range(row_start + first, row_start + first + local_heads * head_dim))
    if first % head_dim or rows[: len(expected)] != expected:
        raise ValueError(
            f"{name}: this rank's query rows ({rows[0]}..{rows[-1]}) are not {local_heads} "
            f"whole heads of {head_dim} rows in one block; QK-clip cannot tell which heads the "
            "attention computed"
        )
    return first // head_dim
