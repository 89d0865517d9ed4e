"""``StepRunner``: one optimizer's step, from its checks to its telemetry.

``Muon`` (the facade) holds the settings, the param groups and the state; its runner holds
everything derived from them and runs the step: the plan (rebuilt when a planned setting
changes), the agreement checks, the step counters, the pipeline or the overlapped step,
``step_chunk``'s rounds, the offload stager, the CUDA graphs and the telemetry. Two seams
are the runner's to fill:

- ``hyperparams``: how a round reads its groups' hyperparameters (lr, weight decay,
  momentum, Nesterov) for the phases (``runtime/phases.py``'s ``GroupHyperparams``: host
  numbers today; device-resident values would come in here, with phases that take them);
- ``owner_update``: what the owner of a matrix computes from its whole direction, by
  default Newton–Schulz per partition block (``StepContext.orthogonalize``); a variant
  update (a row normalisation after the iteration, say) replaces this one function.

The runner is rebuilt from the settings after a copy (``Muon.__setstate__``): nothing in it
is saved.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import _global_optimizer_post_hooks

from shardmuon.planning.chunks import Chunk, batch_for_directions, chunk_info
from shardmuon.planning.placements import local_tensor
from shardmuon.planning.plan import ChunkInfo, Plan, build_plan, plan_key
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
from shardmuon.runtime.calibration import calibrate_plan
from shardmuon.runtime.exchange import check_backends
from shardmuon.runtime.graphs import GraphCache, graphs_available
from shardmuon.runtime.offload import StateStager, stager_for
from shardmuon.runtime.overlap import ForwardOverlap, forward_order, snapshot_group, synchronize_all
from shardmuon.runtime.phases import (
    GroupHyperparams,
    OwnerUpdate,
    StepContext,
    orthogonalize_directions,
    read_hyperparams,
)
from shardmuon.runtime.pipeline import chunk_progress, run_step, step_one_chunk
from shardmuon.runtime.rounds import ChunkRounds
from shardmuon.runtime.state import (
    adopt_loaded_counts,
    adopt_loaded_settings,
    advance_step_counters,
    check_state_devices,
    init_state,
)
from shardmuon.runtime.telemetry import StepStats
from shardmuon.runtime.warmup import plan_groups, warm_up, warmup_sizes
from shardmuon.settings import MuonSettings
from shardmuon.validation import check_grads, check_group, check_live_groups

__all__ = ["StepHost", "StepRunner"]


class StepHost(Protocol):
    """What the runner reads of its optimizer (``Muon``): torch.optim's groups, state and
    hooks, and the settings (which it replaces once, resolving ``workspace_bytes="auto"``)."""

    settings: MuonSettings
    param_groups: list[dict]
    state: dict
    defaults: dict
    _optimizer_step_post_hooks: dict


class StepRunner:
    """The step of one ``Muon`` (see the module docstring); ``optimizer`` is read live."""

    def __init__(
        self,
        optimizer: StepHost,
        partitions: dict[Tensor, Sequence[int]],
        ddp_ranks: tuple[int, ...] | None,
        auto_record: dict | None = None,
    ) -> None:
        self.optimizer = optimizer
        # What the optimizer was given, kept by its copies (``given()``).
        self.partitions = partitions
        self.ddp_ranks = ddp_ranks  # dion's DDP form: the ranks plain parameters replicate over
        self.auto_record = auto_record  # "auto"'s table: checkpoints and copies keep it
        self.built_plan: Plan | None = None  # None until the groups are first planned
        self.plan_key: tuple | None = None
        # The scheduled settings the last state_dict() handed out as tensors (an in-place
        # load into them is adopted at the next step: runtime/state.py).
        self.handed_settings: list = []
        self.plan_verified = False
        # The groups of the last plan every rank agreed on: each step's live check runs there.
        self.agreed_groups: list = []
        self.agreed_rounds: list[int] = []
        self.agreed_plan: Plan | None = None
        self.agreed_key: tuple | None = None
        self.auto_choices: dict[tuple[int, int], str] | None = None
        self.schedule_cache = ScheduleCache()
        self.rounds = ChunkRounds()
        self.stager: StateStager | None = None
        self.overlap = ForwardOverlap()
        self.warned_post_hooks = False
        self.round_context: StepContext | None = None
        # Per group: the count its parameters' ``step`` counters were last given.
        self.counted_steps: dict[int, int] = {}
        self.last_stats = StepStats()
        self.graphs = GraphCache()
        # The seams (module docstring).
        self.hyperparams: Callable[[list[dict]], list[GroupHyperparams]] = read_hyperparams
        self.owner_update: OwnerUpdate | None = None

    # ------------------------------------------------------------------ the plan

    @property
    def plan(self) -> Plan:
        """The current plan (built at construction, rebuilt when what it reads changes)."""
        if self.built_plan is None:
            raise RuntimeError("the optimizer has not planned its param groups yet")
        return self.built_plan

    def device(self) -> torch.device:
        """Where the parameters are (the first one's device; the CPU without any)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                return local_tensor(p).device
        return torch.device("cpu")

    def workspace_budget(self) -> int:
        """``workspace_bytes``, with ``"auto"`` resolved on first read (and kept in the
        settings, so copies and the agreement see the number)."""
        opt = self.optimizer
        if opt.settings.workspace_bytes == "auto":
            opt.settings = opt.settings.replace(workspace_bytes=self.auto_workspace_bytes())
        budget = opt.settings.workspace_bytes
        assert isinstance(budget, int)
        return budget

    def auto_workspace_bytes(self) -> int:
        """``workspace_bytes="auto"`` on this optimizer's device (a warning where less than
        twice that is free now: the step may then run out of memory)."""
        device = self.device()
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
                stacklevel=5,
            )
        return budget

    def plain_replica_ranks(self) -> tuple[int, ...] | None:
        """The ranks plain parameters are replicas over: ``distributed_mesh``'s (a process
        group), or with ``split_replicas`` the whole job's; ``None``: they are local."""
        if self.ddp_ranks is not None:
            return self.ddp_ranks
        split = self.optimizer.settings.split_replicas
        if split and dist.is_initialized() and dist.get_world_size() > 1:
            return tuple(range(dist.get_world_size()))
        return None

    def plan_arguments(self) -> tuple:
        settings = self.optimizer.settings
        return (
            self.partitions,
            settings.update_rms,
            settings.rotate_owners,
            settings.split_replicas,
            self.workspace_budget(),
            settings.newton_schulz.cost(self.device().type),
            settings.adamw_chunks,
            self.plain_replica_ranks(),
        )

    def make_plan(self, param_groups: list[dict] | None = None) -> Plan:
        groups = self.optimizer.param_groups if param_groups is None else param_groups
        return build_plan(groups, *self.plan_arguments())

    def ensure_plan(self) -> None:
        """Rebuild the plan if what it was built from changed (``Muon._ensure_plan``'s
        rule: the groups' planned keys and parameters, the planned settings); the groups'
        live settings are checked first. Nothing changes if a check raises."""
        opt = self.optimizer
        check_live_groups(opt.param_groups)
        key = plan_key(opt.param_groups, *self.plan_arguments())
        if key == self.plan_key:
            return
        if self.rounds.is_open:
            raise RuntimeError(
                "the param groups' planned settings or parameters changed during a "
                "step_chunk round; step the remaining chunks first, then change them"
            )
        for index, group in enumerate(opt.param_groups):
            check_group(index, group)
        plan = self.make_plan()
        check_backends(agreement_groups(plan.batches, plan.sinkhorn), self.device())
        if opt.settings.split_replicas and all(layout.replicas is None for layout in plan.layouts):
            warnings.warn(
                "split_replicas=True has no effect: no Muon parameter is replicated over "
                "ranks (an HSDP Replicate mesh dim, or plain parameters in a job of several "
                "processes, DDP)",
                UserWarning,
                stacklevel=4,
            )
        self.built_plan, self.plan_key = plan, key
        self.init_state()
        self.plan_verified = False
        self.auto_choices = None

    def ensure_plan_or_defer(self) -> None:
        """:meth:`ensure_plan` for ``chunks()``/``chunk_info()``, which a rank may call alone:
        a setting this rank refuses (edited here only) raises at the next ``step_chunk``,
        whose live check compares the ranks first so that every rank raises, not this one
        alone. Without a plan yet, it raises here."""
        try:
            self.ensure_plan()
        except (ValueError, TypeError):
            if self.built_plan is None or not self.agreed_groups:
                raise

    def init_state(self, keep_placed: bool = False) -> None:
        """State for every parameter, where it lives (``runtime/state.py``); ``keep_placed``:
        existing state stays on the device it is on (a ``step_chunk`` round: the caller may
        keep each chunk's state elsewhere between its steps)."""
        opt = self.optimizer
        offloaded = opt.settings.offload == "state"
        init_state(
            opt.param_groups, opt.state, offloaded, self.counted_steps, keep_placed=keep_placed
        )

    def chunks(self) -> list[Chunk]:
        """The plan's chunks in the order the step runs their collectives."""
        if not self.rounds.is_open:
            self.ensure_plan_or_defer()
        plan = self.plan
        return [*plan.sinkhorn, *plan.batches, *plan.adamw]

    def chunk_info(self, chunk: Chunk) -> ChunkInfo:
        if not self.rounds.is_open:
            self.ensure_plan_or_defer()
        opt = self.optimizer
        return chunk_info(self.plan, opt.param_groups, opt.state, chunk)

    def schedule(self) -> list[tuple[str, int]]:
        """The step's schedule (overlapped: the batches in the forward's order)."""
        plan, settings = self.plan, self.optimizer.settings
        order = None if settings.overlap is None else forward_order(plan.batches)
        return self.schedule_cache.get(plan, self.workspace_budget(), settings.max_in_flight, order)

    # ------------------------------------------------------------------ agreement

    def check_live_agreement(self) -> None:
        """Every step, before anything validates or replans: the ranks of the last agreed
        plan's groups still hold the same settings (``runtime/agreement.py``), so an edit
        made on some ranks only raises on all of them instead of diverging or hanging."""
        if not self.agreed_groups:
            return
        opt = self.optimizer
        try:  # as the step will plan
            rebuilt: object = plan_key(opt.param_groups, *self.plan_arguments()) != self.agreed_key
        except Exception as err:  # an invalid group setting: every rank refuses it, after this
            rebuilt = f"cannot plan: {type(err).__name__}"
        live = live_settings(opt.settings.agreed(), opt.param_groups, rebuilt)
        check_live_agreement(
            self.agreed_groups, self.agreed_plan, live, self.device(), self.agreed_rounds
        )

    def check_agreement(self) -> None:
        """Every group's ranks agree on batches, settings and grads (``runtime/agreement.py``)."""
        opt = self.optimizer
        compare_grads = opt.settings.check_grads != "never"
        self.agreed_rounds = check_plan_agreement(
            self.plan,
            opt.param_groups,
            opt.settings.agreed(),
            self.device(),
            self.schedule(),
            compare_grads,
        )

    def warm_plan_groups(self, setting: bool | None) -> None:
        plan = self.plan
        groups = plan_groups(plan.batches, plan.sinkhorn)
        warm_up(groups, warmup_sizes(plan.batches, plan.sinkhorn), self.device(), setting)

    def warmup(self) -> None:
        """``Muon.warmup``: every group the step uses now, set up."""
        self.ensure_plan()
        self.warm_plan_groups(True)
        if self.optimizer.settings.overlap is not None:
            self.overlap.prepare(self.plan, self.optimizer.param_groups, True, self.device())

    # ------------------------------------------------------------------ a round

    def calibrate_auto(self) -> None:
        """``"auto"``: measure the candidates on this plan's shape classes, once; every rank
        gets here together (``runtime/calibration.py``)."""
        opt = self.optimizer
        if opt.settings.newton_schulz_impl == "auto" and self.auto_choices is None:
            eps = opt.defaults["epsilon"]
            self.auto_choices, self.auto_record = calibrate_plan(
                self.plan.batches,
                opt.settings.newton_schulz,
                self.device(),
                eps,
                self.auto_record,
            )

    def begin_round(self, keep_placed: bool = False) -> list[tuple[str, int]]:
        """Checks first (nothing changes if they raise), then the step counters advance.
        Returns the step's schedule. ``keep_placed``: existing state is not moved."""
        opt = self.optimizer
        self.ensure_plan()
        check_grads(opt.param_groups)
        # State replaced by the user (a channels_last momentum) or offload changed: every
        # state tensor where the step expects it; a step_chunk round leaves it in place.
        self.init_state(keep_placed)
        # "never" still compares the plan once: a rank configured otherwise would meet the
        # check with its first all-to-all.
        schedule = self.schedule()
        if opt.settings.check_grads == "always" or not self.plan_verified:
            self.check_agreement()
            if not self.plan_verified:
                # A new plan's groups (warmed ones are skipped), once the ranks agreed on
                # the plan and on the setting: they all warm the same groups in one order.
                self.warm_plan_groups(opt.settings.warmup)
            self.calibrate_auto()
            self.plan_verified = True
            self.agreed_groups = agreement_groups(self.plan.batches, self.plan.sinkhorn)
            self.agreed_plan, self.agreed_key = self.plan, self.plan_key
        advance_step_counters(opt.param_groups, opt.state, self.counted_steps)
        self.last_stats = StepStats()
        return schedule

    def orthogonalizer(self) -> Any:
        """The step's Newton–Schulz: the settings' engine, its calls replayed from CUDA
        graphs where ``cuda_graphs`` is on and the parameters are on CUDA."""
        settings = self.optimizer.settings
        inner = settings.newton_schulz.orthogonalizer(self.auto_choices)
        device = self.device()
        if settings.cuda_graphs is not False and graphs_available(device):
            return self.graphs.wrap(
                inner,
                device,
                guarded_only=settings.cuda_graphs is None,
                max_static_bytes=self.workspace_budget(),
            )
        return inner

    def context(self, param_groups: list[dict] | None = None) -> StepContext:
        opt = self.optimizer
        groups = opt.param_groups if param_groups is None else param_groups
        return StepContext(
            plan=self.plan,
            param_groups=groups,
            state=opt.state,
            stats=self.last_stats,
            orthogonalizer=self.orthogonalizer(),
            coefficients=opt.settings.coefficients,
            device=self.device(),
            workspace_bytes=self.workspace_budget(),
            hyperparams=self.hyperparams(groups),
            owner_update=self.owner_update,
        )

    def state_stager(self) -> StateStager | None:
        settings = self.optimizer.settings
        if settings.offload != "state":
            return None
        self.stager = stager_for(
            self.stager, self.device(), settings.offload_prefetch, self.last_stats
        )
        return self.stager

    # ------------------------------------------------------------------ the step

    def step(self, closure: Callable[[], Any] | None) -> Any:
        """``Muon.step``: checks, the counters, then the pipeline (or the overlapped step)."""
        opt = self.optimizer
        self.overlap.synchronize()  # raises while a failed overlapped step is not restored
        synchronize_all()  # this optimizer's last step, and any other's (their groups)
        adopt_loaded_settings(opt.param_groups, self.handed_settings)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_live_agreement()
        self.rounds.check_step(len(self.chunks()))
        schedule = self.begin_round()
        ctx, stager = self.context(), self.state_stager()
        if opt.settings.overlap is None:
            self.last_stats.workspace_peak_bytes = run_step(ctx, schedule, stager)
            return loss
        self.overlap.start(ctx, schedule, stager, run_step, warm=opt.settings.warmup)
        if opt._optimizer_step_post_hooks or _global_optimizer_post_hooks:
            self.wait_for_post_hooks()
        return loss

    def wait_for_post_hooks(self) -> None:
        """Step post-hooks see the finished step: with any registered, an overlapped step is
        waited for before ``step()`` returns (said once)."""
        if not self.warned_post_hooks:
            self.warned_post_hooks = True
            warnings.warn(
                "Muon(overlap='forward') with step post-hooks registered: step() waits for "
                "the step so that the hooks see it (no overlap while they are registered)",
                UserWarning,
                stacklevel=4,
            )
        self.overlap.synchronize()

    def step_chunk(self, chunk: Chunk) -> None:
        """``Muon.step_chunk``: one chunk of the open round (opened here if none is)."""
        opt = self.optimizer
        self.overlap.synchronize()
        if not self.rounds.is_open:
            adopt_loaded_settings(opt.param_groups, self.handed_settings)
            self.check_live_agreement()
        chunks = self.chunks()
        key = self.rounds.key_of(chunk, chunks)
        if not self.rounds.is_open:
            self.begin_round(keep_placed=True)
            self.rounds.open()
            # The round's settings, read once: an edit between its chunks (on one rank: a
            # divergence) takes effect at the next round, whose live check compares it.
            self.round_context = self.context([snapshot_group(g) for g in opt.param_groups])
        ctx, stager = self.round_context, self.state_stager()
        assert ctx is not None
        if stager is None:
            info = chunk_info(ctx.plan, ctx.param_groups, opt.state, chunk)
            check_state_devices(info.params, opt.state)
        self.rounds.run(
            key,
            lambda: chunk_progress(ctx, chunk),
            lambda progress: step_one_chunk(ctx, chunk, progress, stager, key),
            len(chunks),
        )

    def after_load(self) -> None:
        """A whole ``load_state_dict``: the loaded groups' counts and settings rule, a broken
        round ends, the plan is rebuilt."""
        self.counted_steps.clear()
        self.init_state()
        self.rounds.end()
        self.handed_settings.clear()
        self.plan_key = None
        self.ensure_plan()

    def orthogonalize_chunk(
        self, params: Sequence[Tensor], U: Sequence[Tensor], first_owner: int
    ) -> list[Tensor]:
        """``Muon.orthogonalize_chunk``: the directions through the exchange and Newton–Schulz."""
        self.ensure_plan()
        groups = self.optimizer.param_groups
        batch, indices = batch_for_directions(self.plan, groups, params, U, first_owner)
        return orthogonalize_directions(self.context(), batch, indices, list(U))

    def settle(self) -> None:
        """Before the optimizer is read whole (``state_dict()``, a copy): the overlapped step
        done, offload's stores landed, the step counters and handed-out settings adopted."""
        opt = self.optimizer
        self.overlap.synchronize()
        if self.stager is not None:  # offload: the host state as its stores left it
            self.stager.wait_host()
        adopt_loaded_counts(opt.param_groups, opt.state, self.counted_steps)
        adopt_loaded_settings(opt.param_groups, self.handed_settings)

    def given(self) -> dict[str, Any]:
        """What the runner was given (and "auto"'s table): a copy's runner is built from it."""
        return {
            "partitions": self.partitions,
            "ddp_ranks": self.ddp_ranks,
            "auto_record": self.auto_record,
        }
