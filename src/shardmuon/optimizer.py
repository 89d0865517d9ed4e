"""``Muon``: the optimizer class. It plans once and dispatches; the math lives elsewhere.

A step runs in three phases per batch (see ``layout.py`` for batches and ``exchange.py``
for the all-to-alls):

1. *prepare* — momentum ``M = mu*M + G`` on the local shard, the direction ``U``
   (Nesterov or ``M``) cast to bf16; for exchanged batches the gather all-to-all starts.
2. *compute* — the owner assembles its whole matrix and runs Newton–Schulz (per block
   for partitioned matrices); the return all-to-all starts. Local batches run
   Newton–Schulz on their stack here.
3. *finish* — with ``split_replicas``, the computing replica broadcasts each rank's result
   shard over the replicate dim (the other replicas skipped phases 1's exchange and 2);
   then every rank applies decoupled weight decay and ``X -= lr*scale*O`` to its own shard,
   in fp32.

``step()`` keeps up to ``max_in_flight`` batches between phases 1 and 2, so all-to-alls
of later batches overlap Newton–Schulz of earlier ones, and finishes a batch only after
the next one has been computed, so return traffic overlaps compute too. AdamW groups run
while the first batches are in flight. ``step_chunk()`` runs the same three phases for one
chunk synchronously; since every phase is element-wise or per matrix, both give the
same bits.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from shardmuon.adamw import adamw_update_
from shardmuon.agreement import AgreementSettings, agreement_groups, check_agreement
from shardmuon.exchange import BatchExchange, warmup_groups
from shardmuon.layout import (
    MatrixLayout,
    MuonBatch,
    Segment,
    ShardGroup,
    batch_key,
    local_tensor,
)
from shardmuon.newton_schulz import (
    newton_schulz,
    newton_schulz_compiled,
    newton_schulz_unfolded,
    resolve_coefficients,
)
from shardmuon.partitions import orthogonalize_blocks
from shardmuon.plan import AdamWChunk, Plan, build_plan, plan_settings, setting_float
from shardmuon.state_dict_checks import DROPPED_KEYS, checked_groups
from shardmuon.telemetry import StepStats
from shardmuon.update import direction, momentum_update_, weight_update_
from shardmuon.validation import (
    check_adjust_lr,
    check_grads,
    check_group,
    check_group_settings,
    check_mesh,
    check_number,
)

__all__ = ["Muon"]

NS_IMPLEMENTATIONS = {
    "folded": newton_schulz,
    "unfolded": newton_schulz_unfolded,
    "compiled": newton_schulz_compiled,
}
CHECK_GRADS = ("first", "always", "never")


Chunk = MuonBatch | AdamWChunk


@dataclass
class _Run:
    """A batch between phases: its directions, exchange and results."""

    batch: MuonBatch
    segments: list[Segment]
    directions: Tensor | list[Tensor]
    exchange: BatchExchange | None = None
    result: Tensor | list[Tensor] | None = None
    receives_from_replica: bool = False
    momentum_done: int = 0
    prepared: bool = False
    computed: bool = False
    results: Tensor | None = None
    finished: int = 0


@dataclass
class _AdamWProgress:
    """How many parameters of an AdamW chunk were updated (to resume a failed chunk)."""

    done: int = 0


def _nothing() -> None:
    return None


class Muon(Optimizer):
    """Muon with dion's param groups, state and checkpoints; distribution read from DTensors.

    Args:
        params: param groups (dicts with ``params`` and ``algorithm`` = ``"muon"`` or
            ``"adamw"``), or an iterable of tensors (one Muon group).
        distributed_mesh: accepted for drop-in use with dion (in dion's position) and only
            type-checked: the distribution comes from each parameter's DTensor placements.
        lr, mu, betas, weight_decay, epsilon, nesterov, adjust_lr, flatten: group defaults, as
            in dion, with dion's defaults (``adjust_lr="spectral_norm"``: the lr of an
            ``[m, n]`` matrix is scaled by ``sqrt(m / n)``; ``epsilon`` > 0 is AdamW's eps and
            Newton–Schulz's normalisation eps). Each group may also carry microsoft/dion's
            ``split_sizes`` / ``num_heads`` (turned into partitions).
        use_triton: dion's kernel switch, accepted and ignored (the math is the same).
        newton_schulz_func: dion's custom-orthogonalization hook; only ``None`` is accepted.
        update_rms: the update RMS for ``adjust_lr="rms_norm"``: the lr of an
            ``[m, n]`` matrix is scaled by ``update_rms * sqrt(max(m, n))`` (0.2 = dion).
        newton_schulz_coefficients: a preset name from ``NS_PRESETS`` or a list of
            ``(a, b, c)`` triples, one per iteration; ``None`` = ``"dion"``.
        matrix_partitions: ``{param: (rows_1, ...)}`` for fused weights: blocks along dim -2
            orthogonalized and scaled on their own. An optimizer attribute, not a group key.
        max_in_flight: batches between the gather and the compute phase in ``step()``.
        newton_schulz_impl: ``"folded"`` (default), ``"unfolded"`` (dion's bf16 recipe,
            for benchmarks) or ``"compiled"`` (``"folded"`` through ``torch.compile``).
        rotate_owners: continue owners round-robin across batches (``False`` for benchmarks).
        split_replicas: for parameters with a replicate mesh dim (HSDP), let one replica
            orthogonalize each batch and broadcast the result to the others, instead of every
            replica repeating it: Newton–Schulz work divided by the replica count, for one
            bf16 broadcast of each rank's result shard over the replicate dim.
        warmup: run :meth:`warmup` at construction.
        world_mesh, fsdp_mesh_dim: samsja/dion's mesh arguments (prime-rl passes them),
            accepted and only type-checked, like ``distributed_mesh``.
        check_grads: when to verify, with two small all-reduces per shard group, that the
            group's ranks planned the same batches and that a parameter's grad is present on
            all ranks of its group or on none: ``"first"`` step (default), ``"always"`` or
            ``"never"``. A parameter without a grad is
            skipped (no momentum, no decay) on every rank, as in dion.

    NaN or inf in a gradient propagate into that parameter's momentum and, through
    Newton–Schulz's normalisation, into its whole update (every element becomes NaN); other
    parameters are unaffected. Clip or skip such steps outside the optimizer.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        distributed_mesh: Any = None,
        lr: float = 0.01,
        mu: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        nesterov: bool = False,
        adjust_lr: str | None = "spectral_norm",
        flatten: bool = False,
        use_triton: bool = False,
        newton_schulz_func: Callable | None = None,
        *,
        update_rms: float = 0.2,
        newton_schulz_coefficients: str | Sequence[Sequence[float]] | None = None,
        matrix_partitions: dict[Tensor, Sequence[int]] | None = None,
        max_in_flight: int = 3,
        newton_schulz_impl: str = "folded",
        rotate_owners: bool = True,
        split_replicas: bool = False,
        warmup: bool = False,
        check_grads: str = "first",
        world_mesh: Any = None,
        fsdp_mesh_dim: Any = None,
    ) -> None:
        if not isinstance(betas, Sequence) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_mesh(distributed_mesh)
        check_mesh(world_mesh, "world_mesh")
        if fsdp_mesh_dim is not None and not isinstance(fsdp_mesh_dim, (int, str)):
            raise TypeError(
                f"fsdp_mesh_dim must be None, an int or a mesh dim name, got {fsdp_mesh_dim!r}"
            )
        if not isinstance(use_triton, bool):
            raise TypeError(f"use_triton must be True or False, got {use_triton!r}")
        if newton_schulz_func is not None:
            raise ValueError(
                "newton_schulz_func (dion's custom orthogonalization) is not supported; choose "
                "the iteration with newton_schulz_coefficients (a preset name or (a, b, c) "
                "triples)"
            )
        for name, value, upper in (
            ("lr", lr, None),
            ("mu", mu, 1.0),
            ("betas[0]", betas[0], 1.0),
            ("betas[1]", betas[1], 1.0),
            ("weight_decay", weight_decay, None),
        ):
            check_number(name, value, upper)
        check_number("epsilon", epsilon, positive=True)
        check_adjust_lr("", adjust_lr)
        defaults = dict(
            lr=lr,
            mu=mu,
            beta1=betas[0],
            beta2=betas[1],
            weight_decay=weight_decay,
            algorithm="muon",
            step=0,
            epsilon=epsilon,
            nesterov=nesterov,
            flatten=flatten,
            adjust_lr=adjust_lr,
        )
        self.update_rms = update_rms
        self.coefficients = resolve_coefficients(newton_schulz_coefficients)
        self.max_in_flight = max_in_flight
        self.rotate_owners = rotate_owners
        self.split_replicas = split_replicas
        self.check_grads = check_grads
        self.newton_schulz_impl = newton_schulz_impl
        self._check_options()
        self.update_rms = float(update_rms)
        self._raw_partitions = dict(matrix_partitions or {})
        self._reset_runtime()
        super().__init__(params, defaults)
        self._ensure_plan()
        if warmup:
            self.warmup()

    def _reset_runtime(self) -> None:
        """What is derived from the settings, not part of them (rebuilt after a copy)."""
        self._plan: Plan | None = None
        self._plan_settings: tuple | None = None
        self._plan_verified = False
        self._round: set[int] | None = None
        self._pending: dict[int, Any] = {}
        self.last_step_stats = StepStats()

    def _check_options(self) -> None:
        """The optimizer-wide settings (public attributes, so checked again before each step)."""
        rms = self.update_rms
        if isinstance(rms, bool) or not isinstance(rms, (int, float)):
            raise TypeError(f"update_rms must be a number, got {rms!r}")
        if not (rms > 0 and math.isfinite(rms)):
            raise ValueError(f"update_rms must be a finite number > 0, got {rms!r}")
        flight = self.max_in_flight
        if isinstance(flight, bool) or not isinstance(flight, int):
            raise TypeError(f"max_in_flight must be an int >= 1, got {flight!r}")
        if flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {flight!r}")
        if self.newton_schulz_impl not in NS_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown newton_schulz_impl {self.newton_schulz_impl!r}; accepted: "
                f"{', '.join(map(repr, NS_IMPLEMENTATIONS))}"
            )
        if self.check_grads not in CHECK_GRADS:
            raise ValueError(
                f"unknown check_grads {self.check_grads!r}; accepted: "
                f"{', '.join(map(repr, CHECK_GRADS))}"
            )
        for name in ("rotate_owners", "split_replicas"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    # ----------------------------------------------------------------- planning

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (validated as in the constructor); the plan is rebuilt.

        A group that fails validation, or whose parameters cannot be planned, is removed
        again, leaving the optimizer as it was. Refused while a ``step_chunk`` round is open.
        """
        if self._round is not None:
            raise RuntimeError(
                "add_param_group during a step_chunk round; step the remaining chunks first"
            )
        super().add_param_group(param_group)
        if self._plan_settings is None:  # the constructor plans once, after all groups
            return
        try:
            self._ensure_plan()
        except Exception:
            self.param_groups.pop()
            raise

    def _make_plan(self, param_groups: list[dict] | None = None) -> Plan:
        return build_plan(
            self.param_groups if param_groups is None else param_groups,
            self._raw_partitions,
            self.update_rms,
            self.rotate_owners,
            self.split_replicas,
        )

    def _current_settings(self) -> tuple:
        return plan_settings(
            self.param_groups,
            self._raw_partitions,
            self.update_rms,
            self.rotate_owners,
            self.split_replicas,
        )

    def _ensure_plan(self) -> None:
        """Check the live settings; rebuild the plan if what it was built from changed.

        Group settings are live, as in torch.optim: lr, weight_decay, mu, nesterov and the
        betas are read at each step; a change of a group's algorithm, adjust_lr, epsilon,
        flatten, split_sizes/num_heads or parameters (an edit, a loaded state dict,
        ``add_param_group``), or of ``update_rms``/``rotate_owners``/``split_replicas``,
        rebuilds the plan and reruns the first-step agreement check. Nothing changes if a
        check raises.
        """
        self._check_options()
        for index, group in enumerate(self.param_groups):
            check_group_settings(index, group)
        settings = self._current_settings()
        if settings == self._plan_settings:
            return
        if self._round is not None:
            raise RuntimeError(
                "the param groups' planned settings or parameters changed during a "
                "step_chunk round; step the remaining chunks first, then change them"
            )
        for index, group in enumerate(self.param_groups):
            check_group(index, group)
        plan = self._make_plan()
        self._plan, self._plan_settings = plan, settings
        self._init_state()
        self._plan_verified = False

    def _init_state(self) -> None:
        """Create state for every parameter now: DCP needs the same keys on every rank."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                keys = ("momentum", "variance") if group["algorithm"] == "adamw" else ("momentum",)
                for key in keys:
                    value = state.get(key)
                    if value is None:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    elif isinstance(p, DTensor) and not isinstance(value, DTensor):
                        state[key] = _distribute_like(value, p)

    def chunks(self) -> list[Chunk]:
        """The list of chunks: Muon batches (exchanged ones first), then AdamW groups.

        Fixed while the plan is (see :meth:`_ensure_plan`); a changed setting gives new
        chunk objects.
        """
        self._ensure_plan()
        return [*self._plan.batches, *self._plan.adamw]

    def shard_groups(self) -> list[ShardGroup]:
        """Distinct process groups the Muon all-to-alls use, in first-use order."""
        self._ensure_plan()
        seen: dict[tuple[int, ...], ShardGroup] = {}
        for layout in self._plan.layouts:
            if layout.group is not None:
                seen.setdefault(layout.group.ranks, layout.group)
        return list(seen.values())

    def warmup(self) -> None:
        """Run a tiny all-to-all on every group Muon uses: shard and replicate dims."""
        self._ensure_plan()
        groups = agreement_groups(self._plan.batches)
        if groups:
            warmup_groups(groups, self._device())

    def _device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return local_tensor(p).device
        return torch.device("cpu")

    # ----------------------------------------------------------------- stepping

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over all chunks, pipelined (see the module docstring).

        If it raises before the step counters advance (every input check), nothing has
        changed. If it raises after (out of memory in Newton–Schulz, a failed collective),
        the counters have advanced, chunks already finished are updated, batches prepared
        but not finished have their momentum updated and parameters unchanged, and the rest
        is untouched: restore a checkpoint rather than step again.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._round is not None:
            raise RuntimeError(
                f"step() called while a step_chunk() round is open ({len(self._round)} of "
                f"{len(self.chunks())} chunks stepped); step the remaining chunks first"
            )
        self._begin_round()
        in_flight: deque[_Run] = deque()
        returning: deque[_Run] = deque()
        adamw_pending = list(self._plan.adamw)
        for batch in self._plan.batches:
            in_flight.append(self._prepare(self._new_run(batch)))
            if len(in_flight) >= self.max_in_flight:
                if adamw_pending:
                    for chunk in adamw_pending:
                        self._step_adamw(chunk)
                    adamw_pending = []
                self._advance(in_flight, returning)
        for chunk in adamw_pending:
            self._step_adamw(chunk)
        while in_flight:
            self._advance(in_flight, returning)
        while returning:
            self._finish(returning.popleft())
        return loss

    def _advance(self, in_flight: deque[_Run], returning: deque[_Run]) -> None:
        run = in_flight.popleft()
        self._compute(run)
        returning.append(run)
        while len(returning) > 1:
            self._finish(returning.popleft())

    @torch.no_grad()
    def step_chunk(self, chunk: Chunk) -> None:
        """Step one chunk (on the current stream); the step counters advance on a round's first chunk.

        A round is one pass over :meth:`chunks`; stepping a chunk twice in a round raises, so
        counters and bias corrections cannot drift. Chunks that communicate (exchanged
        batches, batches shared across replicas) must be stepped in the order of
        :meth:`chunks` — any other order raises before a collective, since every rank must
        pair the same all-to-alls; local batches and AdamW chunks may go in any order. A chunk whose step
        raised is not marked done: calling ``step_chunk`` with it again resumes where it
        failed (its momentum is not updated twice, parameters already updated are not
        updated again).
        """
        chunks = self.chunks()
        key = next((i for i, c in enumerate(chunks) if c is chunk), None)
        if key is None:
            raise ValueError(
                "step_chunk got a chunk that is not in this optimizer's chunks() (chunks "
                "are rebuilt when a planned setting changes: call chunks() again)"
            )
        if self._round is not None and key in self._round:
            raise RuntimeError(
                f"chunk {key} was already stepped in this round; step the other "
                f"{len(chunks) - len(self._round)} chunks first"
            )
        if _communicates(chunk):
            done = self._round or set()
            earlier = [i for i, c in enumerate(chunks[:key]) if _communicates(c) and i not in done]
            if earlier:
                raise RuntimeError(
                    f"step_chunk: chunk {key} exchanges data with other ranks, and so does "
                    f"chunk {earlier[0]}, not yet stepped in this round; chunks that "
                    "communicate must be stepped in the order of chunks() (the same on every "
                    "rank, so the collectives pair up); local and AdamW chunks may go in any "
                    "order"
                )
        if self._round is None:
            self._begin_round()
            self._round = set()
        progress = self._pending.pop(key, None)
        try:
            if isinstance(chunk, AdamWChunk):
                progress = progress or _AdamWProgress()
                self._step_adamw(chunk, progress)
            else:
                progress = progress or self._new_run(chunk)
                if not progress.prepared:
                    self._prepare(progress)
                if not progress.computed:
                    self._compute(progress)
                self._finish(progress)
        except BaseException:
            if progress is not None:
                self._pending[key] = progress
            raise
        self._round.add(key)
        if len(self._round) == len(chunks):
            self._round = None

    def _begin_round(self) -> None:
        """Checks first (nothing changes if they raise), then the step counters advance."""
        self._ensure_plan()
        check_grads(self.param_groups)
        if self.check_grads == "always" or (
            self.check_grads == "first" and not self._plan_verified
        ):
            self._check_agreement()
            self._plan_verified = True
        for group in self.param_groups:
            group["step"] += 1
        self.last_step_stats = StepStats()

    def _check_agreement(self) -> None:
        """Every group's ranks agree on batches, settings and grads (see ``agreement.py``)."""
        plan = self._plan
        settings = AgreementSettings(
            update_rms=self.update_rms,
            coefficients=tuple(map(tuple, self.coefficients)),
            newton_schulz_impl=self.newton_schulz_impl,
            max_in_flight=self.max_in_flight,
            split_replicas=self.split_replicas,
            rotate_owners=self.rotate_owners,
            check_grads=self.check_grads,
        )
        check_agreement(
            agreement_groups(plan.batches),
            plan.batches,
            plan.params,
            plan.group_of,
            self.param_groups,
            settings,
            self._device(),
        )

    def _views(self, index: int, tensor: Tensor) -> Tensor:
        """The ``[N, rows, cols]`` view of Muon parameter ``index``'s local shard (or state).

        A view when the strides allow one, else a copy: only for tensors that are read
        (grads, directions); writes go through :meth:`_writable`.
        """
        local = local_tensor(tensor)
        layout: MatrixLayout = self._plan.layouts[index]
        return local.reshape(layout.num_matrices, layout.local_rows, layout.local_cols)

    def _writable(self, index: int, tensor: Tensor) -> tuple[Tensor, Callable[[], None]]:
        """``[N, rows, cols]`` matrices of a tensor that is updated in place, and a commit.

        A view when the strides allow (the commit does nothing); otherwise (a channels_last
        conv weight with ``flatten``, a permuted stack) a contiguous copy whose commit
        writes it back, so every parameter and momentum is really updated.
        """
        local = local_tensor(tensor)
        layout: MatrixLayout = self._plan.layouts[index]
        shape = (layout.num_matrices, layout.local_rows, layout.local_cols)
        try:
            return local.view(shape), _nothing
        except RuntimeError:
            matrices = local.reshape(shape)
            return matrices, lambda: local.copy_(matrices.view(local.shape))

    def _new_run(self, batch: MuonBatch) -> _Run:
        """A batch about to be prepared: the segments that have grads on this rank."""
        plan = self._plan
        segments = [s for s in batch.segments if plan.params[s.param_index].grad is not None]
        return _Run(batch, segments, None, receives_from_replica=_receives_from_replica(batch))

    def _prepare(self, run: _Run) -> _Run:
        """Phase 1: momentum and directions; the gather starts for exchanged batches.

        Resumable: ``run.momentum_done`` counts the segments whose momentum is updated; a
        retry recomputes their directions from the momentum instead of updating it again.
        """
        plan = self._plan
        batch = run.batch
        for seg in run.segments[run.momentum_done :]:
            p = plan.params[seg.param_index]
            group = self.param_groups[plan.group_of[seg.param_index]]
            momentum, commit = self._writable(seg.param_index, self.state[p]["momentum"])
            grad = self._views(seg.param_index, p.grad)
            momentum_update_(
                momentum[seg.start : seg.stop],
                grad[seg.start : seg.stop],
                setting_float(group["mu"]),
                False,
            )
            commit()
            run.momentum_done += 1
        stats = self.last_step_stats
        stats.num_batches += 1
        if run.receives_from_replica:
            run.prepared = True
            return run
        directions = []
        for seg in run.segments:
            p = plan.params[seg.param_index]
            group = self.param_groups[plan.group_of[seg.param_index]]
            momentum = self._views(seg.param_index, self.state[p]["momentum"])
            grad = self._views(seg.param_index, p.grad)
            directions.append(
                direction(
                    momentum[seg.start : seg.stop],
                    grad[seg.start : seg.stop],
                    setting_float(group["mu"]),
                    bool(group["nesterov"]),
                ).to(torch.bfloat16)
            )
        if not batch.layout.exchanged:
            run.directions = (
                None
                if not directions
                else directions[0]
                if len(directions) == 1
                else torch.cat(directions)
            )
            run.prepared = True
            return run
        pieces = [d for block in directions for d in block.unbind(0)]
        owners = self._active_owners(batch, run.segments)
        exchange = BatchExchange(batch.layout, owners, stats)
        exchange.start_gather(pieces, self._device())
        stats.bytes_minimum += exchange.minimum_bytes()
        run.directions, run.exchange = pieces, exchange
        run.prepared = True
        return run

    def _active_owners(self, batch: MuonBatch, segments: list[Segment]) -> tuple[int, ...]:
        active = {(s.param_index, i) for s in segments for i in range(s.start, s.stop)}
        units = [(s.param_index, i) for s in batch.segments for i in range(s.start, s.stop)]
        return tuple(o for u, o in zip(units, batch.owners) if u in active)

    def _orthogonalize(self, U: Tensor, batch: MuonBatch) -> Tensor:
        """Newton–Schulz on a bf16 ``[N, rows, cols]`` stack, per partition block."""
        implementation = NS_IMPLEMENTATIONS[self.newton_schulz_impl]
        stats = self.last_step_stats

        def ns(X: Tensor) -> Tensor:
            stats.ns_calls.append((X.size(0), X.size(1), X.size(2)))
            return implementation(X, self.coefficients, batch.eps)

        stats.matrices_orthogonalized += U.size(0)
        stats.owned_shapes.extend([(U.size(1), U.size(2))] * U.size(0))
        return orthogonalize_blocks(U, batch.partitions, ns)

    def _compute(self, run: _Run) -> None:
        """Phase 2: Newton–Schulz (the owner's matrix, or the local stack); return starts."""
        if run.receives_from_replica:
            run.computed = True
            return
        if run.exchange is None:
            if run.directions is not None:
                run.result = self._orthogonalize(run.directions, run.batch)
            run.computed = True
            return
        whole = run.exchange.assemble()
        result = None if whole is None else self._orthogonalize(whole[None], run.batch)[0]
        run.exchange.start_return(result, self._device())
        run.computed = True

    def _finish(self, run: _Run) -> None:
        """Phase 3: decay and update of this rank's shard (results shared across replicas).

        Resumable: the results are fetched once and segments already updated are skipped.
        """
        plan = self._plan
        if run.results is None:
            if run.exchange is not None:
                pieces = run.exchange.finish_return()
                results = torch.stack(pieces) if pieces else None
            else:
                results = run.result
            if run.batch.replica is not None and run.segments:
                results = self._share_with_replicas(run, results)
            run.results = results
        offset = sum(seg.count for seg in run.segments[: run.finished])
        for seg in run.segments[run.finished :]:
            p = plan.params[seg.param_index]
            group = self.param_groups[plan.group_of[seg.param_index]]
            matrices, commit = self._writable(seg.param_index, p)
            weight_update_(
                matrices[seg.start : seg.stop],
                run.results[offset : offset + seg.count],
                setting_float(group["lr"]),
                setting_float(group["weight_decay"]),
                plan.row_scales[seg.param_index],
            )
            commit()
            offset += seg.count
            run.finished += 1

    def _share_with_replicas(self, run: _Run, results: Tensor | None) -> Tensor:
        """Broadcast this rank's bf16 results ``[N, r, c]`` from the computing replica."""
        layout = run.batch.layout
        replicas = layout.replicas
        shape = (sum(s.count for s in run.segments), layout.local_rows, layout.local_cols)
        if run.receives_from_replica:
            buffer = torch.empty(shape, dtype=torch.bfloat16, device=self._device())
        else:
            buffer = results.contiguous()
        if buffer.numel() == 0:  # an empty shard: every replica knows, nothing to send
            return buffer
        src = replicas.ranks[run.batch.replica]
        dist.broadcast(buffer, src=src, group=replicas.process_group)
        stats = self.last_step_stats
        nbytes = buffer.numel() * buffer.element_size()
        if run.receives_from_replica:
            stats.replica_bytes_received += nbytes
        else:
            stats.replica_bytes_sent += nbytes * (replicas.size - 1)
        return buffer

    def _step_adamw(self, chunk: AdamWChunk, progress: _AdamWProgress | None = None) -> None:
        """AdamW on one group; ``progress`` counts the parameters done (for a resumed chunk)."""
        group = self.param_groups[chunk.group_index]
        params = [p for p in group["params"] if p.grad is not None]
        start = progress.done if progress is not None else 0
        params = params[start:]

        def done(_: int) -> None:
            if progress is not None:
                progress.done += 1

        adamw_update_(
            [local_tensor(p) for p in params],
            [local_tensor(p.grad) for p in params],
            [local_tensor(self.state[p]["momentum"]) for p in params],
            [local_tensor(self.state[p]["variance"]) for p in params],
            lr=setting_float(group["lr"]),
            beta1=setting_float(group["beta1"]),
            beta2=setting_float(group["beta2"]),
            weight_decay=setting_float(group["weight_decay"]),
            epsilon=setting_float(group["epsilon"]),
            step=int(group["step"]),
            on_param_done=done,
        )

    # ----------------------------------------------------- orthogonalize only

    @torch.no_grad()
    def orthogonalize_chunk(
        self, params: Sequence[Tensor], U: Sequence[Tensor], first_owner: int = 0
    ) -> list[Tensor]:
        """Newton–Schulz plus the exchange for given directions; no momentum, no update.

        ``params``: Muon parameters of one layout (one batch's worth: at most the shard-group
        size of matrices when exchanged); ``U[i]``: a local tensor shaped like
        ``params[i]``'s local shard. Returns the bf16 results, shaped like ``U``. The owner of
        the ``j``-th matrix is ``(first_owner + j) % k``. Collective over the shard group.
        """
        self._ensure_plan()
        if len(params) != len(U) or not params:
            raise ValueError(
                f"orthogonalize_chunk needs one direction per parameter, got {len(params)} "
                f"parameters and {len(U)} directions"
            )
        index_of = {id(p): i for i, p in enumerate(self._plan.params)}
        indices = []
        for p in params:
            if id(p) not in index_of:
                raise ValueError(
                    f"orthogonalize_chunk: a parameter of shape {tuple(p.shape)} is not a Muon "
                    "parameter of this optimizer"
                )
            indices.append(index_of[id(p)])
        layouts = {self._batch_signature(i) for i in indices}
        if len(layouts) != 1:
            raise ValueError(
                "orthogonalize_chunk needs parameters of one layout (global shape, placements, "
                "dtype, partitions)"
            )
        layout = self._plan.layouts[indices[0]]
        segments = [Segment(i, 0, self._plan.layouts[i].num_matrices) for i in indices]
        count = sum(s.count for s in segments)
        owners: tuple[int, ...] = ()
        if layout.exchanged:
            k = layout.group.size
            if count > k:
                raise ValueError(
                    f"orthogonalize_chunk got {count} matrices for a shard group of {k} ranks; "
                    f"pass at most {k}"
                )
            owners = tuple((first_owner + j) % k for j in range(count))
        batch = MuonBatch(
            -1,
            layout=layout,
            segments=segments,
            owners=owners,
            partitions=self._plan.partitions[indices[0]],
            eps=setting_float(self.param_groups[self._plan.group_of[indices[0]]]["epsilon"]),
        )
        directions = [self._views(i, u.to(torch.bfloat16)) for i, u in zip(indices, U)]
        if layout.exchanged:
            exchange = BatchExchange(layout, owners, self.last_step_stats)
            exchange.start_gather([m for d in directions for m in d.unbind(0)], self._device())
            whole = exchange.assemble()
            result = None if whole is None else self._orthogonalize(whole[None], batch)[0]
            exchange.start_return(result, self._device())
            flat = exchange.finish_return()
            results = torch.stack(flat) if flat else torch.empty(0)
        else:
            results = self._orthogonalize(torch.cat(directions), batch)
        out, offset = [], 0
        for seg, u in zip(segments, U):
            out.append(results[offset : offset + seg.count].reshape(local_tensor(u).shape))
            offset += seg.count
        return out

    def _batch_signature(self, index: int) -> tuple:
        plan = self._plan
        eps = setting_float(self.param_groups[plan.group_of[index]]["epsilon"])
        return batch_key(plan.layouts[index], plan.params[index].dtype, plan.partitions[index], eps)

    # ----------------------------------------------------------- checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shardmuon or dion state dict, all or nothing.

        The whole state dict is validated first (group count and sizes, each group's
        algorithm and settings, every state entry's keys, shapes, dtypes and DTensor
        placements against its parameter, and that the loaded groups can be planned); a
        failed load raises naming what is wrong and leaves the optimizer as it was. State
        missing for a parameter (dion creates it lazily) is created; a full state tensor
        for a DTensor parameter (a single-process dion checkpoint) is laid out like it.
        Loaded group settings take effect (the plan is rebuilt if they differ).

        Both dion forks load: samsja/dion's layout is shardmuon's; microsoft/dion's group
        keys ``split_sizes``/``num_heads`` become partitions, ``cautious_wd=True`` is refused
        (shardmuon has no cautious weight decay) and its per-parameter AdamW ``step_dev`` is
        dropped (the group's ``step`` counts).
        """
        if self._round is not None:
            raise RuntimeError(
                "load_state_dict during a step_chunk round; step the remaining chunks first"
            )
        merged = checked_groups(state_dict, self.param_groups, self._make_plan)
        # torch runs the post-hooks at the end of its load; they must see the finished load.
        post_hooks = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_post_hooks = post_hooks
        for group, full in zip(self.param_groups, merged):
            for key, value in full.items():
                group.setdefault(key, value)
        for state in self.state.values():
            if isinstance(state, dict):
                for key in DROPPED_KEYS:
                    state.pop(key, None)
        self._init_state()
        self._pending.clear()
        self._plan_settings = None  # replan: the loaded settings rule
        self._ensure_plan()
        for hook in post_hooks.values():
            hook(self)

    # ----------------------------------------------------------------- copies

    def __getstate__(self) -> dict[str, Any]:
        """torch keeps defaults, state and groups; the optimizer-wide settings come too."""
        state = super().__getstate__()
        state["_shardmuon_settings"] = {
            "update_rms": self.update_rms,
            "coefficients": self.coefficients,
            "max_in_flight": self.max_in_flight,
            "rotate_owners": self.rotate_owners,
            "split_replicas": self.split_replicas,
            "check_grads": self.check_grads,
            "newton_schulz_impl": self.newton_schulz_impl,
            "_raw_partitions": self._raw_partitions,
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore settings and rebuild what is derived from them (the plan).

        torch's ``load_state_dict`` also calls this, with only ``state`` and ``param_groups``:
        then the settings and the plan stay (``load_state_dict`` replans itself).
        """
        settings = state.pop("_shardmuon_settings", None)
        super().__setstate__(state)
        if settings is None:
            return
        self.__dict__.update(settings)
        self._reset_runtime()
        self._ensure_plan()


def _distribute_like(value: Tensor, param: DTensor) -> DTensor:
    """A full (e.g. dion single-process) state tensor laid out like ``param``, no communication."""
    if value.shape != param.shape:
        raise ValueError(
            f"optimizer state of shape {tuple(value.shape)} does not fit a parameter of global "
            f"shape {tuple(param.shape)}"
        )
    return distribute_tensor(
        value.to(local_tensor(param).device),
        param.device_mesh,
        param.placements,
        src_data_rank=None,
    )


def _communicates(chunk: Chunk) -> bool:
    """Whether stepping ``chunk`` runs a collective (an all-to-all or a replica broadcast)."""
    return isinstance(chunk, MuonBatch) and (chunk.layout.exchanged or chunk.replica is not None)


def _receives_from_replica(batch: MuonBatch) -> bool:
    """Whether another replica orthogonalizes ``batch`` for this rank."""
    replicas = batch.layout.replicas
    return batch.replica is not None and batch.replica != replicas.rank_index
