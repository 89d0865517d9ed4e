"""The paired all-to-all of one batch: shards to their owners, results back.

Phase 1 (gather): every rank of the shard group sends its piece of matrix ``i`` to the
owner of matrix ``i``, all in one ``all_to_all_single`` whose split sizes are the exact
piece sizes (bf16). A rank that owns no matrix of the batch receives nothing; a piece of
an empty shard has size 0. Nothing is padded and no dummy matrix exists.

Phase 2 (the owner): puts each piece's blocks in their place in the whole matrix (each
piece is a set of global row and column ranges, :class:`~shardmuon.planning.pieces.Piece`) and
orthogonalizes it (done by the caller, between the phases).

Phase 3 (return): the owner cuts the result into the same pieces and a second
``all_to_all_single`` with the transposed split sizes sends each rank its piece back.

Each rank owns at most one matrix of a batch (a batch has at most ``k`` matrices) and the
owners of a batch ascend, so a rank's send buffer is just its pieces in the matrices'
order, written there directly by the step (no packing copy); with the rows sharded the
owner's receive buffer is the whole matrix and its result is the return's send buffer.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from shardmuon.planning.groups import ShardGroup
from shardmuon.planning.placements import MatrixLayout
from shardmuon.runtime.telemetry import BF16_BYTES, StepStats

__all__ = ["BatchExchange", "backend_serving", "check_backends"]


@dataclass
class BatchExchange:
    """One batch's gather/return pair on this rank.

    ``owners[i]``: the owner (rank index in the group) of the ``i``-th matrix; ``pieces``
    passed to :meth:`start_gather` are this rank's bf16 pieces of those matrices, in order.
    """

    layout: MatrixLayout
    owners: tuple[int, ...]
    stats: StepStats
    # The group the all-to-alls run on (the overlapped step's own); None: the layout's.
    process_group: dist.ProcessGroup | None = None
    _work: dist.Work | None = field(default=None, repr=False)
    _recv: Tensor | None = field(default=None, repr=False)
    _device: torch.device | None = field(default=None, repr=False)

    @property
    def group(self) -> ShardGroup:
        return self.layout.group

    @property
    def owned(self) -> int | None:
        """Which matrix of the batch this rank owns, or ``None``."""
        me = self.group.rank_index
        return self.owners.index(me) if me in self.owners else None

    def minimum_bytes(self) -> int:
        """What this rank must send: its pieces to other owners, and as owner the others' pieces."""
        me = self.group.rank_index
        total = 0
        for owner in self.owners:
            if owner == me:
                total += sum(self.layout.piece_numel(j) for j in range(self.group.size) if j != me)
            else:
                total += self.layout.piece_numel(me)
        return BF16_BYTES * total

    def _piece_splits(self) -> list[int]:
        """Per rank index: the size of its piece of the matrix this rank owns (or zeros)."""
        if self.owned is None:
            return [0] * self.group.size
        return [self.layout.piece_numel(j) for j in range(self.group.size)]

    def _own_piece_splits(self) -> list[int]:
        """Per destination rank index: the size of this rank's piece it owns (or 0)."""
        mine = self.layout.piece_numel(self.group.rank_index)
        splits = [0] * self.group.size
        for owner in self.owners:
            splits[owner] = mine
        return splits

    def start_gather(self, send: Tensor) -> None:
        """Send this rank's bf16 pieces (``send``: ``[n, local_rows, local_cols]``, one per
        matrix, in the matrices' order) to their owners (async).

        Owners ascend within a batch, so the matrices' order is the destination order
        ``all_to_all_single`` needs: the buffer is sent as it is, without packing.
        """
        if list(self.owners) != sorted(self.owners):
            raise ValueError(f"owners within a batch must ascend, got {self.owners}")
        self._device = send.device
        self._launch(send.reshape(-1), self._own_piece_splits(), self._piece_splits())

    def _launch(self, send: Tensor, send_splits: list[int], recv_splits: list[int]) -> None:
        self._recv = send.new_empty(sum(recv_splits))
        self._work = dist.all_to_all_single(
            self._recv,
            send,
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self.group.process_group if self.process_group is None else self.process_group,
            async_op=True,
        )
        self.stats.add_traffic(send_splits, recv_splits, self.group.rank_index)

    def assemble(self) -> Tensor | None:
        """Wait for the gather; return the owned whole matrix ``[rows, cols]`` (bf16) or None.

        With whole rows sharded in rank order the pieces arrive as the matrix itself: the
        receive buffer is returned as a view. Otherwise each piece's blocks are copied to
        their place in a new matrix (column shards, two-dimensional and strided pieces).
        """
        self._work.wait()
        self._work = None
        if self.owned is None:
            self._recv = None
            return None
        layout = self.layout
        recv, self._recv = self._recv, None
        if layout.rows_in_rank_order:
            return recv.view(layout.rows, layout.cols)
        matrix = recv.new_empty(layout.rows, layout.cols)
        for where, block in _piece_blocks(layout, recv, self._piece_splits()):
            matrix[where] = block
        return matrix

    def start_return(self, result: Tensor | None) -> None:
        """Send each rank its piece of the owned result (async); ``result`` None if not owner."""
        layout = self.layout
        if result is None:
            send = torch.empty(0, dtype=torch.bfloat16, device=self._device)
        elif layout.rows_in_rank_order:
            send = result.reshape(-1)  # row pieces in rank order: the matrix itself
        else:
            send = result.new_empty(layout.rows * layout.cols)
            for where, block in _piece_blocks(layout, send, self._piece_splits()):
                block.copy_(result[where])
        self._launch(send, self._piece_splits(), self._own_piece_splits())

    def finish_return(self) -> Tensor:
        """Wait for the return; this rank's result pieces ``[n * piece]`` (bf16), in the
        matrices' order."""
        self._work.wait()
        self._work = None
        recv, self._recv = self._recv, None
        return recv


def _piece_blocks(
    layout: MatrixLayout, buffer: Tensor, splits: list[int]
) -> Iterator[tuple[tuple[slice, slice], Tensor]]:
    """Every block of every piece: where it lies in the whole matrix, and its view in
    ``buffer`` (the pieces end to end in rank order, ``splits`` elements each)."""
    for piece, flat in zip(layout.pieces, buffer.split(splits)):
        local = flat.view(piece.shape)
        for (r0, r1), (c0, c1), (lr0, lr1), (lc0, lc1) in piece.blocks():
            yield (slice(r0, r1), slice(c0, c1)), local[lr0:lr1, lc0:lc1]


# What each backend runs collectives on ("gloo" stages CUDA tensors through the host).
_BACKEND_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu",)}


def _backend_for(group: dist.ProcessGroup, device_type: str) -> tuple[str, str | None]:
    """``(backend string, the backend serving device_type or None)``; unknown backends are
    trusted (returned as serving it)."""
    name = str(dist.get_backend(group))
    if ":" in name:  # "cpu:gloo,cuda:nccl"
        pairs = dict(part.split(":", 1) for part in name.split(","))
        return name, pairs.get(device_type)
    devices = _BACKEND_DEVICES.get(name)
    return name, name if devices is None or device_type in devices else None


def backend_serving(group: dist.ProcessGroup, device_type: str) -> str | None:
    """The backend that runs ``group``'s collectives on ``device_type`` tensors ("nccl",
    "gloo", ...), or ``None`` if none does."""
    return _backend_for(group, device_type)[1]


def check_backends(groups: list[ShardGroup], device: torch.device) -> None:
    """Refuse, before any collective, a group whose backend has no collectives for the
    parameters' device (CPU shards, e.g. FSDP2's CPU offload, on an NCCL-only job: the
    step's all-to-all would raise inside it); warn once where CUDA shards go through gloo
    (host copies and blocking waits: correct, not overlapped). The same verdict on every
    rank of a group (its backend and, when the ranks agree, the device are shared)."""
    if not dist.is_initialized():
        return
    for group in groups:
        name, serving = _backend_for(group.process_group, device.type)
        if serving is None:
            raise ValueError(
                f"Muon's parameters are on {device.type} and exchanged over process group "
                f"{list(group.ranks)}, whose backend {name!r} has no {device.type} "
                "collectives; initialise the process group with one for each device "
                "(init_process_group(backend='cpu:gloo,cuda:nccl')) or keep the parameters "
                f"on the backend's device"
            )
        if device.type == "cuda" and serving == "gloo":
            warnings.warn(
                f"Muon's CUDA parameters are exchanged over process group "
                f"{list(group.ranks)} with gloo: each all-to-all copies through host memory "
                "and blocks (correct, not overlapped); use NCCL for CUDA tensors",
                UserWarning,
                stacklevel=3,
            )
            return
