"""Memory of one optimizer step on CPU, where there is no allocator peak counter.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free of the
CPU allocator (size and time). Summed in time order from the start of the step, they give
the live bytes the step added at each moment; the maximum is the step's transient peak.
The peak of the step is that plus the bytes alive when it started (params, grads and
optimizer state, counted once per storage).

Limits: allocations made on threads the profiler does not follow (a communication
library's own buffers) are not seen; tensors created by the step are. The profiled step
runs slower, so it is a separate step from the timed ones.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from shardmuon.planning.placements import local_tensor

__all__ = ["StepMemory", "gemm_scratch_bytes", "live_bytes", "measure_cpu_step", "peak_of_events"]


@dataclass(frozen=True)
class StepMemory:
    """Peak live bytes during a step, and the part of it the step itself allocated."""

    peak_bytes: int
    transient_bytes: int


def live_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = local_tensor(t).untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def peak_of_events(events: Iterable[tuple[int, int]]) -> int:
    """Max over time of the running sum of ``(time, +/-bytes)`` events, at least 0."""
    running = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
        running += nbytes
        peak = max(peak, running)
    return peak


@contextlib.contextmanager
def _stderr_silenced():
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def measure_cpu_step(step: Callable[[], object], baseline_bytes: int) -> StepMemory:
    """Run ``step()`` once under the profiler; return its peak and transient bytes."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_silenced():  # kineto prints a line on start and stop, on fd 2
        prof.start()
    try:
        step()
    finally:
        with _stderr_silenced():
            prof.stop()
    # The raw event list keeps every allocation with its own size and timestamp; the
    # aggregated FunctionEvents fold allocations made inside an op into that op.
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    transient = peak_of_events(events)
    return StepMemory(peak_bytes=baseline_bytes + transient, transient_bytes=transient)


def gemm_scratch_bytes(
    shapes: Iterable[tuple[int, int, int]], dtypes: Iterable[torch.dtype] = (torch.bfloat16,)
) -> int:
    """The most bytes the GEMM library allocates, and frees, inside one GEMM of
    Newton–Schulz on ``[batch, rows, cols]`` inputs in any of ``dtypes`` (an engine's GEMM
    dtypes: its iteration dtype, Gram's chain dtype, fp32 for the guard), measured on this
    machine.

    ``workspace_bytes`` bounds the buffers shardmuon allocates; a GEMM library may allocate
    scratch of its own inside each call (oneDNN packs its operands on AVX-512 CPUs: a few
    hundred KB, depending on the shapes and the thread count; none on the AVX2 CPU of
    ``docs/benchmarks.md``). One GEMM runs at a time per rank, so a step's transient is at
    most its estimate plus the largest of these. Measured with the CPU profiler on the
    iteration's three GEMMs (``out=`` given: the output is not counted).
    """
    worst = 0
    for (batch, rows, cols), dtype in itertools.product(set(shapes), set(dtypes)):
        small, large = sorted((rows, cols))
        X = torch.randn(batch, small, large).to(dtype)
        A = torch.empty(batch, small, small, dtype=dtype)
        B = torch.empty_like(A)
        spare = torch.empty_like(X)
        calls = _iteration_gemms(X, A, B, spare)
        for call in calls:
            worst = max(worst, measure_cpu_step(call, 0).transient_bytes)
    return worst


def _iteration_gemms(X, A, B, spare) -> list[Callable[[], object]]:
    """The three GEMMs of one Newton–Schulz iteration, as the iteration calls them."""
    if X.size(0) == 1:
        X, A, B, spare = X[0], A[0], B[0], spare[0]
        matmul, matmul_add = torch.mm, torch.addmm
    else:
        matmul, matmul_add = torch.bmm, torch.baddbmm
    return [
        functools.partial(matmul, X, X.mT, out=A),
        functools.partial(matmul_add, A, A, A, beta=-1.0, alpha=0.5, out=B),
        functools.partial(matmul_add, X, B, X, beta=2.0, alpha=1.0, out=spare),
    ]
