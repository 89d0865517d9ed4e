"""``Muon``: the optimizer class. It plans and dispatches; the math and the step live elsewhere.

The torch.optim facade: settings and their checks, param groups, state, checkpoints, the
plan (``planning/``: computed once, rebuilt when a planned setting changes), the agreement
check (``runtime/agreement.py``), rounds of ``step_chunk`` (``runtime/rounds.py``), the
overlapped step (``runtime/overlap.py``). A step's work is in ``runtime/phases.py`` and
``runtime/pipeline.py``; the all-to-alls in ``runtime/exchange.py``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks

from shardmuon.ops.engines import resolve_ns_dtype, resolve_restarts
from shardmuon.ops.newton_schulz import resolve_coefficients
from shardmuon.ops.orthogonalizer import (
    NS_CHOICES,
    NewtonSchulzSettings,
    Orthogonalizer,
    live_coefficients,
)
from shardmuon.planning.chunks import Chunk, batch_for_directions, chunk_info
from shardmuon.planning.placements import local_tensor
from shardmuon.planning.plan import (
    ChunkInfo,
    Plan,
    build_plan,
    plan_key,
)
from shardmuon.planning.workspace import (
    DEFAULT_WORKSPACE_BYTES,
    ScheduleCache,
    device_workspace_bytes,
)
from shardmuon.runtime.agreement import (
    agreement_groups,
    check_live_agreement,
    check_plan_agreement,
    live_settings,
)
from shardmuon.runtime.calibration import calibrate_plan, read_auto_record, with_auto_record
from shardmuon.runtime.exchange import check_backends
from shardmuon.runtime.graphs import GraphCache, GraphedOrthogonalizer, graphs_available
from shardmuon.runtime.offload import OFFLOAD_CHOICES, StateStager, stager_for
from shardmuon.runtime.overlap import (
    OVERLAP_CHOICES,
    ForwardOverlap,
    forward_order,
    snapshot_group,
    synchronize_all,
)
from shardmuon.runtime.phases import StepContext, orthogonalize_directions
from shardmuon.runtime.pipeline import chunk_progress, run_step, step_one_chunk
from shardmuon.runtime.rounds import ChunkRounds
from shardmuon.runtime.state import (
    COPIED_PRIVATE,
    SETTINGS_KEY,
    adopt_loaded_counts,
    adopt_loaded_groups,
    adopt_loaded_settings,
    advance_step_counters,
    check_state_devices,
    init_state,
    load_groups_to_host,
    load_hooks_held,
    plain_settings,
    restore_fp32_state,
    run_load_pre_hooks,
    with_setting_tensors,
    with_settings,
)
from shardmuon.runtime.telemetry import StepStats
from shardmuon.runtime.warmup import plan_groups, warm_up, warmup_sizes
from shardmuon.state_dict_checks import DROPPED_KEYS, checked_groups
from shardmuon.validation import (
    AGREED_SETTINGS,
    MOMENTUM_ALIAS,
    OPTIMIZER_SETTINGS,
    check_dion_arguments,
    check_grads,
    check_group,
    check_live_groups,
    check_optimizer_settings,
    group_defaults,
    resolve_max_in_flight,
    split_by_shape,
    with_sinkhorn_defaults,
)

__all__ = ["Muon"]


class Muon(Optimizer):
    r"""Muon with dion's param groups, state and checkpoints; distribution read from DTensors.

    The update of each matrix (the last two dims of a Muon parameter; each block of a
    partitioned one) is :func:`shardmuon.functional.muon_update_`'s (its math is written
    there); ``"adamw"`` groups get dion's AdamW; ``"sinkhorn"`` groups (embeddings, output
    heads) the Sinkhorn update of :mod:`shardmuon.ops.sinkhorn` (DeepSeek-V4.1's, as prime-rl
    runs it: keys ``sinkhorn_iters`` (odd, default 11), ``sinkhorn_tau`` (1e-3),
    ``sinkhorn_eps`` (1e-20), ``sinkhorn_lr_scale`` (0.18); ``mu`` is its momentum; no
    weight decay; its row and column sums all-reduced over the dims that split it). The owner of each matrix (one rank of its
    shard group) runs Newton–Schulz on the whole matrix; the others send their pieces and
    get theirs of the result back (``planning/`` decides who, ``runtime/`` does it).

    Args:
        params: param groups (dicts with ``params`` and ``algorithm`` = ``"muon"``,
            ``"sinkhorn"`` or ``"adamw"``), or an iterable of tensors. A group without an
            ``algorithm`` (or the tensors) is split by shape: its matrices (2-D or more) to
            Muon, the rest to AdamW, each keeping the group's other keys (so
            ``Muon(model.parameters())`` and Hugging Face's ``optimizer_cls_and_kwargs``
            work; embeddings and heads are matrices then: route them with
            :func:`shardmuon.routing.build_param_groups`).
        distributed_mesh: dion's argument. A ``ProcessGroup`` (dion's DDP form): plain
            (non-DTensor) Muon parameters are replicas over it (DDP), and its ranks share
            their Newton–Schulz work (each orthogonalizes its share of the batches and
            broadcasts the results). A ``DeviceMesh`` is only type-checked (DTensor
            parameters carry their own).
        world_mesh, fsdp_mesh_dim, use_triton: dion's arguments, accepted for drop-in use
            and only type-checked (distribution comes from the placements).
        newton_schulz_func: dion's custom-orthogonalization hook; only ``None`` is accepted.
        lr, mu, betas, weight_decay, epsilon, nesterov, adjust_lr, flatten: group defaults,
            dion's (``epsilon``: AdamW's eps and Newton–Schulz's normalisation eps). A group
            may carry microsoft/dion's ``split_sizes`` / ``num_heads`` (partitions).
        update_rms: the update RMS of ``adjust_lr="rms_norm"`` (0.2 = dion).
        newton_schulz_coefficients: a preset of ``NS_PRESETS`` or ``(a, b, c)`` triples, one
            per iteration; ``None``: ``"dion"`` (``"aol"`` with the AOL preconditioner).
        matrix_partitions: ``{param: (rows_1, ...)}`` for fused weights: blocks along dim -2
            orthogonalized and scaled on their own.
        max_in_flight: batches between the gather and the compute phase in ``step()``
            (default 3). ``max_concurrent_tasks``: the same setting under prime-rl's name;
            both given and different: ``ValueError``.
        workspace_bytes: each rank's budget for the step's transient buffers
            (``planning/workspace.py``): batches enter flight while their bytes fit, local
            stacks are cut to fit; a batch larger than the budget runs alone. ``"auto"``
            (default): 512 MiB on a CPU; on CUDA a sixteenth of the GPU's memory in whole
            256 MiB, at least 512 MiB (``device_workspace_bytes``; a warning where less than
            twice that is free); resolved once, then an int like a given one (agreed by
            every rank, kept by copies).
        offload, offload_prefetch: ``"state"``: the state in pinned host memory, each chunk's
            streamed in ``offload_prefetch`` chunks ahead (``runtime/offload.py``); same bits.
        newton_schulz_impl: the engine (``ops/engines.py``): ``"folded"`` (default),
            ``"gram"`` (fewer FLOPs on wide matrices, guarded), ``"auto"`` (folded or guarded
            Gram per shape class, timed by rank 0 at the first step; ``state_dict()`` keeps the
            choice), ``"per-matrix"`` (batch-invariant), ``"unfolded"`` (dion's), ``"compiled"``.
        newton_schulz_dtype, newton_schulz_restarts, newton_schulz_guard: the iteration's
            dtype (bf16 default, fp16, fp32; bf16 results), Gram's restart steps (``None``:
            after 2, then every 3), the divergence guard (``None``: on for Gram; certifies
            sigma_max <= 1.15x the band, ``ops/newton_schulz_guard.py``).
        newton_schulz_preconditioner: ``None`` (dion's numerics) or ``"aol"`` (Turbo-Muon's
            row scaling from the first iteration's Gram matrix; 4 steps by default; keeps the
            epsilon floor: a grad far below epsilon is damped as without AOL, at every dtype).
        rotate_owners: continue owners round-robin across batches (``False`` for benchmarks).
        split_replicas: HSDP: one replica orthogonalizes each batch and broadcasts the
            result over the replicate dim, instead of every replica repeating it. Plain
            (non-DTensor) parameters in a job of several processes are then taken as
            replicas over the whole job (DDP) and share the work the same way (their
            values and grads are compared across ranks with the plan; ranks that differ raise).
        warmup: :meth:`warmup` at construction and whenever a new plan first steps (its
            groups not yet warmed); ``None`` (default): on where the parameters are on a GPU
            and a group's collectives run on NCCL, off elsewhere (gloo, one process).
        check_grads: when a group's ranks verify (one small all-reduce) that they planned
            alike and a grad is present on all or none: ``"first"`` step and after a plan
            change (default), ``"always"``, ``"never"`` (the plan still once; grads never).
            Whatever it says, every later step compares the live settings first (a
            2-element all-reduce per group): an edit made on some ranks only raises on all.
        overlap: ``"forward"``: ``step()`` checks, starts the step in the background and
            returns; with :meth:`overlap_with`, each module's next forward waits only for
            its own parameters' chunks (``runtime/overlap.py``). ``None`` (default): not.
        adamw_chunks: ``"group"`` (default): one AdamW chunk per group in :meth:`chunks`;
            ``"parameter"``: one per parameter (a trainer that moves each chunk's state to
            the device and back holds one parameter's at a time).
        cuda_graphs: on CUDA, Newton–Schulz calls captured in CUDA graphs at their second
            call (per shape and engine) and replayed after (``runtime/graphs.py``): one
            launch instead of some twenty, the same bits; a guarded call then decides its
            recompute on the device (no host synchronisation). ``True``: every call;
            ``None`` (default): the guarded calls only (``newton_schulz_guard``, the Gram
            engine's default), whose eager form reads the device once a call; ``False``:
            none. Each captured call keeps its input and output (twice the stack's bf16
            bytes, all of them within ``workspace_bytes``) and the captures share one pool
            of intermediates. Ignored off CUDA.

    A matrix whose direction holds NaN or inf is skipped: its orthogonalized direction is
    zero (weight decay still applies), it is counted in ``last_step_stats.nonfinite_matrices``
    and every other matrix gets exactly its update; its momentum keeps the non-finite
    values (zero it or restore a checkpoint). Huge finite grads (1e18) do not overflow.
    A Sinkhorn table likewise: left unchanged on every rank that holds it, and counted.
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
        max_in_flight: int | None = None,
        max_concurrent_tasks: int | None = None,
        workspace_bytes: int | str = "auto",
        offload: str | None = None,
        offload_prefetch: int = 2,
        newton_schulz_impl: str = "folded",
        newton_schulz_dtype: torch.dtype | str = "bfloat16",
        newton_schulz_restarts: Sequence[int] | None = None,
        newton_schulz_guard: bool | None = None,
        newton_schulz_preconditioner: str | None = None,
        rotate_owners: bool = True,
        split_replicas: bool = False,
        warmup: bool | None = None,
        check_grads: str = "first",
        overlap: str | None = None,
        adamw_chunks: str = "group",
        cuda_graphs: bool | None = None,
        world_mesh: Any = None,
        fsdp_mesh_dim: Any = None,
    ) -> None:
        check_dion_arguments(
            distributed_mesh, world_mesh, fsdp_mesh_dim, use_triton, newton_schulz_func
        )
        max_in_flight = resolve_max_in_flight(max_in_flight, max_concurrent_tasks)
        defaults = group_defaults(
            lr=lr, mu=mu, betas=betas, weight_decay=weight_decay, epsilon=epsilon,
            nesterov=nesterov, flatten=flatten, adjust_lr=adjust_lr,
        )  # fmt: skip
        given = locals()  # the optimizer-wide settings are attributes of the same names
        self.__dict__.update({n: given[n] for n in OPTIMIZER_SETTINGS if n in given})
        # None: the default schedule, which follows the preconditioner (AOL's 4 steps).
        coefficients = newton_schulz_coefficients
        self.coefficients = None if coefficients is None else resolve_coefficients(coefficients)
        self._default_coefficients = None
        self._check_options()
        self.newton_schulz_restarts = resolve_restarts(
            newton_schulz_restarts, len(self.coefficients)
        )
        self.update_rms = float(update_rms)
        self._raw_partitions = dict(matrix_partitions or {})
        # dion's DDP form: the ranks plain parameters are replicas over (kept as ranks, so
        # copies and pickles carry it; the group is found again from them).
        self._ddp_ranks = (
            tuple(sorted(dist.get_process_group_ranks(distributed_mesh)))
            if isinstance(distributed_mesh, dist.ProcessGroup)
            else None
        )
        self._auto_record: dict | None = None  # "auto"'s table: checkpoints and copies keep it
        self._reset_runtime()
        super().__init__(split_by_shape(params), defaults)
        # OneCycleLR/CyclicLR need "momentum" in the defaults (an alias of mu / beta1,
        # validation.apply_momentum_alias); added after the groups, so dion's keys otherwise.
        self.defaults[MOMENTUM_ALIAS] = None
        if warmup is not None and not isinstance(warmup, bool):
            raise TypeError(f"warmup must be True, False or None (on with NCCL), got {warmup!r}")
        self.warmup_setting = warmup
        self._ensure_plan()

    @property
    def max_concurrent_tasks(self) -> int:
        """prime-rl's name for :attr:`max_in_flight` (dion's ``AsyncRuntime`` tasks)."""
        return self.max_in_flight

    @max_concurrent_tasks.setter
    def max_concurrent_tasks(self, value: int) -> None:
        self.max_in_flight = value

    # ``warmup``, as given (a class default for copies made before it existed).
    warmup_setting: bool | None = None
    adamw_chunks: str = "group"
    cuda_graphs: bool | None = None

    def _reset_runtime(self) -> None:
        """What is derived from the settings, not part of them (rebuilt after a copy)."""
        self._plan: Plan | None = None
        self._plan_key: tuple | None = None
        # The scheduled settings the last state_dict() handed out as tensors (an in-place
        # load into them is adopted at the next step: runtime/state.py).
        self._handed_settings: list = []
        self._plan_verified = False
        # The groups of the last plan every rank agreed on: each step's live check runs there.
        self._agreed_groups: list = []
        self._agreed_rounds: list[int] = []
        self._agreed_plan: Plan | None = None
        self._agreed_key: tuple | None = None
        self._auto_choices: dict[tuple[int, int], str] | None = None
        self._schedule = ScheduleCache()
        self._rounds = ChunkRounds()
        self._state_stager: StateStager | None = None
        self._overlap = ForwardOverlap()
        self._warned_post_hooks = False
        self._round_context: StepContext | None = None
        # Per group: the count its parameters' ``step`` counters were last given.
        self._counted_steps: dict[int, int] = {}
        self._last_stats = StepStats()
        self._graphs = GraphCache()

    @property
    def auto_choices(self) -> dict[tuple[int, int], str] | None:
        """``newton_schulz_impl="auto"``: the engine measured for each ``(short, long)``
        shape class (a copy), once the first step calibrated it; ``None`` before, or with
        another engine."""
        return None if self._auto_choices is None else dict(self._auto_choices)

    @property
    def last_step_stats(self) -> StepStats:
        """The last step's counters (``runtime/telemetry.py``); an overlapped step's once it
        is done: reading them waits for it (raising its failure, as :meth:`synchronize`)."""
        self.synchronize()
        return self._last_stats

    def _settings(self, names: Sequence[str] = OPTIMIZER_SETTINGS) -> dict[str, Any]:
        return {name: getattr(self, name) for name in names}

    def _check_options(self) -> None:
        """The optimizer-wide settings (public attributes, so checked again before each step)."""
        self.coefficients, self._default_coefficients = live_coefficients(
            self.coefficients, self._default_coefficients, self.newton_schulz_preconditioner
        )
        check_optimizer_settings(self._settings(), NS_CHOICES, OFFLOAD_CHOICES, OVERLAP_CHOICES)
        if hasattr(self, "param_groups"):
            self._workspace_budget()

    def _workspace_budget(self) -> int:
        """``workspace_bytes``, with ``"auto"`` resolved (and kept) on first read."""
        if self.workspace_bytes == "auto":
            self.workspace_bytes = self._auto_workspace_bytes()
        return self.workspace_bytes

    def _auto_workspace_bytes(self) -> int:
        """``workspace_bytes="auto"`` on this optimizer's device (a warning where less than
        twice that is free now: the step may then run out of memory)."""
        device = self._device()
        if device.type != "cuda":
            return DEFAULT_WORKSPACE_BYTES
        free, total = torch.cuda.mem_get_info(device)
        budget = device_workspace_bytes(total)
        if free < 2 * budget:
            warnings.warn(
                f"workspace_bytes='auto' gives {budget / 2**30:.2f} GiB (a sixteenth of "
                f"{device}'s memory) but {free / 2**30:.2f} GiB is free on it now; if the "
                "step runs out of memory, pass a smaller workspace_bytes (the same on every "
                "rank)",
                UserWarning,
                stacklevel=4,
            )
        return budget

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (validated as in the constructor); the plan is rebuilt.

        A group that fails validation, or whose parameters cannot be planned, is removed
        again, leaving the optimizer as it was. Refused while a ``step_chunk`` round is open.
        """
        self.synchronize()
        self._rounds.refuse_while_open("add_param_group")
        if isinstance(param_group, dict) and "algorithm" not in param_group:
            # Split by shape as the constructor does: its matrices, then the rest (AdamW).
            parts = split_by_shape([param_group])
            if len(parts) > 1:
                added = 0
                try:
                    for part in parts:
                        self.add_param_group(part)
                        added += 1
                except Exception:
                    del self.param_groups[len(self.param_groups) - added :]
                    if added and self._plan_key is not None:
                        self._ensure_plan()
                    raise
                return
            param_group = parts[0]
        given_alias = isinstance(param_group, dict) and MOMENTUM_ALIAS in param_group
        if isinstance(param_group, dict):
            param_group = with_sinkhorn_defaults(param_group)
        super().add_param_group(param_group)
        if not given_alias:
            self.param_groups[-1].pop(MOMENTUM_ALIAS, None)
        if self._plan_key is None:  # the constructor plans once, after all groups
            return
        try:
            self._ensure_plan()
        except Exception:
            self.param_groups.pop()
            raise

    def _plan_arguments(self) -> tuple:
        return (
            self._raw_partitions,
            self.update_rms,
            self.rotate_owners,
            self.split_replicas,
            self._workspace_budget(),
            self._newton_schulz_settings().cost(self._device().type),
            self.adamw_chunks,
            self._plain_replica_ranks(),
        )

    def _plain_replica_ranks(self) -> tuple[int, ...] | None:
        """The ranks plain parameters are replicas over: ``distributed_mesh``'s (a process
        group), or with ``split_replicas`` the whole job's; ``None``: they are local."""
        if self._ddp_ranks is not None:
            return self._ddp_ranks
        if self.split_replicas and dist.is_initialized() and dist.get_world_size() > 1:
            return tuple(range(dist.get_world_size()))
        return None

    def _make_plan(self, param_groups: list[dict] | None = None) -> Plan:
        groups = self.param_groups if param_groups is None else param_groups
        return build_plan(groups, *self._plan_arguments())

    def _ensure_plan(self) -> None:
        """Check the live settings; rebuild the plan if what it was built from changed.

        Group settings are live, as in torch.optim (lr, weight_decay, mu, nesterov, betas);
        a change of what the plan is built from (``planning/plan.py``: a group's algorithm,
        adjust_lr, epsilon, flatten, partitions or parameters; ``update_rms``,
        ``rotate_owners``, ``split_replicas``, the budget, the engine) rebuilds it and reruns
        the agreement check. Nothing changes if a check raises.
        """
        self._check_options()
        check_live_groups(self.param_groups)
        key = plan_key(self.param_groups, *self._plan_arguments())
        if key == self._plan_key:
            return
        if self._rounds.is_open:
            raise RuntimeError(
                "the param groups' planned settings or parameters changed during a "
                "step_chunk round; step the remaining chunks first, then change them"
            )
        for index, group in enumerate(self.param_groups):
            check_group(index, group)
        plan = self._make_plan()
        check_backends(agreement_groups(plan.batches, plan.sinkhorn), self._device())
        if self.split_replicas and all(layout.replicas is None for layout in plan.layouts):
            warnings.warn(
                "split_replicas=True has no effect: no Muon parameter is replicated over "
                "ranks (an HSDP Replicate mesh dim, or plain parameters in a job of several "
                "processes, DDP)",
                UserWarning,
                stacklevel=3,
            )
        self._plan, self._plan_key = plan, key
        self._init_state()
        self._plan_verified = False
        self._auto_choices = None

    def _init_state(self, keep_placed: bool = False) -> None:
        """State for every parameter, where it lives (``runtime/state.py``); ``keep_placed``:
        existing state stays on the device it is on (a ``step_chunk`` round: the caller may
        keep each chunk's state elsewhere between its steps)."""
        init_state(
            self.param_groups,
            self.state,
            self.offload == "state",
            self._counted_steps,
            keep_placed=keep_placed,
        )

    def chunks(self) -> list[Chunk]:
        """Sinkhorn parameters (one chunk each), Muon batches (exchanged ones first), then
        AdamW groups, the order ``step()`` runs their collectives in; fixed while the plan is
        (a changed planned setting gives new chunk objects at the next round: an open
        ``step_chunk`` round keeps the plan it began with)."""
        if not self._rounds.is_open:
            self._ensure_plan_or_defer()
        return [*self._plan.sinkhorn, *self._plan.batches, *self._plan.adamw]

    def _ensure_plan_or_defer(self) -> None:
        """:meth:`_ensure_plan` for ``chunks()``/``chunk_info()``, which a rank may call alone:
        a setting this rank refuses (edited here only) raises at the next ``step_chunk``,
        whose live check compares the ranks first so that every rank raises, not this one
        alone. Without a plan yet, it raises here."""
        try:
            self._ensure_plan()
        except (ValueError, TypeError):
            if self._plan is None or not self._agreed_groups:
                raise

    def chunk_info(self, chunk: Chunk) -> ChunkInfo:
        """What ``chunk`` (one of :meth:`chunks`) holds: parameters, matrices, state bytes."""
        if not self._rounds.is_open:
            self._ensure_plan_or_defer()
        return chunk_info(self._plan, self.param_groups, self.state, chunk)

    def warmup(self) -> None:
        """Set up every process group the step uses now: an all-to-all on each exchange group
        with the plan's largest piece as its per-peer message, a broadcast on each group
        that shares results between replicas; with ``overlap="forward"`` the overlapped
        step's own groups too. Groups already warmed for these sizes are skipped
        (``runtime/warmup.py``). Collective: every rank of those groups calls it together.
        (With ``warmup`` on, the step does this itself before a plan's first step.)"""
        self._ensure_plan()
        self._warm_plan_groups(True)
        if self.overlap is not None:
            self._overlap.prepare(self._plan, self.param_groups, True, self._device())

    def _warm_plan_groups(self, setting: bool | None) -> None:
        plan = self._plan
        groups, sizes = (
            plan_groups(plan.batches, plan.sinkhorn),
            warmup_sizes(plan.batches, plan.sinkhorn),
        )
        warm_up(groups, sizes, self._device(), setting)

    def _device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return local_tensor(p).device
        return torch.device("cpu")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, state_offloader: Any = None) -> Any:
        """One optimizer step over all chunks, pipelined (``runtime/pipeline.py``). If it
        raises in a check, nothing changed; if later (out of memory, a failed collective),
        counters and momenta have advanced (and, where no fused update kernel runs, the
        weight decay of the fp32 parameters updated in place: it is applied to all of them
        first), finished chunks are updated, the rest not: restore a checkpoint rather than
        step again (``step_chunk`` resumes a chunk that raised). ``state_offloader``
        (prime-rl's streamed offload for dion) is refused: see the message."""
        if state_offloader is not None:
            raise TypeError(
                f"Muon.step(state_offloader={type(state_offloader).__name__}(...)) is prime-rl's "
                "protocol for dion and is not taken: use Muon(offload='state') (the state "
                "streamed chunk by chunk, at most offload_prefetch chunks on the device), or "
                "step chunk by chunk yourself: for chunk in opt.chunks(): move "
                "opt.chunk_info(chunk).params' grads and state to the device, "
                "opt.step_chunk(chunk), move them back (Muon(adamw_chunks='parameter'): one "
                "AdamW parameter per chunk)"
            )
        self.synchronize()  # raises while a failed overlapped step is not restored
        synchronize_all()  # this optimizer's last step, and any other's (their groups)
        adopt_loaded_settings(self.param_groups, self._handed_settings)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_live_agreement()
        self._rounds.check_step(len(self.chunks()))
        schedule = self._begin_round()
        ctx, stager = self._context(), self._stager()
        if self.overlap is None:
            self._last_stats.workspace_peak_bytes = run_step(ctx, schedule, stager)
            return loss
        self._overlap.start(ctx, schedule, stager, run_step, warm=self.warmup_setting)
        if self._optimizer_step_post_hooks or _global_optimizer_post_hooks:
            self._wait_for_post_hooks()
        return loss

    def _wait_for_post_hooks(self) -> None:
        """Step post-hooks see the finished step: with any registered, an overlapped step is
        waited for before ``step()`` returns (said once)."""
        if not self._warned_post_hooks:
            self._warned_post_hooks = True
            warnings.warn(
                "Muon(overlap='forward') with step post-hooks registered: step() waits for "
                "the step so that the hooks see it (no overlap while they are registered)",
                UserWarning,
                stacklevel=3,
            )
        self.synchronize()

    def synchronize(self) -> None:
        """Wait for this optimizer's overlapped step in flight, if any; raise ``OverlapError``
        if it failed (restore a checkpoint then, as after any failed step)."""
        self._overlap.synchronize()

    def overlap_with(self, model: torch.nn.Module) -> list[Any]:
        """Hooks before the forward of each module of ``model`` that reads parameters of
        this optimizer (an FSDP2 module ahead of its own all-gather): each waits for the
        chunks of the step in flight holding those parameters. A parameter read outside
        the module that holds it must wait for :meth:`synchronize`. Returns the handles."""
        if self.overlap is None:
            raise ValueError("overlap_with needs Muon(..., overlap='forward'); overlap is None")
        return self._overlap.hook(model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's. ``set_to_none=False`` first waits for an overlapped step in flight (it
        reads the grads it would zero); the default does not (the step holds its grads)."""
        if not set_to_none:
            self.synchronize()
        super().zero_grad(set_to_none)

    def _stager(self) -> StateStager | None:
        if self.offload != "state":
            return None
        stats, device = self._last_stats, self._device()
        self._state_stager = stager_for(self._state_stager, device, self.offload_prefetch, stats)
        return self._state_stager

    def _newton_schulz_settings(self) -> NewtonSchulzSettings:
        """The live Newton–Schulz settings, resolved (``ops/orthogonalizer.py``)."""
        return NewtonSchulzSettings.from_settings(self._settings())

    def _calibrate_auto(self) -> None:
        """``"auto"``: measure the candidates on this plan's shape classes, once; every rank
        gets here together (``runtime/calibration.py``)."""
        if self.newton_schulz_impl == "auto" and self._auto_choices is None:
            ns, eps = self._newton_schulz_settings(), self.defaults["epsilon"]
            self._auto_choices, self._auto_record = calibrate_plan(
                self._plan.batches, ns, self._device(), eps, self._auto_record
            )

    def _orthogonalizer(self) -> Orthogonalizer | GraphedOrthogonalizer:
        """The step's Newton–Schulz: the live settings' engine, its calls replayed from
        CUDA graphs where ``cuda_graphs`` is on and the parameters are on CUDA."""
        inner = self._newton_schulz_settings().orthogonalizer(self._auto_choices)
        device = self._device()
        if self.cuda_graphs is not False and graphs_available(device):
            return self._graphs.wrap(
                inner,
                device,
                guarded_only=self.cuda_graphs is None,
                max_static_bytes=self._workspace_budget(),
            )
        return inner

    def _context(self, param_groups: list[dict] | None = None) -> StepContext:
        return StepContext(
            plan=self._plan,
            param_groups=self.param_groups if param_groups is None else param_groups,
            state=self.state,
            stats=self._last_stats,
            orthogonalizer=self._orthogonalizer(),
            coefficients=self.coefficients,
            device=self._device(),
            workspace_bytes=self._workspace_budget(),
        )

    @torch.no_grad()
    def step_chunk(self, chunk: Chunk) -> None:
        """Step one chunk (on the current stream); the step counters advance on a round's
        first chunk. A round is one pass over :meth:`chunks`, each chunk once; chunks that
        communicate go in the order of :meth:`chunks`, local and AdamW chunks in any order.
        A chunk that raised before any collective can be stepped again (it resumes); one
        that raised after its collectives began breaks the round until ``load_state_dict``
        restores a checkpoint (``runtime/rounds.py``). A round reads its settings once, when
        it opens: edits made between its chunks take effect at the next round.
        """
        self.synchronize()
        if not self._rounds.is_open:
            adopt_loaded_settings(self.param_groups, self._handed_settings)
            self._check_live_agreement()
        chunks = self.chunks()
        key = self._rounds.key_of(chunk, chunks)
        if not self._rounds.is_open:
            self._begin_round(keep_placed=True)
            self._rounds.open()
            # The round's settings, read once: an edit between its chunks (on one rank: a
            # divergence) takes effect at the next round, whose live check compares it.
            self._round_context = self._context([snapshot_group(g) for g in self.param_groups])
        ctx, stager = self._round_context, self._stager()
        if stager is None:
            check_state_devices(
                chunk_info(ctx.plan, ctx.param_groups, self.state, chunk).params, self.state
            )
        self._rounds.run(
            key,
            lambda: chunk_progress(ctx, chunk),
            lambda progress: step_one_chunk(ctx, chunk, progress, stager, key),
            len(chunks),
        )

    def _begin_round(self, keep_placed: bool = False) -> list[tuple[str, int]]:
        """Checks first (nothing changes if they raise), then the step counters advance.
        Returns the step's schedule (computed once per plan and budget). ``keep_placed``:
        existing state is not moved (see :meth:`_init_state`)."""
        self._ensure_plan()
        check_grads(self.param_groups)
        # State replaced by the user (a channels_last momentum) or offload changed: every
        # state tensor where the step expects it (offload: contiguous host memory); a
        # step_chunk round leaves it where the caller keeps it.
        self._init_state(keep_placed)
        # "never" still compares the plan once: a rank configured otherwise would meet the
        # check with its first all-to-all.
        schedule = self._step_schedule()
        if self.check_grads == "always" or not self._plan_verified:
            self._check_agreement()
            if not self._plan_verified:
                # A new plan's groups (warmed ones are skipped), once the ranks agreed on
                # the plan and on the setting: they all warm the same groups in one order.
                self._warm_plan_groups(self.warmup_setting)
            self._calibrate_auto()
            self._plan_verified = True
            self._agreed_groups = agreement_groups(self._plan.batches, self._plan.sinkhorn)
            self._agreed_plan, self._agreed_key = self._plan, self._plan_key

        advance_step_counters(self.param_groups, self.state, self._counted_steps)
        self._last_stats = StepStats()
        return schedule

    def _step_schedule(self) -> list[tuple[str, int]]:
        """The schedule (overlapped: the batches in the forward's order)."""
        order = None if self.overlap is None else forward_order(self._plan.batches)
        return self._schedule.get(self._plan, self._workspace_budget(), self.max_in_flight, order)

    def _check_live_agreement(self) -> None:
        """Every step, before anything validates or replans: the ranks of the last agreed
        plan's groups still hold the same settings (``runtime/agreement.py``), so an edit
        made on some ranks only raises on all of them instead of diverging or hanging."""
        if not self._agreed_groups:
            return
        settings = {**self._settings(AGREED_SETTINGS), "warmup": self.warmup_setting}
        # One spelling per dtype ("float32" is torch.float32); a bad value as it is.
        with contextlib.suppress(TypeError, ValueError):
            settings["newton_schulz_dtype"] = str(resolve_ns_dtype(self.newton_schulz_dtype))
        with contextlib.suppress(TypeError, ValueError):  # a preset's name is its triples
            settings["coefficients"] = resolve_coefficients(self.coefficients)
        try:  # as the step will plan (a preset's name resolved first)
            self._check_options()
            rebuilt: object = plan_key(self.param_groups, *self._plan_arguments()) != (
                self._agreed_key
            )
        except Exception as err:  # an invalid setting: every rank refuses it, after this
            rebuilt = f"cannot plan: {type(err).__name__}"
        live = live_settings(settings, self.param_groups, rebuilt)
        check_live_agreement(
            self._agreed_groups, self._agreed_plan, live, self._device(), self._agreed_rounds
        )

    def _check_agreement(self) -> None:
        """Every group's ranks agree on batches, settings and grads (see ``runtime/agreement.py``)."""
        ns = self._newton_schulz_settings()  # one spelling per value: "float32" is torch.float32
        settings = {**self._settings(AGREED_SETTINGS), "coefficients": ns.coefficients}
        settings["warmup"] = self.warmup_setting  # every rank warms the same groups
        settings["newton_schulz_dtype"] = str(ns.dtype)
        compare_grads = self.check_grads != "never"
        ops, device = self._step_schedule(), self._device()
        self._agreed_rounds = check_plan_agreement(
            self._plan, self.param_groups, settings, device, ops, compare_grads
        )

    @torch.no_grad()
    def orthogonalize_chunk(
        self, params: Sequence[Tensor], U: Sequence[Tensor], first_owner: int = 0
    ) -> list[Tensor]:
        """Newton–Schulz plus the exchange for given directions; no momentum, no update.

        ``params``: Muon parameters of one layout (at most the shard-group size of matrices
        when exchanged); ``U[i]``: local, shaped like ``params[i]``'s shard. Returns the bf16
        results shaped like ``U``; owners are ranks ``first_owner, first_owner + 1, ...``
        (mod the group size) in ascending rank order. Collective over the shard group.
        """
        self._ensure_plan()
        batch, indices = batch_for_directions(self._plan, self.param_groups, params, U, first_owner)
        return orthogonalize_directions(self._context(), batch, indices, U)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shardmuon or dion state dict (either fork's), all or nothing: the whole
        dict is validated first (``state_dict_checks.py``: groups, settings, every state
        entry's keys, shapes, dtypes and placements, that the groups can be planned), and a
        failed load raises naming what is wrong and changes nothing. Missing state (dion's
        lazy state) is created, a full tensor for a DTensor parameter laid out like it;
        microsoft/dion's ``split_sizes``/``num_heads`` become partitions, its
        ``cautious_wd=True`` is refused. Loaded group settings take effect.
        """
        self._overlap.discard()  # a failed overlapped step is what a restore undoes
        state_dict = run_load_pre_hooks(self, state_dict)
        if isinstance(state_dict, dict) and isinstance(state_dict.get("param_groups"), list):
            # Our own state dicts hand the scheduled settings out as tensors: numbers again.
            groups = plain_settings(state_dict["param_groups"], self.param_groups)
            state_dict = {**state_dict, "param_groups": groups}
        merged = checked_groups(state_dict, self.param_groups, self._make_plan)
        auto_record = read_auto_record(state_dict)  # "auto"'s saved table, checked
        if self._state_stager is not None:
            self._state_stager.wait_host()
        with load_hooks_held(self) as post_hooks:
            if self.offload == "state":
                load_groups_to_host(self, super().load_state_dict, state_dict)
            else:
                super().load_state_dict(state_dict)
        adopt_loaded_groups(self.param_groups, self.state, merged, DROPPED_KEYS)
        restore_fp32_state(self.param_groups, self.state, state_dict)
        self._counted_steps.clear()  # a whole load: the loaded groups' counts rule
        self._init_state()
        self._rounds.end()  # a broken round ends with the restore
        self._handed_settings.clear()  # a whole load: its settings rule
        self._auto_record = auto_record  # its choices rule; none: "auto" measures anew
        self._plan_key = None  # replan: the loaded settings rule
        self._ensure_plan()
        for hook in post_hooks:
            hook(self)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict (dion's keys); with offload, the host state as it is (no copy
        to the device), after any store still in flight has landed."""
        self.synchronize()
        if self._state_stager is not None:
            self._state_stager.wait_host()
        adopt_loaded_counts(self.param_groups, self.state, self._counted_steps)
        adopt_loaded_settings(self.param_groups, self._handed_settings)
        state_dict = with_auto_record(super().state_dict(), self._auto_record)
        return with_setting_tensors(state_dict, self._handed_settings)

    def __getstate__(self) -> dict[str, Any]:
        """torch keeps defaults, state and groups; the optimizer-wide settings come too."""
        self.synchronize()
        if self._state_stager is not None:  # offload: the host state as its stores left it
            self._state_stager.wait_host()
        adopt_loaded_counts(self.param_groups, self.state, self._counted_steps)
        adopt_loaded_settings(self.param_groups, self._handed_settings)
        return with_settings(super().__getstate__(), self._settings(), COPIED_PRIVATE, self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore settings and rebuild the plan (torch's ``load_state_dict`` calls this
        with only ``state`` and ``param_groups``: then settings and plan stay)."""
        settings = state.pop(SETTINGS_KEY, None)
        super().__setstate__(state)
        if settings is not None:
            self.__dict__.update({"overlap": None, **settings})  # copies made before overlap
            self._reset_runtime()
            self._ensure_plan()
