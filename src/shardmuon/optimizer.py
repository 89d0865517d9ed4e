"""``Muon``: the optimizer class, a torch.optim facade that plans and dispatches.

It holds the settings (``settings.py``: one frozen ``MuonSettings``), the param groups and
the state, and hands the step to its runner (``runtime/stepper.py``: the plan, the
agreement checks, the pipeline, the overlapped step, ``step_chunk``'s rounds). Its own work
is torch's protocol: param groups, checkpoints (``state_dict_checks.py``, ``runtime/state.py``),
copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from shardmuon.planning.chunks import Chunk
from shardmuon.planning.plan import ChunkInfo, Plan
from shardmuon.runtime.calibration import read_auto_record, with_auto_record
from shardmuon.runtime.state import (
    SETTINGS_KEY,
    adopt_loaded_groups,
    load_groups_to_host,
    load_hooks_held,
    plain_settings,
    restore_fp32_state,
    run_load_pre_hooks,
    saved_settings,
    with_setting_tensors,
)
from shardmuon.runtime.stepper import StepRunner
from shardmuon.runtime.telemetry import StepStats
from shardmuon.settings import (
    SETTING_NAMES,
    MuonSettings,
    setting_property,
    settings_args,
    settings_attribute,
)
from shardmuon.state_dict_checks import DROPPED_KEYS, checked_groups
from shardmuon.validation import (
    MOMENTUM_ALIAS,
    check_dion_arguments,
    group_defaults,
    refuse_state_offloader,
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
        matrix_partitions: ``{param: (rows_1, ...)}`` for fused weights: blocks along dim -2
            orthogonalized and scaled on their own.
        max_concurrent_tasks: prime-rl's name for ``max_in_flight``; both given and
            different: ``ValueError``.
        {settings}

    A matrix whose direction holds NaN or inf is skipped: its orthogonalized direction is
    zero (weight decay still applies), it is counted in ``last_step_stats.nonfinite_matrices``
    and every other matrix gets exactly its update; its momentum keeps the non-finite
    values (zero it or restore a checkpoint). Huge finite grads (1e18) do not overflow.
    A Sinkhorn table likewise: left unchanged on every rank that holds it, and counted.

    Every setting below ``max_concurrent_tasks`` is an attribute of the same name (``warmup``:
    ``warmup_setting``) that reads ``settings``; assigning one checks it and replaces
    ``settings`` (a bad value raises there and changes nothing). Settings checked together
    change at once: ``opt.settings = opt.settings.replace(newton_schulz_impl="folded",
    newton_schulz_restarts=None)``.
    """

    settings = settings_attribute()

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
        defaults = group_defaults(
            lr=lr, mu=mu, betas=betas, weight_decay=weight_decay, epsilon=epsilon,
            nesterov=nesterov, flatten=flatten, adjust_lr=adjust_lr,
        )  # fmt: skip
        self.settings = MuonSettings(
            update_rms=update_rms, newton_schulz_coefficients=newton_schulz_coefficients,
            max_in_flight=resolve_max_in_flight(max_in_flight, max_concurrent_tasks),
            workspace_bytes=workspace_bytes, offload=offload, offload_prefetch=offload_prefetch,
            newton_schulz_impl=newton_schulz_impl, newton_schulz_dtype=newton_schulz_dtype,
            newton_schulz_restarts=newton_schulz_restarts, newton_schulz_guard=newton_schulz_guard,
            newton_schulz_preconditioner=newton_schulz_preconditioner, check_grads=check_grads,
            overlap=overlap, adamw_chunks=adamw_chunks, cuda_graphs=cuda_graphs,
            rotate_owners=rotate_owners, split_replicas=split_replicas, warmup=warmup,
        )  # fmt: skip
        # dion's DDP form: the ranks plain parameters are replicas over (kept as ranks, so
        # copies and pickles carry it; the group is found again from them).
        ddp_ranks = (
            tuple(sorted(dist.get_process_group_ranks(distributed_mesh)))
            if isinstance(distributed_mesh, dist.ProcessGroup)
            else None
        )
        self.runner = StepRunner(self, dict(matrix_partitions or {}), ddp_ranks)
        super().__init__(split_by_shape(params), defaults)
        # OneCycleLR/CyclicLR need "momentum" in the defaults (an alias of mu / beta1,
        # validation.apply_momentum_alias); added after the groups, so dion's keys otherwise.
        self.defaults[MOMENTUM_ALIAS] = None
        self.runner.ensure_plan()

    @property
    def coefficients(self) -> tuple:
        """The iteration's ``(a, b, c)`` triples; assign a preset name, triples or ``None``
        (the default, which follows the preconditioner)."""
        return self.settings.coefficients

    @coefficients.setter
    def coefficients(self, value: Any) -> None:
        unchanged_default = value is self.settings.coefficients
        if unchanged_default and self.settings.newton_schulz_coefficients is None:
            value = None
        self.settings = self.settings.replace(newton_schulz_coefficients=value)

    # prime-rl's name for max_in_flight (dion's AsyncRuntime tasks).
    max_concurrent_tasks = setting_property("max_in_flight")

    @property
    def matrix_partitions(self) -> dict[Tensor, tuple[int, ...]]:
        """The ``matrix_partitions`` given (a copy)."""
        return dict(self.runner.partitions)

    @property
    def plan(self) -> Plan:
        """The current plan (``planning/plan.py``): batches, layouts, chunks. Read-only."""
        return self.runner.plan

    @property
    def auto_choices(self) -> dict[tuple[int, int], str] | None:
        """``newton_schulz_impl="auto"``: the engine measured for each ``(short, long)``
        shape class (a copy), once the first step calibrated it; ``None`` before, or with
        another engine."""
        choices = self.runner.auto_choices
        return None if choices is None else dict(choices)

    @property
    def last_step_stats(self) -> StepStats:
        """The last step's counters (``runtime/telemetry.py``); an overlapped step's once it
        is done: reading them waits for it (raising its failure, as :meth:`synchronize`)."""
        self.synchronize()
        return self.runner.last_stats

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (validated as in the constructor); the plan is rebuilt.

        A group that fails validation, or whose parameters cannot be planned, is removed
        again, leaving the optimizer as it was. Refused while a ``step_chunk`` round is open.
        """
        self.synchronize()
        self.runner.rounds.refuse_while_open("add_param_group")
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
                    if added and self.runner.plan_key is not None:
                        self.runner.ensure_plan()
                    raise
                return
            param_group = parts[0]
        given_alias = isinstance(param_group, dict) and MOMENTUM_ALIAS in param_group
        if isinstance(param_group, dict):
            param_group = with_sinkhorn_defaults(param_group)
        super().add_param_group(param_group)
        if not given_alias:
            self.param_groups[-1].pop(MOMENTUM_ALIAS, None)
        if self.runner.plan_key is None:  # the constructor plans once, after all groups
            return
        try:
            self.runner.ensure_plan()
        except Exception:
            self.param_groups.pop()
            raise

    def chunks(self) -> list[Chunk]:
        """Sinkhorn parameters (one chunk each), Muon batches (exchanged ones first), then
        AdamW groups, the order ``step()`` runs their collectives in; fixed while the plan is
        (a changed planned setting gives new chunk objects at the next round: an open
        ``step_chunk`` round keeps the plan it began with)."""
        return self.runner.chunks()

    def chunk_info(self, chunk: Chunk) -> ChunkInfo:
        """What ``chunk`` (one of :meth:`chunks`) holds: parameters, matrices, state bytes."""
        return self.runner.chunk_info(chunk)

    def warmup(self) -> None:
        """Set up every process group the step uses now: an all-to-all on each exchange group
        with the plan's largest piece as its per-peer message, a broadcast on each group
        that shares results between replicas; with ``overlap="forward"`` the overlapped
        step's own groups too. Groups already warmed for these sizes are skipped
        (``runtime/warmup.py``). Collective: every rank of those groups calls it together.
        (With ``warmup`` on, the step does this itself before a plan's first step.)"""
        self.runner.warmup()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, state_offloader: Any = None) -> Any:
        """One optimizer step over all chunks, pipelined (``runtime/pipeline.py``). If it
        raises in a check, nothing changed; if later (out of memory, a failed collective),
        counters and momenta have advanced (and, where no fused update kernel runs, the
        weight decay of the fp32 parameters updated in place: it is applied to all of them
        first), finished chunks are updated, the rest not: restore a checkpoint rather than
        step again (``step_chunk`` resumes a chunk that raised). ``state_offloader``
        (prime-rl's streamed offload for dion) is refused: see the message."""
        refuse_state_offloader(state_offloader)
        return self.runner.step(closure)

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
        self.runner.step_chunk(chunk)

    def synchronize(self) -> None:
        """Wait for this optimizer's overlapped step in flight, if any; raise ``OverlapError``
        if it failed (restore a checkpoint then, as after any failed step)."""
        self.runner.overlap.synchronize()

    def overlap_with(self, model: torch.nn.Module) -> list[Any]:
        """Hooks before the forward of each module of ``model`` that reads parameters of
        this optimizer (an FSDP2 module ahead of its own all-gather): each waits for the
        chunks of the step in flight holding those parameters. A parameter read outside
        the module that holds it must wait for :meth:`synchronize`. Returns the handles."""
        if self.settings.overlap is None:
            raise ValueError("overlap_with needs Muon(..., overlap='forward'); overlap is None")
        return self.runner.overlap.hook(model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's. ``set_to_none=False`` first waits for an overlapped step in flight (it
        reads the grads it would zero); the default does not (the step holds its grads)."""
        if not set_to_none:
            self.synchronize()
        super().zero_grad(set_to_none)

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
        return self.runner.orthogonalize_chunk(params, U, first_owner)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shardmuon or dion state dict (either fork's), all or nothing: the whole
        dict is validated first (``state_dict_checks.py``: groups, settings, every state
        entry's keys, shapes, dtypes and placements, that the groups can be planned), and a
        failed load raises naming what is wrong and changes nothing. Missing state (dion's
        lazy state) is created, a full tensor for a DTensor parameter laid out like it;
        microsoft/dion's ``split_sizes``/``num_heads`` become partitions, its
        ``cautious_wd=True`` is refused. Loaded group settings take effect.
        """
        runner = self.runner
        runner.overlap.discard()  # a failed overlapped step is what a restore undoes
        state_dict = run_load_pre_hooks(self, state_dict)
        if isinstance(state_dict, dict) and isinstance(state_dict.get("param_groups"), list):
            # Our own state dicts hand the scheduled settings out as tensors: numbers again.
            groups = plain_settings(state_dict["param_groups"], self.param_groups)
            state_dict = {**state_dict, "param_groups": groups}
        merged = checked_groups(state_dict, self.param_groups, runner.make_plan)
        auto_record = read_auto_record(state_dict)  # "auto"'s saved table, checked
        if runner.stager is not None:
            runner.stager.wait_host()
        with load_hooks_held(self) as post_hooks:
            if self.settings.offload == "state":
                load_groups_to_host(self, super().load_state_dict, state_dict)
            else:
                super().load_state_dict(state_dict)
        adopt_loaded_groups(self.param_groups, self.state, merged, DROPPED_KEYS)
        restore_fp32_state(self.param_groups, self.state, state_dict)
        runner.auto_record = auto_record  # its choices rule; none: "auto" measures anew
        runner.after_load()
        for hook in post_hooks:
            hook(self)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict (dion's keys); with offload, the host state as it is (no copy
        to the device), after any store still in flight has landed."""
        self.runner.settle()
        state_dict = with_auto_record(super().state_dict(), self.runner.auto_record)
        return with_setting_tensors(state_dict, self.runner.handed_settings)

    def __getstate__(self) -> dict[str, Any]:
        """torch keeps defaults, state and groups; the settings and what the runner was
        given come too."""
        self.runner.settle()
        return {**super().__getstate__(), SETTINGS_KEY: (self.settings, self.runner.given())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore settings and rebuild the runner and its plan (torch's
        ``load_state_dict`` calls this with only ``state`` and ``param_groups``: then
        settings and plan stay)."""
        saved = state.pop(SETTINGS_KEY, None)
        super().__setstate__(state)
        if saved is not None:
            self.settings, given = saved_settings(saved)
            self.runner = StepRunner(self, **given)
            self.runner.ensure_plan()


# Every setting is an attribute of the same name (``warmup``, a method, as ``warmup_setting``):
# assigning one checks it and replaces ``settings``; a bad value raises and changes nothing.
for _field_name in SETTING_NAMES:
    _name = "warmup_setting" if _field_name == "warmup" else _field_name
    setattr(Muon, _name, setting_property(_field_name))
Muon.__doc__ = (Muon.__doc__ or "").replace(" " * 8 + "{settings}", settings_args(indent=8))
