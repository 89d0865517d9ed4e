"""``Muon(overlap="forward")`` on gloo worlds (run by ``tests/runtime/test_overlap_distributed.py``):
bitwise the sequential distributed step, step after step, on every layout (DTensor
placements: rows, columns, two-dimensional shards, expert stacks, HSDP with
``split_replicas``; real models: FSDP2 per layer, HSDP, DDP), under random per-rank delays
in the background, with gradient clipping and accumulation; a failure in the background on
every rank raises the same message on every rank and a restore recovers."""

from __future__ import annotations

import copy
import itertools
import random
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_checks import (
    S0,
    S1,
    Context,
    Spec,
    assert_same_local_optimizers,
    make_context,
    make_optimizer,
    place,
    random_tensors,
    set_placed_random_grads,
)
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate

import shardmuon.runtime.overlap as overlap_module
from shardmuon import Muon
from shardmuon.runtime.overlap import OverlapError

__all__ = ["CASES", "make_context"]

R = Replicate()
STEPS = 20


class RandomDelays:
    """Sleep 0-2 ms before each chunk is marked done, from a per-rank seed: the ranks'
    workers and forwards interleave differently (collectives must still pair up)."""

    def __init__(self, rank: int, fail_at: tuple[str, int] | None = None) -> None:
        self.rng = random.Random(1000 + rank)
        self.fail_at = fail_at
        self.mark = overlap_module.OverlappedStep._mark

    def __enter__(self):
        delays = self

        def delayed(step, key):
            time.sleep(delays.rng.random() * 0.002)
            if key == delays.fail_at:
                raise RuntimeError(f"injected failure at {key}")
            delays.mark(step, key)

        overlap_module.OverlappedStep._mark = delayed
        return self

    def __exit__(self, *exc) -> None:
        overlap_module.OverlappedStep._mark = self.mark


# ------------------------------------------------------------ placements, no model

SPEC_SETS: dict[str, list[Spec]] = {
    "rows_and_columns": [
        *[Spec((40, 24), (S0,))] * 3,
        Spec((30, 16), (S0,)),
        Spec((24, 36), (S1,)),
        Spec((4, 16, 24), (S0,)),  # an expert stack: local matrices
        Spec((24,), (S0,), algorithm="adamw"),
        Spec((16, 16)),  # replicated
    ],
    "two_dimensional": [
        Spec((32, 24), (S0, S1), mesh="2d"),
        Spec((24, 40), (R, S0), mesh="2d"),  # HSDP
        Spec((4, 16, 24), (S0, S1), mesh="2d"),  # experts over one dim, rows over the other
        Spec((40,), (R, S0), mesh="2d", algorithm="adamw"),
    ],
}


def _specs_bitwise(ctx: Context, specs: list[Spec], **kwargs) -> None:
    init = random_tensors([s.shape for s in specs], seed=3)
    plain = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    overlapped = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    settings = {"lr": 0.02, "weight_decay": 0.1, "nesterov": True, **kwargs}
    a = make_optimizer(plain, specs, **settings)
    b = make_optimizer(overlapped, specs, overlap="forward", **settings)
    with RandomDelays(ctx.rank):
        for step in range(STEPS):
            # New grads while the last step may still run: it holds the grads it began with.
            set_placed_random_grads(ctx, plain, specs, 100 + step)
            set_placed_random_grads(ctx, overlapped, specs, 100 + step)
            a.step()
            b.step()
    b.synchronize()
    assert_same_local_optimizers(a, plain, b, overlapped)


def placements_bitwise(ctx: Context) -> None:
    _specs_bitwise(ctx, SPEC_SETS["rows_and_columns"])


def placements_bitwise_offloaded(ctx: Context) -> None:
    _specs_bitwise(ctx, SPEC_SETS["rows_and_columns"], offload="state", max_in_flight=1)


def two_dimensional_bitwise(ctx: Context) -> None:
    _specs_bitwise(ctx, SPEC_SETS["two_dimensional"])


def two_dimensional_split_replicas_bitwise(ctx: Context) -> None:
    _specs_bitwise(ctx, SPEC_SETS["two_dimensional"], split_replicas=True)


# ------------------------------------------------------------ real models


def _layers(width: int = 24, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(depth)]
    return nn.Sequential(nn.Linear(8, width), *blocks, nn.Linear(width, 4))


def _optimizer(model: nn.Module, **kwargs) -> Muon:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return Muon(
        [dict(params=matrices), dict(params=others, algorithm="adamw")],
        lr=0.02, weight_decay=0.1, nesterov=True, **kwargs,
    )  # fmt: skip


def _train(
    ctx: Context,
    model: nn.Module,
    opt: Muon,
    steps: range,
    before_forward: Callable[[], None] = lambda: None,
) -> list[float]:
    """Even steps accumulate two micro-batches; every step clips the grad norm to 0.5."""
    losses = []
    for step in steps:
        for micro in range(2 if step % 2 == 0 else 1):
            before_forward()
            generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + ctx.rank)
            loss = model(torch.randn(6, 8, generator=generator)).square().mean()
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return losses


def _models_bitwise(ctx: Context, wrap: Callable[[nn.Module], nn.Module], **kwargs) -> None:
    plain, overlapped = wrap(_layers()), wrap(_layers())
    a = _optimizer(plain, **kwargs)
    b = _optimizer(overlapped, overlap="forward", **kwargs)
    b.overlap_with(overlapped)
    losses_a = _train(ctx, plain, a, range(STEPS))
    with RandomDelays(ctx.rank):
        losses_b = _train(ctx, overlapped, b, range(STEPS))
    assert losses_a == losses_b  # every forward saw the updated weights
    b.synchronize()
    assert_same_local_optimizers(a, list(plain.parameters()), b, list(overlapped.parameters()))


def _fully_shard(mesh) -> Callable[[nn.Module], nn.Module]:
    def wrap(model: nn.Module) -> nn.Module:
        for block in model:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return wrap


def fsdp2_model_bitwise(ctx: Context) -> None:
    _models_bitwise(ctx, _fully_shard(ctx.mesh))


class PauseAfterEachChunk:
    """The worker pauses after marking each chunk done: a forward woken by one chunk runs
    well before the next is written (a read the waits do not cover meets old weights)."""

    def __init__(self, seconds: float = 0.02) -> None:
        self.seconds = seconds
        self.mark = overlap_module.OverlappedStep._mark

    def __enter__(self):
        pause = self

        def mark_then_pause(step, key):
            pause.mark(step, key)
            time.sleep(pause.seconds)

        overlap_module.OverlappedStep._mark = mark_then_pause
        return self

    def __exit__(self, *exc) -> None:
        overlap_module.OverlappedStep._mark = self.mark


def fsdp2_forward_prefetch_bitwise(ctx: Context) -> None:
    """FSDP2's explicit forward prefetch: each block all-gathers the next one in its own
    pre-forward, before the next block's hook runs; the prefetching block waits for it."""

    def wrap(model: nn.Module) -> nn.Module:
        model = _fully_shard(ctx.mesh)(model)
        blocks = list(model)[1:-1]
        for block, following in itertools.pairwise(blocks):
            block.set_modules_to_forward_prefetch([following])
        return model

    plain, overlapped = wrap(_layers()), wrap(_layers())
    a = _optimizer(plain)
    b = _optimizer(overlapped, overlap="forward")
    b.overlap_with(overlapped)
    losses_a = _train(ctx, plain, a, range(4))
    with PauseAfterEachChunk():
        losses_b = _train(ctx, overlapped, b, range(4))
    assert losses_a == losses_b  # every forward saw the updated weights
    b.synchronize()
    assert_same_local_optimizers(a, list(plain.parameters()), b, list(overlapped.parameters()))


def hsdp_model_split_replicas_bitwise(ctx: Context) -> None:
    _models_bitwise(ctx, _fully_shard(ctx.mesh_2d), split_replicas=True)


def fsdp2_explicit_unshard_bitwise(ctx: Context) -> None:
    """``FSDPModule.unshard()`` called on every FSDP2 module before the forward (a pipeline
    schedule's prefetch): its all-gather waits for the module's update like its forward."""
    from torch.distributed.fsdp import FSDPModule

    plain, overlapped = _fully_shard(ctx.mesh)(_layers()), _fully_shard(ctx.mesh)(_layers())
    a = _optimizer(plain)
    b = _optimizer(overlapped, overlap="forward")
    b.overlap_with(overlapped)

    def unshard_all(model: nn.Module) -> Callable[[], None]:
        def unshard() -> None:
            units = [m for m in model.modules() if isinstance(m, FSDPModule)]
            for handle in [unit.unshard(async_op=True) for unit in units]:
                if handle is not None:
                    handle.wait()

        return unshard

    losses_a = _train(ctx, plain, a, range(4), unshard_all(plain))
    with PauseAfterEachChunk():
        losses_b = _train(ctx, overlapped, b, range(4), unshard_all(overlapped))
    assert losses_a == losses_b
    b.synchronize()
    assert_same_local_optimizers(a, list(plain.parameters()), b, list(overlapped.parameters()))


def fsdp2_all_gather_streams_wait_too(ctx: Context) -> None:
    """FSDP2 copies a unit's shards into its all-gather on its own copy-in stream, which
    waits on the current stream only in the root's pre-forward: each unit's hook makes
    those streams wait for the unit's update too (on CUDA, stream waits on the chunks'
    events), with implicit and explicit forward prefetch. The streams are FSDP2's own
    (identity): a wait on the current stream alone fails this."""
    from torch.distributed.fsdp import FSDPModule

    model = _fully_shard(ctx.mesh)(_layers())
    blocks = list(model)[1:-1]
    blocks[0].set_modules_to_forward_prefetch([blocks[1]])
    opt = _optimizer(model, overlap="forward")
    opt.overlap_with(model)
    _train(ctx, model, opt, range(1))  # FSDP2's lazy init: its streams exist from here
    waits: list[tuple[set[int], list]] = []
    original = opt.runner.overlap.wait_for_params

    def recorded(ids, streams=()):
        ids = list(ids)
        waits.append((set(ids), list(streams)))
        return original(ids, streams)

    opt.runner.overlap.wait_for_params = recorded
    with PauseAfterEachChunk():
        _train(ctx, model, opt, range(1, 3))
    opt.synchronize()
    reads = overlap_module.ReadMap(model)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        comm = unit._get_fsdp_state()._comm_ctx
        wanted = [comm.all_gather_copy_in_stream, comm.all_gather_stream]
        own = set(reads.own[id(unit)])
        if not own:  # the root: every layer is a unit of its own
            continue
        covering = [streams for ids, streams in waits if own & ids]
        assert covering, f"no wait covered {type(unit).__name__}'s parameters"
        for streams in covering:
            assert all(any(s is w for s in streams) for w in wanted), (
                f"a wait for {type(unit).__name__}'s parameters left FSDP2's all-gather "
                f"streams out: {streams}"
            )


def warmup_sets_every_group_up_before_the_background_step(ctx: Context) -> None:
    """``warmup=True`` (the default with NCCL): the first ``step()`` of a plan, once the ranks
    agreed, warms the plan's groups and the overlapped step's own groups (other group objects
    over the same ranks: each warmed), on the calling thread before the background step
    starts, so the background step's first collective on every group it uses meets a group
    already set up; later steps warm nothing. Building the optimizer, and the default on
    gloo, warm nothing."""
    import threading

    from shardmuon.runtime import warmup as warmup_module

    warmup_module._WARMED.clear()
    calls: list[tuple[str, int]] = []  # (thread, id(group))
    original = dist.all_to_all_single

    def all_to_all(output, input, *args, group=None, **kwargs):
        calls.append((threading.current_thread().name, id(group)))
        return original(output, input, *args, group=group, **kwargs)

    dist.all_to_all_single = all_to_all
    try:
        model = _fully_shard(ctx.mesh)(_layers())
        quiet = _optimizer(model, overlap="forward")  # warmup=None on gloo
        opt = _optimizer(model, overlap="forward", warmup=True)
        assert calls == [], calls
        opt.overlap_with(model)
        _train(ctx, model, opt, range(1))
        opt.synchronize()
        main = [group for thread, group in calls if thread == "MainThread"]
        assert len(main) == len(set(main)), calls  # each group warmed once
        step_groups = {id(g) for g in opt.runner.overlap._step_groups.values()}
        plan_groups = {id(ctx.mesh.get_group(0))}
        assert step_groups and step_groups.isdisjoint(plan_groups)
        assert step_groups | plan_groups <= set(main), (step_groups, plan_groups, calls)
        for k, (thread, group) in enumerate(calls):
            if thread != "MainThread":  # the background step's: warmed before it
                assert (("MainThread", group)) in calls[:k], calls
        before = len(calls)
        _train(ctx, model, opt, range(1, 3))
        opt.synchronize()
        assert all(thread != "MainThread" for thread, _ in calls[before:]), "warmed twice"
        for thread, group in calls:
            assert thread == "MainThread" or group in step_groups, calls
        quiet_calls = len(calls)
        _train(ctx, model, quiet, range(1))
        quiet.synchronize()
        assert all(t != "MainThread" for t, _ in calls[quiet_calls:]), "gloo default warmed"
    finally:
        dist.all_to_all_single = original


def step_groups_made_once_and_a_local_optimizer_asks_nobody(ctx: Context) -> None:
    """The step's own process groups are made at the first overlapped step of a plan (one
    world ``all_gather_object``), not at every step; an overlapped optimizer of this rank's
    own parameters (rank 0 only) communicates with no one."""
    model = _fully_shard(ctx.mesh)(_layers())
    opt = _optimizer(model, overlap="forward")
    opt.overlap_with(model)
    gathers = []
    original = dist.all_gather_object

    def counted(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    dist.all_gather_object = counted
    try:
        _train(ctx, model, opt, range(3))
        opt.synchronize()
    finally:
        dist.all_gather_object = original
    assert len(gathers) <= 1, f"{len(gathers)} world gathers in 3 overlapped steps"
    if ctx.rank == 0:
        own = nn.Linear(6, 5, bias=False)
        local = Muon(own.parameters(), lr=0.02, overlap="forward")
        local.overlap_with(own)
        for _ in range(2):
            own(torch.ones(2, 6)).sum().backward()
            local.step()
        local.synchronize()
    dist.barrier()


def ddp_model_bitwise(ctx: Context) -> None:
    from torch.nn.parallel import DistributedDataParallel

    _models_bitwise(ctx, DistributedDataParallel)


def pipeline_stages_bitwise(ctx: Context) -> None:
    """2 stages x 2 ranks (mesh ``("pp", "dp")``), FSDP2 over each stage's ``dp``, each stage
    its own layers and optimizer, both overlapped: every stage bitwise its sequential step
    (the step's groups are made by the world at the stages' first step, taken together)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, dp_mesh = mesh.get_local_rank("pp"), mesh["dp"]
    width = 24 if stage == 0 else 16  # other layers, other shapes per stage
    wrap = _fully_shard(dp_mesh)

    def stage_layers() -> nn.Module:
        torch.manual_seed(stage)
        blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(2)]
        return nn.Sequential(nn.Linear(8, width), *blocks, nn.Linear(width, 4))

    plain, overlapped = wrap(stage_layers()), wrap(stage_layers())
    a, b = _optimizer(plain), _optimizer(overlapped, overlap="forward")
    b.overlap_with(overlapped)
    losses_a = _train(ctx, plain, a, range(6))
    with RandomDelays(ctx.rank):
        losses_b = _train(ctx, overlapped, b, range(6))
    assert losses_a == losses_b, f"stage {stage}"
    b.synchronize()
    assert_same_local_optimizers(a, list(plain.parameters()), b, list(overlapped.parameters()))


# ------------------------------------------------------------ faults


def a_failure_on_every_rank_raises_alike_and_a_restore_recovers(ctx: Context) -> None:
    wrap = _fully_shard(ctx.mesh)
    model, reference_model = wrap(_layers()), wrap(_layers())
    opt, reference = _optimizer(model, overlap="forward"), _optimizer(reference_model)
    opt.overlap_with(model)
    _train(ctx, model, opt, range(2))
    _train(ctx, reference_model, reference, range(2))
    opt.synchronize()
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    message = None
    with RandomDelays(ctx.rank, fail_at=("batch", 1)):
        try:
            _train(ctx, model, opt, range(2, 4))
        except OverlapError as err:
            message = str(err)
    assert message is not None and "injected failure at ('batch', 1)" in message
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, message)
    assert len(set(gathered)) == 1, gathered  # the same message on every rank
    opt.zero_grad()
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    _train(ctx, model, opt, range(2, 5))
    _train(ctx, reference_model, reference, range(2, 5))
    opt.synchronize()
    assert_same_local_optimizers(
        reference, list(reference_model.parameters()), opt, list(model.parameters())
    )


CASES_BY_WORLD: dict[int, dict[str, Callable[[Context], None]]] = {
    2: {
        "placements_bitwise": placements_bitwise,
        "placements_bitwise_offloaded": placements_bitwise_offloaded,
        "fsdp2_model_bitwise": fsdp2_model_bitwise,
        "fsdp2_forward_prefetch_bitwise": fsdp2_forward_prefetch_bitwise,
        "fsdp2_explicit_unshard_bitwise": fsdp2_explicit_unshard_bitwise,
        "fsdp2_all_gather_streams_wait_too": fsdp2_all_gather_streams_wait_too,
        "warmup_sets_every_group_up_before_the_background_step": (
            warmup_sets_every_group_up_before_the_background_step
        ),
        "step_groups_made_once_and_a_local_optimizer_asks_nobody": (
            step_groups_made_once_and_a_local_optimizer_asks_nobody
        ),
        "ddp_model_bitwise": ddp_model_bitwise,
        "a_failure_on_every_rank_raises_alike_and_a_restore_recovers": (
            a_failure_on_every_rank_raises_alike_and_a_restore_recovers
        ),
    },
    4: {
        "placements_bitwise": placements_bitwise,
        "two_dimensional_bitwise": two_dimensional_bitwise,
        "two_dimensional_split_replicas_bitwise": two_dimensional_split_replicas_bitwise,
        "fsdp2_model_bitwise": fsdp2_model_bitwise,
        "hsdp_model_split_replicas_bitwise": hsdp_model_split_replicas_bitwise,
        "pipeline_stages_bitwise": pipeline_stages_bitwise,
    },
}
CASES: dict[str, Callable[[Context], None]] = {
    name: case for cases in CASES_BY_WORLD.values() for name, case in cases.items()
}


FAULT_TIMEOUT_S = 5.0  # the fault world's collective timeout (tests/runtime/test_overlap_faults.py)


def the_groups_made_here_take_the_job_timeout(ctx: Context) -> None:
    """Every group this package makes (a part group of some ranks, the overlapped step's own
    groups) takes the job's timeout (5 s here), not the backend's default (NCCL's 10 and
    gloo's 30 minutes): a peer's failure surfaces when the job expects."""
    from shardmuon.planning import groups as planning_groups

    def timeout_of(group: dist.ProcessGroup) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    part = planning_groups._part_group(frozenset({(0, 1)}), (0, 1))
    steps = overlap_module.step_process_groups({(0, 1)})
    timeouts = [timeout_of(part), *(timeout_of(g) for g in steps.values())]
    assert timeouts == [FAULT_TIMEOUT_S] * 2, timeouts


def a_failure_on_one_rank_reaches_its_peer_at_the_timeout(ctx: Context) -> None:
    wrap = _fully_shard(ctx.mesh)
    model = wrap(_layers())
    opt = _optimizer(model, overlap="forward")
    opt.overlap_with(model)
    _train(ctx, model, opt, range(1))
    opt.synchronize()
    fail_at = ("batch", 0) if ctx.rank == 0 else None
    began = time.monotonic()
    with RandomDelays(ctx.rank, fail_at=fail_at):
        try:
            _train(ctx, model, opt, range(1, 3))
            opt.synchronize()
        except Exception as err:
            error = err
        else:
            raise AssertionError("no rank may finish the step a peer abandoned")
    waited = time.monotonic() - began
    if ctx.rank == 0:
        assert isinstance(error, OverlapError), repr(error)
        assert "injected failure at ('batch', 0)" in str(error)
        # Stay alive until the peer has seen its timeout: leaving at once (the harness's
        # barrier timing out, then destroying the group) closes the connection under the
        # peer, which then sees "Connection closed by peer" instead of the timeout this case
        # is about. The store (on this rank) still works when the collectives do not.
        store = dist.distributed_c10d._get_default_store()
        store.wait(["fault-peer-saw-its-error"], timedelta(seconds=4 * FAULT_TIMEOUT_S))
    else:
        dist.distributed_c10d._get_default_store().set("fault-peer-saw-its-error", "1")
        # Whichever of its collectives meets the gap first times out: the worker's
        # all-to-all (an OverlapError naming it) or the forward's FSDP2 all-gather.
        assert isinstance(error, OverlapError) or "Timed out" in str(error), repr(error)
        assert waited < 60, f"waited {waited:.0f} s: not the job's 5 s timeout"


FAULT_CASES: dict[str, Callable[[Context], None]] = {
    "the_groups_made_here_take_the_job_timeout": the_groups_made_here_take_the_job_timeout,
    "a_failure_on_one_rank_reaches_its_peer_at_the_timeout": (
        a_failure_on_one_rank_reaches_its_peer_at_the_timeout
    ),
}
