"""Cases run inside each spawned gloo world (see ``dist_harness``); one registry for all sizes.

Every case checks the distributed optimizer against something independent of it: the same
``Muon`` on plain (single-process) tensors with the same grads (bitwise), the bytes actually
handed to ``dist.all_to_all_single`` (counted by a wrapper) against the bytes implied by the
global shapes, the shards every rank really holds and the owners, or pinned error messages.

Cases do all their collectives before any assertion, so a check failing on one rank only
leaves the ranks in step for the next case.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from dist_checks import (
    ALL_WORLDS,
    BF16_BYTES,
    CASES,
    MESH_2X2,
    MULTI_RANK,
    S0,
    S1,
    S2,
    Context,
    R,
    Spec,
    case,
    cases_for,
    check_against_single,
    check_step_traffic,
    compare_states,
    compare_with_single,
    counting_all_to_all,
    fail_on,
    full,
    make_context,
    make_optimizer,
    matrix_shard_group,
    place,
    random_tensors,
    step_by_chunks,
)

__all__ = ["CASES", "cases_for", "make_context"]
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, distribute_tensor

from shardmuon import Muon, newton_schulz
from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.placements import local_tensor

# ------------------------------------------------------- hand-built layouts

# name -> (specs, Muon kwargs, world sizes, expect_no_traffic)
LAYOUTS: dict[str, tuple[list[Spec], dict, tuple[int, ...], bool]] = {
    "shard0_rows": (
        [
            Spec((64, 48), (S0,)),
            Spec((64, 48), (S0,)),
            Spec((64, 48), (S0,)),
            Spec((48, 64), (S0,)),
        ],
        {"nesterov": False},
        ALL_WORLDS,
        False,
    ),
    "shard1_cols": (
        [Spec((16, 30), (S1,)), Spec((30, 16), (S1,)), Spec((30, 16), (S1,))],
        {"adjust_lr": "spectral_norm"},
        ALL_WORLDS,
        False,
    ),
    # 30 rows: 15/15, 10/10/10, 8/8/8/6; five matrices: more batches than ranks.
    "uneven_30_rows": ([Spec((30, 16), (S0,))] * 5, {}, ALL_WORLDS, False),
    # 3 rows on 4 ranks: 1/1/1/0; 2 rows on 3 or 4 ranks: empty shards too.
    "empty_shards": (
        [Spec((3, 16), (S0,)), Spec((3, 16), (S0,)), Spec((16, 3), (S1,)), Spec((2, 8), (S0,))],
        {},
        ALL_WORLDS,
        False,
    ),
    # Five of one shape (a full batch and a short one) and a single matrix of another.
    "short_batches": ([Spec((20, 12), (S0,))] * 5 + [Spec((9, 12), (S0,))], {}, ALL_WORLDS, False),
    # 3-D stacks sharded on a matrix dim are exchanged matrix by matrix.
    "stack_3d_exchanged": (
        [Spec((4, 12, 8), (S1,)), Spec((3, 8, 12), (S2,)), Spec((2, 3, 9), (S1,))],
        {"nesterov": False},
        ALL_WORLDS,
        False,
    ),
    # Expert parallel on a 1-D mesh: Shard(0) of a stack is a batch dim, so no communication
    # (5 experts on 4 ranks: 2/2/1/0; 3 on 4: a rank without experts).
    "experts_shard0_local": (
        [Spec((5, 12, 8), (S0,)), Spec((3, 8, 8), (S0,)), Spec((24, 8), (R,))],
        {},
        ALL_WORLDS,
        True,
    ),
    # Shards cross partition boundaries (rows 44 = 10 + 20 + 14) in both shard directions;
    # a same-shape unpartitioned matrix must not share its batch.
    "partitions_cross_shards": (
        [
            Spec((44, 16), (S0,), partitions=(10, 20, 14)),
            Spec((44, 16), (S1,), partitions=(10, 20, 14)),
            Spec((2, 30, 8), (S1,), partitions=(6, 24)),
            Spec((44, 16), (S0,)),
        ],
        {},
        ALL_WORLDS,
        False,
    ),
    "plain_and_dtensor": (
        [Spec((20, 12)), Spec((20, 12), (S0,)), Spec((6, 10), (R,)), Spec((2, 5, 7))],
        {},
        ALL_WORLDS,
        False,
    ),
    "adamw_vectors": (
        [
            Spec((16, 16), (S0,)),
            Spec((10,), (S0,), algorithm="adamw"),
            Spec((3,), (S0,), algorithm="adamw"),
            Spec((7,), (R,), algorithm="adamw"),
            Spec((5,), algorithm="adamw"),
            Spec((12, 8), (S0,), algorithm="adamw"),
        ],
        {"betas": (0.8, 0.9)},
        ALL_WORLDS,
        False,
    ),
    "no_nesterov_no_decay_no_scale": (
        [Spec((30, 16), (S0,)), Spec((16, 30), (S1,)), Spec((3, 16), (S0,)), Spec((8, 8))],
        {"nesterov": False, "weight_decay": 0.0, "adjust_lr": None, "mu": 0.9},
        ALL_WORLDS,
        False,
    ),
    "flatten_conv_like": (
        [Spec((8, 3, 4), (S0,)), Spec((6, 2, 5), (S0,)), Spec((5, 4), (S0,))],
        {"flatten": True},
        ALL_WORLDS,
        False,
    ),
    # A parameter without a grad on every rank is skipped (no momentum, no decay).
    "grad_absent_everywhere": (
        [Spec((30, 16), (S0,)), Spec((30, 16), (S0,), has_grad=False), Spec((9, 4), (S1,))],
        {},
        ALL_WORLDS,
        False,
    ),
    "hsdp_2x2": (
        [
            Spec((30, 16), (R, S0), "2d"),
            Spec((3, 16), (R, S0), "2d"),
            Spec((16, 30), (R, S1), "2d"),
            Spec((10,), (R, S0), "2d", algorithm="adamw"),
        ],
        {},
        MESH_2X2,
        False,
    ),
    # Expert parallel over mesh dim 0, FSDP over mesh dim 1 on the matrix rows/cols.
    "ep_2x2": (
        [
            Spec((4, 12, 8), (S0, S1), "2d"),
            Spec((3, 10, 6), (S0, S1), "2d"),
            Spec((4, 6, 10), (S0, S2), "2d"),
            Spec((12, 8), (S0,)),
        ],
        {},
        MESH_2X2,
        False,
    ),
    "nested_shard0_2x2": (
        [Spec((5, 8, 6), (S0, S0), "2d"), Spec((4, 6, 6), (S0, S0), "2d")],
        {},
        MESH_2X2,
        True,
    ),
    # Shards over mesh dim 0 only: groups {0, 2} and {1, 3}.
    "mesh_dim0_groups_2x2": (
        [
            Spec((13, 7), (S0, R), "2d"),
            Spec((7, 13), (S1, R), "2d"),
            Spec((13, 7), (R, S0), "2d"),
            Spec((6, 6), (R, R), "2d"),
        ],
        {},
        MESH_2X2,
        False,
    ),
}


def _register_layout(name: str, specs: list[Spec], kwargs: dict, worlds, no_traffic: bool):
    @case(f"layout_{name}", worlds)
    def run(ctx: Context) -> None:
        check_against_single(ctx, specs, expect_no_traffic=no_traffic, **kwargs)


for _name, (_specs, _kwargs, _worlds, _quiet) in LAYOUTS.items():
    _register_layout(_name, _specs, _kwargs, _worlds, _quiet)


@case("hsdp_split_replicas_2x2", MESH_2X2)
def _hsdp_split_replicas(ctx: Context) -> None:
    """HSDP with ``split_replicas``: one replica orthogonalizes each batch, all get the bits.

    Across the world each matrix is orthogonalized once (not once per replica), the
    computing replica's result bytes equal what the other replica receives, and the
    update equals the single-process one bitwise.
    """
    specs = [
        Spec((30, 16), (R, S0), "2d"),
        Spec((3, 16), (R, S0), "2d"),
        Spec((16, 30), (R, S1), "2d"),
        Spec((12, 8), (R, S0), "2d"),
        Spec((12, 8), (R, S0), "2d"),
        Spec((4, 6, 10), (R, S0), "2d"),  # experts: local to each shard, still split
        Spec((10,), (R, S0), "2d", algorithm="adamw"),
    ]
    opt, problems = compare_with_single(ctx, specs, check_traffic=False, split_replicas=True)
    stats = opt.last_step_stats
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(
        gathered,
        (stats.matrices_orthogonalized, stats.replica_bytes_sent, stats.replica_bytes_received),
    )
    # exchanged: 5 whole matrices; local: the expert stack's 2 matrices per shard, 2 shards
    expected = 5 + 2 * 2
    orthogonalized = sum(g[0] for g in gathered)
    if orthogonalized != expected:
        problems.append(
            f"orthogonalized {orthogonalized} matrices in the world, expected {expected}"
        )
    sent, received = sum(g[1] for g in gathered), sum(g[2] for g in gathered)
    if sent != received or sent == 0:
        problems.append(f"replica bytes sent {sent} != received {received} (or zero)")
    fail_on(problems)


@case("replicated_split_replicas", MULTI_RANK)
def _replicated_split(ctx: Context) -> None:
    """DDP-style ``Replicate()`` params with ``split_replicas``: the world shares the work.

    Seven matrices of one shape and two of another, whole on every rank: each is
    orthogonalized by one rank (the batches are cut so every rank gets a share) and
    broadcast; the update equals the single-process one bitwise.
    """
    specs = [Spec((12, 8), (R,))] * 7 + [Spec((8, 20), (R,))] * 2
    opt, problems = compare_with_single(ctx, specs, check_traffic=False, split_replicas=True)
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, opt.last_step_stats.matrices_orthogonalized)
    if sum(gathered) != 9 or max(gathered) > 5:
        problems.append(f"matrices orthogonalized per rank {gathered}: expected 9 in all, shared")
    fail_on(problems)


@case("layout_uneven_chunked")
def _uneven_chunked(ctx: Context) -> None:
    specs = LAYOUTS["partitions_cross_shards"][0] + LAYOUTS["adamw_vectors"][0]
    check_against_single(ctx, specs, chunked=True)


# ---------------------------------------------------------- FSDP2 on a model


def _tiny_moe() -> nn.Module:
    from shardmuon.harness.models import build_model

    return build_model("tiny-moe", num_layers=2, vocab_size=256, seed=0)


def _routed(model: nn.Module):
    from shardmuon.routing import build_param_groups

    return build_param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)


def check_fsdp_model(ctx: Context, mesh: DeviceMesh) -> None:
    """FSDP2 ``fully_shard`` per decoder layer and root; random grads; vs single process."""
    from torch.distributed.fsdp import fully_shard

    reference, sharded = _tiny_moe(), _tiny_moe()
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    ref_routes, routes = _routed(reference), _routed(sharded)
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": True}
    ref = Muon(ref_routes.groups, matrix_partitions=ref_routes.partitions, **kwargs)
    opt = Muon(routes.groups, matrix_partitions=routes.partitions, **kwargs)
    ref_named = dict(reference.named_parameters())
    named = dict(sharded.named_parameters())
    problems = []
    if set(named) != set(ref_named) or routes.labels != ref_routes.labels:
        problems.append("test setup: names or routes differ between the two models")
    not_dtensor = [n for n, p in named.items() if not isinstance(p, DTensor)]
    if not_dtensor:
        problems.append(f"test setup: fully_shard left plain params {not_dtensor}")
    if not routes.partitions:
        problems.append("test setup: no partitioned (gate_up) expert stack was routed")
    names = sorted(ref_named)
    for step in range(2):
        grads = random_tensors([tuple(ref_named[n].shape) for n in names], 77 + step)
        for n, g in zip(names, grads):
            ref_named[n].grad = g.clone()
            p = named[n]
            p.grad = distribute_tensor(g, p.device_mesh, list(p.placements), src_data_rank=None)
        ref.step()
        with counting_all_to_all() as calls:
            opt.step()
        problems += check_step_traffic(ctx, opt, calls, False, f"step {step + 1}")
    if ctx.world_size > 1 and opt.last_step_stats.bytes_sent == 0 and ctx.rank == 0:
        problems.append("test setup: FSDP2 model moved no bytes on rank 0")
    specs = [Spec(tuple(ref_named[n].shape), None) for n in names]
    problems += compare_states(
        specs, opt, [named[n] for n in names], ref, [ref_named[n] for n in names], "FSDP2"
    )
    fail_on(problems)


@case("fsdp2_tiny_moe")
def _fsdp(ctx: Context) -> None:
    check_fsdp_model(ctx, ctx.mesh)


@case("hsdp2_tiny_moe_2x2", MESH_2X2)
def _hsdp(ctx: Context) -> None:
    check_fsdp_model(ctx, ctx.mesh_2d)


# ------------------------------------------------------------ chunked stepping

CHUNK_SPECS = [
    Spec((30, 16), (S0,)),
    Spec((30, 16), (S0,)),
    Spec((3, 16), (S0,)),
    Spec((16, 30), (S1,)),
    Spec((3, 6, 4), (S0,)),
    Spec((5, 7)),
    Spec((10,), (S0,), algorithm="adamw"),
    Spec((4,), algorithm="adamw"),
]


@case("chunks_equal_step")
def _chunks_equal_step(ctx: Context) -> None:
    """Two rounds by chunks vs two by step(): same bits, same counters; then misuse raises."""
    specs = CHUNK_SPECS
    init = random_tensors([s.shape for s in specs], 5)
    by_step = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    by_chunk = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    opt_step = make_optimizer(by_step, specs, lr=0.03, weight_decay=0.05, nesterov=True)
    opt_chunk = make_optimizer(by_chunk, specs, lr=0.03, weight_decay=0.05, nesterov=True)
    for step in range(2):
        grads = random_tensors([s.shape for s in specs], 500 + step)
        for s, a, b, g in zip(specs, by_step, by_chunk, grads):
            a.grad, b.grad = place(ctx, s, g), place(ctx, s, g)
        opt_step.step()
        step_by_chunks(opt_chunk)
    problems = compare_states(specs, opt_chunk, by_chunk, opt_step, by_step, "chunks vs step")
    if [g["step"] for g in opt_chunk.param_groups] != [2] * len(opt_chunk.param_groups):
        problems.append(f"step counters {[g['step'] for g in opt_chunk.param_groups]} != 2")

    # Misuse: the same chunk twice in a round, and step() in the middle of a round. The
    # chunk stepped first is local or AdamW-only where possible, so a rank that (wrongly)
    # does not raise cannot strand the others in a collective.
    chunks = opt_chunk.chunks()
    first = next(c for c in reversed(chunks) if not _is_exchanged(c))
    opt_chunk.step_chunk(first)
    for what, call, error in (
        ("a chunk stepped twice", lambda: opt_chunk.step_chunk(first), RuntimeError),
        ("step() mid-round", opt_chunk.step, RuntimeError),
    ):
        try:
            call()
            problems.append(f"{what} did not raise")
        except error as e:
            if what.startswith("a chunk") and "already stepped in this round" not in str(e):
                problems.append(f"{what}: unexpected message {e}")
    for chunk in [c for c in chunks if _is_exchanged(c)] + [
        c for c in chunks if not _is_exchanged(c) and c is not first
    ]:
        opt_chunk.step_chunk(chunk)
    opt_chunk.step()  # a new round starts cleanly
    if [g["step"] for g in opt_chunk.param_groups] != [4] * len(opt_chunk.param_groups):
        problems.append(f"step counters {[g['step'] for g in opt_chunk.param_groups]} != 4")
    fail_on(problems)


def _is_exchanged(chunk) -> bool:
    return isinstance(chunk, MuonBatch) and chunk.layout.exchanged


# ------------------------------------------------------------ owner rotation


@case("owner_rotation", MULTI_RANK)
def _owner_rotation(ctx: Context) -> None:
    """Single matrices of three shapes plus a long run of one shape over the world group.

    With rotation the owned counts differ by at most one between ranks; without, every
    batch starts at rank 0. Both give the single-process bits.
    """
    k = ctx.world_size
    specs = [Spec((12, 10), (S0,)), Spec((14, 10), (S0,)), Spec((16, 10), (S0,))]
    specs += [Spec((10, 12), (S0,))] * (2 * k + 1)
    total = len(specs)
    counts = {}
    problems = []
    for rotate in (True, False):
        opt, found = compare_with_single(ctx, specs, steps=1, rotate_owners=rotate)
        problems += [f"rotate_owners={rotate}: {p}" for p in found]
        gathered: list = [None] * k
        dist.all_gather_object(gathered, opt.last_step_stats.matrices_orthogonalized)
        counts[rotate] = gathered
        batches = sum(1 for c in opt.chunks() if _is_exchanged(c))
        if not rotate and gathered[0] != batches:
            problems.append(f"rotate_owners=False: rank 0 owns {gathered[0]}, batches {batches}")
    if sum(counts[True]) != total or max(counts[True]) - min(counts[True]) > 1:
        problems.append(f"owned per rank with rotation {counts[True]} for {total} matrices")
    fail_on(problems)


# ----------------------------------------------------- orthogonalize_chunk


ORTHO_LAYOUTS = [
    Spec((30, 16), (S0,)),
    Spec((16, 30), (S1,)),
    Spec((3, 16), (S0,)),
    Spec((2, 12, 8), (S1,)),
    Spec((20, 12), (S0,), partitions=(5, 15)),
    Spec((5, 9, 6), (S0,)),
    Spec((9, 6)),
]


@case("orthogonalize_chunk")
def _orthogonalize_chunk(ctx: Context) -> None:
    """Each rank's piece of the result is its piece of ``newton_schulz(U)`` on the whole matrix."""
    problems = []
    for spec in ORTHO_LAYOUTS:
        group = matrix_shard_group(place(ctx, spec, torch.zeros(spec.shape)), False)
        k = len(group) if group else 1
        # As many parameters as fit in one exchange (at most k matrices), up to three.
        per_param = math.prod(spec.shape[:-2])
        count = max(1, min(3, k // per_param)) if group else 2
        specs = [spec] * count
        params = [nn.Parameter(place(ctx, spec, torch.zeros(spec.shape))) for _ in specs]
        opt = make_optimizer(params, specs)
        directions = random_tensors([spec.shape] * count, 900)
        expected = [_ns_reference(u, spec.partitions) for u in directions]
        pieces = [local_tensor(place(ctx, spec, u)) for u in directions]
        want = [local_tensor(place(ctx, spec, e)) for e in expected]
        for first_owner in range(k):
            out = opt.orthogonalize_chunk(params, pieces, first_owner=first_owner)
            for i, (got, w) in enumerate(zip(out, want)):
                if got.dtype != torch.bfloat16 or not torch.equal(got, w):
                    problems.append(
                        f"{spec} first_owner={first_owner} matrix {i}: got {got.dtype} "
                        f"{tuple(got.shape)}, differs from newton_schulz of the whole matrix"
                    )
        if k > 1:
            extra = [nn.Parameter(place(ctx, spec, torch.zeros(spec.shape))) for _ in range(k + 1)]
            opt = make_optimizer(extra, [spec] * (k + 1))
            try:
                opt.orthogonalize_chunk(extra, [local_tensor(x).clone() for x in extra])
                problems.append(f"{spec}: {k + 1} matrices for {k} ranks did not raise")
            except ValueError as e:
                if f"pass at most {k}" not in str(e):
                    problems.append(f"{spec}: unexpected message {e}")
    fail_on(problems)


def _ns_reference(u: torch.Tensor, partitions: tuple[int, ...] | None) -> torch.Tensor:
    """``newton_schulz`` per matrix of the whole (bf16) direction, per row block if partitioned."""
    mats = u.to(torch.bfloat16).reshape(-1, *u.shape[-2:])
    out = []
    for m in mats:
        blocks = m.split(list(partitions), dim=0) if partitions else [m]
        out.append(torch.cat([newton_schulz(b) for b in blocks], dim=0))
    return torch.stack(out).reshape(u.shape)


# ------------------------------------------------------------------ warmup


@case("warmup_every_group")
def _warmup(ctx: Context) -> None:
    """``warmup()`` runs one all-to-all on each shard group the parameters imply, no other,
    whose per-peer message is the largest piece over that group; building an optimizer runs
    none (with ``warmup=True`` it warms before its first step, once the ranks agree), nor
    does the default on gloo."""
    from shardmuon.runtime import warmup as warmup_module

    warmup_module._WARMED.clear()  # what earlier cases of this world warmed
    specs = [Spec((30, 16), (S0,)), Spec((16, 3), (S1,)), Spec((5, 4, 4), (S0,)), Spec((4, 4))]
    if ctx.mesh_2d is not None:
        specs += [
            Spec((12, 8), (R, S0), "2d"),
            Spec((4, 12, 8), (S0, S1), "2d"),
            Spec((13, 7), (S0, R), "2d"),
            Spec((6, 6), (R, R), "2d"),
        ]
    params = [nn.Parameter(place(ctx, s, torch.zeros(s.shape))) for s in specs]
    expected = {g for p in params if (g := matrix_shard_group(p, False)) is not None}
    problems = []
    for how, wanted in (("warmup()", 1), ("warmup=True", 0), ("default", 0)):
        with counting_all_to_all() as calls:
            if how == "warmup()":
                opt = make_optimizer(params, specs, warmup=False)
                opt.warmup()
                largest: dict[tuple[int, ...], int] = {}
                for chunk in opt.chunks():
                    layout = getattr(chunk, "layout", None)
                    if layout is not None and layout.exchanged:
                        ranks = tuple(sorted(layout.group.ranks))
                        piece = max(layout.piece_numel(j) for j in range(layout.group.size))
                        largest[ranks] = max(largest.get(ranks, 0), piece)
            else:
                make_optimizer(params, specs, **({"warmup": True} if how == "warmup=True" else {}))
        per_group = Counter(c.ranks for c in calls)
        if wanted and (set(per_group) != expected or any(n != 1 for n in per_group.values())):
            problems.append(f"{how}: all-to-alls per group {dict(per_group)}, expected {expected}")
        if not wanted and calls:
            problems.append(f"{how}: {len(calls)} all-to-alls, expected none")
        if how == "warmup()":
            for call in calls:
                per_peer = call.sent // (2 * (len(call.ranks) - 1))
                if per_peer != largest[tuple(sorted(call.ranks))]:
                    problems.append(f"group {call.ranks}: warmed with {per_peer} per peer")
    fail_on(problems)


# ------------------------------------------------------------------ errors


def expect_raises(error: type, fragments: list[str], call: Callable[[], object]) -> list[str]:
    """Run ``call``; problems unless it raises ``error`` with every fragment in the message."""
    try:
        call()
    except error as e:
        missing = [f for f in fragments if f not in str(e)]
        return [f"{error.__name__} message {str(e)!r} lacks {missing}"] if missing else []
    except Exception as e:
        return [f"expected {error.__name__}, got {type(e).__name__}: {e}"]
    return [f"expected {error.__name__}, nothing was raised"]


@contextlib.contextmanager
def counting_all_reduce() -> Iterator[list[int]]:
    """Record the element count of every ``dist.all_reduce`` (the grad-presence check's)."""
    original = dist.all_reduce
    calls: list[int] = []

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _error_step(
    ctx: Context,
    grads: Callable[[list], None],
    error: type,
    fragments: list[str],
    all_reduces: int = 0,
) -> None:
    """A step with bad grads raises on every rank before any all-to-all, params untouched.

    ``all_reduces``: how many all-reduces may run first (the first-step check: one for the
    plan signature, one for grad presence).
    """
    specs = [Spec((8, 6), (S0,)), Spec((9, 6), (S0,))]
    init = random_tensors([s.shape for s in specs], 3)
    params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    opt = make_optimizer(params, specs)
    grads(params)
    with counting_all_to_all() as calls, counting_all_reduce() as reduces:
        problems = expect_raises(error, fragments, opt.step)
    if calls:
        problems.append(f"{len(calls)} all-to-alls ran before the error")
    if len(reduces) > all_reduces:
        problems.append(f"{len(reduces)} all-reduces ran before the error (<= {all_reduces})")
    changed = [i for i, (p, t) in enumerate(zip(params, init)) if not torch.equal(full(p), t)]
    if changed:
        problems.append(f"params {changed} changed by a step that raised")
    steps = [g["step"] for g in opt.param_groups]
    if any(steps):
        problems.append(f"step counters {steps} advanced by a step that raised")
    fail_on(problems)


@case("error_plain_grad_on_dtensor")
def _plain_grad(ctx: Context) -> None:
    def grads(params):
        params[0].grad = place(ctx, Spec((8, 6), (S0,)), torch.ones(8, 6))
        params[1].grad = torch.ones(9, 6)

    _error_step(ctx, grads, TypeError, ["param group 0 parameter 1", "is a DTensor", "plain"])


@case("error_grad_placements_differ", MULTI_RANK)
def _grad_placements(ctx: Context) -> None:
    def grads(params):
        params[0].grad = place(ctx, Spec((8, 6), (S0,)), torch.ones(8, 6))
        params[1].grad = place(ctx, Spec((9, 6), (R,)), torch.ones(9, 6))

    _error_step(ctx, grads, ValueError, ["parameter 1", "grad placements", "Replicate", "Shard"])


@case("error_grad_on_some_ranks", MULTI_RANK)
def _grad_some_ranks(ctx: Context) -> None:
    def grads(params):
        params[0].grad = place(ctx, Spec((8, 6), (S0,)), torch.ones(8, 6))
        if ctx.rank == 0:
            params[1].grad = place(ctx, Spec((9, 6), (S0,)), torch.ones(9, 6))
        else:
            params[1].grad = None

    _error_step(
        ctx, grads, ValueError, ["disagree on which Muon parameters have a grad"], all_reduces=1
    )


@case("error_different_params_per_rank", MULTI_RANK)
def _different_params(ctx: Context) -> None:
    """The last rank holds one more sharded matrix than the others: all ranks raise at the
    first step's plan check, before any all-to-all, instead of hanging."""
    specs = [Spec((8, 6), (S0,))] + [Spec((10, 6), (S0,))] * (ctx.rank == ctx.world_size - 1)
    init = random_tensors([s.shape for s in specs], 5)
    params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    opt = make_optimizer(params, specs)
    for p, s in zip(params, specs):
        p.grad = place(ctx, s, torch.ones(s.shape))
    with counting_all_to_all() as calls:
        problems = expect_raises(
            ValueError, ["disagree on the Muon step", "10x6 matrices"], opt.step
        )
    if calls:
        problems.append(f"{len(calls)} all-to-alls ran before the error")
    fail_on(problems)


@case("error_partial_param")
def _partial(ctx: Context) -> None:
    p = nn.Parameter(DTensor.from_local(torch.zeros(4, 3), ctx.mesh, [Partial()]))
    q = nn.Parameter(place(ctx, Spec((6, 3), (S0,)), torch.zeros(6, 3)))
    problems = expect_raises(
        ValueError,
        ["param 1", "Partial"],
        lambda: Muon([{"params": [q, p], "algorithm": "muon"}]),
    )
    fail_on(problems)


@case("two_matrix_shards_2x2", MESH_2X2)
def _two_matrix_shards(ctx: Context) -> None:
    """Once refused, now exchanged over both mesh dims (more in ``dist_tp_cases``): a matrix
    sharded on rows and columns, a stack sharded on both matrix dims, beside a 1-D shard."""
    specs = [
        Spec((8, 8), (S0,)),
        Spec((8, 12), (S0, S1), "2d"),
        Spec((2, 8, 12), (S1, S2), "2d"),
    ]
    check_against_single(ctx, specs)


@case("error_flatten_shard_not_dim0", MULTI_RANK)
def _flatten_shard_not_dim0(ctx: Context) -> None:
    """With ``flatten=True`` only shards of dim 0 are exchanged; a shard of another dim,
    alone or beside one of dim 0, is refused at construction, naming the parameter."""
    params = [nn.Parameter(place(ctx, Spec((8, 3, 4), (S1,)), torch.zeros(8, 3, 4)))]
    if ctx.mesh_2d is not None:
        spec = Spec((8, 3, 4), (S0, S1), "2d")
        params.append(nn.Parameter(place(ctx, spec, torch.zeros(8, 3, 4))))
    problems = []
    for param in params:
        found = expect_raises(
            NotImplementedError,
            ["param 0", "(8, 3, 4)", "flatten=True", "dim 0"],
            lambda param=param: Muon([{"params": [param], "algorithm": "muon"}], flatten=True),
        )
        problems += [f"{tuple(param.placements)}: {p}" for p in found]
    fail_on(problems)


@case("exact_bytes_3_rows", MULTI_RANK)
def _exact_bytes_3_rows(ctx: Context) -> None:
    """3 rows of 16 on k ranks: the world sends exactly the non-owner rows, there and back."""
    spec = Spec((3, 16), (S0,))
    opt = check_against_single(ctx, [spec], steps=1)
    (batch,) = [c for c in opt.chunks() if _is_exchanged(c)]
    sent: list = [None] * ctx.world_size
    dist.all_gather_object(sent, opt.last_step_stats.bytes_sent)
    rows_per_rank = [len(c) for c in torch.arange(3).chunk(ctx.world_size)]
    rows_per_rank += [0] * (ctx.world_size - len(rows_per_rank))
    owner_rows = rows_per_rank[batch.owners[0]]
    want = 2 * BF16_BYTES * (3 - owner_rows) * 16
    fail_on([] if sum(sent) == want else [f"world sent {sent} (sum {sum(sent)}), expected {want}"])
