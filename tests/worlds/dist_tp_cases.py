"""Two-dimensional shards (issue #13): matrices sharded on both matrix dims, or on one matrix
dim twice (``_StridedShard`` included), at world 4 (a 2x2 ``("dp", "tp")`` mesh) and world 8
(a 2x2x2 ``("replicate", "dp", "tp")`` mesh and a 4x2 ``("dp", "tp")`` one). Run by
``test_tp.py``.

Every case compares the distributed Muon with the same Muon on plain tensors in one process
(params and momentum bitwise, several steps), counts the bytes handed to
``all_to_all_single`` against the minimum implied by the local shapes every rank really
holds and the batches' owners (each piece not on its owner goes there and back once, in
bf16), records every collective of the step (only all-to-alls, plus the agreement check's
all-reduces on the first step), and compares each batch's ``layout.pieces`` with the global
rows and columns DTensor really gives each rank. Each case logs a line
``TRAFFIC case=... sent=... minimum=... ratio=...`` (world totals over all steps) in rank 0's
log, which ``test_tp.py`` collects.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from dist_cases import expect_raises
from dist_checks import (
    S0,
    S1,
    S2,
    Case,
    Context,
    R,
    Spec,
    agreement_groups_of,
    check_orthogonalized,
    check_step_collectives,
    check_step_traffic,
    compare_states,
    compare_with_single,
    counting_all_to_all,
    fail_on,
    make_optimizer,
    muon_params,
    place,
    random_tensors,
    recording_collectives,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from shardmuon import Muon
from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.placements import local_tensor

__all__ = ["CASES", "cases_for", "make_context"]

WORLD4 = (4,)
WORLD8 = (8,)
# FSDP2 over TP's colwise weights: dp's strided shard of rows that tp shards again.
SS0 = _StridedShard(0, split_factor=2)
SS1 = _StridedShard(1, split_factor=2)


@dataclass
class TPContext(Context):
    """Meshes by name: ``"1d"`` (the world), ``"2d"`` (``("dp", "tp")``: 2x2 at world 4, 4x2 at
    world 8) and, at world 8, ``"3d"`` (``("replicate", "dp", "tp")``, 2x2x2)."""

    meshes: dict[str, DeviceMesh] = field(default_factory=dict)

    def mesh_for(self, name: str) -> DeviceMesh:
        return self.meshes[name]


def make_context(rank: int, world_size: int) -> TPContext:
    meshes = {"1d": init_device_mesh("cpu", (world_size,))}
    if world_size == 4:
        meshes["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        # Without names a mesh cannot be flattened by DeviceMesh: shardmuon makes the group.
        meshes["2d_unnamed"] = init_device_mesh("cpu", (2, 2))
    if world_size == 8:
        meshes["2d"] = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        meshes["3d"] = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "dp", "tp"))
    return TPContext(rank, world_size, meshes["1d"], meshes.get("2d"), meshes)


CASES: dict[str, Case] = {}
# Cases that log a TRAFFIC line (test_tp.py checks each one did).
TRAFFIC_CASES: set[str] = set()


def case(name: str, worlds: tuple[int, ...], traffic: bool = True):
    def register(fn):
        if name in CASES:
            raise ValueError(f"case {name!r} registered twice")
        CASES[name] = Case(fn, worlds)
        if traffic:
            TRAFFIC_CASES.add(name)
        return fn

    return register


def cases_for(world_size: int) -> list[str]:
    return [name for name, c in CASES.items() if world_size in c.worlds]


# ------------------------------------------------------------------ shared checks


def flat_index(p: DTensor) -> torch.Tensor:
    """The global flat index of every element of ``p``'s local tensor, as ``distribute_tensor``
    (hence :func:`dist_checks.place`) lays it out: ``arange`` distributed with ``p``'s
    placements (no communication)."""
    index = torch.arange(p.numel(), dtype=torch.float64).view(p.shape)
    shard = distribute_tensor(index, p.device_mesh, list(p.placements), src_data_rank=None)
    return local_tensor(shard).long()


def _pieces_of(
    index: torch.Tensor, shape: tuple[int, ...]
) -> tuple[tuple[int, int], list[int] | None, list[int] | None]:
    """From a local flat-index tensor of a global ``shape``: the local matrix shape, and the
    global rows and columns in local order (``None`` where the piece is empty)."""
    rows, cols = shape[-2], shape[-1]
    local = (index.shape[-2], index.shape[-1])
    if index.numel() == 0:
        return local, None, None
    first = index.reshape(-1, *local)[0]
    return local, ((first[:, 0] // cols) % rows).tolist(), (first[0, :] % cols).tolist()


def _expanded(ranges) -> list[int]:
    return [i for start, stop in ranges for i in range(start, stop)]


def check_pieces(
    ctx: Context, opt: Muon, label: str, index: dict[int, torch.Tensor] | None = None
) -> list[str]:
    """Every exchanged batch's ``layout.pieces[j]`` is what rank ``group.ranks[j]`` holds of
    each of the batch's parameters (shape, global rows and columns). ``index``: the local
    flat-index tensor of Muon parameter ``i`` where it is not laid out as
    ``distribute_tensor`` does (FSDP2's own layout); default :func:`flat_index`. Collective."""
    params = muon_params(opt)
    index = index or {}
    mine = [
        _pieces_of(index[i] if i in index else flat_index(p), tuple(p.shape))
        if isinstance(p, DTensor)
        else None
        for i, p in enumerate(params)
    ]
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    problems = []
    exchanged = 0
    for batch in opt.chunks():
        if not isinstance(batch, MuonBatch) or not batch.layout.exchanged:
            continue
        exchanged += 1
        layout = batch.layout
        pieces = getattr(layout, "pieces", None)
        if pieces is None or len(pieces) != layout.group.size:
            problems.append(f"{label}: batch {batch.index} has pieces {pieces}")
            continue
        for index in sorted({s.param_index for s in batch.segments}):
            for j, rank in enumerate(layout.group.ranks):
                shape, rows, cols = everyone[rank][index]
                piece = pieces[j]
                where = f"{label}: batch {batch.index}, Muon param {index}, rank {rank}"
                if tuple(piece.shape) != tuple(shape):
                    problems.append(f"{where}: piece {piece} but DTensor's local shape {shape}")
                elif rows is not None and (
                    _expanded(piece.rows) != rows or _expanded(piece.cols) != cols
                ):
                    problems.append(
                        f"{where}: piece {piece} but DTensor holds rows {rows}, cols {cols}"
                    )
    if exchanged == 0:
        problems.append(f"{label}: no exchanged batch (the case needs one)")
    return problems


def log_traffic(ctx: Context, name: str, tally: list[tuple[int, int]]) -> list[str]:
    """World totals of bytes sent and of the minimum over all steps; rank 0 logs the line.
    Collective."""
    sent, minimum = sum(t[0] for t in tally), sum(t[1] for t in tally)
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (sent, minimum))
    world_sent = sum(g[0] for g in gathered)
    world_minimum = sum(g[1] for g in gathered)
    ratio = world_sent / world_minimum if world_minimum else float("nan")
    if ctx.rank == 0:
        print(
            f"TRAFFIC case={name} world={ctx.world_size} sent={world_sent} "
            f"minimum={world_minimum} ratio={ratio:.4f}",
            flush=True,
        )
    if world_minimum == 0:
        return [f"{name}: the layout moved no bytes (minimum 0): not a two-dim exchange"]
    return []


def check_layout(ctx: Context, name: str, specs: list[Spec], **kwargs) -> Muon:
    """Against one process (bitwise), minimum bytes, only the expected collectives, pieces."""
    tally: list[tuple[int, int]] = []
    opt, problems = compare_with_single(ctx, specs, check_collectives=True, tally=tally, **kwargs)
    problems += check_pieces(ctx, opt, name)
    problems += log_traffic(ctx, name, tally)
    fail_on(problems)
    return opt


# ------------------------------------------------------------------ raw DTensors

# name -> (specs, Muon kwargs, worlds)
LAYOUTS: dict[str, tuple[list[Spec], dict, tuple[int, ...]]] = {
    # Five of a shape on a group of 4: a full batch and a short one.
    "s0_s1": (
        [Spec((12, 8), (S0, S1), "2d")] * 5 + [Spec((8, 12), (S0, S1), "2d")],
        {},
        WORLD4,
    ),
    "s1_s0": (
        [Spec((12, 8), (S1, S0), "2d")] * 5 + [Spec((8, 12), (S1, S0), "2d")],
        {"nesterov": False},
        WORLD4,
    ),
    "s0_s0": (
        [Spec((12, 8), (S0, S0), "2d")] * 5 + [Spec((8, 12), (S0, S0), "2d")],
        {"adjust_lr": "spectral_norm"},
        WORLD4,
    ),
    "s1_s1": ([Spec((8, 12), (S1, S1), "2d")] * 3, {}, WORLD4),
    "strided_s0": (
        [Spec((12, 8), (SS0, S0), "2d")] * 5 + [Spec((8, 12), (SS0, S0), "2d")],
        {},
        WORLD4,
    ),
    "strided_s1": ([Spec((8, 12), (SS1, S1), "2d")] * 3, {}, WORLD4),
    # Uneven and empty pieces: 9x7, 5x3, 3x2 (3 rows twice over 2x2: 1, 1, 1, 0 rows).
    "uneven": (
        [
            Spec(shape, placements, "2d")
            for shape in ((9, 7), (5, 3), (3, 2))
            for placements in ((S0, S1), (S1, S0), (S0, S0), (SS0, S0), (S1, S1))
        ],
        {},
        WORLD4,
    ),
    # Stacks with both matrix dims sharded (no batch-dim shard): exchanged matrix by matrix.
    "stacks_two_matrix_dims": (
        [
            Spec((2, 8, 12), (S1, S2), "2d"),
            Spec((3, 9, 7), (S2, S1), "2d"),
            Spec((2, 10, 6), (S1, S1), "2d"),
            Spec((2, 10, 6), (_StridedShard(1, split_factor=2), S1), "2d"),
        ],
        {},
        WORLD4,
    ),
    # Expert parallel on the batch dim (mesh dim 0) plus TP on rows or columns (mesh dim 1);
    # 3 experts on 2 ranks: 2 and 1.
    "experts_ep_tp": (
        [
            Spec((4, 12, 8), (S0, S1), "2d"),
            Spec((3, 10, 6), (S0, S1), "2d"),
            Spec((4, 6, 10), (S0, S2), "2d"),
            Spec((3, 9, 7), (S0, S2), "2d"),
        ],
        {},
        WORLD4,
    ),
    # Partitions (fused row blocks) across the strided and doubly-sharded row sets: each rank's
    # rows cross block boundaries and take each block's own lr scale.
    "partitions": (
        [
            Spec((12, 8), (SS0, S0), "2d", partitions=(4, 8)),
            Spec((12, 8), (S0, S1), "2d", partitions=(5, 7)),
            Spec((12, 8), (S0, S0), "2d", partitions=(3, 9)),
            Spec((12, 8), (S1, S0), "2d", partitions=(6, 6)),
            Spec((2, 14, 6), (S1, S2), "2d", partitions=(7, 7)),
            Spec((12, 8), (S0, S1), "2d"),  # same shape, no partitions: another batch
        ],
        {},
        WORLD4,
    ),
    # One matrix shape under many layouts, 1-D and 2-D, in one optimizer: those over all four
    # ranks share the group's ranks but not its pieces, so must not share a batch.
    "mixed_1d_2d": (
        [
            Spec((12, 8), (S0, S1), "2d"),
            Spec((12, 8), (S0,), "1d"),
            Spec((12, 8), (S1, S0), "2d"),
            Spec((12, 8), (SS0, S0), "2d"),
            Spec((12, 8), (S0, S0), "2d"),
            Spec((12, 8), (R, S0), "2d"),
            Spec((12, 8), (S1, R), "2d"),
            Spec((12, 8), (S1,), "1d"),
            Spec((12, 8)),
            Spec((12, 8), (S0, S1), "2d"),
            Spec((12,), (S0, R), "2d", algorithm="adamw"),
            Spec((12, 8), (S0, S1), "2d", algorithm="adamw"),
        ],
        {},
        WORLD4,
    ),
    # bf16 weights and grads, uneven local lengths on both axes.
    "bf16_weights": (
        [
            Spec((9, 7), (S0, S1), "2d"),
            Spec((9, 7), (S1, S0), "2d"),
            Spec((14, 5), (SS0, S0), "2d"),
            Spec((5, 13), (S1, S1), "2d"),
        ],
        {"dtype": torch.bfloat16},
        WORLD4,
    ),
    # State offload (host state, loaded chunk by chunk) and a small workspace budget (one
    # batch in flight at a time) change nothing on 2-D layouts.
    "offload_small_workspace": (
        [
            Spec((12, 8), (S0, S1), "2d"),
            Spec((12, 8), (S0, S1), "2d"),
            Spec((9, 7), (SS0, S0), "2d"),
            Spec((8, 12), (S1, S0), "2d"),
            Spec((10,), (S0, R), "2d", algorithm="adamw"),
        ],
        {"offload": "state", "offload_prefetch": 1, "workspace_bytes": 1},
        WORLD4,
    ),
    "unnamed_mesh": (
        [Spec((12, 8), (S0, S1), "2d_unnamed"), Spec((9, 7), (SS0, S0), "2d_unnamed")],
        {},
        WORLD4,
    ),
    # ---- world 8
    # HSDP x TP: replicas of a dp x tp shard group.
    "hsdp_tp": (
        [
            Spec((12, 8), (R, S0, S1), "3d"),
            Spec((12, 8), (R, S0, S1), "3d"),
            Spec((12, 8), (R, S0, S1), "3d"),
            Spec((9, 7), (R, SS0, S0), "3d"),
            Spec((8, 12), (R, S1, S0), "3d"),
            Spec((3, 2), (R, S0, S1), "3d"),
            Spec((10,), (R, S0, R), "3d", algorithm="adamw"),
        ],
        {},
        WORLD8,
    ),
    # Experts on mesh dim 0, rows on dp, columns on tp (both matrix dims plus the expert dim);
    # rows twice; a strided row shard; 3 experts on 2 ranks.
    "experts_3d": (
        [
            Spec((4, 12, 8), (S0, S1, S2), "3d"),
            Spec((3, 9, 7), (S0, S1, S2), "3d"),
            Spec((4, 12, 8), (S0, S1, S1), "3d"),
            Spec((2, 12, 8), (S0, SS1, S1), "3d"),
        ],
        {},
        WORLD8,
    ),
    # Three matrix-dim shards: one group of all 8 ranks.
    "three_shards": (
        [
            Spec((12, 10), (S0, S1, S0), "3d"),
            Spec((16, 8), (S0, S0, S0), "3d"),
            Spec((9, 7), (S1, S0, S1), "3d"),
            Spec((12, 10), (_StridedShard(0, split_factor=4), S0, S0), "3d"),
        ],
        {},
        WORLD8,
    ),
    # 4-way dp over 2-way tp, uneven. (Not 9 rows under (SS0, S0): there FSDP2's layout and
    # distribute_tensor's differ; FSDP2's is tested in tp_torchtitan_dp4_tp2.)
    "dp4_tp2": (
        [
            Spec((9, 7), (S0, S1), "2d"),
            Spec((10, 7), (SS0, S0), "2d"),
            Spec((14, 6), (SS0, S0), "2d"),
            Spec((5, 11), (S1, S0), "2d"),
        ],
        {},
        WORLD8,
    ),
}


def _register(name: str, specs: list[Spec], kwargs: dict, worlds: tuple[int, ...]) -> None:
    @case(f"tp_{name}", worlds)
    def run(ctx: Context) -> None:
        check_layout(ctx, f"tp_{name}", specs, **kwargs)


for _name, (_specs, _kwargs, _worlds) in LAYOUTS.items():
    _register(_name, _specs, _kwargs, _worlds)


@case("tp_hsdp_tp_split_replicas", WORLD8, traffic=False)
def _hsdp_tp_split(ctx: TPContext) -> None:
    """HSDP x TP with ``split_replicas``: each batch orthogonalized by one replica (each matrix
    once in the world), results broadcast over the replicate dim; bitwise one process."""
    specs = LAYOUTS["hsdp_tp"][0]
    opt, problems = compare_with_single(ctx, specs, check_traffic=False, split_replicas=True)
    stats = opt.last_step_stats
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (stats.matrices_orthogonalized, stats.replica_bytes_received))
    muon = [s for s in specs if s.algorithm == "muon"]
    if sum(g[0] for g in gathered) != len(muon):
        problems.append(
            f"orthogonalized {[g[0] for g in gathered]} per rank, expected {len(muon)} in all"
        )
    if sum(g[1] for g in gathered) == 0:
        problems.append("no replica bytes received: the replicas did not share the work")
    fail_on(problems)


@case("tp_chunked", WORLD4)
def _chunked(ctx: Context) -> None:
    """``chunks()``/``step_chunk``: the same bits and bytes as ``step()``."""
    specs = LAYOUTS["mixed_1d_2d"][0] + LAYOUTS["partitions"][0][:2]
    check_layout(ctx, "tp_chunked", specs, chunked=True)


# ------------------------------------------------------------ torchtitan-style model


class _Block(nn.Module):
    """Attention-like projections and a SwiGLU-like feed-forward, as torchtitan names them."""

    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, heads, bias=False)
        self.wo = nn.Linear(heads, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.norm = nn.Parameter(torch.ones(dim))


class _Model(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block(dim, hidden, heads) for _ in range(layers))


TP_PLAN = {"wq": "colwise", "w1": "colwise", "w3": "colwise", "wo": "rowwise", "w2": "rowwise"}


def _parallelize(model: _Model, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> None:
    """TP on ``tp_mesh`` (torchtitan's plan), then FSDP2 per block and at the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in model.layers:
        parallelize_module(block, tp_mesh, {n: styles[s]() for n, s in TP_PLAN.items()})
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def _fsdp_index(sizes: tuple[int, int, int], tp_mesh: DeviceMesh, dp_mesh: DeviceMesh) -> dict:
    """Name -> the global flat index of every local element, as FSDP2 over TP really lays the
    params out: a model whose every parameter holds ``arange`` (exact in float64), sharded
    the same way. Independent of DTensor's reading of the placements."""
    model = _Model(*sizes).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.arange(p.numel(), dtype=torch.float64).view(p.shape))
    _parallelize(model, tp_mesh, dp_mesh)
    return {n: local_tensor(p).detach().long() for n, p in model.named_parameters()}


def check_tp_model(
    ctx: Context,
    name: str,
    sizes: tuple[int, int, int],
    tp_mesh: DeviceMesh,
    dp_mesh: DeviceMesh,
    expected: dict,
    fsdp_differs: bool = False,
) -> None:
    """FSDP2 over TP on a small model, random grads set on the params, vs one process.

    Grads are built from FSDP2's real layout (read from an ``arange`` model sharded the same
    way) and the states are compared shard by shard in that layout, so the check does not
    rely on DTensor's reading of ``_StridedShard`` (which differs from FSDP2's where sizes are
    uneven). ``fsdp_differs``: the sizes are chosen so that on some rank FSDP2's layout of
    some parameter is not ``distribute_tensor``'s (checked)."""
    reference, sharded = _Model(*sizes), _Model(*sizes)
    _parallelize(sharded, tp_mesh, dp_mesh)
    index = _fsdp_index(sizes, tp_mesh, dp_mesh)
    ref_named = dict(reference.named_parameters())
    named = dict(sharded.named_parameters())
    names = sorted(ref_named)
    problems = []
    if set(named) != set(ref_named):
        problems.append("test setup: names differ between the two models")
    for n in names:
        leaf = n.split(".")[-2] if n.endswith(".weight") else n.split(".")[-1]
        want = expected.get(TP_PLAN.get(leaf, leaf))
        got = tuple(named[n].placements) if isinstance(named[n], DTensor) else None
        if want is not None and got != want:
            problems.append(f"test setup: {n} has placements {got}, expected {want}")
        if tuple(index[n].shape) != tuple(local_tensor(named[n]).shape):
            problems.append(f"test setup: {n}: the arange model's shard has another shape")
        elif not torch.equal(local_tensor(named[n]), ref_named[n].detach().flatten()[index[n]]):
            problems.append(f"test setup: {n}: FSDP2's shard is not where the arange model says")
    differs = [
        n
        for n in names
        if isinstance(named[n], DTensor) and not torch.equal(index[n], flat_index(named[n]))
    ]
    seen: list = [None] * ctx.world_size
    dist.all_gather_object(seen, differs)
    if fsdp_differs and not any(seen):
        problems.append("test setup: FSDP2's layout equals distribute_tensor's everywhere")
    muon_names = [n for n in names if ref_named[n].ndim == 2]
    adamw_names = [n for n in names if ref_named[n].ndim != 2]

    def groups(params: dict) -> list[dict]:
        return [
            {"params": [params[n] for n in muon_names], "algorithm": "muon"},
            {"params": [params[n] for n in adamw_names], "algorithm": "adamw"},
        ]

    def shard_of(n: str, full_tensor: torch.Tensor) -> DTensor:
        p = named[n]
        local = full_tensor.detach().flatten()[index[n]].clone()
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": True}
    ref, opt = Muon(groups(ref_named), **kwargs), Muon(groups(named), **kwargs)
    tally: list[tuple[int, int]] = []
    agreement = len(agreement_groups_of(muon_params(opt), False))
    for step in range(3):
        grads = random_tensors([tuple(ref_named[n].shape) for n in names], 40 + step)
        for n, g in zip(names, grads):
            ref_named[n].grad = g.clone()
            named[n].grad = shard_of(n, g)
        ref.step()
        with counting_all_to_all() as calls, recording_collectives() as collectives:
            opt.step()
        label = f"{name} step {step + 1}"
        problems += check_step_traffic(ctx, opt, calls, False, label, tally)
        problems += check_orthogonalized(ctx, opt, False, label)
        problems += check_step_collectives(collectives, agreement, step == 0, label)
    for n in names:
        p, r = named[n], ref_named[n]
        pairs = [("param", p, r)]
        pairs += [(k, opt.state[p][k], ref.state[r][k]) for k in ref.state[r] if k != "step"]
        for what, got, want in pairs:
            if not isinstance(want, torch.Tensor):
                continue
            got, want = local_tensor(got).detach(), want.detach().flatten()[index[n]]
            if got.shape != want.shape or not torch.equal(got, want):
                problems.append(f"{name}: {what} of {n} {tuple(p.placements)} differs")
    steps = [g["step"] for g in opt.param_groups]
    if steps != [g["step"] for g in ref.param_groups]:
        problems.append(f"{name}: step counters {steps}")
    position = {id(p): i for i, p in enumerate(muon_params(opt))}
    muon_index = {position[id(named[n])]: index[n] for n in muon_names}
    problems += check_pieces(ctx, opt, name, muon_index)
    problems += log_traffic(ctx, name, tally)
    fail_on(problems)


@case("tp_torchtitan_fsdp_tp", WORLD4)
def _torchtitan(ctx: TPContext) -> None:
    """hidden 14: tp gives 7 rows each, dp's strided shard 4 and 3 (uneven)."""
    mesh = ctx.meshes["2d"]
    expected = {
        "colwise": (SS0, S0),
        "rowwise": (S0, S1),
        "norm": (S0,),  # not TP'd: FSDP2 on the dp mesh alone
    }
    check_tp_model(ctx, "tp_torchtitan_fsdp_tp", (10, 14, 12), mesh["tp"], mesh["dp"], expected)


@case("tp_torchtitan_dp4_tp2", WORLD8)
def _torchtitan_dp4(ctx: TPContext) -> None:
    """hidden 9 and heads 17 on dp 4 x tp 2: tp gives 5 and 4 rows, FSDP2 then 2/2/1/0 and
    1/1/1/1 (where DTensor's _StridedShard reading would put rows elsewhere)."""
    mesh = ctx.meshes["2d"]
    expected = {"colwise": (SS0, S0), "rowwise": (S0, S1), "norm": (S0,)}
    check_tp_model(
        ctx, "tp_torchtitan_dp4_tp2", (10, 9, 17), mesh["tp"], mesh["dp"], expected, True
    )


@case("tp_torchtitan_hsdp_tp", WORLD8)
def _torchtitan_hsdp(ctx: TPContext) -> None:
    """HSDP (replicate x dp) over TP: torchtitan's 3-D layout."""
    mesh = ctx.meshes["3d"]
    expected = {"colwise": (R, SS0, S0), "rowwise": (R, S0, S1), "norm": (R, S0)}
    check_tp_model(
        ctx, "tp_torchtitan_hsdp_tp", (10, 14, 12), mesh["tp"], mesh["replicate", "dp"], expected
    )


# ------------------------------------------------------------------ checkpoints


@case("tp_state_dict_round_trip", WORLD4, traffic=False)
def _state_dict(ctx: TPContext) -> None:
    """Two steps, ``state_dict()``, a new optimizer on copies of the params loads it, two
    more steps: bitwise what one process gets in four."""
    specs = [
        Spec((12, 8), (S0, S1), "2d"),
        Spec((9, 7), (SS0, S0), "2d"),
        Spec((8, 12), (S1, S0), "2d"),
        Spec((10,), (S0, R), "2d", algorithm="adamw"),
    ]
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": True}
    init = random_tensors([s.shape for s in specs], 11)
    ref_params = [nn.Parameter(t.clone()) for t in init]
    params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(specs, init)]
    ref = make_optimizer(ref_params, specs, **kwargs)
    opt = make_optimizer(params, specs, **kwargs)

    def set_grads(targets: list, step: int) -> None:
        grads = random_tensors([s.shape for s in specs], 300 + step)
        for s, r, p, g in zip(specs, ref_params, targets, grads):
            r.grad = g.clone()
            p.grad = place(ctx, s, g)

    for step in range(2):
        set_grads(params, step)
        ref.step()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = make_optimizer(resumed_params, specs, **kwargs)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        set_grads(resumed_params, step)
        ref.step()
        resumed.step()
    problems = compare_states(specs, resumed, resumed_params, ref, ref_params, "resumed")
    momentum = resumed.state[resumed_params[0]]["momentum"]
    if not isinstance(momentum, DTensor) or tuple(momentum.placements) != specs[0].placements:
        problems.append(f"test setup: momentum of param 0 is {type(momentum).__name__}")
    fail_on(problems)


@case("error_split_tensor_strided_layout", WORLD8, traffic=False)
def _split_tensor_layout(ctx: TPContext) -> None:
    """9 rows under (_StridedShard(0, sf=2), Shard(0)) on 4x2, laid out by distribute_tensor
    (``_split_tensor``'s reading), not as FSDP2 would: only ranks 6 and 7 can see that from
    their shapes. No rank may raise alone (its peers would hang): every rank raises the same
    error at the first step, with nothing updated."""
    mesh = ctx.mesh_for("2d")
    full_weight = torch.randn(9, 7, generator=torch.Generator().manual_seed(3))
    weight = nn.Parameter(distribute_tensor(full_weight, mesh, [SS0, S0], src_data_rank=None))
    weight.grad = distribute_tensor(torch.ones(9, 7), mesh, [SS0, S0], src_data_rank=None)
    before = local_tensor(weight).detach().clone()
    opt = Muon([weight], lr=0.1)
    problems = expect_raises(ValueError, ["disagree", "_StridedShard"], opt.step)
    if not torch.equal(local_tensor(weight), before):
        problems.append("the weight changed although the step raised")
    fail_on(problems)


@case("local_slice_is_fsdp_layout", WORLD8, traffic=False)
def _local_slice(ctx: TPContext) -> None:
    """``layout.local_slice`` (what checkpoint loading keeps of a whole tensor) is exactly what
    FSDP2 over TP holds, on 4x2 with uneven sizes and under HSDP x TP: checked against the
    arange model's real local elements."""
    from shardmuon.planning.placements import local_slice

    problems = []
    for label, tp_mesh, dp_mesh in (
        ("dp4_tp2", ctx.meshes["2d"]["tp"], ctx.meshes["2d"]["dp"]),
        ("hsdp_tp", ctx.meshes["3d"]["tp"], ctx.meshes["3d"]["replicate", "dp"]),
    ):
        sizes = (10, 9, 17)
        real = _fsdp_index(sizes, tp_mesh, dp_mesh)
        model = _Model(*sizes).double()
        _parallelize(model, tp_mesh, dp_mesh)
        for name, p in model.named_parameters():
            whole = torch.arange(p.numel(), dtype=torch.float64).view(p.shape)
            got = local_slice(whole, p).long()
            if not torch.equal(got, real[name]):
                problems.append(
                    f"{label} {name} {tuple(p.placements)}: local_slice {got.flatten().tolist()}"
                    f" != FSDP2's {real[name].flatten().tolist()}"
                )
    fail_on(problems)


# ------------------------------------------------------------------ groups


def _exchange_groups(opt: Muon) -> list:
    return [c.layout.group for c in opt.chunks() if isinstance(c, MuonBatch) and c.layout.exchanged]


@case("flattened_group_reused", WORLD4, traffic=False)
def _flattened_group_reused(ctx: TPContext) -> None:
    """Two optimizers over the same dp x tp ranks share one group; once the user has
    flattened the mesh (``mesh["dp", "tp"]._flatten()``, as torchtitan does), a new
    optimizer exchanges over that flattened mesh's group instead of making another."""
    spec = Spec((12, 8), (S0, S1), "2d")
    full_weight = random_tensors([spec.shape], 5)[0]
    groups = []
    for _ in range(2):
        weight = nn.Parameter(place(ctx, spec, full_weight))
        groups += _exchange_groups(Muon([weight]))
    problems = []
    if len({id(g.process_group) for g in groups}) != 1:
        problems.append("two optimizers over the same ranks made two groups")
    flat = ctx.meshes["2d"]._flatten()
    weight = nn.Parameter(place(ctx, spec, full_weight))
    (group,) = set(_exchange_groups(Muon([weight])))
    if group.process_group is not flat.get_group(0):
        problems.append("the user's flattened mesh was not reused")
    if group.ranks != tuple(flat.mesh.flatten().tolist()):
        problems.append(f"group ranks {group.ranks} != the flattened mesh's")
    fail_on(problems)


@case("stages_without_tp_take_no_part", WORLD8, traffic=False)
def _stages(ctx: TPContext) -> None:
    """Like pipeline stages: on a ("pp", "dp", "tp") mesh whose stages are ranks 0, 2, 4, 6
    and 1, 3, 5, 7 (rank sets no earlier case flattened), stage 0 holds FSDP-over-TP weights
    and stage 1 only 1-D ones. Only stage 0 makes its dp x tp group (no rank waits for the
    other stage), and each stage steps bitwise like one process."""
    from torch.distributed.device_mesh import DeviceMesh

    from shardmuon.planning import groups as planning_groups

    ranks = torch.arange(8).view(2, 2, 2).permute(2, 0, 1).contiguous()
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("pp", "dp", "tp"))
    stage_mesh = mesh["dp", "tp"]
    stage = mesh.get_local_rank(0)
    stage_ranks = tuple(stage_mesh.mesh.flatten().tolist())
    problems = []
    if stage_ranks in planning_groups._FLATTENED_GROUPS:
        problems.append(f"stage ranks {stage_ranks} already have a group: the case tests nothing")
    if stage == 0:
        specs = [(12, 8), (9, 7)]
        placements = [(S0, S1), (SS0, S0)]
    else:
        specs = [(12, 8)]
        placements = [(S0, R)]
    fulls = random_tensors(specs, 11)
    grads = random_tensors(specs, 12)
    params = [
        nn.Parameter(distribute_tensor(f.clone(), stage_mesh, list(p), src_data_rank=None))
        for f, p in zip(fulls, placements)
    ]
    for param, g, p in zip(params, grads, placements):
        param.grad = distribute_tensor(g.clone(), stage_mesh, list(p), src_data_rank=None)
    opt = Muon(params, lr=0.02, weight_decay=0.1)
    opt.step()
    refs = [nn.Parameter(f.clone()) for f in fulls]
    for ref, g in zip(refs, grads):
        ref.grad = g.clone()
    Muon(refs, lr=0.02, weight_decay=0.1).step()
    for i, (param, ref, p) in enumerate(zip(params, refs, placements)):
        want = distribute_tensor(ref.detach(), stage_mesh, list(p), src_data_rank=None)
        if not torch.equal(local_tensor(param), want.to_local()):
            problems.append(f"stage {stage} param {i} {p}: not bitwise one process")
    groups = _exchange_groups(opt)
    sizes = sorted({g.size for g in groups})
    if sizes != ([4] if stage == 0 else [2]):
        problems.append(f"stage {stage}: exchange group sizes {sizes}")
    # The world can still make groups together afterwards: stage 0's group creation left no
    # trace that differs between the stages (torch numbers unnamed groups by a counter).
    everyone = dist.new_group(list(range(ctx.world_size)))
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    if total.item() != ctx.world_size:
        problems.append(f"a group of the whole world reduced to {total.item()}")
    fail_on(problems)


@case("error_ranks_disagree_on_pieces", WORLD4, traffic=False)
def _disagree_on_pieces(ctx: TPContext) -> None:
    """Rank 0 places a 12x8 weight as (Shard(1), Shard(0)), the others as (Shard(0),
    Shard(1)): the same group, the same 6x4 local shape, different pieces. Exchanging would
    assemble a wrong matrix without any error; every rank must raise at the first step
    instead, with the weight untouched."""
    mesh = ctx.mesh_for("2d")
    placements = [S1, S0] if ctx.rank == 0 else [S0, S1]
    full_weight = random_tensors([(12, 8)], 21)[0]
    weight = nn.Parameter(distribute_tensor(full_weight, mesh, placements, src_data_rank=None))
    weight.grad = distribute_tensor(torch.ones(12, 8), mesh, placements, src_data_rank=None)
    problems = []
    if tuple(local_tensor(weight).shape) != (6, 4):
        problems.append(f"setup: local shape {tuple(local_tensor(weight).shape)}")
    before = local_tensor(weight).detach().clone()
    opt = Muon([weight], lr=0.1)
    problems += expect_raises(ValueError, ["disagree"], opt.step)
    if not torch.equal(local_tensor(weight), before):
        problems.append("the weight changed although the step raised")
    fail_on(problems)
