"""``bench plan``, one rank: lay a copy of the meta model out as rank ``r`` of ``W`` on torch's
fake process group, build ``Muon`` (which plans without communicating) and read its plan:
the bytes, Newton–Schulz FLOPs and workspace of that rank (see :mod:`shardmuon.bench.plan`).
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from shardmuon.bench.optimizers import make_optimizer
from shardmuon.harness.models import model_config
from shardmuon.harness.parallel import LayoutPlan, apply_layout
from shardmuon.planning.batches import MuonBatch, newton_schulz_cost
from shardmuon.planning.workspace import workspace_peak_bytes
from shardmuon.runtime.exchange import BatchExchange
from shardmuon.runtime.telemetry import StepStats

__all__ = [
    "PlanConfig",
    "RankFigures",
    "RankPlan",
    "build_meta_model",
    "bytes_by_param",
    "evaluate_rank",
    "rank_figures",
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
    FLOPs, matrices orthogonalized and the estimated workspace peak (``planning/workspace.py``)."""
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
