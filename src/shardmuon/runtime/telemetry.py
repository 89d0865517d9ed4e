"""What a step did on this rank: all-to-all bytes, batches, matrices (for benchmarks and logs)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

import torch

__all__ = ["BF16_BYTES", "StepStats"]

BF16_BYTES = 2


def _bytes(n: int) -> str:
    """``n`` bytes in binary units: ``512 B``, ``2.00 KiB``, ``3.00 MiB``, ``1.50 GiB``."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if n >= 100 else f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def _shape_counts(shapes: list[tuple[int, ...]], most: int = 4) -> str:
    """``"1000 x (1024, 4096), 24 x (512, 512)"``: each shape once with its count, the most
    common first, at most ``most`` of them."""
    counts = Counter(tuple(s) for s in shapes).most_common()
    text = ", ".join(f"{n} x {shape}" for shape, n in counts[:most])
    rest = len(counts) - most
    return text + (f", {rest} more shape{'s' if rest > 1 else ''}" if rest > 0 else "")


def _reduce(values: list, on_device, on_host, empty):
    """``values`` (0-d device tensors, or plain numbers) reduced to one number: the tensors
    stacked and reduced on the device (``on_device``: ``torch.sum``, ``torch.max``) and read
    with one synchronisation, then combined with the numbers (``on_host``)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    plain = [v for v in values if not isinstance(v, torch.Tensor)]
    if tensors:
        plain.append(on_device(torch.stack([t.reshape(()) for t in tensors])).item())
    return on_host(plain) if plain else empty


@dataclass(repr=False)
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
    step's transient buffers on this rank (``planning/workspace.py``), what ``workspace_bytes`` caps;
    ``offload_*`` (``offload="state"``): optimizer state copied host -> device and back,
    and the most state bytes on the device at once; ``nonfinite_matrices``: matrices whose
    update was skipped because their direction held inf or NaN; ``ns_checked``,
    ``ns_fallbacks``, ``ns_worst_ratio`` (with the divergence guard on): matrices whose result
    was checked, those recomputed by the safe iteration, and the largest estimated top
    singular value over the preset's band (1.0: at the band's top). The last two are read
    from the guard's device tensors (``ns_fallback_counts``, ``ns_worst_ratios``) when asked
    for, like ``nonfinite_matrices``.
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
    ns_checked: int = 0
    # overlap="forward": seconds the caller waited for this step (the next forward's hooks,
    # synchronize and everything else that waits).
    overlap_wait_seconds: float = 0.0
    # Per Newton–Schulz call, the device mask of its matrices with a non-finite entry (per
    # Sinkhorn table, a 0-d flag): kept on the device, not even summed (no launch, no
    # synchronisation in the step) until ``nonfinite_matrices`` is read.
    nonfinite_counts: list = field(default_factory=list, repr=False)
    # Per guarded Newton–Schulz call, the verdict's device count of recomputed matrices
    # (int64, 0-d) and its worst ratio (fp32, 0-d): kept on the device like the counts
    # above until ``ns_fallbacks`` / ``ns_worst_ratio`` is read.
    ns_fallback_counts: list = field(default_factory=list, repr=False)
    ns_worst_ratios: list = field(default_factory=list, repr=False)

    @property
    def nonfinite_matrices(self) -> int:
        """Matrices this rank orthogonalized, and Sinkhorn tables it holds a shard of, whose
        direction held inf or NaN (a gradient or momentum gone non-finite): their update was
        skipped (a zero direction; decoupled weight decay still applied to Muon matrices).
        Reading it synchronises with the device once (the masks summed there first, not
        read one by one)."""
        masks = [c for c in self.nonfinite_counts if isinstance(c, torch.Tensor)]
        rest = sum(int(c) for c in self.nonfinite_counts if not isinstance(c, torch.Tensor))
        if masks:
            rest += int(torch.cat([m.reshape(-1) for m in masks]).sum().item())
        return rest

    @property
    def ns_fallbacks(self) -> int:
        """Matrices the divergence guard recomputed in this step. Reading it synchronises
        with the device once (the per-call counts summed there first)."""
        return int(_reduce(self.ns_fallback_counts, torch.sum, sum, 0))

    @property
    def ns_worst_ratio(self) -> float:
        """The largest top singular value over the band that the guard saw in this step
        (0.0 with no guarded call). Reading it synchronises with the device once."""
        return float(_reduce(self.ns_worst_ratios, torch.max, max, 0.0))

    def __str__(self) -> str:
        """A few lines with units: what ``print(opt.last_step_stats)`` shows.

        The shape lists are summarized (each shape once, with its count); the replica and
        offload lines appear only when the step had such traffic. Reads
        :attr:`nonfinite_matrices` (one synchronisation with the device), and with the
        divergence guard on :attr:`ns_fallbacks` and :attr:`ns_worst_ratio` (one each).
        """
        calls = len(self.ns_calls)
        lines = [
            "StepStats of this rank's last step:",
            f"  all-to-all: sent {_bytes(self.bytes_sent)}, received "
            f"{_bytes(self.bytes_received)} (least the layout needs: "
            f"{_bytes(self.bytes_minimum)})",
            f"  orthogonalized: {self.matrices_orthogonalized} matrices in "
            f"{self.num_batches} batches, {calls} Newton-Schulz call{'' if calls == 1 else 's'}",
        ]
        if self.owned_shapes:
            lines.append(f"  owned shapes: {_shape_counts(self.owned_shapes)}")
        if self.ns_calls:
            lines.append(f"  call shapes (batch, rows, cols): {_shape_counts(self.ns_calls)}")
        lines.append(f"  workspace peak (estimated): {_bytes(self.workspace_peak_bytes)}")
        if self.replica_bytes_sent or self.replica_bytes_received:
            lines.append(
                f"  replicas: sent {_bytes(self.replica_bytes_sent)}, received "
                f"{_bytes(self.replica_bytes_received)}"
            )
        if self.offload_bytes_loaded or self.offload_bytes_stored:
            lines.append(
                f"  offload: loaded {_bytes(self.offload_bytes_loaded)}, stored "
                f"{_bytes(self.offload_bytes_stored)}, state on device at most "
                f"{_bytes(self.offload_workspace_peak_bytes)}"
            )
        if self.ns_checked:
            lines.append(
                f"  divergence guard: {self.ns_checked} checked, {self.ns_fallbacks} "
                f"recomputed, worst {self.ns_worst_ratio:.3f} x the band"
            )
        lines.append(f"  non-finite matrices skipped: {self.nonfinite_matrices}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        """One line: every counter by name, the lists by length (they can be thousands long).
        The counts held on the device are left out (reading them synchronises; ``str``
        does)."""
        parts = []
        for f in fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if isinstance(value, list):
                what = "shapes" if f.name == "owned_shapes" else "calls"
                parts.append(f"{f.name}=<{len(value)} {what}>")
            else:
                parts.append(f"{f.name}={value!r}")
        return f"StepStats({', '.join(parts)})"

    def add_traffic(self, send_splits: list[int], recv_splits: list[int], me: int) -> None:
        """Count one all-to-all given its split sizes (elements) and this rank's index."""
        self.bytes_sent += BF16_BYTES * (sum(send_splits) - send_splits[me])
        self.bytes_received += BF16_BYTES * (sum(recv_splits) - recv_splits[me])
