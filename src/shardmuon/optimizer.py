"""``Muon``: the optimizer class. It plans and dispatches; the math and the step live elsewhere.

The class is the torch.optim facade: settings and their checks, param groups, state,
checkpoints, the plan (``planning/``: layouts, batches, owners, computed once and rebuilt
when a planned setting changes), the agreement check between ranks (``runtime/agreement.py``),
and rounds of ``step_chunk``. A step's work, batch by batch and phase by phase, is in
``runtime/phases.py`` and ``runtime/pipeline.py``; the all-to-alls in ``runtime/exchange.py``;
the bytes in flight in ``planning/workspace.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from shardmuon.ops.engines import resolve_restarts
from shardmuon.ops.newton_schulz import resolve_coefficients
from shardmuon.ops.ns_engine import NS_CHOICES, EngineCost, Orthogonalizer, resolve_ns_dtype
from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.chunks import Chunk, batch_for_directions, chunk_info, communicates
from shardmuon.planning.placements import local_tensor
from shardmuon.planning.plan import (
    ChunkInfo,
    Plan,
    build_plan,
    plan_settings,
)
from shardmuon.planning.workspace import DEFAULT_WORKSPACE_BYTES, batch_bytes, step_schedule
from shardmuon.runtime.agreement import agreement_groups, check_plan_agreement
from shardmuon.runtime.calibration import calibrate, plan_shape_classes
from shardmuon.runtime.exchange import warmup_groups
from shardmuon.runtime.offload import OFFLOAD_CHOICES, StateStager
from shardmuon.runtime.phases import BatchRun, StepContext, orthogonalize_directions
from shardmuon.runtime.pipeline import new_progress, run_step, step_one_chunk
from shardmuon.runtime.state import (
    adopt_loaded_counts,
    advance_step_counters,
    host_state_entries,
    init_state,
)
from shardmuon.runtime.telemetry import StepStats
from shardmuon.state_dict_checks import DROPPED_KEYS, checked_groups
from shardmuon.validation import (
    AGREED_SETTINGS,
    MOMENTUM_ALIAS,
    OPTIMIZER_SETTINGS,
    apply_momentum_alias,
    check_dion_arguments,
    check_grads,
    check_group,
    check_group_settings,
    check_momentum_alias,
    check_optimizer_settings,
    group_defaults,
)

__all__ = ["Muon"]


class Muon(Optimizer):
    r"""Muon with dion's param groups, state and checkpoints; distribution read from DTensors.

    For each matrix ``X`` (the last two dims of a Muon parameter; each block of a
    partitioned one) with gradient ``G``, at every step::

        M <- mu * M + G                                  (momentum, fp32 or the param dtype)
        U <- mu * M + G  if nesterov  else  M
        O <- NS(U / (||U||_F + eps))                     (Newton-Schulz in bf16: for each
                                                           (a, b, c), A = X X^T,
                                                           X <- a X + (b A + c A^2) X)
        X <- X * (1 - lr * weight_decay) - lr * scale(m, n) * O

    for an ``[m, n]`` matrix, with ``scale`` = ``sqrt(m / n)`` for ``adjust_lr=
    "spectral_norm"``, ``update_rms * sqrt(max(m, n))`` for ``"rms_norm"``,
    ``sqrt(max(1, m / n))`` for ``"keller_muon"``, 1 for ``None``. Parameters of
    ``"adamw"`` groups get dion's AdamW. The owner of each matrix (one rank of its shard
    group) runs ``NS`` on the whole matrix; the others send their pieces and get theirs of
    ``O`` back (``planning/`` decides who, ``runtime/`` does it).

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
        workspace_bytes: the budget for the step's transient buffers on each rank (bf16
            send/receive buffers, gathered matrices, local stacks, Newton–Schulz's
            buffers; see ``planning/workspace.py``): batches are admitted into flight only while
            their estimated bytes fit, and local stacks are cut to fit. A single batch
            larger than the budget runs alone. Default 512 MiB.
        offload: ``"state"`` keeps ``momentum``/``variance`` in host memory (pinned when the
            parameters are on an accelerator) and streams each chunk's state to the device
            just before the chunk needs it and back right after (see ``runtime/offload.py``);
            ``None`` (default) keeps the state with the parameters. The update is the same,
            bit for bit.
        offload_prefetch: with offload, how many chunks' state may be on the device at once
            (the chunk being stepped and the ones loading ahead of it); default 2.
        newton_schulz_dtype, newton_schulz_restarts, newton_schulz_guard: the iteration's
            dtype (``"bfloat16"`` default, ``"float16"``, ``"float32"``; fp32 normalisation,
            bf16 results; bf16 Gram runs its GEMMs in fp16 on CUDA, fp32 elsewhere), Gram's
            restart steps (``None``: after 2, then every 3; runs of more than 3 steps
            without a restart are refused), and the divergence guard (``None``: on for
            ``"gram"`` only; certifies sigma_max <= 1.15x the band; a device sync per call):
            see ``ops/engines.py``, ``ops/ns_guard.py``. Every engine honours the dtype.
        newton_schulz_preconditioner: ``None`` (default: dion's numerics) or ``"aol"``:
            rescale each matrix's rows by its Gram matrix's absolute row sums (Turbo-Muon,
            arXiv:2512.04632) from the product the first iteration computes anyway; with
            ``newton_schulz_coefficients=None`` it runs the 4-step ``"aol"`` preset (one
            iteration fewer). Every engine applies it.
        newton_schulz_impl: ``"folded"`` (default); ``"gram"`` (fewer FLOPs for wide
            matrices); ``"auto"`` (Gram for aspect >= 2.5 on CUDA, else folded);
            ``"per-matrix"`` (folded one matrix at a time: bits independent of the batch,
            so of the layout and budget); ``"unfolded"`` (dion's recipe) or ``"compiled"``.
        rotate_owners: continue owners round-robin across batches (``False`` for benchmarks).
        split_replicas: for parameters with a replicate mesh dim (HSDP), let one replica
            orthogonalize each batch and broadcast the result to the others, instead of every
            replica repeating it: Newton–Schulz work divided by the replica count, for one
            bf16 broadcast of each rank's result shard over the replicate dim.
        warmup: run :meth:`warmup` at construction.
        world_mesh, fsdp_mesh_dim: samsja/dion's mesh arguments, type-checked only.
        check_grads: when to verify, with one small all-reduce per group, that the group's
            ranks planned the same batches with the same settings and that a parameter's
            grad is present on all ranks of its group or on none: ``"first"`` step and after
            a plan change (default), ``"always"``, or ``"never"`` (the plan is still compared
            once, so that ranks configured differently get an error, not a hang; grads
            never). A parameter without a grad is skipped (no momentum, no decay) on every
            rank, as in dion.

    A matrix whose direction holds NaN or inf (a non-finite gradient or momentum) is
    skipped: its orthogonalized direction is zero (decoupled weight decay still applies),
    it is counted in ``last_step_stats.nonfinite_matrices``, and every other matrix gets
    exactly its update. Its momentum keeps the non-finite values: zero it or restore a
    checkpoint. Huge finite gradients (1e18) are normalised without overflow.
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
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        offload: str | None = None,
        offload_prefetch: int = 2,
        newton_schulz_impl: str = "folded",
        newton_schulz_dtype: torch.dtype | str = "bfloat16",
        newton_schulz_restarts: Sequence[int] | None = None,
        newton_schulz_guard: bool | None = None,
        newton_schulz_preconditioner: str | None = None,
        rotate_owners: bool = True,
        split_replicas: bool = False,
        warmup: bool = False,
        check_grads: str = "first",
        world_mesh: Any = None,
        fsdp_mesh_dim: Any = None,
    ) -> None:
        check_dion_arguments(
            distributed_mesh, world_mesh, fsdp_mesh_dim, use_triton, newton_schulz_func
        )
        defaults = group_defaults(
            lr=lr, mu=mu, betas=betas, weight_decay=weight_decay, epsilon=epsilon,
            nesterov=nesterov, flatten=flatten, adjust_lr=adjust_lr,
        )  # fmt: skip
        self.__dict__.update(
            update_rms=update_rms,
            # None: the default schedule, which follows the preconditioner (AOL's 4 steps).
            coefficients=None
            if newton_schulz_coefficients is None
            else resolve_coefficients(newton_schulz_coefficients),
            _default_coefficients=None,
            newton_schulz_impl=newton_schulz_impl,
            newton_schulz_dtype=newton_schulz_dtype,
            newton_schulz_restarts=newton_schulz_restarts,
            newton_schulz_guard=newton_schulz_guard,
            newton_schulz_preconditioner=newton_schulz_preconditioner,
            max_in_flight=max_in_flight,
            workspace_bytes=workspace_bytes,
            offload=offload,
            offload_prefetch=offload_prefetch,
            rotate_owners=rotate_owners,
            split_replicas=split_replicas,
            check_grads=check_grads,
        )
        self._check_options()
        self.newton_schulz_restarts = resolve_restarts(
            newton_schulz_restarts, len(self.coefficients)
        )
        self.update_rms = float(update_rms)
        self._raw_partitions = dict(matrix_partitions or {})
        self._reset_runtime()
        super().__init__(params, defaults)
        # torch's OneCycleLR/CyclicLR (cycle_momentum=True) need "momentum" in the defaults
        # and then write group["momentum"]: an alias of mu (muon) / beta1 (adamw), see
        # validation.apply_momentum_alias. It is added after the groups, so that a group
        # only has the key once a scheduler (or the user) sets it: dion's keys otherwise.
        self.defaults[MOMENTUM_ALIAS] = None
        self._ensure_plan()
        if warmup:
            self.warmup()

    def _reset_runtime(self) -> None:
        """What is derived from the settings, not part of them (rebuilt after a copy)."""
        self._plan: Plan | None = None
        self._plan_settings: tuple | None = None
        self._plan_verified = False
        self._auto_choices: dict[tuple[int, int], str] | None = None
        self._round: set[int] | None = None
        self._pending: dict[int, Any] = {}
        self._broken: str | None = None  # why the open step_chunk round cannot go on
        self._state_stager: StateStager | None = None
        # Per group: the count its parameters' ``step`` counters were last given.
        self._counted_steps: dict[int, int] = {}
        self.last_step_stats = StepStats()

    def _settings(self, names: Sequence[str] = OPTIMIZER_SETTINGS) -> dict[str, Any]:
        return {name: getattr(self, name) for name in names}

    def _check_options(self) -> None:
        """The optimizer-wide settings (public attributes, so checked again before each step)."""
        self._resolve_live_coefficients()
        check_optimizer_settings(self._settings(), NS_CHOICES, OFFLOAD_CHOICES)

    def _resolve_live_coefficients(self) -> None:
        """``coefficients`` as the iteration reads them: a preset name or a list set on a
        live optimizer is resolved, ``None`` is the default, and the default follows the
        preconditioner (dion's 5 steps, or AOL's 4) until coefficients are given."""
        value = self.coefficients
        if value is None or value is self._default_coefficients:
            preset = "aol" if self.newton_schulz_preconditioner == "aol" else None
            self.coefficients = self._default_coefficients = resolve_coefficients(preset)
        elif not (isinstance(value, tuple) and all(isinstance(t, tuple) for t in value)):
            self.coefficients = resolve_coefficients(value)

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
        given_alias = MOMENTUM_ALIAS in param_group
        super().add_param_group(param_group)
        if not given_alias:
            self.param_groups[-1].pop(MOMENTUM_ALIAS, None)
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
            self.workspace_bytes,
            self._engine_cost(),
        )

    def _current_settings(self) -> tuple:
        return plan_settings(
            self.param_groups,
            self._raw_partitions,
            self.update_rms,
            self.rotate_owners,
            self.split_replicas,
            self.workspace_bytes,
            self._engine_cost(),
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
        for index, group in enumerate(self.param_groups):  # all checked before any is applied
            check_momentum_alias(index, group)
        for index, group in enumerate(self.param_groups):
            apply_momentum_alias(index, group)
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
        self._auto_choices = None

    def _init_state(self) -> None:
        """State for every parameter, where it lives (``runtime/state.py``)."""
        init_state(self.param_groups, self.state, self.offload == "state", self._counted_steps)

    def chunks(self) -> list[Chunk]:
        """The list of chunks: Muon batches (exchanged ones first), then AdamW groups.

        Fixed while the plan is (see :meth:`_ensure_plan`); a changed setting gives new
        chunk objects.
        """
        self._ensure_plan()
        return [*self._plan.batches, *self._plan.adamw]

    def chunk_info(self, chunk: Chunk) -> ChunkInfo:
        """What ``chunk`` (one of :meth:`chunks`) holds: parameters, matrices, state bytes."""
        self._ensure_plan()
        return chunk_info(self._plan, self.param_groups, self.state, chunk)

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
        """One optimizer step over all chunks, pipelined (see ``runtime/pipeline.py``).

        If it raises before the step counters advance (every input check), nothing has
        changed. If it raises after (out of memory in Newton–Schulz, a failed collective),
        the counters have advanced, every Muon momentum is updated (one ``_foreach`` pass at
        the start), chunks already finished are updated, and the other parameters are
        unchanged: restore a checkpoint rather than step again.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if self._round is not None:
            raise RuntimeError(
                f"step() called while a step_chunk() round is open ({len(self._round)} of "
                f"{len(self.chunks())} chunks stepped); step the remaining chunks first"
            )
        self._begin_round()
        stager = self._stager()
        peak = run_step(self._context(), self.workspace_bytes, self.max_in_flight, stager)
        self.last_step_stats.workspace_peak_bytes = peak
        return loss

    def _stager(self) -> StateStager | None:
        if self.offload != "state":
            return None
        if self._state_stager is None or self._state_stager.prefetch != self.offload_prefetch:
            self._state_stager = StateStager(
                self._device(), self.offload_prefetch, self.last_step_stats
            )
        self._state_stager.stats = self.last_step_stats
        return self._state_stager

    def _orthogonalizer(self) -> Orthogonalizer:
        return Orthogonalizer(
            self.newton_schulz_impl,
            resolve_ns_dtype(self.newton_schulz_dtype),
            self.newton_schulz_restarts,
            guard=self.newton_schulz_guard,
            preconditioner=self.newton_schulz_preconditioner,
            choices=self._auto_choices,
        )

    def _calibrate_auto(self) -> None:
        """``"auto"``: time the candidates on this plan's shape classes once (rank 0's
        choice, broadcast: ``runtime/calibration.py``). Every rank gets here together."""
        if self.newton_schulz_impl != "auto" or self._auto_choices is not None:
            return
        dtype = resolve_ns_dtype(self.newton_schulz_dtype)
        key = (
            str(self._device()),
            str(dtype),
            self.newton_schulz_preconditioner,
            tuple(map(tuple, self.coefficients)),
            self.newton_schulz_restarts,
            self.newton_schulz_guard,
        )

        def make(name: str) -> Orthogonalizer:
            return Orthogonalizer(
                name,
                dtype,
                self.newton_schulz_restarts if name == "gram" else None,
                guard=self.newton_schulz_guard,
                preconditioner=self.newton_schulz_preconditioner,
            )

        classes = plan_shape_classes(self._plan.batches)
        eps = float(self.defaults["epsilon"])
        self._auto_choices = calibrate(classes, key, make, self._device(), self.coefficients, eps)

    def _engine_cost(self) -> EngineCost:
        """The Newton–Schulz cost model the plan's workspace and owner balancing read."""
        return EngineCost(
            impl=self.newton_schulz_impl,
            dtype=resolve_ns_dtype(self.newton_schulz_dtype),
            restarts=resolve_restarts(self.newton_schulz_restarts, len(self.coefficients)),
            guard=self.newton_schulz_guard,
            coefficients=tuple(map(tuple, self.coefficients)),
            device_type=self._device().type,
            preconditioner=self.newton_schulz_preconditioner,
        )

    def _context(self) -> StepContext:
        return StepContext(
            plan=self._plan,
            param_groups=self.param_groups,
            state=self.state,
            stats=self.last_step_stats,
            newton_schulz=self._orthogonalizer(),
            coefficients=self.coefficients,
            device=self._device(),
            workspace_bytes=self.workspace_bytes,
        )

    @torch.no_grad()
    def step_chunk(self, chunk: Chunk) -> None:
        """Step one chunk (on the current stream); the step counters advance on a round's first chunk.

        A round is one pass over :meth:`chunks`; stepping a chunk twice in a round raises, so
        counters and bias corrections cannot drift. Chunks that communicate (exchanged
        batches, batches shared across replicas) must be stepped in the order of
        :meth:`chunks` — any other order raises before a collective, since every rank must
        pair the same all-to-alls; local batches and AdamW chunks may go in any order. A chunk whose step
        raised before any collective (a local or AdamW chunk, or a check before an
        exchange) is not marked done: calling ``step_chunk`` with it again resumes where it
        failed (its momentum is not updated twice, parameters already updated are not
        updated again). A chunk that raised after its collectives began cannot be replayed
        (its peers are past them, or fail in them at the process group's timeout): every
        later ``step_chunk``/``step`` raises saying so, until ``load_state_dict`` restores
        a checkpoint and ends the round.
        """
        chunks = self.chunks()
        key = next((i for i, c in enumerate(chunks) if c is chunk), None)
        if key is None:
            raise ValueError(
                "step_chunk got a chunk that is not in this optimizer's chunks() (chunks "
                "are rebuilt when a planned setting changes: call chunks() again)"
            )
        if self._broken is not None:
            raise RuntimeError(self._broken)
        if self._round is not None and key in self._round:
            raise RuntimeError(
                f"chunk {key} was already stepped in this round; step the other "
                f"{len(chunks) - len(self._round)} chunks first"
            )
        if communicates(chunk):
            done = self._round or set()
            earlier = [i for i, c in enumerate(chunks[:key]) if communicates(c) and i not in done]
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
        ctx = self._context()
        progress = self._pending.pop(key, None) or new_progress(ctx, chunk)
        try:
            step_one_chunk(ctx, chunk, progress, self._stager(), key)
        except BaseException as error:
            if isinstance(progress, BatchRun) and progress.communicated:
                self._broken = _unreplayable(key, error)
            else:
                self._pending[key] = progress
            raise
        if isinstance(chunk, MuonBatch):
            stats = self.last_step_stats
            stats.workspace_peak_bytes = max(
                stats.workspace_peak_bytes,
                sum(vars(batch_bytes(chunk, self._plan.ns_cost)).values()),
            )
        self._round.add(key)
        if len(self._round) == len(chunks):
            self._round = None

    def _begin_round(self) -> None:
        """Checks first (nothing changes if they raise), then the step counters advance."""
        self._ensure_plan()
        check_grads(self.param_groups)
        # State replaced by the user (a channels_last momentum, say) or ``offload`` changed
        # since construction: put every state tensor where the step expects it (with
        # offload: contiguous host memory, which staging views and writes back in place).
        self._init_state()
        # "never" still compares the plan once (one small all-reduce per group): a rank
        # configured otherwise would otherwise meet this check with its first all-to-all.
        if self.check_grads == "always" or not self._plan_verified:
            self._check_agreement()
            self._calibrate_auto()
            self._plan_verified = True
        advance_step_counters(self.param_groups, self.state, self._counted_steps)
        self.last_step_stats = StepStats()

    def _check_agreement(self) -> None:
        """Every group's ranks agree on batches, settings and grads (see ``runtime/agreement.py``)."""
        settings = self._settings(AGREED_SETTINGS)
        settings["coefficients"] = tuple(map(tuple, self.coefficients))
        # One spelling per value: "float32" and torch.float32 are the same setting.
        settings["newton_schulz_dtype"] = str(resolve_ns_dtype(self.newton_schulz_dtype))
        schedule = step_schedule(
            self._plan.batches, self.workspace_bytes, self.max_in_flight, self._plan.ns_cost
        )
        check_plan_agreement(
            self._plan, self.param_groups, settings, self._device(), schedule,
            compare_grads=self.check_grads != "never",
        )  # fmt: skip

    @torch.no_grad()
    def orthogonalize_chunk(
        self, params: Sequence[Tensor], U: Sequence[Tensor], first_owner: int = 0
    ) -> list[Tensor]:
        """Newton–Schulz plus the exchange for given directions; no momentum, no update.

        ``params``: Muon parameters of one layout (one batch's worth: at most the shard-group
        size of matrices when exchanged); ``U[i]``: a local tensor shaped like
        ``params[i]``'s local shard. Returns the bf16 results, shaped like ``U``. The owners
        are ranks ``first_owner, first_owner + 1, ...`` (mod ``k``), given to the matrices
        in ascending rank order. Collective over the shard group.
        """
        self._ensure_plan()
        batch, indices = batch_for_directions(self._plan, self.param_groups, params, U, first_owner)
        return orthogonalize_directions(self._context(), batch, indices, U)

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
        # The pre-hooks run first, here, so that what is validated is what is loaded (a
        # hook may return another dict); torch must not run them a second time.
        pre_hooks = self._optimizer_load_state_dict_pre_hooks
        for hook in pre_hooks.values():
            changed = hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        merged = checked_groups(state_dict, self.param_groups, self._make_plan)
        if self._state_stager is not None:
            self._state_stager.wait_host()
        # torch runs the post-hooks at the end of its load; they must see the finished load.
        post_hooks = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            if self.offload == "state":
                self._load_to_host(state_dict)
            else:
                super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre_hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        for group, full in zip(self.param_groups, merged):
            for key, value in full.items():
                group.setdefault(key, value)
        for state in self.state.values():
            if isinstance(state, dict):
                for key in DROPPED_KEYS:
                    state.pop(key, None)
        self._counted_steps.clear()  # a whole load: the loaded groups' counts rule
        self._init_state()
        self._pending.clear()
        self._round, self._broken = None, None  # a broken round ends with the restore
        self._plan_settings = None  # replan: the loaded settings rule
        self._ensure_plan()
        for hook in post_hooks.values():
            hook(self)

    def _load_to_host(self, state_dict: dict[str, Any]) -> None:
        """torch's load of the groups; the state cast where it is, then placed in host memory."""
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        self.state.update(host_state_entries(state_dict["state"], saved_ids, params))

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict (dion's keys); with offload, the host state as it is (no copy
        to the device), after any store still in flight has landed."""
        if self._state_stager is not None:
            self._state_stager.wait_host()
        adopt_loaded_counts(self.param_groups, self.state, self._counted_steps)
        return super().state_dict()

    # ----------------------------------------------------------------- copies

    def __getstate__(self) -> dict[str, Any]:
        """torch keeps defaults, state and groups; the optimizer-wide settings come too."""
        adopt_loaded_counts(self.param_groups, self.state, self._counted_steps)
        state = super().__getstate__()
        state["_shardmuon_settings"] = {
            **self._settings(),
            "_raw_partitions": self._raw_partitions,
            # The same object as ``coefficients`` while they are the default (deepcopy and
            # pickle keep the identity), so the default still follows the preconditioner.
            "_default_coefficients": self._default_coefficients,
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


def _unreplayable(key: int, error: BaseException) -> str:
    """Why a round whose communicating chunk ``key`` failed midway cannot go on."""
    return (
        f"step_chunk: chunk {key} raised ({type(error).__name__}: {error}) after its "
        "collectives with other ranks began; they cannot be replayed (the peers have "
        "completed or abandoned their side), so this step_chunk round cannot go on. Restore "
        "a checkpoint with load_state_dict (which ends the round) and step again. Chunks "
        "that failed before any collective (local and AdamW chunks, and checks before an "
        "exchange) can be retried"
    )
