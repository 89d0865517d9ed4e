"""What a step did on this rank: all-to-all bytes, batches, matrices (for benchmarks and logs)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BF16_BYTES", "StepStats"]

BF16_BYTES = 2


@dataclass
class StepStats:
    """Counters of the last step on this rank.

    ``bytes_sent``/``bytes_received``: all-to-all payload to/from other ranks (a rank's piece
    of its own matrix never leaves it); ``bytes_minimum``: what "each non-owner piece to its
    owner and back once, in bf16" requires of this rank; ``owned_shapes``: the
    ``(rows, cols)`` of every matrix this rank orthogonalized; ``replica_bytes_*``: results
    broadcast to / received from other replicas (``split_replicas=True`` only);
    ``ns_calls``: the input shape ``(batch, rows, cols)`` of every Newton–Schulz call this
    rank made, in order (partition blocks and one-matrix calls as they ran), so a benchmark
    can time exactly the same calls; ``workspace_peak_bytes``: the estimated peak of the
    step's transient buffers on this rank (``workspace.py``), what ``workspace_bytes`` caps;
    ``offload_*`` (``offload="state"``): optimizer state copied host -> device and back,
    and the most state bytes on the device at once; ``nonfinite_matrices``: matrices whose
    update was skipped because their direction held inf or NaN.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_minimum: int = 0
    num_batches: int = 0
    matrices_orthogonalized: int = 0
    owned_shapes: list[tuple[int, int]] = field(default_factory=list)
    replica_bytes_sent: int = 0
    replica_bytes_received: int = 0
    ns_calls: list[tuple[int, int, int]] = field(default_factory=list)
    workspace_peak_bytes: int = 0
    offload_bytes_loaded: int = 0
    offload_bytes_stored: int = 0
    offload_workspace_peak_bytes: int = 0
    # Per Newton–Schulz call, a device count of its matrices with a non-finite entry: kept
    # on the device (no synchronisation in the step) until ``nonfinite_matrices`` is read.
    nonfinite_counts: list = field(default_factory=list, repr=False)

    @property
    def nonfinite_matrices(self) -> int:
        """Matrices this rank orthogonalized whose direction held inf or NaN (a gradient or
        momentum gone non-finite): their update was skipped (a zero direction; decoupled
        weight decay still applied). Reading it synchronises with the device once."""
        return int(sum(int(count) for count in self.nonfinite_counts))

    def add_traffic(self, send_splits: list[int], recv_splits: list[int], me: int) -> None:
        """Count one all-to-all given its split sizes (elements) and this rank's index."""
        self.bytes_sent += BF16_BYTES * (sum(send_splits) - send_splits[me])
        self.bytes_received += BF16_BYTES * (sum(recv_splits) - recv_splits[me])
