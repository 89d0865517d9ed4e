"""One batch's phases: what a step runs for Muon, piece by piece (AdamW: ``adamw_step.py``).

1. *prepare* — momentum ``M = mu*M + G`` on the local shard; the direction (Nesterov's
   ``mu*M + G`` or ``M``) is written, rounded to bf16, straight into the batch's buffer:
   the all-to-all send buffer of an exchanged batch (pieces in owner order, which is the
   matrices' order: owners within a batch ascend), or the stack of a local batch. The
   gather starts.
2. *compute* — the owner reads its whole matrix from the receive buffer (no copy when the
   rows are sharded), runs Newton–Schulz (per partition block) and sends each rank its
   piece of the result; local batches run Newton–Schulz on their stack.
3. *finish* — with ``split_replicas``, the computing replica broadcasts each rank's result
   shard over the replicate dim; every rank applies decoupled weight decay and
   ``X -= lr*scale*O`` to its own shard, reading the results where they were received.

Each phase is element-wise or per matrix, so a batch stepped alone (``step_chunk``) or in
the pipeline (:mod:`shardmuon.runtime.pipeline`) gives the same bits, and every phase is
resumable (a failed chunk retried does not update anything twice).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from shardmuon.ops.fused_momentum import momentum_direction_into
from shardmuon.ops.fused_update import fused_update_available
from shardmuon.ops.orthogonalizer import Orthogonalizer
from shardmuon.ops.partitions import orthogonalize_blocks
from shardmuon.ops.update import direction, momentum_update_, weight_update_, weight_updates_
from shardmuon.planning.batches import MuonBatch, Segment
from shardmuon.planning.groups import ShardGroup
from shardmuon.planning.placements import local_tensor
from shardmuon.planning.plan import Plan, setting_float
from shardmuon.runtime.exchange import BatchExchange
from shardmuon.runtime.telemetry import StepStats

__all__ = [
    "BatchRun",
    "GroupHyperparams",
    "OwnerUpdate",
    "StepContext",
    "compute",
    "decay_all_params",
    "finish",
    "momentum_views",
    "new_run",
    "orthogonalize_directions",
    "orthogonalize_run",
    "prepare",
    "read_hyperparams",
    "step_batch",
    "update_all_momenta",
]


@dataclass(frozen=True)
class GroupHyperparams:
    """A param group's hyperparameters as the phases read them, once per round (Python
    numbers: the phases branch on a zero decay and pass lr to ``alpha=``). The runner's
    reader (``StepRunner.hyperparams``, :func:`read_hyperparams` by default) is the one
    place they come from."""

    lr: float
    weight_decay: float
    mu: float
    nesterov: bool


def read_hyperparams(param_groups: list[dict]) -> list[GroupHyperparams]:
    """Each group's hyperparameters as Python numbers (a tensor lr read once)."""
    return [
        GroupHyperparams(
            lr=setting_float(g["lr"]),
            weight_decay=setting_float(g["weight_decay"]),
            mu=setting_float(g.get("mu", 0.0)),
            nesterov=bool(g.get("nesterov", False)),
        )
        for g in param_groups
    ]


# What the owner of a matrix computes from its whole direction: ``(ctx, U, batch)`` with
# ``U`` a bf16 ``[N, rows, cols]`` stack it may overwrite, returning bf16 results of the
# same shape. ``None``: Newton–Schulz per partition block (``StepContext.orthogonalize``).
OwnerUpdate = Callable[["StepContext", Tensor, MuonBatch], Tensor]


@dataclass
class StepContext:
    """What the phases read: the plan, the groups, the state, where the telemetry goes."""

    plan: Plan
    param_groups: list[dict]
    state: dict
    stats: StepStats
    orthogonalizer: Orthogonalizer
    coefficients: tuple
    device: torch.device
    workspace_bytes: int
    hyperparams: list[GroupHyperparams] = field(default_factory=list)
    owner_update: OwnerUpdate | None = None
    # The overlapped step's own process groups, by sorted global ranks (runtime/overlap.py);
    # empty: the mesh's groups.
    step_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    # The grads as the step began, by ``id`` of the parameter (the overlapped step: the
    # caller may set ``p.grad = None`` meanwhile); None: read ``p.grad``.
    grads: dict[int, Tensor] | None = None

    def __post_init__(self) -> None:
        if not self.hyperparams:
            self.hyperparams = read_hyperparams(self.param_groups)

    def grad(self, param: Tensor) -> Tensor | None:
        """``param``'s grad for this step."""
        return param.grad if self.grads is None else self.grads.get(id(param))

    def process_group(self, group: ShardGroup) -> dist.ProcessGroup:
        """The process group the step's collectives over ``group``'s ranks run on."""
        return self.step_groups.get(tuple(sorted(group.ranks)), group.process_group)

    def hyperparams_of(self, param_index: int) -> GroupHyperparams:
        return self.hyperparams[self.plan.group_of[param_index]]

    def matrices(self, index: int, tensor: Tensor) -> Tensor:
        """The ``[N, rows, cols]`` view of Muon parameter ``index``'s local shard (or state).

        A view when the strides allow, else a copy: for tensors that are only read.
        """
        layout = self.plan.layouts[index]
        shape = (layout.num_matrices, layout.local_rows, layout.local_cols)
        return local_tensor(tensor).reshape(shape)

    def writable(self, index: int, tensor: Tensor) -> tuple[Tensor, Callable[[], None]]:
        """``[N, rows, cols]`` matrices of a tensor updated in place, and a commit.

        A view when the strides allow (the commit does nothing); otherwise (a channels_last
        conv weight with ``flatten``, a permuted stack) a contiguous copy that the commit
        writes back, so every parameter and momentum is really updated.
        """
        local = local_tensor(tensor)
        layout = self.plan.layouts[index]
        shape = (layout.num_matrices, layout.local_rows, layout.local_cols)
        try:
            return local.view(shape), _nothing
        except RuntimeError:
            matrices = local.reshape(shape)
            return matrices, lambda: local.copy_(matrices.view(local.shape))

    def orthogonalize(self, U: Tensor, batch: MuonBatch) -> Tensor:
        """The owner's results for a bf16 ``[N, rows, cols]`` stack of whole directions:
        ``owner_update``'s where one is set, else :meth:`newton_schulz`'s.

        ``U`` is overwritten (the pipeline's own buffer; the folded iteration uses it).
        """
        if self.owner_update is not None:
            return self.owner_update(self, U, batch)
        return self.newton_schulz(U, batch)

    def newton_schulz(self, U: Tensor, batch: MuonBatch) -> Tensor:
        """Newton–Schulz on a bf16 ``[N, rows, cols]`` stack, per partition block (counted
        in the step's telemetry); ``U`` is overwritten."""
        stats = self.stats
        stats.matrices_orthogonalized += U.size(0)
        stats.owned_shapes.extend([(U.size(1), U.size(2))] * U.size(0))

        def ns(X: Tensor) -> Tensor:
            stats.ns_calls.append((X.size(0), X.size(1), X.size(2)))
            out = self.orthogonalizer(X, self.coefficients, batch.eps)
            # What the call saw, from its own normalisation: no pass over the directions.
            masks, verdicts = self.orthogonalizer.take_report()
            stats.nonfinite_counts.extend(masks)
            # The guard's count and worst ratio stay on the device (read once, when asked).
            for verdict in verdicts:
                stats.ns_checked += verdict.checked
                if verdict.checked:
                    stats.ns_fallback_counts.append(verdict.fallback_count)
                    stats.ns_worst_ratios.append(verdict.worst_ratio_tensor)
            return out

        return orthogonalize_blocks(U, batch.partitions, ns)


def _nothing() -> None:
    return None


@dataclass
class BatchRun:
    """One batch between phases on this rank, with what is done (to resume a failed chunk)."""

    batch: MuonBatch
    segments: list[Segment]
    receives_from_replica: bool
    buffer: Tensor | None = None  # bf16 directions: the send buffer or the local stack
    momenta: list[Tensor] | None = None  # per segment, staged on the device (offload)
    exchange: BatchExchange | None = None
    results: Tensor | None = None  # bf16 [n, local_rows, local_cols] for this rank
    results_ready: bool = False  # received (and shared across replicas)
    momentum_done: int = 0
    communicated: bool = False  # a collective of this batch was issued (no replay)
    prepared: bool = False
    computed: bool = False
    finished: int = 0
    decayed: bool = False  # every segment's parameter already decayed (decay_all_params)

    @property
    def count(self) -> int:
        return sum(s.count for s in self.segments)


def new_run(ctx: StepContext, batch: MuonBatch) -> BatchRun:
    """A batch about to be prepared: the segments that have grads on this rank."""
    params = ctx.plan.params
    segments = [s for s in batch.segments if ctx.grad(params[s.param_index]) is not None]
    replicas = batch.layout.replicas
    from_replica = batch.replica is not None and batch.replica != replicas.mesh_index
    return BatchRun(batch, segments, receives_from_replica=from_replica)


def _active_owners(batch: MuonBatch, segments: list[Segment]) -> tuple[int, ...]:
    active = {(s.param_index, i) for s in segments for i in range(s.start, s.stop)}
    units = [(s.param_index, i) for s in batch.segments for i in range(s.start, s.stop)]
    return tuple(o for u, o in zip(units, batch.owners) if u in active)


def _segment_momentum(ctx: StepContext, run: BatchRun, k: int) -> tuple[Tensor, Callable[[], None]]:
    """Segment ``k``'s momentum ``[count, rows, cols]`` (its staged copy under offload)."""
    if run.momenta is not None:
        return run.momenta[k], _nothing
    seg = run.segments[k]
    p = ctx.plan.params[seg.param_index]
    momentum, commit = ctx.writable(seg.param_index, ctx.state[p]["momentum"])
    return momentum[seg.start : seg.stop], commit


def momentum_views(ctx: StepContext, run: BatchRun) -> list[Tensor]:
    """Views of the (host) momentum of each segment of ``run``, for staging."""
    return [
        ctx.matrices(s.param_index, ctx.state[ctx.plan.params[s.param_index]]["momentum"])[
            s.start : s.stop
        ]
        for s in run.segments
    ]


def _update_momentum(ctx: StepContext, run: BatchRun) -> None:
    plan = ctx.plan
    for k in range(run.momentum_done, len(run.segments)):
        seg = run.segments[k]
        momentum, commit = _segment_momentum(ctx, run, k)
        grad = ctx.matrices(seg.param_index, ctx.grad(plan.params[seg.param_index]))
        momentum_update_(
            momentum, grad[seg.start : seg.stop], ctx.hyperparams_of(seg.param_index).mu
        )
        commit()
        run.momentum_done += 1


def update_all_momenta(ctx: StepContext, runs: list[BatchRun]) -> None:
    """``M = mu*M + G`` for every run whose momenta are fp32 views, with one ``_foreach``
    pair per ``mu`` (the same element-wise ops, so the same bits, in two calls instead of
    two per segment: on a GPU, two multi-tensor kernels). Other runs update theirs in
    *prepare*."""
    by_mu: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    ready: list[BatchRun] = []
    for run in runs:
        if run.momentum_done or _fused_momentum_segments(ctx, run) is not None:
            continue  # (the fused pass updates the latter's momenta in *prepare*)
        pairs = []
        for seg in run.segments:
            p = ctx.plan.params[seg.param_index]
            momentum, commit = ctx.writable(seg.param_index, ctx.state[p]["momentum"])
            # fp32 only: on bf16, _foreach_mul_ rounds differently from mul_ (tested).
            if commit is not _nothing or momentum.dtype != torch.float32:
                break
            grad = ctx.matrices(seg.param_index, ctx.grad(p))[seg.start : seg.stop]
            pairs.append(
                (ctx.hyperparams_of(seg.param_index).mu, momentum[seg.start : seg.stop], grad)
            )
        else:
            for mu, momentum, grad in pairs:
                moms, grads = by_mu.setdefault(mu, ([], []))
                moms.append(momentum)
                grads.append(grad)  # a bf16 grad is added exactly, with no fp32 copy
            ready.append(run)
    for mu, (moms, grads) in by_mu.items():
        torch._foreach_mul_(moms, mu)
        torch._foreach_add_(moms, grads)
    for run in ready:
        run.momentum_done = len(run.segments)


def decay_all_params(ctx: StepContext, runs: list[BatchRun]) -> None:
    """``X *= 1 - lr*wd`` for every run whose parameters are fp32 views, with one
    ``_foreach_mul_`` per factor at the start of the step (the multiply *finish* would make,
    so the same bits, in a launch or two instead of one per segment); those runs' *finish*
    then adds the step only. Not where the fused kernel decays and updates in one pass."""
    if fused_update_available(ctx.device):
        return
    by_factor: dict[float, list[Tensor]] = {}
    for run in runs:
        if run.decayed or run.finished or not run.segments:
            continue
        views = []
        for seg in run.segments:
            p = ctx.plan.params[seg.param_index]
            matrices, commit = ctx.writable(seg.param_index, p)
            if matrices.dtype != torch.float32 or commit is not _nothing:
                break
            hyper = ctx.hyperparams_of(seg.param_index)
            if hyper.weight_decay != 0.0:
                views.append((1.0 - hyper.lr * hyper.weight_decay, matrices[seg.start : seg.stop]))
        else:
            for factor, view in views:
                by_factor.setdefault(factor, []).append(view)
            run.decayed = True
    for factor, views in by_factor.items():
        torch._foreach_mul_(views, factor)


def write_directions(ctx: StepContext, run: BatchRun, out: Tensor) -> None:
    """Each segment's direction, rounded to bf16, into consecutive matrices of ``out``
    (momenta without Nesterov in one ``_foreach_copy_``: the same rounding, one launch)."""
    plan = ctx.plan
    offset = 0
    targets: list[Tensor] = []
    momenta: list[Tensor] = []
    for k, seg in enumerate(run.segments):
        p = plan.params[seg.param_index]
        hyper = ctx.hyperparams_of(seg.param_index)
        momentum = _segment_momentum(ctx, run, k)[0]
        target = out[offset : offset + seg.count]
        if hyper.nesterov:
            grad = ctx.matrices(seg.param_index, ctx.grad(p))[seg.start : seg.stop]
            target.copy_(direction(momentum, grad, hyper.mu, True))
        else:
            targets.append(target)
            momenta.append(momentum)
        offset += seg.count
    if len(targets) == 1:
        targets[0].copy_(momenta[0])
    elif targets:
        torch._foreach_copy_(targets, momenta)


def _directions(ctx: StepContext, run: BatchRun) -> Tensor:
    """A new contiguous bf16 ``[count, rows, cols]`` buffer of the batch's directions (one
    segment without Nesterov: its momentum's bf16 copy, one call)."""
    if len(run.segments) == 1 and not ctx.hyperparams_of(run.segments[0].param_index).nesterov:
        momentum = _segment_momentum(ctx, run, 0)[0]
        if tuple(momentum.shape) == _buffer_shape(run):
            return momentum.to(torch.bfloat16, copy=True, memory_format=torch.contiguous_format)
    buffer = torch.empty(_buffer_shape(run), dtype=torch.bfloat16, device=ctx.device)
    write_directions(ctx, run, buffer)
    return buffer


def _buffer_shape(run: BatchRun) -> tuple[int, int, int]:
    layout = run.batch.layout
    return (run.count, layout.local_rows, layout.local_cols)


def _fused_momentum_segments(
    ctx: StepContext, run: BatchRun
) -> list[tuple[Tensor, Tensor, float, bool]] | None:
    """``(momentum, grad, mu, nesterov)`` of each segment where one fused pass per segment
    updates the momentum and writes the direction (``ops/fused_momentum.py``): on an
    accelerator with the fused kernels, a run not started that computes its own directions,
    every momentum fp32, contiguous and written where it lies (or staged). ``None``
    otherwise."""
    if (
        run.momentum_done
        or run.receives_from_replica
        or not run.segments
        or not fused_update_available(ctx.device)
    ):
        return None
    segments = []
    for k, seg in enumerate(run.segments):
        momentum, commit = _segment_momentum(ctx, run, k)
        if commit is not _nothing or momentum.dtype != torch.float32:
            return None
        if not momentum.is_contiguous():
            return None
        grad = ctx.matrices(seg.param_index, ctx.grad(ctx.plan.params[seg.param_index]))
        hyper = ctx.hyperparams_of(seg.param_index)
        segments.append((momentum, grad[seg.start : seg.stop], hyper.mu, hyper.nesterov))
    return segments


def prepare(ctx: StepContext, run: BatchRun) -> None:
    """Phase 1: momentum, the bf16 directions in the batch's buffer; the gather starts.

    On an accelerator with the fused kernels, each segment's momentum update and direction
    are one pass (:func:`_fused_momentum_segments`); a run that failed part-way through
    them resumes on the unfused path (the same bits)."""
    fused = _fused_momentum_segments(ctx, run)
    if fused is None:
        _update_momentum(ctx, run)
    ctx.stats.num_batches += 1
    if not run.receives_from_replica and run.segments:
        if fused is None:
            run.buffer = _directions(ctx, run)
        else:
            buffer = torch.empty(_buffer_shape(run), dtype=torch.bfloat16, device=ctx.device)
            offset = 0
            for (momentum, grad, mu, nesterov), seg in zip(fused, run.segments):
                target = buffer[offset : offset + seg.count]
                momentum_direction_into(momentum, grad, mu, nesterov, target)
                run.momentum_done += 1
                offset += seg.count
            run.buffer = buffer
        start_gather(ctx, run)
    run.prepared = True


def start_gather(ctx: StepContext, run: BatchRun) -> None:
    """Start the all-to-all of an exchanged batch whose ``buffer`` holds its directions."""
    if not run.batch.layout.exchanged:
        return
    owners = _active_owners(run.batch, run.segments)
    layout = run.batch.layout
    run.exchange = BatchExchange(layout, owners, ctx.stats, ctx.process_group(layout.group))
    ctx.stats.bytes_minimum += run.exchange.minimum_bytes()
    run.communicated = True
    run.exchange.start_gather(run.buffer)


def compute(ctx: StepContext, run: BatchRun) -> None:
    """Phase 2: Newton–Schulz (the owner's matrix, or the local stack); the return starts."""
    if run.exchange is not None:
        whole = run.exchange.assemble()
        run.buffer = None  # the send buffer is no longer needed
        result = None if whole is None else ctx.orthogonalize(whole[None], run.batch)[0]
        del whole
        run.exchange.start_return(result)
    elif run.buffer is not None:
        try:
            run.results = ctx.orthogonalize(run.buffer, run.batch)
        except BaseException:
            # The in-place iteration may have overwritten the directions: a retry writes
            # them again from the momentum (which is not updated twice).
            run.buffer, run.prepared = None, False
            raise
        run.buffer = None
    run.computed = True


def _results(ctx: StepContext, run: BatchRun) -> Tensor | None:
    """This rank's bf16 results ``[n, local_rows, local_cols]``, where they were received."""
    if run.exchange is not None:
        results = run.exchange.finish_return().view(_buffer_shape(run))
        run.exchange = None
    else:
        results = run.results
    if run.batch.replica is not None and run.segments:
        results = share_with_replicas(ctx, run, results)
    return results


def finish(ctx: StepContext, run: BatchRun) -> None:
    """Phase 3: decay and update of this rank's shard, reading the results in place.

    Resumable: the results are fetched once and segments already updated are skipped.
    """
    plan = ctx.plan
    if not run.results_ready:
        run.results = _results(ctx, run)
        run.results_ready = True
    if run.finished == 0 and _update_all_at_once(ctx, run):
        run.finished = len(run.segments)
        run.results = None
        return
    offset = sum(seg.count for seg in run.segments[: run.finished])
    for seg in run.segments[run.finished :]:
        p = plan.params[seg.param_index]
        hyper = ctx.hyperparams_of(seg.param_index)
        matrices, commit = ctx.writable(seg.param_index, p)
        weight_update_(
            matrices[seg.start : seg.stop],
            run.results[offset : offset + seg.count],
            hyper.lr,
            0.0 if run.decayed else hyper.weight_decay,
            plan.row_scales[seg.param_index],
        )
        commit()
        offset += seg.count
        run.finished += 1
    run.results = None


def _update_all_at_once(ctx: StepContext, run: BatchRun) -> bool:
    """Every segment's decay and update in ``_foreach_`` passes (``weight_updates_``: the
    per-segment bits, a few launches per batch instead of four per parameter), when every
    parameter is fp32 and updated through a view. False (nothing done) otherwise."""
    plan = ctx.plan
    if fused_update_available(ctx.device):
        return False  # one fused kernel per parameter (weight_update_) is fewer launches
    params, lrs, decays, scales = [], [], [], []
    for seg in run.segments:
        p = plan.params[seg.param_index]
        matrices, commit = ctx.writable(seg.param_index, p)
        if matrices.dtype != torch.float32 or commit is not _nothing:
            return False
        hyper = ctx.hyperparams_of(seg.param_index)
        params.append(matrices[seg.start : seg.stop])
        lrs.append(hyper.lr)
        decays.append(0.0 if run.decayed else hyper.weight_decay)
        scales.append(plan.row_scales[seg.param_index])
    if len(params) < 2:
        return False  # one parameter: the per-segment path is as short
    weight_updates_(params, run.results, lrs, decays, scales)
    return True


def share_with_replicas(ctx: StepContext, run: BatchRun, results: Tensor | None) -> Tensor:
    """Broadcast this rank's bf16 results ``[N, r, c]`` from the computing replica."""
    replicas = run.batch.layout.replicas
    if run.receives_from_replica:
        buffer = torch.empty(_buffer_shape(run), dtype=torch.bfloat16, device=ctx.device)
    else:
        buffer = results.contiguous()
    if buffer.numel() == 0:  # an empty shard: every replica knows, nothing to send
        return buffer
    run.communicated = True
    src = replicas.global_rank_at(run.batch.replica)
    dist.broadcast(buffer, src=src, group=ctx.process_group(replicas))
    nbytes = buffer.numel() * buffer.element_size()
    if run.receives_from_replica:
        ctx.stats.replica_bytes_received += nbytes
    else:
        ctx.stats.replica_bytes_sent += nbytes * (replicas.size - 1)
    return buffer


def orthogonalize_run(ctx: StepContext, run: BatchRun) -> Tensor:
    """Exchange and orthogonalize the directions already in ``run.buffer``; no momentum, no
    update. Returns this rank's bf16 results ``[n, local_rows, local_cols]``."""
    start_gather(ctx, run)
    compute(ctx, run)
    return _results(ctx, run)


def orthogonalize_directions(
    ctx: StepContext, batch: MuonBatch, indices: list[int], directions: list[Tensor]
) -> list[Tensor]:
    """``Muon.orthogonalize_chunk``: the given directions (local tensors shaped like the
    plan's params ``indices``) through the exchange and Newton–Schulz; bf16 results shaped
    like them."""
    run = BatchRun(batch, batch.segments, receives_from_replica=False)
    run.buffer = torch.cat(
        [ctx.matrices(i, u.to(torch.bfloat16)) for i, u in zip(indices, directions)]
    )
    results = orthogonalize_run(ctx, run)
    out, offset = [], 0
    for seg, u in zip(batch.segments, directions):
        out.append(results[offset : offset + seg.count].reshape(local_tensor(u).shape))
        offset += seg.count
    return out


def step_batch(ctx: StepContext, run: BatchRun) -> None:
    """All three phases of one batch, resuming after the last phase that completed."""
    if not run.prepared:
        prepare(ctx, run)
    if not run.computed:
        compute(ctx, run)
    finish(ctx, run)
