"""Shared machinery of the distributed cases: contexts, placement helpers, byte counting, checks.

The checks compare the distributed optimizer with something independent of it: the same
``Muon`` on plain (single-process) tensors with the same grads (bitwise), and the bytes
actually handed to ``dist.all_to_all_single`` (counted by a wrapper) against the bytes
implied by the global shapes, the shards every rank really holds and the owners.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from shardmuon import Muon
from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.placements import local_tensor
from shardmuon.runtime.agreement import spread_rounds

ALL_WORLDS = (1, 2, 3, 4)
MULTI_RANK = (2, 3, 4)
MESH_2X2 = (4,)
BF16_BYTES = 2
S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()


@dataclass
class Context:
    """Per rank: a 1-D mesh over the world and, at world size 4, a 2x2 mesh."""

    rank: int
    world_size: int
    mesh: DeviceMesh
    mesh_2d: DeviceMesh | None

    def mesh_for(self, name: str) -> DeviceMesh:
        return self.mesh_2d if name == "2d" else self.mesh


def make_context(rank: int, world_size: int) -> Context:
    """Called once per rank by the harness: build the meshes every case shares."""
    mesh = init_device_mesh("cpu", (world_size,))
    mesh_2d = None
    if world_size == 4:
        # FSDP2's HSDP needs named mesh dims.
        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return Context(rank, world_size, mesh, mesh_2d)


@dataclass(frozen=True)
class Case:
    run: Callable[[Context], None]
    worlds: tuple[int, ...]

    def __call__(self, ctx: Context) -> None:
        self.run(ctx)


CASES: dict[str, Case] = {}


def case(name: str, worlds: tuple[int, ...] = ALL_WORLDS):
    """Register ``fn(ctx)`` as case ``name`` for the given world sizes."""

    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        if name in CASES:
            raise ValueError(f"case {name!r} registered twice")
        CASES[name] = Case(fn, worlds)
        return fn

    return register


def cases_for(world_size: int) -> list[str]:
    """Names of the cases that run at ``world_size``, in registration order."""
    return [name for name, c in CASES.items() if world_size in c.worlds]


# ------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class Spec:
    """One parameter: global shape, placements (``None``: a plain tensor), mesh, group."""

    shape: tuple[int, ...]
    placements: tuple | None = None
    mesh: str = "1d"
    algorithm: str = "muon"
    partitions: tuple[int, ...] | None = None
    has_grad: bool = True


def place(ctx: Context, spec: Spec, full: torch.Tensor) -> torch.Tensor:
    """This rank's version of ``full`` (the same on every rank): a DTensor or a plain copy."""
    if spec.placements is None:
        return full.clone()
    return _distribute(full, ctx.mesh_for(spec.mesh), list(spec.placements))


def _distribute(full: torch.Tensor, mesh: DeviceMesh, placements: list) -> torch.Tensor:
    """``full`` laid out by ``distribute_tensor``: cut locally (no collective) on a mesh that
    lists every dim's ranks in ascending order; on one that does not, scattered by torch,
    which gives shard ``i`` to group rank ``i`` as ``full_tensor()`` and FSDP2 read it there
    (a local cut would follow the mesh coordinate instead)."""
    grid = mesh.mesh
    ascending = all(bool((grid.diff(dim=d) > 0).all()) for d in range(grid.ndim))
    src = None if ascending else 0
    return distribute_tensor(full.clone(), mesh, placements, src_data_rank=src)


def full(t: torch.Tensor) -> torch.Tensor:
    """The global tensor (collective for DTensors)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def random_tensors(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def set_placed_random_grads(
    ctx: Context, params: list, specs: list[Spec], seed: int, reference: list | None = None
) -> None:
    """Give ``params`` the grads ``random_tensors(<the specs' shapes>, seed)``, laid out as
    their specs say; ``reference`` (plain tensors, one process's twin), copies of the whole
    grads."""
    grads = random_tensors([s.shape for s in specs], seed)
    for i, (spec, p, g) in enumerate(zip(specs, params, grads)):
        p.grad = place(ctx, spec, g)
        if reference is not None:
            reference[i].grad = g.clone()


def set_placed_constant_grads(
    ctx: Context, params: list, specs: list[Spec], skip: set[int] = frozenset()
) -> None:
    """Grad ``i`` all ``i + 1``, laid out as spec ``i`` says; none for the indices ``skip``."""
    for i, (p, s) in enumerate(zip(params, specs)):
        p.grad = None if i in skip else place(ctx, s, torch.ones(s.shape) * (i + 1))


def make_optimizer(params: list[torch.Tensor], specs: list[Spec], **kwargs) -> Muon:
    """Muon with one group per algorithm, params in spec order; partitions from the specs."""
    groups = []
    for algorithm in ("muon", "adamw"):
        members = [p for p, s in zip(params, specs) if s.algorithm == algorithm]
        if members:
            groups.append({"params": members, "algorithm": algorithm})
    partitions = {p: s.partitions for p, s in zip(params, specs) if s.partitions is not None}
    return Muon(groups, matrix_partitions=partitions or None, **kwargs)


def muon_params(opt: Muon) -> list[torch.Tensor]:
    """The Muon parameters in plan order (groups, then params), which batch segments index."""
    return [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]


# ---------------------------------------------------------------- all-to-all


@dataclass(frozen=True)
class AllToAllCall:
    """One ``all_to_all_single`` as this rank made it: bytes to / from other ranks."""

    ranks: tuple[int, ...]
    sent: int
    received: int
    dtype: torch.dtype
    input_matches_splits: bool


@contextlib.contextmanager
def counting_all_to_all() -> Iterator[list[AllToAllCall]]:
    """Wrap ``dist.all_to_all_single`` and record each call's payload to other ranks."""
    original = dist.all_to_all_single
    calls: list[AllToAllCall] = []

    def counted(
        output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs
    ):
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        me = ranks.index(dist.get_rank())
        k = len(ranks)
        ins = list(input_split_sizes) if input_split_sizes else [input.numel() // k] * k
        outs = list(output_split_sizes) if output_split_sizes else [output.numel() // k] * k
        calls.append(
            AllToAllCall(
                ranks=ranks,
                sent=(sum(ins) - ins[me]) * input.element_size(),
                received=(sum(outs) - outs[me]) * output.element_size(),
                dtype=input.dtype,
                input_matches_splits=input.numel() == sum(ins) and output.numel() == sum(outs),
            )
        )
        return original(output, input, output_split_sizes, input_split_sizes, group, **kwargs)

    dist.all_to_all_single = counted
    try:
        yield calls
    finally:
        dist.all_to_all_single = original


@dataclass(frozen=True)
class Collective:
    """One collective as the dispatcher saw it: the op, and its tensor argument(s)."""

    op: str
    numel: int
    dtype: torch.dtype | None


class _CollectiveRecorder(TorchDispatchMode):
    """Records every ``c10d`` / functional-collective op dispatched while active."""

    NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in self.NAMESPACES:
            first = args[0] if args else None
            tensors = list(first) if isinstance(first, (list, tuple)) else [first]
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            self.calls.append(
                Collective(
                    op=f"{func.namespace}.{func._schema.name.split('::')[-1]}",
                    numel=sum(t.numel() for t in tensors),
                    dtype=tensors[0].dtype if tensors else None,
                )
            )
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording_collectives() -> Iterator[list[Collective]]:
    """Record every collective dispatched in the block (``torch.distributed``'s and the
    functional ones DTensor uses), whatever calls it."""
    recorder = _CollectiveRecorder()
    with recorder:
        yield recorder.calls


def agreement_groups_of(params: list[torch.Tensor], flatten: bool) -> set[tuple[int, ...]]:
    """Groups the agreement check must reduce over: the matrix-shard groups and the HSDP
    replicate groups of the Muon params (size > 1), read from placements."""
    groups = set()
    for p in params:
        for g in (matrix_shard_group(p, flatten), replicate_group(p)):
            if g is not None and len(g) > 1:
                groups.add(g)
    return groups


def check_step_collectives(
    calls: list[Collective], agreement_groups: int, first_step: bool, label: str, rounds: int = 0
) -> list[str]:
    """Only all-to-alls, plus one int64 all-reduce per group: the full check's 5 elements on
    the first step, the live settings' 2 on every later one; and ``rounds`` 1-element ones
    per group where the verdict is passed on (``agreement.spread_rounds``)."""
    problems = []
    reduces = [c for c in calls if c.op == "c10d.allreduce_"]
    others = [c for c in calls if c.op not in ("c10d.allreduce_", "c10d.alltoall_base_")]
    if others:
        problems.append(f"{label}: collectives other than all-to-alls and the check: {others}")
    numel = 5 if first_step else 2
    checks = [c for c in reduces if c.numel != 1]
    spreads = [c for c in reduces if c.numel == 1]
    if len(checks) != agreement_groups or any(
        c.numel != numel or c.dtype != torch.int64 for c in checks
    ):
        problems.append(
            f"{label}: all-reduces {reduces}, expected {agreement_groups} of {numel} int64 "
            "elements (the agreement check: one per group, 5 elements on the first step, the "
            "live settings' 2 later)"
        )
    if len(spreads) != agreement_groups * rounds or any(c.dtype != torch.int64 for c in spreads):
        problems.append(
            f"{label}: {len(spreads)} 1-element all-reduces, expected {agreement_groups} "
            f"groups x {rounds} rounds"
        )
    return problems


def matrix_shard_group(p: torch.Tensor, flatten: bool) -> tuple[int, ...] | None:
    """Global ranks holding pieces of the same matrices as this rank, or None.

    Read from the placements and the mesh: every mesh dim of size > 1 that shards a matrix
    dim (``Shard`` or ``_StridedShard``) is flattened, in row-major order, the other mesh
    dims fixed at this rank's coordinate (as ``mesh[names]._flatten()`` would); one such
    mesh dim gives its own group, in its own order.
    """
    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    matrix_dims = set(range(p.ndim)) if flatten else {p.ndim - 2, p.ndim - 1}
    dims = [
        d
        for d, placement in enumerate(p.placements)
        if isinstance(placement, (Shard, _StridedShard))
        and placement.dim % p.ndim in matrix_dims
        and mesh.size(d) > 1
    ]
    if not dims:
        return None
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if d in dims else coordinate[d] for d in range(mesh.ndim))
    return tuple(mesh.mesh[index].flatten().tolist())


def replicate_group(p: torch.Tensor) -> tuple[int, ...] | None:
    """Global ranks along ``p``'s one ``Replicate`` mesh dim of size > 1 (HSDP's), or None."""
    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    dims = [
        d
        for d, placement in enumerate(p.placements)
        if isinstance(placement, Replicate) and mesh.size(d) > 1
    ]
    if len(dims) != 1:
        return None
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if d == dims[0] else coordinate[d] for d in range(mesh.ndim))
    return tuple(mesh.mesh[index].flatten().tolist())


def local_matrices(p: torch.Tensor, flatten: bool) -> tuple[int, int, int]:
    """This rank's piece of ``p`` as ``(count, rows, cols)`` of matrices."""
    shape = local_tensor(p).shape
    if flatten:
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def global_matrix(p: torch.Tensor, flatten: bool) -> tuple[int, int]:
    if flatten:
        return p.shape[0], math.prod(p.shape[1:])
    return p.shape[-2], p.shape[-1]


@dataclass
class Traffic:
    """What one step should move and compute, derived from shapes, shards and owners."""

    sent: int = 0
    received: int = 0
    exchanged_batches: int = 0
    groups: set[tuple[int, ...]] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


def expected_traffic(ctx: Context, opt: Muon, flatten: bool) -> Traffic:
    """Bytes this rank must send/receive: each non-owner piece to its owner and back, bf16.

    Piece sizes come from the local shapes every rank really holds (gathered), groups from
    the placements; only the owners are taken from the optimizer's batches (and checked:
    distinct, in range, at most one matrix per rank per batch). Collective.
    """
    params = muon_params(opt)
    mine = [local_matrices(p, flatten) for p in params]
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    traffic = Traffic()
    seen: set[tuple[int, int]] = set()
    for chunk in opt.chunks():
        if not isinstance(chunk, MuonBatch) or not chunk.layout.exchanged:
            continue
        units = [(s.param_index, i) for s in chunk.segments for i in range(s.start, s.stop)]
        if not units:  # planned for experts only other ranks hold: nothing to exchange
            continue
        traffic.exchanged_batches += 1
        owners = chunk.owners
        ranks = matrix_shard_group(params[units[0][0]], flatten)
        if ranks is None or tuple(chunk.layout.group.ranks) != ranks:
            traffic.problems.append(
                f"batch {chunk.index}: group {chunk.layout.group.ranks} but the placements "
                f"say {ranks}"
            )
            continue
        traffic.groups.add(ranks)
        k = len(ranks)
        if len(owners) != len(units) or len(set(owners)) != len(owners) or len(units) > k:
            traffic.problems.append(
                f"batch {chunk.index}: {len(units)} matrices, owners {owners}, group of {k}"
            )
            continue
        if not all(0 <= o < k for o in owners):
            traffic.problems.append(f"batch {chunk.index}: owners {owners} out of range")
            continue
        me = ranks.index(ctx.rank)
        for (index, i), owner in zip(units, owners):
            if (index, i) in seen:
                traffic.problems.append(f"matrix {i} of Muon param {index} in two batches")
            seen.add((index, i))
            if params[index].grad is None:
                continue
            pieces = [everyone[r][index][1] * everyone[r][index][2] for r in ranks]
            if me == owner:
                others = sum(pieces) - pieces[me]
                traffic.sent += BF16_BYTES * others
                traffic.received += BF16_BYTES * others
            else:
                traffic.sent += BF16_BYTES * pieces[me]
                traffic.received += BF16_BYTES * pieces[me]
    for index, p in enumerate(params):
        if matrix_shard_group(p, flatten) is None:
            continue
        missing = [i for i in range(mine[index][0]) if (index, i) not in seen]
        if missing:
            traffic.problems.append(f"matrices {missing} of Muon param {index} in no batch")
    return traffic


def check_step_traffic(
    ctx: Context,
    opt: Muon,
    calls: list[AllToAllCall],
    flatten: bool,
    label: str,
    tally: list[tuple[int, int]] | None = None,
) -> list[str]:
    """Compare the counted all-to-alls with the stats and the independent expectation.

    ``tally``: if given, ``(bytes sent as counted, minimum)`` of this rank is appended.
    """
    expected = expected_traffic(ctx, opt, flatten)
    stats = opt.last_step_stats
    counted_sent = sum(c.sent for c in calls)
    counted_received = sum(c.received for c in calls)
    if tally is not None:
        tally.append((counted_sent, expected.sent))
    problems = [f"{label}: {p}" for p in expected.problems]

    def expect(what: str, got, want) -> None:
        if got != want:
            problems.append(f"{label}: {what} is {got}, expected {want}")

    expect("stats.bytes_sent vs bytes counted at all_to_all_single", stats.bytes_sent, counted_sent)
    expect("stats.bytes_received vs bytes counted", stats.bytes_received, counted_received)
    expect("stats.bytes_sent vs stats.bytes_minimum", stats.bytes_sent, stats.bytes_minimum)
    expect("bytes sent (counted) vs shapes and owners", counted_sent, expected.sent)
    expect("bytes received (counted) vs shapes and owners", counted_received, expected.received)
    expect("all_to_all_single calls", len(calls), 2 * expected.exchanged_batches)
    bad = [c for c in calls if c.dtype != torch.bfloat16 or not c.input_matches_splits]
    if bad:
        problems.append(f"{label}: all-to-alls not bf16 or with data beyond the splits: {bad}")
    stray = {c.ranks for c in calls} - expected.groups
    if stray:
        problems.append(f"{label}: all-to-alls on groups {stray} no parameter is sharded over")
    return problems


def check_orthogonalized(ctx: Context, opt: Muon, flatten: bool, label: str) -> list[str]:
    """World-wide: every matrix with a grad orthogonalized exactly once per shard group."""
    expected: Counter = Counter()
    for p in muon_params(opt):
        if p.grad is None:
            continue
        count, _, _ = local_matrices(p, flatten)
        ranks = matrix_shard_group(p, flatten)
        # A matrix sharded over k ranks is orthogonalized once by its owner: k pieces, 1 matrix.
        expected[(global_matrix(p, flatten), len(ranks) if ranks else 1)] += count
    stats = opt.last_step_stats
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (dict(expected), list(stats.owned_shapes)))
    want: Counter = Counter()
    for counts, _ in gathered:
        for (shape, k), n in counts.items():
            want[tuple(shape)] += n / k
    got = Counter(tuple(s) for _, shapes in gathered for s in shapes)
    if any(n != int(n) for n in want.values()) or got != Counter(
        {s: int(n) for s, n in want.items()}
    ):
        return [f"{label}: orthogonalized shapes (world) {dict(got)}, expected {dict(want)}"]
    return []


# ----------------------------------------------------- single-process equality


def compare_states(
    specs: list[Spec], dist_opt: Muon, dist_params: list, ref_opt: Muon, ref_params: list, label
) -> list[str]:
    """Bitwise param/momentum/variance/step comparison (gathers first, then checks).

    ``ref_params`` are usually plain tensors: each rank then compares its local shards with
    the same shards cut from the reference by ``distribute_tensor`` (no gather: DTensor
    cannot gather some uneven ``_StridedShard`` layouts). DTensors (another distributed run)
    are compared whole.
    """
    pairs = []
    for i, (p, r) in enumerate(zip(dist_params, ref_params)):
        pairs.append((f"param {i}", *_comparable(p.detach(), r.detach())))
        for key in ("momentum", "variance"):
            if key in ref_opt.state[r]:
                got, want = dist_opt.state[p][key], ref_opt.state[r][key]
                pairs.append((f"{key} {i}", *_comparable(got, want)))
    problems = []
    for what, got, want in pairs:
        index = int(what.split()[-1])
        if got.shape != want.shape:
            problems.append(
                f"{label}: {what} {specs[index]} has shape {tuple(got.shape)}, expected "
                f"{tuple(want.shape)}"
            )
        elif not torch.equal(got, want):
            diff = (got.double() - want.double()).abs().max().item()
            problems.append(f"{label}: {what} {specs[index]} differs (max abs diff {diff:.3g})")
    steps = [g["step"] for g in dist_opt.param_groups]
    ref_steps = [g["step"] for g in ref_opt.param_groups]
    if steps != ref_steps:
        problems.append(f"{label}: group step counters {steps}, single-process {ref_steps}")
    return problems


def assert_same_locals(label: str, pairs) -> None:
    """Each pair of tensors holds the same piece on this rank, bitwise (DTensors: their local
    shards; no collective)."""
    for k, (a, b) in enumerate(pairs):
        assert torch.equal(local_tensor(a), local_tensor(b)), f"{label}: tensor {k}"


def assert_same_local_optimizers(
    opt_a: Muon, params_a: list, opt_b: Muon, params_b: list, label: str = ""
) -> None:
    """This rank's pieces of the params and of every state tensor bitwise equal: the twin of
    ``checks.assert_same_optimizers`` for two runs laid out alike (no collective)."""
    prefix = f"{label}: " if label else ""
    assert_same_locals(f"{prefix}params", zip(params_a, params_b))
    for k, (p, q) in enumerate(zip(params_a, params_b)):
        for key, value in opt_a.state[p].items():
            if torch.is_tensor(value):
                other = opt_b.state[q][key]
                assert torch.equal(local_tensor(value), local_tensor(other)), (
                    f"{prefix}param {k} state {key}"
                )


def _comparable(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``got``'s local shard and the same shard of plain ``want``; or both whole."""
    if isinstance(got, DTensor) and not isinstance(want, DTensor):
        shard = _distribute(want, got.device_mesh, list(got.placements))
        return local_tensor(got), local_tensor(shard)
    return full(got), full(want)


def step_by_chunks(opt: Muon) -> None:
    """One round through ``chunks()``: AdamW first, then exchanged batches, then local ones.

    Exchanged batches are collectives: they must go in the order of ``chunks()`` (the
    optimizer refuses any other); AdamW and local batches may go anywhere.
    """
    chunks = opt.chunks()
    exchanged = [c for c in chunks if isinstance(c, MuonBatch) and c.layout.exchanged]
    local_batches = [c for c in chunks if isinstance(c, MuonBatch) and not c.layout.exchanged]
    adamw = [c for c in chunks if not isinstance(c, MuonBatch)]
    for chunk in [*adamw, *exchanged, *local_batches]:
        opt.step_chunk(chunk)


def fail_on(problems: list[str]) -> None:
    """Raise one AssertionError listing every problem (call only after the last collective)."""
    if problems:
        raise AssertionError("\n".join(problems))


def check_against_single(ctx: Context, specs: list[Spec], **kwargs) -> Muon:
    """:func:`compare_with_single`, raising on any problem; returns the distributed Muon."""
    opt, problems = compare_with_single(ctx, specs, **kwargs)
    fail_on(problems)
    return opt


def compare_with_single(
    ctx: Context,
    specs: list[Spec],
    *,
    steps: int = 3,
    seed: int = 0,
    chunked: bool = False,
    expect_no_traffic: bool = False,
    check_traffic: bool = True,
    check_collectives: bool = False,
    tally: list[tuple[int, int]] | None = None,
    dtype: torch.dtype = torch.float32,
    **muon_kwargs,
) -> tuple[Muon, list[str]]:
    """Step a distributed Muon and the same Muon on plain tensors; everything must match.

    Checks per step: the traffic (counted vs stats vs shapes and owners) and what was
    orthogonalized; at the end: params, momentum, variance and step counters, bitwise.
    Returns the distributed optimizer and the problems found (empty: all matched); raising
    is left to the caller, so that a case can run more collectives after a mismatch.
    ``check_traffic=False`` skips the per-step traffic checks (which assume every replica
    exchanges its own batches) for cases that check traffic themselves.
    ``check_collectives``: no collective in a step but the all-to-alls and, on the first
    step, the agreement check's all-reduces (one per group the placements imply).
    ``tally`` collects ``(bytes sent, minimum)`` per step (see :func:`check_step_traffic`).
    ``dtype``: of the params and grads (both sides).
    """
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": True, **muon_kwargs}
    flatten = bool(kwargs.get("flatten", False))
    init = [t.to(dtype) for t in random_tensors([s.shape for s in specs], seed)]
    ref_params = [nn.Parameter(t.clone()) for t in init]
    dist_params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    ref = make_optimizer(ref_params, specs, **kwargs)
    opt = make_optimizer(dist_params, specs, **kwargs)
    has_partitions = any(s.partitions for s in specs)
    problems: list[str] = []
    for step in range(steps):
        grads = random_tensors([s.shape for s in specs], seed * 1000 + step + 1)
        grads = [g.to(dtype) for g in grads]
        for spec, r, p, g in zip(specs, ref_params, dist_params, grads):
            r.grad = g.clone() if spec.has_grad else None
            p.grad = place(ctx, spec, g) if spec.has_grad else None
        ref.step()
        recording = recording_collectives() if check_collectives else contextlib.nullcontext([])
        with counting_all_to_all() as calls, recording as collectives:
            step_by_chunks(opt) if chunked else opt.step()
        label = f"step {step + 1}"
        if check_collectives:
            groups = len(agreement_groups_of(muon_params(opt), flatten))
            rounds = spread_rounds(muon_params(opt))
            problems += check_step_collectives(collectives, groups, step == 0, label, rounds)
        if not check_traffic:
            continue
        problems += check_step_traffic(ctx, opt, calls, flatten, label, tally)
        if not has_partitions:
            problems += check_orthogonalized(ctx, opt, flatten, label)
        if expect_no_traffic and calls:
            problems.append(f"{label}: {len(calls)} all-to-alls in a layout that needs none")
    problems += compare_states(specs, opt, dist_params, ref, ref_params, f"after {steps} steps")
    return opt, problems
