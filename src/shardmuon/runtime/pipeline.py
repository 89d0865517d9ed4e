"""The step: chunks in the schedule's order, and the state stager driven from one place.

:func:`run_step` runs every batch of the plan in the order
:func:`shardmuon.planning.workspace.step_schedule` gives: several batches in flight
(all-to-alls overlap Newton–Schulz), bounded by ``max_in_flight`` and by the workspace
budget in bytes; Sinkhorn chunks first (in plan order: their all-reduces pair up on every
rank), AdamW chunks once the first gather is under way. :func:`step_one_chunk`
runs one chunk for ``Muon.step_chunk``. With offload, both load each chunk's state through
:class:`_Staging` (load ahead, acquire, use, store), the only code that drives the stager.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from torch import Tensor

from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.plan import AdamWChunk, SinkhornChunk
from shardmuon.planning.workspace import batch_bytes
from shardmuon.runtime.adamw_step import (
    AdamWProgress,
    adamw_peak_bytes,
    adamw_state_views,
    step_adamw,
)
from shardmuon.runtime.offload import StateStager
from shardmuon.runtime.phases import (
    BatchRun,
    StepContext,
    compute,
    decay_all_params,
    finish,
    momentum_views,
    new_run,
    prepare,
    step_batch,
    update_all_momenta,
)
from shardmuon.runtime.sinkhorn_step import (
    SinkhornProgress,
    sinkhorn_peak_bytes,
    sinkhorn_state_views,
    step_sinkhorn,
)

__all__ = ["chunk_progress", "run_step", "step_one_chunk"]


def run_step(
    ctx: StepContext,
    schedule: list[tuple[str, int]],
    stager: StateStager | None = None,
    done: Callable[[tuple[str, int]], None] | None = None,
) -> int:
    """Every batch and AdamW chunk of the plan, pipelined in the order of ``schedule``
    (:func:`shardmuon.planning.workspace.step_schedule` of the plan, for the budget
    ``ctx.workspace_bytes``); returns the estimated peak bytes.

    Sinkhorn chunks run first, in plan order (the same on every rank of their groups, so
    their all-reduces pair up; the forward reads embeddings first). AdamW runs once the
    first batch's gather is under way (it overlaps that traffic). With a ``stager``
    (offload), each chunk's state is loaded ``stager.prefetch`` chunks ahead of its use and
    stored right after it. ``done`` is called with ``("batch", i)``, ``("sinkhorn", k)`` or
    ``("adamw", k)`` once that chunk's parameters are updated (the overlapped step's waits, :mod:`shardmuon.runtime.overlap`).
    """
    plan = ctx.plan
    sizes = [batch_bytes(b, plan.ns_cost) for b in plan.batches]
    runs = {i: new_run(ctx, batch) for i, batch in enumerate(plan.batches)}
    if stager is None:
        update_all_momenta(ctx, list(runs.values()))
    decay_all_params(ctx, list(runs.values()))
    ops = [*(("sinkhorn", k) for k in range(len(plan.sinkhorn)))]
    ops += _with_adamw(schedule, len(plan.adamw))
    staging = None
    if stager is not None:
        uses = [op for op in ops if op[0] in ("prepare", "adamw", "sinkhorn")]
        staging = _Staging(stager, uses, lambda use: _state_views(ctx, runs, use))
    held = peak = 0
    try:
        for phase, i in ops:
            if phase == "sinkhorn":
                if i == 0:
                    peak = max(peak, sinkhorn_peak_bytes(plan.sinkhorn))
                staged = staging.take() if staging else None
                step_sinkhorn(ctx, plan.sinkhorn[i], staged=staged)
                if staging:
                    staging.release()
                if done is not None:
                    done(("sinkhorn", i))
                continue
            if phase == "adamw":
                if i == 0:
                    peak = max(peak, held + adamw_peak_bytes(ctx))
                staged = staging.take() if staging else None
                step_adamw(ctx, plan.adamw[i], staged=staged)
                if staging:
                    staging.release()
                if done is not None:
                    done(("adamw", i))
                continue
            if phase == "prepare":
                if staging:
                    runs[i].momenta = staging.take()
                prepare(ctx, runs[i])
                runs[i].momenta = None
                if staging:
                    staging.release()
                held += sizes[i].held
            elif phase == "compute":
                compute(ctx, runs[i])
            else:
                finish(ctx, runs.pop(i))
                held -= sizes[i].held
                if done is not None:
                    done(("batch", i))
            peak = max(peak, held + sizes[i].peak)
    finally:
        if stager is not None:
            stager.store_all()
    return peak


def _with_adamw(ops: list[tuple[str, int]], num_adamw: int) -> list[tuple[str, int]]:
    """``ops`` with ``("adamw", k)`` for every AdamW chunk before the first compute."""
    first = next((k for k, (phase, _) in enumerate(ops) if phase == "compute"), len(ops))
    return [*ops[:first], *(("adamw", k) for k in range(num_adamw)), *ops[first:]]


def _state_views(ctx: StepContext, runs: dict[int, BatchRun], use: tuple[str, int]):
    """The host state a use of the step reads: an AdamW chunk's or a batch's momenta."""
    phase, i = use
    if phase == "adamw":
        return adamw_state_views(ctx, ctx.plan.adamw[i])
    if phase == "sinkhorn":
        return sinkhorn_state_views(ctx, ctx.plan.sinkhorn[i])
    return momentum_views(ctx, runs[i])


class _Staging:
    """The state uses of a step (or of one chunk) in order, each loaded ``prefetch`` ahead:
    load -> acquire (the device copy) -> use -> store."""

    def __init__(
        self,
        stager: StateStager,
        uses: Sequence[Hashable],
        views: Callable[[Hashable], list[Tensor]],
    ) -> None:
        self.stager, self.uses, self.views = stager, list(uses), views
        self.position = self.issued = 0

    def take(self) -> list[Tensor]:
        """Load up to ``prefetch`` uses ahead; the device state of the current one."""
        while self.issued < min(len(self.uses), self.position + self.stager.prefetch):
            use = self.uses[self.issued]
            self.stager.load(use, self.views(use))
            self.issued += 1
        return self.stager.acquire(self.uses[self.position])

    def release(self) -> None:
        self.stager.store(self.uses[self.position])
        self.position += 1


Chunk = MuonBatch | SinkhornChunk | AdamWChunk
Progress = BatchRun | SinkhornProgress | AdamWProgress


def chunk_progress(ctx: StepContext, chunk: Chunk) -> Progress:
    """A chunk's progress through its step, from the start (see :func:`step_one_chunk`)."""
    if isinstance(chunk, AdamWChunk):
        return AdamWProgress()
    if isinstance(chunk, SinkhornChunk):
        return SinkhornProgress()
    return new_run(ctx, chunk)


def step_one_chunk(
    ctx: StepContext,
    chunk: Chunk,
    progress: Progress,
    stager: StateStager | None,
    key: Hashable,
) -> None:
    """Step one chunk (``Muon.step_chunk``) from where ``progress`` stands; ``progress``
    records how far it got, so that a chunk that raised can be resumed. The state is staged
    as in a step, under ``key``, and stored whatever happens."""
    staging = None
    if stager is not None and not getattr(progress, "prepared", False):
        if isinstance(chunk, AdamWChunk):
            views = adamw_state_views(ctx, chunk)
        elif isinstance(chunk, SinkhornChunk):
            views = sinkhorn_state_views(ctx, chunk)
        else:
            views = momentum_views(ctx, progress)
        staging = _Staging(stager, [key], lambda _: views)
    try:
        if isinstance(chunk, AdamWChunk):
            step_adamw(ctx, chunk, progress, staged=staging.take() if staging else None)
        elif isinstance(chunk, SinkhornChunk):
            step_sinkhorn(ctx, chunk, progress, staged=staging.take() if staging else None)
        else:
            if staging:
                progress.momenta = staging.take()
            step_batch(ctx, progress)
    finally:
        if isinstance(progress, BatchRun):
            progress.momenta = None
        if stager is not None:
            stager.store_all()
    if isinstance(chunk, MuonBatch):
        stats = ctx.stats
        bound = sum(vars(batch_bytes(chunk, ctx.plan.ns_cost)).values())
        stats.workspace_peak_bytes = max(stats.workspace_peak_bytes, bound)
