"""``newton_schulz_impl="auto"``: which engine each shape class runs, measured once on the
device and the same on every rank.

Candidates are the engines of equal certified error (``ops.engines.AUTO_CANDIDATES``: the
folded iteration and the guarded Gram iteration, whose accepted restart schedules stay
within 1.05x the folded error, ``tests/ops/test_engine_promises.py``). A shape class is a
Newton–Schulz call's matrix shape ``(short, long)``; it is timed at the largest count of
matrices a call of this plan stacks for it.

Every rank's classes are gathered over the world, rank 0 times them all, and its choices
are broadcast: ranks that compute the same matrix (HSDP replicas without
``split_replicas``) then run the same engine and get the same bits, whatever each rank's
own timing noise. Choices are cached per process (device, dtype, preconditioner,
coefficients, restarts), so a rebuilt plan only times classes it has not seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from shardmuon.ops.engines import AUTO_CANDIDATES
from shardmuon.ops.orthogonalizer import NewtonSchulzSettings, Orthogonalizer
from shardmuon.planning.batches import MuonBatch

__all__ = ["ShapeClass", "calibrate", "calibrate_plan", "plan_shape_classes", "time_engines"]

ShapeClass = tuple[int, int]
TIMED_REPEATS = 3
# Cache: settings key -> {shape class: engine name}.
_CHOICES: dict[tuple, dict[ShapeClass, str]] = {}


def plan_shape_classes(batches: Iterable[MuonBatch]) -> dict[ShapeClass, int]:
    """The ``(short, long)`` of every call this rank's batches make, with the largest
    number of matrices one call stacks (an owner's matrix alone; a local stack whole)."""
    classes: dict[ShapeClass, int] = {}
    for batch in batches:
        layout = batch.layout
        count = 1 if layout.exchanged else batch.num_matrices
        rows = layout.rows if layout.exchanged else layout.local_rows
        cols = layout.cols if layout.exchanged else layout.local_cols
        blocks = batch.partitions or (rows,)
        for size in set(blocks):
            same = blocks.count(size)
            key = (min(size, cols), max(size, cols))
            if min(key) > 0:
                classes[key] = max(classes.get(key, 0), count * same)
    return classes


def time_engines(
    make: Callable[[str], Orthogonalizer],
    shape: tuple[int, int, int],
    device: torch.device,
    coefficients,
    eps: float,
    repeats: int = TIMED_REPEATS,
) -> dict[str, float]:
    """Median seconds of one call on a random bf16 ``shape`` per candidate engine."""
    gen = torch.Generator(device=device).manual_seed(0)
    X = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
    seconds = {}
    for name in AUTO_CANDIDATES:
        engine = make(name)
        engine(X.clone(), coefficients, eps)  # warm-up (kernels, caches)
        samples = []
        for _ in range(repeats):
            G = X.clone()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            engine(G, coefficients, eps)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        engine.take_report()
        seconds[name] = sorted(samples)[len(samples) // 2]
    return seconds


def calibrate(
    classes: dict[ShapeClass, int],
    key: tuple,
    make: Callable[[str], Orthogonalizer],
    device: torch.device,
    coefficients,
    eps: float,
    timer: Callable[..., dict[str, float]] | None = None,
) -> dict[ShapeClass, str]:
    """The engine for each of ``classes`` (and every other rank's), the same on all ranks.

    Collective over the world when a process group is initialised (an all-gather of the
    classes and a broadcast of rank 0's choices); every rank must call it together.
    """
    timer = timer or time_engines
    cache = _CHOICES.setdefault(key, {})
    everywhere = dict(classes)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, classes)
        for other in gathered:
            for shape, count in other.items():
                everywhere[shape] = max(everywhere.get(shape, 0), count)
    table: dict[ShapeClass, str] = {}
    if not distributed or dist.get_rank() == 0:
        for m, n in sorted(everywhere):
            if (m, n) in cache:
                table[(m, n)] = cache[(m, n)]
            elif m == n:
                table[(m, n)] = "folded"  # square: Gram runs the folded iteration itself
            else:
                seconds = timer(make, (everywhere[(m, n)], m, n), device, coefficients, eps)
                table[(m, n)] = min(seconds, key=lambda name: (seconds[name], name))
    if distributed:
        box = [table]
        dist.broadcast_object_list(box, src=0)
        table = box[0]
    cache.update(table)  # rank 0's word, also for classes this rank had cached otherwise
    return table


def calibrate_plan(
    batches: Iterable[MuonBatch], ns: NewtonSchulzSettings, device: torch.device, eps: float
) -> dict[ShapeClass, str]:
    """:func:`calibrate` for an optimizer: its plan's shape classes, candidates built from
    its Newton–Schulz settings, cached under their calibration key. Collective, as
    :func:`calibrate` is."""
    return calibrate(
        plan_shape_classes(batches),
        ns.calibration_key(device),
        lambda name: ns.orthogonalizer(impl=name),
        device,
        ns.coefficients,
        float(eps),
    )
