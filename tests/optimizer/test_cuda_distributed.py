"""GPU checks of ``Muon(overlap="forward")`` on NCCL (run by ``scripts/gpu-check.sh`` on a GPU
machine; skipped without CUDA and NCCL, and each test without enough devices).

Every test compares the overlapped step with the sequential step of the same optimizer on
the same ranks, bitwise: the output of every forward, and the final weights and optimizer
state. The gloo versions (``tests/runtime/dist_overlap_cases.py``) cover the logic; these
cover what only CUDA streams and NCCL communicators show.

- ``test_fsdp2_at_world_size_one_on_nccl_with_a_slow_worker`` (1 GPU): FSDP2 per layer on a
  one-rank NCCL world in the test process, the worker's stream slowed by
  ``torch.cuda._sleep`` before each chunk is marked done, gradient accumulation and
  clipping, 5 steps: each FSDP2 unit's forward waits for its update on the GPU, not only on
  the host. Where torch skips FSDP2's all-gather at world size 1 (2.13 does: the unit's
  shards are copied on the current stream), this covers the current stream's waits only;
  the all-gather copy-in stream's are the next test's.
- ``test_fsdp2_on_two_device_bound_ranks_with_random_delays`` (2 GPUs): the same over two
  processes on a world bound to its devices (``init_process_group(device_id=...)``, as real
  jobs do), random per-rank delays on the worker's stream and host, 6 steps. FSDP2 copies a
  unit's shards into its all-gather on its own copy-in stream, which waits on the current
  stream only in the root's pre-forward: only that stream's waits on the worker's events
  (``fsdp_all_gather_streams``) order the copy after the unit's update. The worker's
  all-to-alls run on the step's own communicators beside FSDP2's collectives.
- ``test_the_background_groups_are_set_up_on_the_calling_thread`` (2 GPUs): with the
  default ``warmup`` (on with NCCL), every group the background worker runs a collective
  on saw its first collective on the calling thread, at construction, ``warmup()`` or the
  first ``step()``: NCCL sets communicators and connections up at their first collective,
  which must not happen on the worker beside the forward's collectives.
- ``test_pipeline_stages_on_a_device_bound_world`` (4 GPUs): mesh ``("pp", "dp")`` =
  (2, 2), each stage its own FSDP2 layers of other widths and its own overlapped
  optimizer, random delays; completes within the deadline and each stage is bitwise.
- ``test_pipeline_stages_with_a_group_made_by_one_stage`` (8 GPUs): mesh
  ``("pp", "dp", "tp")`` = (2, 2, 2), each stage HSDP over its ``("dp", "tp")`` sub-mesh,
  and stage 0 also owns matrices sharded over both of its dims: their exchange group (its 4
  ranks) is no mesh dim's group and is made by stage 0 alone. On a device-bound world torch
  would split every new group from the world's communicator, which stage 1 never joins
  (a hang). It needs 8 GPUs: with 2 ranks per stage every exchange runs over one mesh dim
  (a size-1 dim is not exchanged over), so no placement makes such a group.

The multi-GPU tests spawn one process per rank, each writing its result (or the traceback of
its failure) to a file that the test reads; a world not done within ``WORLD_DEADLINE_S`` is
killed, and the test fails with each rank's error and the tail of its log (where a
faulthandler dump shows the stacks of a hang). The rank functions take the backend and the
device type, so that the same code can be dry-run on gloo and the CPU (``time.sleep`` then
stands in for ``torch.cuda._sleep``); the tests run them on NCCL and CUDA only.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_overlap_cases import _fully_shard  # FSDP2 per layer, then the root
from torch import nn

import shardmuon.runtime.overlap as overlap_module
from shardmuon import Muon
from shardmuon.harness.processes import exit_worker
from shardmuon.planning.placements import local_tensor
from shardmuon.runtime.warmup import wants_warmup

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NCCL = dist.is_available() and dist.is_nccl_available()

pytestmark = pytest.mark.skipif(GPUS == 0 or not NCCL, reason="needs a CUDA device and NCCL")


def gpus(count: int):
    return pytest.mark.skipif(count > GPUS, reason=f"needs {count} CUDA devices")


# A collective that cannot complete fails after this (the groups this package makes take
# the job's timeout too); the world's deadline is later, so that such a failure is reported
# as the rank's error rather than as a kill.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
WORLD_DEADLINE_S = 200.0
# Once every rank has its result: time left for NCCL's teardown before the processes are
# killed (a slow teardown is not what these tests check).
TEARDOWN_GRACE_S = 20.0
# Once a rank failed: its peers may wait in a collective until the timeout; their
# tracebacks add nothing to the failure, so they are killed after this.
FAILURE_GRACE_S = 10.0
# About 10 ms of GPU time at ~2 GHz; the dry run on the CPU sleeps as long on the host.
SLEEP_CYCLES = 20_000_000
LOG_TAIL_LINES = 40


# ------------------------------------------------------------------ shared pieces


def _delay(device: torch.device, cycles: int) -> None:
    if device.type == "cuda":
        torch.cuda._sleep(cycles)  # on the current stream: in _mark, the worker's
    else:
        time.sleep(cycles / 2e9)


@contextlib.contextmanager
def _slow_worker(device: torch.device, rank: int | None = None) -> Iterator[None]:
    """Delay the worker before each chunk is marked done: ``SLEEP_CYCLES`` of GPU time each,
    or with ``rank`` a random amount from a per-rank seed plus 0-2 ms on the host (the ranks'
    workers and forwards then interleave differently; their collectives must still pair)."""
    mark = overlap_module.OverlappedStep._mark
    rng = None if rank is None else random.Random(1000 + rank)

    def delayed(step, key) -> None:
        if rng is None:
            _delay(device, SLEEP_CYCLES)
        else:
            time.sleep(rng.random() * 0.002)
            _delay(device, rng.randrange(SLEEP_CYCLES))
        mark(step, key)

    overlap_module.OverlappedStep._mark = delayed
    try:
        yield
    finally:
        overlap_module.OverlappedStep._mark = mark


def _layers(device: torch.device, width: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(3)]
    return nn.Sequential(nn.Linear(8, width), *blocks, nn.Linear(width, 4)).to(device)


def _optimizer(model: nn.Module, extra: Sequence[nn.Parameter] = (), **kwargs) -> Muon:
    matrices = [p for p in model.parameters() if p.ndim == 2] + list(extra)
    others = [p for p in model.parameters() if p.ndim != 2]
    return Muon(
        [dict(params=matrices), dict(params=others, algorithm="adamw")],
        lr=0.02, weight_decay=0.1, nesterov=True, **kwargs,
    )  # fmt: skip


def _train(
    model: nn.Module,
    opt: Muon,
    steps: range,
    rank: int,
    device: torch.device,
    before_step: Callable[[int], None] = lambda step: None,
) -> list[torch.Tensor]:
    """Even steps accumulate two micro-batches; every step clips the grad norm to 0.5.
    Returns every forward's output (copies, compared bitwise afterwards)."""
    outputs = []
    for step in steps:
        for micro in range(2 if step % 2 == 0 else 1):
            generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
            out = model(torch.randn(6, 8, generator=generator).to(device))
            outputs.append(out.detach().clone())
            out.square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        before_step(step)
        opt.step()
        opt.zero_grad()
    return outputs


def _locals(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [local_tensor(p).detach().clone() for p in params]


def _assert_bitwise(
    label: str,
    outputs: tuple[list[torch.Tensor], list[torch.Tensor]],
    optimizers: tuple[Muon, Muon],
    params: tuple[list[torch.Tensor], list[torch.Tensor]],
    initial: list[torch.Tensor],
) -> None:
    """The overlapped run (second of each pair) is the sequential one, bitwise, and moved."""
    (seq_out, ovl_out), (seq_opt, ovl_opt), (seq_params, ovl_params) = outputs, optimizers, params
    assert len(seq_out) == len(ovl_out), label
    for i, (a, b) in enumerate(zip(seq_out, ovl_out)):
        assert torch.equal(a, b), f"{label}: forward {i} saw other weights than the sequential"
    for k, (p, q) in enumerate(zip(seq_params, ovl_params)):
        assert torch.equal(local_tensor(p), local_tensor(q)), f"{label}: param {k}"
        for key, value in seq_opt.state[p].items():
            if torch.is_tensor(value):
                other = local_tensor(ovl_opt.state[q][key])
                assert torch.equal(local_tensor(value), other), f"{label}: param {k} {key}"
    moved = [not torch.equal(local_tensor(p), x) for p, x in zip(seq_params, initial)]
    assert all(moved), f"{label}: params left unchanged by the steps: {moved}"


def _init_process_group(
    rank: int, world_size: int, store_path: str, backend: str, device_type: str
) -> torch.device:
    """The rank's device; on CUDA the world is bound to it (eager NCCL init, what real jobs
    do): torch then makes each new group by splitting the world's communicator."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        store=dist.FileStore(store_path, world_size),
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    return device


# ------------------------------------------------------------------ one rank, in process


def fsdp2_at_world_size_one(store_path: str, backend: str, device_type: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    device = _init_process_group(0, 1, store_path, backend, device_type)
    try:
        mesh = init_device_mesh(device.type, (1,))
        wrap = _fully_shard(mesh)
        plain, overlapped = wrap(_layers(device, width=256)), wrap(_layers(device, width=256))
        initial = _locals(list(plain.parameters()))
        a = _optimizer(plain)
        b = _optimizer(overlapped, overlap="forward")
        b.overlap_with(overlapped)
        out_a = _train(plain, a, range(5), 0, device)
        with _slow_worker(device):
            out_b = _train(overlapped, b, range(5), 0, device)
        b.synchronize()
        _assert_bitwise(
            "world size 1",
            (out_a, out_b),
            (a, b),
            (list(plain.parameters()), list(overlapped.parameters())),
            initial,
        )
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ cases of spawned worlds


def fsdp2_random_delays(rank: int, world_size: int, device: torch.device, backend: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    wrap = _fully_shard(mesh)
    plain, overlapped = wrap(_layers(device)), wrap(_layers(device))
    initial = _locals(list(plain.parameters()))
    a = _optimizer(plain)
    b = _optimizer(overlapped, overlap="forward")
    b.overlap_with(overlapped)
    out_a = _train(plain, a, range(6), rank, device)
    with _slow_worker(device, rank):
        out_b = _train(overlapped, b, range(6), rank, device)
    b.synchronize()
    _assert_bitwise(
        f"rank {rank}",
        (out_a, out_b),
        (a, b),
        (list(plain.parameters()), list(overlapped.parameters())),
        initial,
    )


def warmup_on_the_calling_thread(
    rank: int, world_size: int, device: torch.device, backend: str
) -> None:
    """Every collective of the exchange (``all_to_all_single``, ``broadcast``) recorded with
    its thread, its group and where the calling thread was; the first one on each group the
    worker uses must be the calling thread's, before the first ``step()`` returned."""
    from torch.distributed.device_mesh import init_device_mesh

    calls: list[tuple[str, str, dist.ProcessGroup]] = []  # (thread, phase, group)
    phase = ["the sequential run"]
    originals = dist.all_to_all_single, dist.broadcast

    def record(group) -> None:
        group = dist.group.WORLD if group is None else group
        calls.append((threading.current_thread().name, phase[0], group))

    def all_to_all(output, input, *args, group=None, **kwargs):
        record(group)
        return originals[0](output, input, *args, group=group, **kwargs)

    def broadcast(tensor, *args, group=None, **kwargs):
        record(group)
        return originals[1](tensor, *args, group=group, **kwargs)

    dist.all_to_all_single, dist.broadcast = all_to_all, broadcast
    try:
        mesh = init_device_mesh(device.type, (world_size,))
        wrap = _fully_shard(mesh)
        plain, overlapped = wrap(_layers(device)), wrap(_layers(device))
        initial = _locals(list(plain.parameters()))
        # The default (None) is on with NCCL; the dry run on gloo asks for it.
        warmup = None if backend == "nccl" else True
        a = _optimizer(plain, warmup=warmup)
        out_a = _train(plain, a, range(3), rank, device)
        phase[0] = "construction"
        b = _optimizer(overlapped, overlap="forward", warmup=warmup)
        b.overlap_with(overlapped)
        world = dist.group.WORLD
        assert wants_warmup(b.warmup_setting, world, device), "the warm-up is off on this world"
        step, steps = b.step, [0]

        def phased_step(*args, **kwargs):
            phase[0] = f"step() {steps[0]}"
            try:
                return step(*args, **kwargs)
            finally:
                phase[0] = f"after step() {steps[0]}"
                steps[0] += 1

        b.step = phased_step
        out_b = _train(overlapped, b, range(3), rank, device)
        b.synchronize()
    finally:
        dist.all_to_all_single, dist.broadcast = originals
    _assert_bitwise(
        f"rank {rank}",
        (out_a, out_b),
        (a, b),
        (list(plain.parameters()), list(overlapped.parameters())),
        initial,
    )
    background = {id(g): g for thread, _, g in calls if thread == "shardmuon-overlap"}
    assert background, f"the worker ran no collective: {calls}"
    assert all(t in ("MainThread", "shardmuon-overlap") for t, _, _ in calls), calls
    for group in background.values():
        thread, where = next((t, p) for t, p, g in calls if g is group)
        ranks = dist.get_process_group_ranks(group)
        assert thread == "MainThread", f"group {ranks}: its first collective ran on {thread}"
        assert where in ("construction", "step() 0"), f"group {ranks}: first set up in {where}"


def _stage_matrices(device: torch.device, stage_mesh, step: int | None) -> list[torch.Tensor]:
    """Stage 0's matrices sharded over both dims of its ``("dp", "tp")`` mesh: the weights
    (``step=None``) or that step's grads, cut locally (no collective)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(7 if step is None else 100 + step)
    shapes = [(48, 40), (32, 24)]
    fulls = [torch.randn(shape, generator=generator) for shape in shapes]
    placements = [Shard(0), Shard(1)]
    return [
        distribute_tensor(f.to(device), stage_mesh, placements, src_data_rank=None) for f in fulls
    ]


def _pipeline_stages(rank: int, world_size: int, device: torch.device, tp: int) -> None:
    """Like ``pipeline_stages_bitwise``: each stage its layers and its optimizers, both
    overlapped and sequential; with ``tp`` > 1, stage 0 also steps matrices exchanged over
    a group of its own 4 ranks (made by stage 0 alone)."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardmuon.planning import groups as planning_groups
    from shardmuon.planning.batches import MuonBatch

    if tp == 1:
        mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("pp", "dp"))
        stage_mesh = mesh["dp"]
    else:
        mesh = init_device_mesh(device.type, (2, 2, tp), mesh_dim_names=("pp", "dp", "tp"))
        stage_mesh = mesh["dp", "tp"]
    stage = mesh.get_local_rank("pp")
    stage_ranks = tuple(sorted(stage_mesh.mesh.flatten().tolist()))
    assert stage_ranks not in planning_groups._FLATTENED_GROUPS, "made before the case"
    own_group = tp > 1 and stage == 0
    wrap = _fully_shard(stage_mesh)
    width = 64 if stage == 0 else 48  # other layers, other shapes per stage
    plain = wrap(_layers(device, width=width, seed=stage))
    overlapped = wrap(_layers(device, width=width, seed=stage))
    extra = [[], []]
    if own_group:
        extra = [[nn.Parameter(t) for t in _stage_matrices(device, stage_mesh, None)] for _ in "ab"]

    def set_grads(params: list[nn.Parameter]) -> Callable[[int], None]:
        def before_step(step: int) -> None:
            if params:
                for p, g in zip(params, _stage_matrices(device, stage_mesh, step)):
                    p.grad = g

        return before_step

    params_a = [*plain.parameters(), *extra[0]]
    params_b = [*overlapped.parameters(), *extra[1]]
    initial = _locals(params_a)
    a = _optimizer(plain, extra[0])
    b = _optimizer(overlapped, extra[1], overlap="forward")
    b.overlap_with(overlapped)
    out_a = _train(plain, a, range(6), rank, device, set_grads(extra[0]))
    with _slow_worker(device, rank):
        out_b = _train(overlapped, b, range(6), rank, device, set_grads(extra[1]))
    b.synchronize()
    label = f"stage {stage} rank {rank}"
    _assert_bitwise(label, (out_a, out_b), (a, b), (params_a, params_b), initial)
    sizes = sorted(
        {c.layout.group.size for c in b.chunks() if isinstance(c, MuonBatch) and c.layout.exchanged}
    )
    want = [2, 4] if own_group else [2]
    assert sizes == want, f"stage {stage}: exchange group sizes {sizes}, expected {want}"
    made = stage_ranks in planning_groups._FLATTENED_GROUPS
    assert made == own_group, f"stage {stage}: a group of its ranks made: {made}"


def pipeline_stages(rank: int, world_size: int, device: torch.device, backend: str) -> None:
    _pipeline_stages(rank, world_size, device, tp=1)


def pipeline_stages_with_a_stage_group(
    rank: int, world_size: int, device: torch.device, backend: str
) -> None:
    _pipeline_stages(rank, world_size, device, tp=2)


CASES: dict[str, Callable[[int, int, torch.device, str], None]] = {
    "fsdp2_random_delays": fsdp2_random_delays,
    "warmup_on_the_calling_thread": warmup_on_the_calling_thread,
    "pipeline_stages": pipeline_stages,
    "pipeline_stages_with_a_stage_group": pipeline_stages_with_a_stage_group,
}


# ------------------------------------------------------------------ spawning


def _rank_main(
    rank: int,
    world_size: int,
    case: str,
    store_path: str,
    out_dir: str,
    backend: str,
    device_type: str,
    dump_after_s: float,
) -> None:
    """One spawned rank: its output to ``rank<r>.log``, its result to ``rank<r>.ok`` or the
    traceback of its failure to ``rank<r>.err``. Leaves without finalising the interpreter
    (``exit_worker``: a gloo or NCCL thread torn down at exit can abort a finished rank)."""
    out = Path(out_dir)
    log = open(out / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115 (lives until exit)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    # The stacks of every thread shortly before the parent kills a hung world.
    faulthandler.dump_traceback_later(dump_after_s, file=log)
    if device_type == "cpu":
        torch.set_num_threads(1)  # the dry run: many ranks on few cores
    try:
        device = _init_process_group(rank, world_size, store_path, backend, device_type)
        CASES[case](rank, world_size, device, backend)
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        exit_worker(1)
    (out / f"rank{rank}.ok").write_text("ok")
    dist.destroy_process_group()
    exit_worker(0)


def run_world(
    case: str,
    world_size: int,
    tmp_path: Path,
    backend: str = "nccl",
    device_type: str = "cuda",
    deadline_s: float = WORLD_DEADLINE_S,
) -> None:
    """Run ``case`` on ``world_size`` spawned ranks; fail with every rank's error, or with the
    ranks still running at the deadline (killed) and their logs' tails."""
    out = tmp_path / "ranks"
    out.mkdir()
    store = str(tmp_path / "store")
    spawn = mp.get_context("spawn")
    dump_after = max(1.0, deadline_s - 10)
    processes = [
        spawn.Process(
            target=_rank_main,
            args=(rank, world_size, case, store, str(out), backend, device_type, dump_after),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    began = time.monotonic()
    deadline = began + deadline_s

    def results(suffix: str) -> list[int]:
        return [r for r in range(world_size) if (out / f"rank{r}.{suffix}").exists()]

    try:
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            if results("err"):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            elif len(results("ok")) == world_size:
                deadline = min(deadline, time.monotonic() + TEARDOWN_GRACE_S)
            time.sleep(0.2)
    finally:
        running = [r for r, p in enumerate(processes) if p.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(10)
    ok, failed = results("ok"), results("err")
    if len(ok) == world_size:
        return
    problems = [f"rank {r} failed:\n{(out / f'rank{r}.err').read_text()}" for r in failed]
    seconds = time.monotonic() - began
    for r in range(world_size):
        if r in ok or r in failed:
            continue
        if r in running:
            how = f"still running after {seconds:.0f} s (killed)"
        else:
            how = f"exited with code {processes[r].exitcode} without a result"
        lines = (out / f"rank{r}.log").read_text(errors="replace").splitlines()
        tail = "\n".join(lines[-LOG_TAIL_LINES:])
        problems.append(f"rank {r} {how}; the end of its log:\n{tail}")
    pytest.fail(f"{case} on {world_size} ranks:\n" + "\n\n".join(problems), pytrace=False)


# ------------------------------------------------------------------ tests


def test_fsdp2_at_world_size_one_on_nccl_with_a_slow_worker(tmp_path: Path) -> None:
    fsdp2_at_world_size_one(str(tmp_path / "store"), "nccl", "cuda")


@gpus(2)
def test_fsdp2_on_two_device_bound_ranks_with_random_delays(tmp_path: Path) -> None:
    run_world("fsdp2_random_delays", 2, tmp_path)


@gpus(2)
def test_the_background_groups_are_set_up_on_the_calling_thread(tmp_path: Path) -> None:
    run_world("warmup_on_the_calling_thread", 2, tmp_path)


@gpus(4)
def test_pipeline_stages_on_a_device_bound_world(tmp_path: Path) -> None:
    run_world("pipeline_stages", 4, tmp_path)


@gpus(8)
def test_pipeline_stages_with_a_group_made_by_one_stage(tmp_path: Path) -> None:
    run_world("pipeline_stages_with_a_stage_group", 8, tmp_path)
