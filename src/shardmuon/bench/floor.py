"""The floor of one rank's optimizer step: what its arithmetic and its memory traffic cost
at the rates this device reaches, measured in the same run.

``floor = sum over the rank's Newton-Schulz calls of FLOPs / GEMM rate + bytes / bandwidth``

* **FLOPs** of a call: its matrices times the engine's own count per matrix
  (:meth:`shardmuon.ops.orthogonalizer.EngineCost.matrix_flops`; folded: ``4 m^2 n + 2 m^3``
  per iteration).
* **GEMM rate**: a bf16 ``X X^T`` of the call's shape ``[count, m, n]`` (``m <= n``),
  timed here; each distinct shape once. What the GEMM library reaches on these shapes, not
  the data sheet's peak.
* **Bytes**: the traffic no implementation of the step avoids, per element of a parameter
  with ``p``-byte values, ``g``-byte grads and ``s``-byte state: Muon ``2s + g + 6 + 2p``
  (the momentum read and written and the grad read; the bf16 direction written and read
  once for its norm; the bf16 result read; the parameter read and written), AdamW
  ``4s + g + 2p`` (two moments read and written), Sinkhorn ``2s + g + 2p``. The
  Newton-Schulz iterations' own reads and writes are in the GEMM rate.
* **Bandwidth**: a device-to-device copy of ``copy_bytes`` (read and written), timed here.

``shardmuon bench step`` prints the step beside it (docs/benchmarks.md, "The step's
floor"); a step at 1.0x its floor does nothing but its GEMMs and one pass over its state.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from shardmuon.bench.report import repeat_times
from shardmuon.ops.orthogonalizer import EngineCost

__all__ = [
    "gemm_rate",
    "measure_floor",
    "memory_bandwidth",
    "optimizer_params",
    "step_bytes",
]

# Per element: state tensors read and written, and bytes beyond them, the grad (g) and the
# parameter read and written (2p): the bf16 direction and result.
_STATE_TENSORS = {"muon": 1, "adamw": 2, "sinkhorn": 1}
_EXTRA_BYTES = {"muon": 6, "adamw": 0, "sinkhorn": 0}


@dataclass(frozen=True)
class StepFloor:
    """One rank's floor and what it is made of (seconds, FLOPs, bytes, rates)."""

    ns_flops: float
    ns_seconds: float  # the calls' FLOPs at their shapes' measured GEMM rates
    gemm_tflops_min: float  # the slowest and fastest rate among the calls' shapes
    gemm_tflops_max: float
    state_bytes: float
    bandwidth_gbs: float
    memory_seconds: float

    @property
    def seconds(self) -> float:
        return self.ns_seconds + self.memory_seconds

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "seconds": self.seconds}


def step_bytes(params: Iterable[tuple[str, int, int, int, int]]) -> int:
    """The step's unavoidable memory traffic for ``(algorithm, elements, p, g, s)`` entries
    (a parameter's local elements, its value's, its grad's and its state's bytes per
    element)."""
    total = 0
    for algorithm, elements, p, g, s in params:
        kind = algorithm if algorithm in _STATE_TENSORS else "muon"
        per_element = 2 * s * _STATE_TENSORS[kind] + _EXTRA_BYTES[kind] + g + 2 * p
        total += elements * per_element
    return total


def gemm_rate(shape: Sequence[int], device: torch.device, repeats: int = 5) -> float:
    """FLOP/s of a bf16 ``X X^T`` on ``[count, m, n]`` (``m <= n``) on ``device``: the
    median of ``repeats`` timed calls after a warm-up."""
    count, m, n = shape
    X = torch.randn(count, m, n, device=device).to(torch.bfloat16)
    out = torch.empty(count, m, m, device=device, dtype=torch.bfloat16)
    seconds = statistics.median(repeat_times(lambda: torch.bmm(X, X.mT, out=out), device, repeats))
    return 2.0 * count * m * m * n / seconds


def memory_bandwidth(device: torch.device, copy_bytes: int, repeats: int = 5) -> float:
    """Bytes/s of a device copy of ``copy_bytes`` (each byte read and written)."""
    src = torch.empty(copy_bytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = statistics.median(repeat_times(lambda: dst.copy_(src), device, repeats))
    return 2.0 * src.numel() * 4 / seconds


def measure_floor(
    calls: Sequence[Sequence[int]],
    cost: EngineCost,
    params: Iterable[tuple[str, int, int, int, int]],
    device: torch.device,
    copy_bytes: int | None = None,
    repeats: int = 5,
) -> StepFloor:
    """The floor of a step that made the Newton-Schulz ``calls`` (``(count, rows, cols)``,
    ``last_step_stats.ns_calls``) with the engine ``cost`` and updated ``params``
    (:func:`step_bytes`'s entries), on ``device``. ``copy_bytes``: the bandwidth probe's
    size (default: 256 MiB on an accelerator, 64 MiB on a CPU)."""
    if copy_bytes is None:
        copy_bytes = (64 if device.type == "cpu" else 256) * 2**20
    rates: dict[tuple[int, int, int], float] = {}
    flops = seconds = 0.0
    for count, rows, cols in calls:
        m, n = sorted((rows, cols))
        shape = (count, m, n)
        if shape not in rates:
            rates[shape] = gemm_rate(shape, device, repeats)
        call_flops = count * cost.matrix_flops(rows, cols)
        flops += call_flops
        seconds += call_flops / rates[shape]
    traffic = step_bytes(params)
    bandwidth = memory_bandwidth(device, copy_bytes, repeats)
    return StepFloor(
        ns_flops=flops,
        ns_seconds=seconds,
        gemm_tflops_min=min(rates.values(), default=0.0) / 1e12,
        gemm_tflops_max=max(rates.values(), default=0.0) / 1e12,
        state_bytes=float(traffic),
        bandwidth_gbs=bandwidth / 1e9,
        memory_seconds=traffic / bandwidth,
    )


def optimizer_params(opt: Any) -> list[tuple[str, int, int, int, int]]:
    """:func:`step_bytes`'s entries for every parameter with a grad that a
    ``shardmuon.Muon`` steps (this rank's local shard of each)."""
    from shardmuon.planning.placements import local_tensor

    entries = []
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            local = local_tensor(p)
            grad = local_tensor(p.grad)
            state = opt.state.get(p, {}).get("momentum")
            size = local_tensor(state).element_size() if state is not None else 4
            entries.append(
                (group.get("algorithm", "muon"), local.numel(), local.element_size(),
                 grad.element_size(), size)
            )  # fmt: skip
    return entries
