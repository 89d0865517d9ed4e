"""Fused matrices (qkv, gate_up): per-block orthogonalization on plain tensors.

A partitioned matrix ``[rows, cols]`` with partitions ``(r_1, ..., r_p)`` (summing to
``rows``) is orthogonalized block by block along dim -2, exactly as if each block were a
separate parameter; blocks of equal size (across blocks and across the matrices of a batch)
share one batched Newton–Schulz call. Because each matrix of a batched call is computed
independently, the result is bitwise the same as separate parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from shardmuon.update import lr_scale

__all__ = [
    "check_partitions",
    "orthogonalize_blocks",
    "row_scales",
]

OrthogonalizeFn = Callable[[Tensor], Tensor]


def check_partitions(name: str, partitions: Sequence[int], rows: int) -> tuple[int, ...]:
    """Validate partitions for a parameter with ``rows`` rows on dim -2; return them as a tuple."""
    if isinstance(partitions, (str, bytes)) or not isinstance(partitions, Sequence):
        raise TypeError(
            f"matrix_partitions[{name}] must be a sequence of row counts, got "
            f"{type(partitions).__name__}"
        )
    sizes = tuple(partitions)
    if not sizes:
        raise ValueError(f"matrix_partitions[{name}] is empty; give at least one row count")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(
                f"matrix_partitions[{name}] must hold positive ints, got {list(sizes)}"
            )
    if sum(sizes) != rows:
        raise ValueError(
            f"matrix_partitions[{name}] = {list(sizes)} sums to {sum(sizes)}, but the "
            f"parameter has {rows} rows on dim -2; the sizes must sum to {rows}"
        )
    return sizes


def orthogonalize_blocks(
    U: Tensor, partitions: tuple[int, ...] | None, orthogonalize: OrthogonalizeFn
) -> Tensor:
    """Orthogonalize ``U[N, rows, cols]`` per row block; returns bf16 ``[N, rows, cols]``.

    ``orthogonalize`` maps a ``[B, m, n]`` stack to its bf16 result (Newton–Schulz).
    Without partitions this is one call on the whole stack.
    """
    if partitions is None or len(partitions) == 1:
        return orthogonalize(U)
    out = torch.empty(U.shape, dtype=torch.bfloat16, device=U.device)
    starts = [sum(partitions[:i]) for i in range(len(partitions))]
    by_size: dict[int, list[int]] = {}
    for start, size in zip(starts, partitions):
        by_size.setdefault(size, []).append(start)
    for size, block_starts in by_size.items():
        blocks = torch.cat([U[:, s : s + size] for s in block_starts], dim=0)
        result = orthogonalize(blocks).unflatten(0, (len(block_starts), U.size(0)))
        for i, s in enumerate(block_starts):
            out[:, s : s + size] = result[i]
    return out


def row_scales(
    partitions: tuple[int, ...] | None,
    rows: int,
    cols: int,
    local_row_start: int,
    local_rows: int,
    adjust_lr: str | None,
    update_rms: float,
) -> list[tuple[int, int, float]]:
    """The lr scale of each local row range: ``[(start, end, scale), ...]`` in local row indices.

    ``rows``/``cols`` are the global matrix dims; the local shard holds rows
    ``[local_row_start, local_row_start + local_rows)`` (all rows when not row-sharded).
    Each partition block is scaled by its own shape ``(block_rows, cols)``.
    """
    blocks = partitions or (rows,)
    ranges = []
    block_start = 0
    local_end = local_row_start + local_rows
    for size in blocks:
        start = max(block_start, local_row_start)
        end = min(block_start + size, local_end)
        if end > start:
            scale = lr_scale(size, cols, adjust_lr, update_rms)
            ranges.append((start - local_row_start, end - local_row_start, scale))
        block_start += size
    return ranges
