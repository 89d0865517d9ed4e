"""``shardmuon bench plan``: the optimizer's plan for a real model at any scale, run nowhere.

For each simulated world size ``W``, the model preset (``shardmuon.harness.models``) is built on the
``meta`` device, so nothing is allocated, and laid out by
:func:`shardmuon.harness.parallel.apply_layout` as ``bench step`` and training lay it out
(``fully_shard`` / ``distribute_tensor``). Every rank's view is made in this one process:
torch's fake process group (``FakeStore`` and the ``"fake"`` backend) is initialised as rank
``r`` of ``W``, the params are routed with :func:`shardmuon.routing.build_param_groups` as
``bench step`` routes them, and :class:`shardmuon.Muon` is constructed, which plans without
communicating. Nothing is stepped. From the batches of ``opt.chunks()``, per rank:

* **all-to-all bytes sent per step**: ``BatchExchange.minimum_bytes()`` of every exchanged
  batch: each non-owner piece to its owner and back once, in bf16. A real step sends exactly
  this (``last_step_stats.bytes_sent``; ``tests/test_bench_plan.py`` compares the two on gloo);
* **Newton–Schulz FLOPs**: ``newton_schulz_cost(rows, cols, partitions)`` times the number
  of iterations, for each matrix the rank owns and each matrix of its local batches;
* **workspace peak**: ``shardmuon.planning.workspace.workspace_peak_bytes`` of the rank's batches
  under the optimizer's ``workspace_bytes`` and ``max_in_flight`` (what a real step reports
  as ``last_step_stats.workspace_peak_bytes``).

**Which ranks are laid out.** ``fully_shard`` cuts every parameter into ``W`` chunks, which
takes seconds per rank at 1024 ranks, so by default one rank per *class* is laid out and
the others are derived from it, exactly. The plan of a rank depends only on its Muon
params' local shapes and groups: all ranks of a shard group plan the same batches and
owners (the optimizer checks this agreement on its first step), so a group's batches are a
function of what its members hold. From rank 0's meshes and placements every rank's local
shapes (DTensor's ``Shard`` chunking) and groups are computed without laying it out; two
ranks are in one class when their local (not exchanged) params have the same local shapes
and each of their shard groups holds, member by member, the same local shapes of the
params exchanged in it. A rank outside the evaluated ones takes its class representative's
batches with each exchanged batch re-indexed to the rank's own position in its group (its
piece, and whether it owns the matrix). Each evaluated rank is checked: its computed local
shapes and groups must equal those its DTensors really have. ``--all-ranks`` lays out every
rank instead (slow at large ``W``; the tests check both agree). Placements other than
``Shard`` and ``Replicate`` fall back to laying out every rank.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardmuon.bench.common import add_model_arguments, add_output_arguments
from shardmuon.bench.optimizers import make_optimizer
from shardmuon.bench.report import fmt, new_progress, print_table, write_outputs
from shardmuon.bench.volume import padded_scheme_bytes
from shardmuon.harness.cli_support import (
    HelpFormatter,
    check_mesh,
    check_outputs,
    default_mesh_note,
    note,
)
from shardmuon.harness.models import model_config
from shardmuon.harness.parallel import LAYOUTS, LayoutPlan, apply_layout
from shardmuon.ops.newton_schulz import NS_PRESETS
from shardmuon.planning.batches import MuonBatch, newton_schulz_cost
from shardmuon.planning.pieces import chunk_sizes, shard_ranges
from shardmuon.planning.placements import MatrixLayout, ShardGroup, local_tensor
from shardmuon.planning.workspace import workspace_peak_bytes
from shardmuon.runtime.exchange import BatchExchange
from shardmuon.runtime.telemetry import StepStats

__all__ = [
    "PlanConfig",
    "RankFigures",
    "RankPlan",
    "add_parser",
    "build_meta_model",
    "evaluate_rank",
    "parse_meshes",
    "parse_world_sizes",
    "plan_world",
    "rank_figures",
    "run",
]

# As ``bench step`` (the plan does not depend on it).
LR = 0.02
# Per-rank arrays go into the JSON up to this many ranks (a 1024-rank list is still small).
PER_RANK_JSON_LIMIT = 4096


@dataclass(frozen=True)
class PlanConfig:
    """What is planned: model, layout and the optimizer settings that change the plan (the
    world sizes and meshes are the :class:`~shardmuon.harness.parallel.LayoutPlan` of each run)."""

    model: str
    layers: int | None
    vocab_size: int | None
    layout: str
    coefficients: str
    all_ranks: bool = False


@dataclass
class RankPlan:
    """One rank's plan, as ``Muon`` built it on that rank's view.

    ``params[i]`` is Muon parameter ``i`` (the ``param_index`` of segments) and ``names[i]``
    its name; ``iterations`` is the number of Newton–Schulz iterations; ``workspace_bytes``
    and ``max_in_flight`` are the optimizer's settings that bound what is in flight.
    """

    rank: int
    batches: list[MuonBatch]
    params: list[Tensor]
    names: list[str]
    iterations: int
    workspace_bytes: int
    max_in_flight: int


@dataclass(frozen=True)
class RankFigures:
    """What one rank does in one step, by the plan."""

    bytes_sent: int
    ns_flops: int
    matrices: int
    workspace_peak: int


# ------------------------------------------------------------------ one rank's view


def build_meta_model(cfg: PlanConfig) -> nn.Module:
    """The preset on the ``meta`` device: shapes only, nothing allocated."""
    from transformers import AutoModelForCausalLM

    config = model_config(cfg.model, num_layers=cfg.layers, vocab_size=cfg.vocab_size)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@contextmanager
def _fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process is rank ``rank`` of ``world_size`` on torch's fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # init_process_group wraps sys.excepthook to prefix "[rankN]: "; once per rank laid out
    # here, that would stack up.
    hook = sys.excepthook
    _clear_sharding_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        _clear_sharding_cache()


def _clear_sharding_cache() -> None:
    """Forget DTensor's cached sharding propagation between two simulated ranks.

    The cache is keyed by device meshes, which compare equal across ranks and process
    groups: without this, a DTensor op (``nn.Parameter(dtensor)``, ``zeros_like``) on one
    rank's view returns the mesh of a rank laid out before, with that rank's groups.
    """
    from torch.distributed.tensor import debug

    clear = getattr(debug, "_clear_sharding_prop_cache", None) or getattr(
        debug, "_clear_python_sharding_prop_cache", None
    )
    if clear is not None:
        clear()


def evaluate_rank(base: nn.Module, cfg: PlanConfig, plan: LayoutPlan, rank: int) -> RankPlan:
    """Lay a copy of ``base`` out as rank ``rank`` sees it, build ``Muon``, read its plan."""
    with _fake_rank(rank, plan.world_size):
        model = copy.deepcopy(base)
        applied = apply_layout(
            model,
            cfg.layout,
            world_size=plan.world_size,
            mesh_shape=plan.mesh_shape or None,
            device_type="cpu",
        )
        opt = make_optimizer(
            "shardmuon",
            model,
            model_name=cfg.model,
            lr=LR,
            coefficients=cfg.coefficients,
            expert_mesh_name=applied.expert_mesh_name,
            meshes=applied.meshes,
        )
        names = {id(p): n for n, p in model.named_parameters()}
        # Segments index the Muon params in the order of the Muon groups (shardmuon.planning.plan).
        params = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        batches = [c for c in opt.chunks() if isinstance(c, MuonBatch)]
        return RankPlan(
            rank=rank,
            batches=batches,
            params=params,
            names=[names[id(p)] for p in params],
            iterations=len(opt.coefficients),
            workspace_bytes=opt.workspace_bytes,
            max_in_flight=opt.max_in_flight,
        )


def _exchange(batch: MuonBatch, owners: tuple[int, ...] | None = None) -> BatchExchange:
    return BatchExchange(batch.layout, batch.owners if owners is None else owners, StepStats())


def rank_figures(batches: list[MuonBatch], plan: RankPlan) -> RankFigures:
    """What a rank with ``batches`` does, under ``plan``'s settings: bytes sent, Newton–Schulz
    FLOPs, matrices orthogonalized and the estimated workspace peak (``workspace.py``)."""
    iterations = plan.iterations
    sent = flops = matrices = 0
    for batch in batches:
        layout = batch.layout
        cost = iterations * newton_schulz_cost(layout.rows, layout.cols, batch.partitions)
        if layout.exchanged:
            sent += _exchange(batch).minimum_bytes()
            owned = batch.owners.count(layout.group.rank_index)
        else:
            owned = batch.num_matrices
        flops += owned * cost
        matrices += owned
    return RankFigures(
        bytes_sent=sent,
        ns_flops=flops,
        matrices=matrices,
        workspace_peak=workspace_peak_bytes(batches, plan.workspace_bytes, plan.max_in_flight),
    )


def _name_pattern(name: str) -> str:
    """``model.layers.7.mlp.gate.weight`` -> ``model.layers.*.mlp.gate.weight``."""
    return re.sub(r"\.\d+\.", ".*.", name)


def bytes_by_param(batches: list[MuonBatch], names: list[str]) -> dict[str, int]:
    """Bytes sent per parameter name (layer index as ``*``), largest first."""
    out: dict[str, int] = {}
    for batch in batches:
        if not batch.layout.exchanged:
            continue
        position = 0
        for seg in batch.segments:
            owners = batch.owners[position : position + seg.count]
            position += seg.count
            key = _name_pattern(names[seg.param_index])
            out[key] = out.get(key, 0) + _exchange(batch, owners).minimum_bytes()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------ symmetry


@dataclass(frozen=True, eq=False)
class _Kind:
    """Muon params that lie alike on every rank: one mesh, placements and global shape."""

    mesh: Tensor | None  # the mesh's rank grid (DeviceMesh.mesh), None for a plain tensor
    placements: tuple
    shape: tuple[int, ...]
    shard_dim: int | None  # the mesh dim the matrices are exchanged over
    replicate_dim: int | None  # the mesh dim of the replicas (HSDP), if any


_NO_LAYOUT = MatrixLayout(rows=0, cols=0, num_matrices=0, local_rows=0, local_cols=0, flatten=False)


def _param_layouts(plan: RankPlan) -> dict[int, MatrixLayout]:
    """Each Muon param's layout, from the batches (a param with no matrices here is absent)."""
    return {seg.param_index: b.layout for b in plan.batches for seg in b.segments}


class _Symmetry:
    """Every rank's local shapes and groups, computed from rank 0's meshes and placements.

    ``supported`` is false when a placement is neither ``Shard`` nor ``Replicate`` (the
    chunking below would not be DTensor's) or a matrix is sharded over several mesh dims;
    then every rank must be laid out.
    """

    def __init__(self, plan0: RankPlan) -> None:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self._shard_type, self._replicate_type = Shard, Replicate
        self.supported = True
        self._groups: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        self._group_ids: dict[tuple[int, ...], int] = {}
        self.group_ranks: list[tuple[int, ...]] = []
        self._coords: dict[int, dict[int, tuple[int, ...]]] = {}
        self._chunks: dict[tuple[int, int], tuple[int, ...]] = {}
        meshes: dict[object, Tensor] = {}
        layouts = _param_layouts(plan0)
        kinds: dict[tuple, int] = {}
        self.kinds: list[_Kind] = []
        self.kind_of: list[int] = []
        for index, p in enumerate(plan0.params):
            if isinstance(p, DTensor):
                if not all(_symmetric_placement(pl, p.dim()) for pl in p.placements):
                    self.supported = False
                    return
                # DeviceMesh.mesh may build a new tensor per access: keep one per mesh.
                mesh = meshes.setdefault(p.device_mesh, p.device_mesh.mesh)
                key = (id(mesh), tuple(p.placements), tuple(p.shape))
            else:
                mesh, key = None, (None, (), tuple(p.shape))
            if key not in kinds:
                # A param without matrices on this rank is in no batch: local, no groups.
                layout = layouts.get(index, _NO_LAYOUT)
                try:
                    shard_dim = self._dim_of(mesh, key[1], layout.group, Shard, plan0.rank)
                except RuntimeError:
                    # Sharded over several mesh dims (FSDP over TP): lay out every rank.
                    self.supported = False
                    return
                kinds[key] = len(self.kinds)
                self.kinds.append(
                    _Kind(
                        mesh=mesh,
                        placements=key[1],
                        shape=key[2],
                        shard_dim=shard_dim,
                        replicate_dim=self._dim_of(
                            mesh, key[1], layout.replicas, Replicate, plan0.rank
                        ),
                    )
                )
            self.kind_of.append(kinds[key])
        self.exchanged = [k for k, kind in enumerate(self.kinds) if kind.shard_dim is not None]
        self.local = [k for k, kind in enumerate(self.kinds) if kind.shard_dim is None]
        self._local_shapes: dict[tuple[int, int], tuple[int, ...]] = {}
        self._signatures: dict[tuple[int, int], int] = {}
        self._signature_ids: dict[tuple, int] = {}

    def _dim_of(self, mesh, placements, group: ShardGroup | None, kind, rank: int) -> int | None:
        """The mesh dim whose group (through ``rank``) is ``group``, among dims of type ``kind``."""
        if group is None or mesh is None:
            return None
        for dim, placement in enumerate(placements):
            if isinstance(placement, kind) and mesh.size(dim) > 1:
                gid, _ = self._group(mesh, dim, rank)
                if self.group_ranks[gid] == group.ranks:
                    return dim
        raise RuntimeError(f"no mesh dim of {tuple(mesh.shape)} holds the group {group.ranks}")

    def _group(self, mesh: Tensor, dim: int, rank: int) -> tuple[int, int]:
        """``(group id, index)`` of ``rank`` in the group along ``dim`` of ``mesh``."""
        key = (id(mesh), dim)
        if key not in self._groups:
            table: dict[int, tuple[int, int]] = {}
            for row in mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist():
                ranks = tuple(row)
                gid = self._group_ids.setdefault(ranks, len(self.group_ranks))
                if gid == len(self.group_ranks):
                    self.group_ranks.append(ranks)
                table.update((r, (gid, i)) for i, r in enumerate(ranks))
            self._groups[key] = table
        return self._groups[key][rank]

    def _coord(self, mesh: Tensor, rank: int) -> tuple[int, ...]:
        key = id(mesh)
        if key not in self._coords:
            flat = mesh.reshape(-1).tolist()
            coords = itertools.product(*(range(n) for n in mesh.shape))
            self._coords[key] = dict(zip(flat, coords))
        return self._coords[key][rank]

    def local_shape(self, kind: int, rank: int) -> tuple[int, ...]:
        """The local shape of kind ``kind`` on ``rank``: DTensor's ``Shard`` chunking."""
        key = (kind, rank)
        if key not in self._local_shapes:
            spec = self.kinds[kind]
            shape = list(spec.shape)
            if spec.mesh is not None:
                coord = self._coord(spec.mesh, rank)
                strided = [pl for pl in spec.placements if isinstance(pl, _StridedShard)]
                for dim, placement in enumerate(spec.placements):
                    if isinstance(placement, self._shard_type) and not strided:
                        d = placement.dim % len(shape)
                        split = (shape[d], spec.mesh.size(dim))
                        if split not in self._chunks:
                            self._chunks[split] = chunk_sizes(*split)
                        shape[d] = self._chunks[split][coord[dim]]
                if strided:  # FSDP2 over expert parallel: the optimizer's own reading
                    shape = list(_strided_local_shape(spec, coord))
            self._local_shapes[key] = tuple(shape)
        return self._local_shapes[key]

    def shard_group(self, kind: int, rank: int) -> tuple[int, int]:
        spec = self.kinds[kind]
        return self._group(spec.mesh, spec.shard_dim, rank)

    def _replica_group(self, kind: int, rank: int) -> int | None:
        spec = self.kinds[kind]
        if spec.replicate_dim is None:
            return None
        return self._group(spec.mesh, spec.replicate_dim, rank)[0]

    def _signature(self, kind: int, rank: int) -> int:
        """Which batches the shard group of ``kind`` through ``rank`` plans (an interned id).

        The kinds exchanged in that group, and member by member their local shapes.
        """
        gid, _ = self.shard_group(kind, rank)
        key = (kind, gid)
        if key not in self._signatures:
            members = self.group_ranks[gid]
            in_group = tuple(k for k in self.exchanged if self.shard_group(k, rank)[0] == gid)
            value = (
                in_group,
                tuple(tuple(self.local_shape(k, m) for k in in_group) for m in members),
            )
            self._signatures[key] = self._signature_ids.setdefault(value, len(self._signature_ids))
        return self._signatures[key]

    def class_of(self, rank: int) -> tuple:
        """Ranks with equal classes have the same plan up to their positions in their groups."""
        local = tuple(self.local_shape(k, rank) for k in self.local)
        groups = tuple(self._signature(k, rank) for k in self.exchanged)
        shard = [self.shard_group(k, rank)[0] for k in self.exchanged]
        replicas = [self._replica_group(k, rank) for k in range(len(self.kinds))]
        # Which kinds share a shard group, and which share a replica group (batch keys).
        pattern = (
            tuple(shard.index(g) for g in shard),
            tuple(replicas.index(g) for g in replicas),
        )
        return local, groups, pattern

    def check(self, plan: RankPlan) -> None:
        """The computed local shapes and groups of ``plan.rank`` equal its real ones."""
        layouts = _param_layouts(plan)
        for index, p in enumerate(plan.params):
            kind = self.kind_of[index]
            actual = tuple(local_tensor(p).shape)
            expected = self.local_shape(kind, plan.rank)
            group = layouts.get(index, _NO_LAYOUT).group
            problem = None
            if actual != expected:
                problem = f"local shape {actual}, computed {expected}"
            elif group is not None:
                gid, position = self.shard_group(kind, plan.rank)
                if (group.ranks, group.rank_index) != (self.group_ranks[gid], position):
                    problem = f"group {group.ranks} at index {group.rank_index}, computed other"
            if problem:
                raise RuntimeError(
                    f"bench plan: rank {plan.rank}, {plan.names[index]}: {problem}; the ranks "
                    "cannot be derived from one another here: rerun with --all-ranks"
                )

    def reindex(self, batches: list[MuonBatch], rank: int) -> list[MuonBatch]:
        """The batches of a rank of the same class, as ``rank`` holds them."""
        out = []
        for batch in batches:
            layout = batch.layout
            if not layout.exchanged:
                out.append(batch)
                continue
            gid, position = self.shard_group(self.kind_of[batch.segments[0].param_index], rank)
            local_rows, local_cols = layout.piece_shape(position)
            layout = replace(
                layout,
                group=ShardGroup(self.group_ranks[gid], position, layout.group.process_group),
                local_rows=local_rows,
                local_cols=local_cols,
            )
            out.append(replace(batch, layout=layout))
        return out


# ------------------------------------------------------------------ a whole world


@dataclass
class WorldPlan:
    """Figures of every rank of one world size, and how they were obtained."""

    world_size: int
    mesh_shape: tuple[int, ...]
    figures: list[RankFigures]
    evaluated: list[int]
    classes: int
    by_symmetry: bool
    max_rank_bytes_by_param: dict[str, int]
    iterations: int
    workspace_bytes: int
    padded_scheme_bytes: int

    def summary(self) -> dict[str, Any]:
        sent = [f.bytes_sent for f in self.figures]
        flops = [f.ns_flops for f in self.figures]
        mean_flops = statistics.fmean(flops)
        out: dict[str, Any] = {
            "world_size": self.world_size,
            "mesh_shape": list(self.mesh_shape),
            "a2a_gb_per_rank_max": max(sent) / 1e9,
            "a2a_gb_per_rank_mean": statistics.fmean(sent) / 1e9,
            "ns_tflop_per_rank_max": max(flops) / 1e12,
            "ns_tflop_per_rank_mean": mean_flops / 1e12,
            "ns_max_over_mean": max(flops) / mean_flops if mean_flops else None,
            "matrices_per_rank_max": max(f.matrices for f in self.figures),
            "workspace_peak_gib_max": max(f.workspace_peak for f in self.figures) / 2**30,
            "workspace_budget_gib": self.workspace_bytes / 2**30,
            # dion's padded scheme for the same batches, on rank 0 (bench/volume.py).
            "padded_scheme_gb_per_rank": self.padded_scheme_bytes / 1e9,
            "ns_iterations": self.iterations,
            "evaluated_ranks": self.evaluated,
            "classes": self.classes,
            "by_symmetry": self.by_symmetry,
            "bytes_by_param_max_rank": self.max_rank_bytes_by_param,
        }
        if self.world_size <= PER_RANK_JSON_LIMIT:
            out["per_rank"] = {
                "bytes_sent": sent,
                "ns_flops": flops,
                "matrices": [f.matrices for f in self.figures],
                "workspace_peak_bytes": [f.workspace_peak for f in self.figures],
            }
        return out


def _symmetric_placement(placement, ndim: int) -> bool:
    """Placements the symmetry model reads: ``Shard``/``Replicate``, and the
    ``_StridedShard`` FSDP2 puts on the expert dim of a stack already split by expert
    parallelism (never on a matrix dim: FSDP over TP is laid out rank by rank)."""
    from torch.distributed.tensor import Replicate

    if type(placement) in (Shard, Replicate):
        return True
    return isinstance(placement, _StridedShard) and placement.dim % ndim < ndim - 2


def _strided_local_shape(spec, coord: tuple[int, ...]) -> tuple[int, ...]:
    """A local shape under placements with ``_StridedShard``: each dim's shards applied in
    FSDP2's order (:func:`shardmuon.planning.pieces.shard_ranges`)."""
    shape = list(spec.shape)
    for d in range(len(shape)):
        splits = [
            (spec.mesh.size(m), coord[m], getattr(pl, "split_factor", 1))
            for m, pl in enumerate(spec.placements)
            if isinstance(pl, (Shard, _StridedShard)) and pl.dim % len(shape) == d
        ]
        if splits:
            shape[d] = sum(stop - start for start, stop in shard_ranges(shape[d], splits))
    return tuple(shape)


def plan_world(
    base: nn.Module,
    cfg: PlanConfig,
    plan: LayoutPlan,
    on_rank: Callable[[int, bool], None] | None = None,
) -> WorldPlan:
    """Figures of every rank of ``plan.world_size`` (see the module docstring for how).

    ``on_rank(rank, evaluated)`` is called after each rank (for a progress bar).
    """
    world = plan.world_size
    first = evaluate_rank(base, cfg, plan, 0)
    symmetry = _Symmetry(first)
    if not symmetry.supported and not cfg.all_ranks:
        note("bench plan: a placement other than Shard/Replicate: laying out every rank")
    by_symmetry = symmetry.supported and not cfg.all_ranks
    representatives: dict[tuple, RankPlan] = {}
    figures: list[RankFigures] = []
    evaluated: list[int] = []
    busiest: tuple[list[MuonBatch], list[str]] = ([], [])  # the rank sending the most
    most = -1
    for rank in range(world):
        key = symmetry.class_of(rank) if by_symmetry else None
        rep = representatives.get(key) if by_symmetry else None
        is_new = rep is None
        if is_new:
            rep = first if rank == 0 else evaluate_rank(base, cfg, plan, rank)
            if symmetry.supported:
                symmetry.check(rep)
            if by_symmetry:
                representatives[key] = rep
            evaluated.append(rank)
        batches = rep.batches if rep.rank == rank else symmetry.reindex(rep.batches, rank)
        figures.append(rank_figures(batches, rep))
        if figures[-1].bytes_sent > most:
            most, busiest = figures[-1].bytes_sent, (batches, rep.names)
        if on_rank is not None:
            on_rank(rank, is_new)
    return WorldPlan(
        world_size=world,
        mesh_shape=plan.mesh_shape,
        figures=figures,
        evaluated=evaluated,
        classes=len(representatives) if by_symmetry else world,
        by_symmetry=by_symmetry,
        max_rank_bytes_by_param=bytes_by_param(*busiest),
        iterations=first.iterations,
        workspace_bytes=first.workspace_bytes,
        padded_scheme_bytes=padded_scheme_bytes(first.batches),
    )


# ------------------------------------------------------------------ command line


# The largest world bench plan accepts (issue #19: a million ranks ran for minutes with no
# output, building the groups and pieces of every rank before the first progress line).
MAX_WORLD_SIZE = 16384


def parse_world_sizes(text: str) -> list[int]:
    """``"8,64,1024"`` -> ``[8, 64, 1024]``; ``ValueError`` naming the flag otherwise."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(
            f"bad --world-size {text!r}; accepted: one or more ints >= 1, comma-separated, "
            "e.g. 8 or 8,64,1024"
        )
    too_large = [s for s in sizes if s > MAX_WORLD_SIZE]
    if too_large:
        raise ValueError(
            f"--world-size {too_large[0]} is more ranks than bench plan lays out in reasonable "
            f"time (every rank's process group and pieces are built in this one process); "
            f"accepted: 1 to {MAX_WORLD_SIZE}"
        )
    return sizes


def parse_meshes(text: str | None, count: int) -> list[tuple[int, ...] | None]:
    """``--mesh``: one shape per world size (``"8x1,8x8"``), or ``None`` for the defaults."""
    if text is None:
        return [None] * count
    try:
        meshes = [tuple(int(d) for d in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"bad --mesh {text!r}; accepted: dims joined by 'x', one shape per --world-size "
            "joined by ',', e.g. 8x2 or 8x1,8x8"
        ) from None
    if len(meshes) != count:
        raise ValueError(
            f"--mesh {text} gives {len(meshes)} shape(s) for {count} world size(s); give one "
            "per --world-size, or leave --mesh out for the defaults"
        )
    return meshes


def add_parser(subparsers) -> None:
    """Register ``plan`` on ``subparsers`` (an argparse sub-parsers action)."""
    p = subparsers.add_parser(
        "plan",
        help="the plan at any scale, without running it: all-to-all GB, NS load balance",
        description=__doc__,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    add_model_arguments(p, "qwen3-30b-a3b")
    p.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary size")
    p.add_argument("--layout", choices=LAYOUTS, default="fsdp", help="how params are sharded")
    p.add_argument(
        "--world-size",
        type=str,
        default="8",
        help="simulated ranks: one or more, comma-separated, e.g. 8,64,256,1024",
    )
    p.add_argument(
        "--mesh",
        type=str,
        default=None,
        help="mesh shape per --world-size, comma-separated, e.g. 8x2 or 8x1,8x8 (hsdp: "
        "REPLICATExSHARD, ep: EPxDP; default: from each world size)",
    )
    p.add_argument(
        "--coefficients",
        choices=sorted(NS_PRESETS),
        default="dion",
        help="Newton-Schulz coefficient preset (its iteration count scales the FLOPs)",
    )
    p.add_argument(
        "--all-ranks",
        action="store_true",
        help="lay out every rank instead of one per class (slow at large world sizes)",
    )
    add_output_arguments(p, "bar chart")
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> tuple[PlanConfig, list[LayoutPlan]]:
    """Every argument checked before any work; ``ValueError`` with a one-line message."""
    check_outputs({"--json": args.json, "--plot": args.plot})
    for flag, value in (("--layers", args.layers), ("--vocab-size", args.vocab_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    sizes = parse_world_sizes(args.world_size)
    meshes = parse_meshes(args.mesh, len(sizes))
    # Errors speak of --world-size: bench plan simulates its ranks and starts no process.
    plans = [check_mesh(args.layout, w, m, f"--world-size {w}") for w, m in zip(sizes, meshes)]
    if args.mesh is None:
        chosen = default_mesh_note(plans, [f"{w} ranks" for w in sizes])
        if chosen:
            note(chosen)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            "bench plan simulates every rank in one process on a fake process group; run it "
            "as a single process (not under torchrun)"
        )
    fields = ("model", "layers", "vocab_size", "layout", "coefficients", "all_ranks")
    return PlanConfig(**{name: getattr(args, name) for name in fields}), plans


def run(args: argparse.Namespace) -> int:
    """Validate, plan every world size, print the table; returns the exit code."""
    cfg, plans = _check_args(args)
    base = build_meta_model(cfg)
    worlds: list[WorldPlan] = []
    with new_progress(not args.no_progress) as progress:
        for plan in plans:
            advance = None
            if progress is not None:
                label = f"{plan.world_size} ranks"
                task = progress.add_task(label, total=plan.world_size)
                laid_out = [0]

                def advance(rank: int, evaluated: bool, task=task, label=label, n=laid_out):
                    n[0] += evaluated
                    progress.update(task, advance=1, description=f"{label}, {n[0]} laid out")

            worlds.append(plan_world(base, cfg, plan, advance))
    rows = [w.summary() for w in worlds]
    _print(rows, cfg)
    write_outputs(
        args,
        "plan",
        {"config": asdict(cfg), "results": rows},
        lambda ax: _draw(ax, rows),
        f"plan, {cfg.model}, {cfg.layout}",
        world_size=1,
    )
    return 0


def _print(rows: list[dict], cfg: PlanConfig) -> None:
    print_table(
        f"plan: {cfg.model}"
        + (f" ({cfg.layers} layers)" if cfg.layers else "")
        + f", {cfg.layout}",
        [
            "ranks",
            "mesh",
            "a2a GB\nmax",
            "a2a GB\nmean",
            "NS TFLOP\nmax",
            "NS max\n÷ mean",
            "workspace\nGiB max",
            "laid\nout",
        ],
        [
            [
                str(r["world_size"]),
                "x".join(map(str, r["mesh_shape"])) or "-",
                fmt(r["a2a_gb_per_rank_max"], ".4f"),
                fmt(r["a2a_gb_per_rank_mean"], ".4f"),
                fmt(r["ns_tflop_per_rank_max"], ".3f"),
                fmt(r["ns_max_over_mean"], ".2f"),
                fmt(r["workspace_peak_gib_max"], ".3f"),
                str(len(r["evaluated_ranks"])),
            ]
            for r in rows
        ],
        caption=f"Per rank and step, by the plan (not run); GB = 1e9 B; NS {cfg.coefficients} "
        f"x{rows[0]['ns_iterations']}.",
        legend=[
            ("a2a GB max", "all-to-all bytes a rank sends (both exchanges), max over ranks"),
            ("a2a GB mean", "the same, mean over ranks"),
            ("NS TFLOP max", "Newton-Schulz work of the busiest rank (owned + local matrices)"),
            ("NS max ÷ mean", "load balance: busiest rank over the mean; 1.00 is even"),
            (
                "workspace GiB max",
                f"est. transient peak of a step, max over ranks; budget "
                f"{rows[0]['workspace_budget_gib']:.2f}",
            ),
            ("laid out", "ranks really laid out; the others derived by symmetry (exact)"),
        ],
    )
    note("Every column is explained in docs/benchmarks.md (bench plan).")


def _draw(ax, rows: list[dict]) -> None:
    labels = [str(r["world_size"]) for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["a2a_gb_per_rank_max"] for r in rows], 0.4, label="max")
    ax.bar([i + 0.2 for i in x], [r["a2a_gb_per_rank_mean"] for r in rows], 0.4, label="mean")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("ranks")
    ax.set_ylabel("all-to-all GB per rank per step")
    balance = ax.twinx()
    balance.plot(
        list(x),
        [r["ns_max_over_mean"] or 1.0 for r in rows],
        "ko-",
        label="Newton-Schulz max ÷ mean (right axis)",
    )
    balance.set_ylabel("Newton-Schulz FLOPs, max ÷ mean")
    # One legend for both axes (bars and the ratio line), under them, over no data.
    ax.figure.legend(loc="outside lower center", ncols=3, fontsize=8)
