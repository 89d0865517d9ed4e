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

import functools
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from shardmuon.adamw import adamw_update_
from shardmuon.exchange import BatchExchange, warmup_groups
from shardmuon.layout import (
    MatrixLayout,
    MuonBatch,
    Segment,
    ShardGroup,
    batch_key,
)
from shardmuon.newton_schulz import newton_schulz, newton_schulz_unfolded, resolve_coefficients
from shardmuon.partitions import orthogonalize_blocks
from shardmuon.plan import AdamWChunk, Plan, build_plan
from shardmuon.telemetry import StepStats
from shardmuon.update import momentum_update_, weight_update_
from shardmuon.validation import check_adjust_lr, check_grads, check_group, check_mesh, check_number

__all__ = ["Muon"]

NS_IMPLEMENTATIONS = {"folded": newton_schulz, "unfolded": newton_schulz_unfolded}
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


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(Optimizer):
    """Muon with dion's param groups, state and checkpoints; distribution read from DTensors.

    Args:
        params: param groups (dicts with ``params`` and ``algorithm`` = ``"muon"`` or
            ``"adamw"``), or an iterable of tensors (one Muon group).
        lr, mu, betas, weight_decay, epsilon, nesterov, adjust_lr, flatten: group defaults, as
            in dion (``epsilon`` is AdamW's eps and Newton–Schulz's normalisation eps).
        update_rms: the update RMS for ``adjust_lr="rms_norm"``: the lr of an
            ``[m, n]`` matrix is scaled by ``update_rms * sqrt(max(m, n))`` (0.2 = dion).
        newton_schulz_coefficients: a preset name from ``NS_PRESETS`` or a list of
            ``(a, b, c)`` triples, one per iteration; ``None`` = ``"dion"``.
        matrix_partitions: ``{param: (rows_1, ...)}`` for fused weights: blocks along dim -2
            orthogonalized and scaled on their own. An optimizer attribute, not a group key.
        max_in_flight: batches between the gather and the compute phase in ``step()``.
        distributed_mesh: accepted for drop-in use with dion and only type-checked: the
            distribution comes from each parameter's DTensor placements.
        newton_schulz_impl: ``"folded"`` (default) or ``"unfolded"`` (dion's bf16 recipe,
            for benchmarks).
        rotate_owners: continue owners round-robin across batches (``False`` for benchmarks).
        split_replicas: for parameters with a replicate mesh dim (HSDP), let one replica
            orthogonalize each batch and broadcast the result to the others, instead of every
            replica repeating it: Newton–Schulz work divided by the replica count, for one
            bf16 broadcast of each rank's result shard over the replicate dim.
        warmup: run :meth:`warmup` at construction.
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
        *,
        lr: float = 0.01,
        mu: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        nesterov: bool = False,
        adjust_lr: str | None = "rms_norm",
        flatten: bool = False,
        update_rms: float = 0.2,
        newton_schulz_coefficients: str | Sequence[Sequence[float]] | None = None,
        matrix_partitions: dict[Tensor, Sequence[int]] | None = None,
        max_in_flight: int = 3,
        distributed_mesh: Any = None,
        newton_schulz_impl: str = "folded",
        rotate_owners: bool = True,
        split_replicas: bool = False,
        warmup: bool = False,
        check_grads: str = "first",
    ) -> None:
        if not isinstance(betas, Sequence) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        if isinstance(update_rms, bool) or not isinstance(update_rms, (int, float)):
            raise TypeError(f"update_rms must be a number, got {update_rms!r}")
        if not update_rms > 0:
            raise ValueError(f"update_rms must be > 0, got {update_rms!r}")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int):
            raise TypeError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        if newton_schulz_impl not in NS_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown newton_schulz_impl {newton_schulz_impl!r}; accepted: "
                f"{', '.join(map(repr, NS_IMPLEMENTATIONS))}"
            )
        if check_grads not in CHECK_GRADS:
            raise ValueError(
                f"unknown check_grads {check_grads!r}; accepted: "
                f"{', '.join(map(repr, CHECK_GRADS))}"
            )
        check_mesh(distributed_mesh)
        for name, value, upper in (
            ("lr", lr, None),
            ("mu", mu, 1.0),
            ("betas[0]", betas[0], 1.0),
            ("betas[1]", betas[1], 1.0),
            ("weight_decay", weight_decay, None),
            ("epsilon", epsilon, None),
        ):
            check_number(name, value, upper)
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
        self.update_rms = float(update_rms)
        self.coefficients = resolve_coefficients(newton_schulz_coefficients)
        self.max_in_flight = max_in_flight
        self.rotate_owners = rotate_owners
        self.split_replicas = bool(split_replicas)
        self.check_grads = check_grads
        self._newton_schulz = NS_IMPLEMENTATIONS[newton_schulz_impl]
        self._raw_partitions = dict(matrix_partitions or {})
        self._plan: Plan | None = None
        self._round_done: set[int] = set()
        self._grads_checked = False
        self.last_step_stats = StepStats()
        super().__init__(params, defaults)
        self._plan = self._make_plan()
        self._init_state()
        if warmup:
            self.warmup()

    # ----------------------------------------------------------------- planning

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (validated as in the constructor); the plan is rebuilt.

        A group that fails validation, or whose parameters cannot be planned, is removed
        again, leaving the optimizer as it was.
        """
        super().add_param_group(param_group)
        try:
            check_group(len(self.param_groups) - 1, self.param_groups[-1])
            if self._plan is not None:
                plan = self._make_plan()
        except Exception:
            self.param_groups.pop()
            raise
        if self._plan is not None:
            self._plan = plan
            self._init_state()

    def _make_plan(self) -> Plan:
        return build_plan(
            self.param_groups,
            self._raw_partitions,
            self.update_rms,
            self.rotate_owners,
            self.split_replicas,
        )

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
        """The fixed list of chunks: Muon batches (exchanged ones first), then AdamW groups."""
        return [*self._plan.batches, *self._plan.adamw]

    def shard_groups(self) -> list[ShardGroup]:
        """Distinct process groups the Muon all-to-alls use, in first-use order."""
        seen: dict[tuple[int, ...], ShardGroup] = {}
        for layout in self._plan.layouts:
            if layout.group is not None:
                seen.setdefault(layout.group.ranks, layout.group)
        return list(seen.values())

    def warmup(self) -> None:
        """Run a tiny all-to-all on every group Muon will use (read from the parameters)."""
        groups = self.shard_groups()
        if groups:
            warmup_groups(groups, self._device())

    def _device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return _local(p).device
        return torch.device("cpu")

    # ----------------------------------------------------------------- stepping

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over all chunks, pipelined (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._round_done:
            raise RuntimeError(
                f"step() called after step_chunk() stepped {len(self._round_done)} of "
                f"{len(self.chunks())} chunks; step the remaining chunks first"
            )
        self._begin_round()
        in_flight: deque[_Run] = deque()
        returning: deque[_Run] = deque()
        adamw_pending = list(self._plan.adamw)
        for batch in self._plan.batches:
            in_flight.append(self._prepare(batch))
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
        self._round_done.clear()
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

        A round is one pass over :meth:`chunks` in any order; stepping a chunk twice in a
        round raises, so counters and bias corrections cannot drift.
        """
        chunks = self.chunks()
        if not any(chunk is c for c in chunks):
            raise ValueError("step_chunk got a chunk that is not in this optimizer's chunks()")
        key = next(i for i, c in enumerate(chunks) if c is chunk)
        if key in self._round_done:
            raise RuntimeError(
                f"chunk {key} was already stepped in this round; step the other "
                f"{len(chunks) - len(self._round_done)} chunks first"
            )
        if not self._round_done:
            self._begin_round()
        self._round_done.add(key)
        if isinstance(chunk, AdamWChunk):
            self._step_adamw(chunk)
        else:
            run = self._prepare(chunk)
            self._compute(run)
            self._finish(run)
        if len(self._round_done) == len(chunks):
            self._round_done.clear()

    def _begin_round(self) -> None:
        """Checks first (nothing changes if they raise), then the step counters advance."""
        check_grads(self.param_groups)
        if self.check_grads == "always" or (
            self.check_grads == "first" and not self._grads_checked
        ):
            self._check_grad_presence()
            self._grads_checked = True
        for group in self.param_groups:
            group["step"] += 1
        self.last_step_stats = StepStats()

    def _check_grad_presence(self) -> None:
        """Per shard group: the same plan everywhere, and grads on all ranks or on none.

        One all-reduce of a plan signature, then one of grad-presence flags, per group; a
        mismatch raises on every rank of the group instead of hanging in an all-to-all.
        """
        plan = self._plan
        for group in self.shard_groups():
            self._check_same_plan(group)
            members = [
                i
                for i, layout in enumerate(plan.layouts)
                if layout.group is not None and layout.group.ranks == group.ranks
            ]
            flags = torch.tensor(
                [int(plan.params[i].grad is not None) for i in members],
                dtype=torch.int32,
                device=self._device(),
            )
            dist.all_reduce(flags, group=group.process_group)
            bad = [members[j] for j, count in enumerate(flags.tolist()) if 0 < count < group.size]
            if bad:
                shapes = [tuple(plan.params[i].shape) for i in bad]
                raise ValueError(
                    f"Muon parameters with shapes {shapes} have a grad on some ranks of the "
                    f"group {list(group.ranks)} and none on others; a sharded parameter's grad "
                    "must exist on all ranks of its group or on none (FSDP2 guarantees this: "
                    "check for parameters used on some ranks only)"
                )

    def _check_same_plan(self, group: ShardGroup) -> None:
        """Raise on every rank of ``group`` if its ranks planned different batches."""
        batches = [b for b in self._plan.batches if b.layout.group is not None]
        batches = [b for b in batches if b.layout.group.ranks == group.ranks]
        described = [
            (b.layout.rows, b.layout.cols, b.layout.shard_axis, b.num_matrices, b.owners)
            for b in batches
        ]
        signature = zlib.crc32(repr(described).encode())
        total = torch.tensor([signature], dtype=torch.int64, device=self._device())
        dist.all_reduce(total, group=group.process_group)
        if total.item() != signature * group.size:
            shapes = sorted({(rows, cols) for rows, cols, *_ in described})
            raise ValueError(
                f"the ranks of shard group {list(group.ranks)} planned different Muon batches "
                f"(this rank: {len(batches)} batches of matrix shapes {shapes}); every rank "
                "of a group must hold the same parameters, in the same order, with the same "
                "global shapes and placements"
            )

    def _views(self, index: int, tensor: Tensor) -> Tensor:
        """The ``[N, rows, cols]`` view of Muon parameter ``index``'s local shard (or state).

        A view (never a copy) so in-place updates land in the parameter; grads that are not
        contiguous are reshaped (copied), which is fine as they are only read.
        """
        local = _local(tensor)
        layout: MatrixLayout = self._plan.layouts[index]
        shape = (layout.num_matrices, layout.local_rows, layout.local_cols)
        return local.view(shape) if local.is_contiguous() else local.reshape(shape)

    def _prepare(self, batch: MuonBatch) -> _Run:
        """Phase 1: momentum and directions; the gather starts for exchanged batches."""
        plan = self._plan
        segments = [s for s in batch.segments if plan.params[s.param_index].grad is not None]
        receives = _receives_from_replica(batch)
        directions = []
        for seg in segments:
            p = plan.params[seg.param_index]
            group = self.param_groups[plan.group_of[seg.param_index]]
            momentum = self._views(seg.param_index, self.state[p]["momentum"])
            grad = self._views(seg.param_index, p.grad)
            direction = momentum_update_(
                momentum[seg.start : seg.stop],
                grad[seg.start : seg.stop],
                float(group["mu"]),
                bool(group["nesterov"]),
            )
            if not receives:
                directions.append(direction.to(torch.bfloat16))
        stats = self.last_step_stats
        stats.num_batches += 1
        if receives:
            return _Run(batch, segments, None, receives_from_replica=True)
        if not batch.layout.exchanged:
            stacked = (
                None
                if not directions
                else directions[0]
                if len(directions) == 1
                else torch.cat(directions)
            )
            return _Run(batch, segments, stacked)
        pieces = [d for block in directions for d in block.unbind(0)]
        owners = self._active_owners(batch, segments)
        exchange = BatchExchange(batch.layout, owners, stats)
        exchange.start_gather(pieces, self._device())
        stats.bytes_minimum += exchange.minimum_bytes()
        return _Run(batch, segments, pieces, exchange)

    def _active_owners(self, batch: MuonBatch, segments: list[Segment]) -> tuple[int, ...]:
        active = {(s.param_index, i) for s in segments for i in range(s.start, s.stop)}
        units = [(s.param_index, i) for s in batch.segments for i in range(s.start, s.stop)]
        return tuple(o for u, o in zip(units, batch.owners) if u in active)

    def _orthogonalize(self, U: Tensor, batch: MuonBatch) -> Tensor:
        """Newton–Schulz on a bf16 ``[N, rows, cols]`` stack, per partition block."""
        ns = functools.partial(self._newton_schulz, coefficients=self.coefficients, eps=batch.eps)
        stats = self.last_step_stats
        stats.matrices_orthogonalized += U.size(0)
        stats.owned_shapes.extend([(U.size(1), U.size(2))] * U.size(0))
        return orthogonalize_blocks(U, batch.partitions, ns)

    def _compute(self, run: _Run) -> None:
        """Phase 2: Newton–Schulz (the owner's matrix, or the local stack); return starts."""
        if run.receives_from_replica:
            return
        if run.exchange is None:
            if run.directions is not None:
                run.result = self._orthogonalize(run.directions, run.batch)
            return
        whole = run.exchange.assemble()
        result = None if whole is None else self._orthogonalize(whole[None], run.batch)[0]
        run.exchange.start_return(result, self._device())

    def _finish(self, run: _Run) -> None:
        """Phase 3: decay and update of this rank's shard (results shared across replicas)."""
        plan = self._plan
        if run.exchange is not None:
            pieces = run.exchange.finish_return()
            results = torch.stack(pieces) if pieces else None
        else:
            results = run.result
        if run.batch.replica is not None and run.segments:
            results = self._share_with_replicas(run, results)
        offset = 0
        for seg in run.segments:
            p = plan.params[seg.param_index]
            group = self.param_groups[plan.group_of[seg.param_index]]
            view = self._views(seg.param_index, p)[seg.start : seg.stop]
            weight_update_(
                view,
                results[offset : offset + seg.count],
                float(group["lr"]),
                float(group["weight_decay"]),
                plan.row_scales[seg.param_index],
            )
            offset += seg.count

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

    def _step_adamw(self, chunk: AdamWChunk) -> None:
        group = self.param_groups[chunk.group_index]
        params = [p for p in group["params"] if p.grad is not None]
        adamw_update_(
            [_local(p) for p in params],
            [_local(p.grad) for p in params],
            [_local(self.state[p]["momentum"]) for p in params],
            [_local(self.state[p]["variance"]) for p in params],
            lr=float(group["lr"]),
            beta1=float(group["beta1"]),
            beta2=float(group["beta2"]),
            weight_decay=float(group["weight_decay"]),
            epsilon=float(group["epsilon"]),
            step=int(group["step"]),
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
            eps=float(self.param_groups[self._plan.group_of[indices[0]]]["epsilon"]),
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
            out.append(results[offset : offset + seg.count].reshape(_local(u).shape))
            offset += seg.count
        return out

    def _batch_signature(self, index: int) -> tuple:
        plan = self._plan
        eps = float(self.param_groups[plan.group_of[index]]["epsilon"])
        return batch_key(plan.layouts[index], plan.params[index].dtype, plan.partitions[index], eps)

    # ----------------------------------------------------------- checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shardmuon or dion state dict; missing state is created, DTensor state restored.

        Both dion forks load: samsja/dion's layout is shardmuon's; microsoft/dion adds the
        group key ``cautious_wd`` (kept; ``True`` is refused, shardmuon has no cautious weight
        decay) and a per-parameter AdamW ``step_dev`` (dropped: the group's ``step`` counts).
        """
        for i, group in enumerate(state_dict.get("param_groups", [])):
            if group.get("cautious_wd"):
                raise ValueError(
                    f"param group {i} of this state dict has cautious_wd=True (microsoft/dion's "
                    "cautious weight decay), which shardmuon does not implement; resuming would "
                    "silently change the update"
                )
        super().load_state_dict(state_dict)
        for state in self.state.values():
            state.pop("step_dev", None)
        self._init_state()
        self._round_done.clear()


def _distribute_like(value: Tensor, param: DTensor) -> DTensor:
    """A full (e.g. dion single-process) state tensor laid out like ``param``, no communication."""
    if value.shape != param.shape:
        raise ValueError(
            f"optimizer state of shape {tuple(value.shape)} does not fit a parameter of global "
            f"shape {tuple(param.shape)}"
        )
    return distribute_tensor(
        value.to(_local(param).device), param.device_mesh, param.placements, src_data_rank=None
    )


def _receives_from_replica(batch: MuonBatch) -> bool:
    """Whether another replica orthogonalizes ``batch`` for this rank."""
    replicas = batch.layout.replicas
    return batch.replica is not None and batch.replica != replicas.rank_index
