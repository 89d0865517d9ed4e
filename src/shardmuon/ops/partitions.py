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

from shardmuon.ops.update import lr_scale

__all__ = [
    "check_partitions",
    "dion_group_partitions",
    "orthogonalize_blocks",
    "row_scales",
]

OrthogonalizeFn = Callable[[Tensor], Tensor]


def check_partitions(
    name: str, partitions: Sequence[int], rows: int, label: str | None = None
) -> tuple[int, ...]:
    """Validate partitions for a parameter with ``rows`` rows on dim -2; return them as a tuple.

    Messages name ``label`` (default ``matrix_partitions[name]``).
    """
    label = label or f"matrix_partitions[{name}]"
    if isinstance(partitions, (str, bytes)) or not isinstance(partitions, Sequence):
        raise TypeError(
            f"{label} must be a sequence of row counts, got {type(partitions).__name__}"
        )
    sizes = tuple(partitions)
    if not sizes:
        raise ValueError(f"{label} is empty; give at least one row count")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{label} must hold positive ints, got {list(sizes)}")
    if sum(sizes) != rows:
        raise ValueError(
            f"{label} = {list(sizes)} sums to {sum(sizes)}, but the "
            f"parameter has {rows} rows on dim -2; the sizes must sum to {rows}"
        )
    return sizes


def dion_group_partitions(where: str, group: dict, param: Tensor) -> tuple[int, ...] | None:
    """microsoft/dion's group keys ``split_sizes`` / ``num_heads`` as partitions of ``param``.

    ``split_sizes=(r_1, ...)`` (at least two positive ints) cuts dim 0 of each 2-D parameter
    of the group into row blocks; ``num_heads=h > 1`` cuts it into ``h`` equal blocks (one per
    head). Each block is orthogonalized and its lr scaled on its own, which is exactly what
    ``matrix_partitions`` does, so dion's per-block update carries over. ``num_heads`` of 1 or
    ``None`` is a no-op (as in dion). Both keys, ``flatten=True`` or a parameter that is not
    2-D are refused, as dion refuses them.
    """
    split_sizes = group.get("split_sizes")
    num_heads = group.get("num_heads")
    if num_heads is not None and (
        isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1
    ):
        raise ValueError(f"{where}: num_heads must be a positive int or None, got {num_heads!r}")
    if num_heads == 1:
        num_heads = None
    if split_sizes is None and num_heads is None:
        return None
    key = "split_sizes" if split_sizes is not None else "num_heads"
    if split_sizes is not None and num_heads is not None:
        raise ValueError(
            f"{where}: split_sizes and num_heads > 1 are both set; use one (num_heads for equal "
            "heads, split_sizes for uneven row blocks)"
        )
    if group["flatten"]:
        raise ValueError(f"{where}: {key} needs flatten=False (it splits dim 0 of 2-D weights)")
    if param.ndim != 2:
        raise ValueError(
            f"{where}: {key} applies to 2-D parameters, got shape {tuple(param.shape)}; "
            "use matrix_partitions for stacks (it splits dim -2)"
        )
    rows = param.shape[0]
    if num_heads is not None:
        if rows % num_heads:
            raise ValueError(
                f"{where}: num_heads={num_heads} does not divide dim 0 of the parameter "
                f"(shape {tuple(param.shape)})"
            )
        return (rows // num_heads,) * num_heads
    if isinstance(split_sizes, (str, bytes)) or not isinstance(split_sizes, Sequence):
        raise ValueError(f"{where}: split_sizes must be a list of row counts, got {split_sizes!r}")
    if len(split_sizes) < 2:
        raise ValueError(
            f"{where}: split_sizes must hold at least 2 block sizes, got {list(split_sizes)}"
        )
    return check_partitions(where, split_sizes, rows, label=f"{where}: split_sizes")


def orthogonalize_blocks(
    U: Tensor, partitions: tuple[int, ...] | None, orthogonalize: OrthogonalizeFn
) -> Tensor:
    """Orthogonalize ``U[N, rows, cols]`` per row block; returns bf16 ``[N, rows, cols]``.

    ``orthogonalize`` maps a ``[B, m, n]`` stack to its bf16 result (Newton–Schulz).
    Without partitions this is one call on the whole stack.
    """
    if partitions is None or len(partitions) == 1:
        return orthogonalize(U)
    if len(set(partitions)) == 1 and U.is_contiguous():
        # Equal blocks (a fused gate_up) of a contiguous stack: viewed as a stack of the
        # blocks, [N * k, size, cols], with no copy in or out (each matrix is orthogonalized
        # alone; only its place in the batch changes).
        result = orthogonalize(U.view(-1, partitions[0], U.size(-1)))
        return result.reshape(U.shape)
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
    local_row_ranges: Sequence[tuple[int, int]],
    adjust_lr: str | None,
    update_rms: float,
) -> list[tuple[int, int, float]]:
    """The lr scale of each local row range: ``[(start, end, scale), ...]`` in local row indices.

    ``rows``/``cols`` are the global matrix dims; the local shard holds the global rows
    ``local_row_ranges`` (``(start, stop)`` pairs, in local order: one range when sharded
    once, several under a strided shard, ``[(0, rows)]`` when not row-sharded). Each
    partition block is scaled by its own shape ``(block_rows, cols)``; adjacent ranges of
    equal scale are one range (a fused gate_up's two halves: one update pass, same bits).
    """
    blocks = partitions or (rows,)
    ranges: list[tuple[int, int, float]] = []
    local_start = 0
    for first, last in local_row_ranges:
        block_start = 0
        for size in blocks:
            start = max(block_start, first)
            end = min(block_start + size, last)
            if end > start:
                scale = lr_scale(size, cols, adjust_lr, update_rms)
                offset = local_start - first
                if ranges and ranges[-1][1] == start + offset and ranges[-1][2] == scale:
                    ranges[-1] = (ranges[-1][0], end + offset, scale)
                else:
                    ranges.append((start + offset, end + offset, scale))
            block_start += size
        local_start += last - first
    return ranges
