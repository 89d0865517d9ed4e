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
  this (``last_step_stats.bytes_sent``; ``tests/bench/test_bench_plan.py`` compares the two on gloo);
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
``Shard`` and ``Replicate`` — but FSDP2's ``_StridedShard`` on the expert dim of a stack
that expert parallelism split first — fall back to laying out every rank.

One rank is laid out by :mod:`shardmuon.bench.plan_rank`, the classes and the re-indexing
are :mod:`shardmuon.bench.plan_symmetry`; this module runs the worlds and prints them.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from shardmuon.bench.common import add_model_arguments, add_output_arguments
from shardmuon.bench.plan_rank import (
    PER_RANK_JSON_LIMIT,
    PlanConfig,
    RankFigures,
    RankPlan,
    build_meta_model,
    bytes_by_param,
    evaluate_rank,
    rank_figures,
)
from shardmuon.bench.plan_symmetry import Symmetry
from shardmuon.bench.report import fmt, new_progress, print_table, write_outputs
from shardmuon.bench.volume import padded_scheme_bytes
from shardmuon.harness.cli_support import (
    HelpFormatter,
    check_outputs,
    note,
    positive_int,
)
from shardmuon.harness.mesh_flags import check_mesh, default_mesh_note
from shardmuon.harness.parallel import LAYOUTS, LayoutPlan
from shardmuon.ops.newton_schulz import NS_PRESETS
from shardmuon.planning.batches import MuonBatch

__all__ = [
    "add_parser",
    "build_meta_model",
    "parse_meshes",
    "parse_world_sizes",
    "plan_world",
]


# ------------------------------------------------------------------ one rank's view


# ------------------------------------------------------------------ symmetry


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
    symmetry = Symmetry(first)
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


# The largest world bench plan accepts (a million ranks ran for minutes with no
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


# What --help prints: plain words and an example. The module docstring keeps the full
# account, in the markup the API docs read.
_DESCRIPTION = """\
The optimizer's plan for a real model at any size, worked out in this one process:
nothing is allocated, started or stepped. For each simulated world size the model is
built without memory, laid out as training lays it out, and Muon plans its batches.

Prints one row per world size: the all-to-all gigabytes a rank sends per step (max and
mean over ranks), the Newton-Schulz work of the busiest rank and how even the load is,
and the optimizer's workspace peak. Columns are explained under the table and in
docs/benchmarks.md.

Example:
  shardmuon bench plan --model glm-4.5-air --world-size 8,64,256,1024 --json plan.json
"""


def add_parser(subparsers) -> None:
    """Register ``plan`` on ``subparsers`` (an argparse sub-parsers action)."""
    p = subparsers.add_parser(
        "plan",
        help="the plan at any scale, without running it: all-to-all GB, NS load balance",
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    add_model_arguments(p, "qwen3-30b-a3b")
    p.add_argument(
        "--vocab-size", type=positive_int, default=None, help="override the vocabulary size"
    )
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
