"""What the two-dimensional shard cases (issue #13, ``dist_tp_cases``) share: the meshes of
worlds 4 and 8 (:class:`TPContext`), each case module's registry, and the checks every case
runs against the one-process Muon: bitwise states, all-to-all bytes against the minimum (a
``TRAFFIC`` line in rank 0's log, world totals over all steps), and each batch's
``layout.pieces`` against the global rows and columns DTensor really gives each rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from dist_checks import Case, Context, Spec, compare_with_single, fail_on, muon_params
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from shardmuon import Muon
from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.placements import local_tensor

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


def tp_registry() -> tuple[dict[str, Case], set[str], Callable]:
    """A TP case module's registry: ``(CASES, TRAFFIC_CASES, case)``. ``@case(name, worlds)``
    registers a case for those world sizes, and (unless ``traffic=False``) among the cases
    that log a TRAFFIC line (``test_tp.py`` checks each one did)."""
    cases: dict[str, Case] = {}
    traffic_cases: set[str] = set()

    def case(name: str, worlds: tuple[int, ...], traffic: bool = True):
        def register(fn):
            if name in cases:
                raise ValueError(f"case {name!r} registered twice")
            cases[name] = Case(fn, worlds)
            if traffic:
                traffic_cases.add(name)
            return fn

        return register

    return cases, traffic_cases, case


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
