"""All-to-all volume of dion's padded scheme for the same batches (the benchmark's yardstick).

dion (microsoft/dion ``megabatch_orthogonalize_async``; samsja/dion's later versions) pads
the ``N`` same-shape matrices of a group to a multiple of the shard-group size ``k`` with
zero "dummy" matrices and pads every shard to ``ceil(extent / k)`` rows, then runs the same
pair of all-to-alls: each rank sends ``ceil(N / k)`` padded pieces to each of the ``k - 1``
other ranks, and as much comes back. shardmuon sends exact pieces of real matrices only;
this module gives the padded figure for the same layout so the benchmark can show both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from shardmuon.planning.batches import MuonBatch
from shardmuon.runtime.telemetry import BF16_BYTES

__all__ = ["padded_scheme_bytes"]


def padded_scheme_bytes(chunks: Iterable[object]) -> int:
    """Bytes one rank would send per step under the padded scheme (both all-to-alls)."""
    counts: dict[tuple, int] = {}
    layouts = {}
    for chunk in chunks:
        if not isinstance(chunk, MuonBatch) or not chunk.layout.exchanged:
            continue
        layout = chunk.layout
        key = (layout.group.ranks, layout.pieces, layout.rows, layout.cols)
        counts[key] = counts.get(key, 0) + chunk.num_matrices
        layouts[key] = layout
    total = 0
    for key, count in counts.items():
        layout = layouts[key]
        k = layout.group.size
        # Every piece padded to the largest (the first, under torch.chunk's sizes).
        padded_piece = max(piece.numel for piece in layout.pieces)
        total += 2 * (k - 1) * math.ceil(count / k) * padded_piece * BF16_BYTES
    return total
