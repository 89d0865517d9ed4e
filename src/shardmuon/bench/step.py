"""``shardmuon bench step``: the optimizer step on a real model layout, implementations side by side.

Setup as in training: model preset (``shardmuon.harness.models``) built on the ``meta`` device and
laid out (``shardmuon.harness.parallel``), materialised with only this rank's shards, params routed
(``shardmuon.routing``) into ``Muon(..., nesterov=True, weight_decay=0.1)`` and the other
implementations (``shardmuon.bench.optimizers``). Weights and grads are random from seeds
that depend on the parameter name, the step and the rank only, so every implementation sees
the same weights and grads. ``--order abba`` runs them A B ... B A and pools both passes.
See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, replace

import torch

from shardmuon.bench.common import add_model_arguments, add_output_arguments
from shardmuon.bench.kernels import DEVICE_PATHS, KernelConfig, measure_preset
from shardmuon.bench.launch import launch, torchrun_world_size
from shardmuon.bench.optimizers import (
    DEFAULT_OFF,
    EAGER_SUFFIX,
    GRAPHS_SUFFIX,
    IMPLEMENTATIONS,
    OFFLOAD_SUFFIX,
    OVERLAP_SUFFIX,
    dion_unavailable,
    shardmuon_options,
)
from shardmuon.bench.report import write_outputs
from shardmuon.bench.step_summary import draw, print_results, summarize
from shardmuon.bench.step_worker import ORDERS, StepConfig, worker
from shardmuon.harness.cli_support import (
    HelpFormatter,
    add_hidden_alias,
    check_outputs,
    int_at_least,
    note,
    positive_float,
    positive_int,
    seed_int,
)
from shardmuon.harness.machine import DTYPES, fp16_cpu_note
from shardmuon.harness.mesh_flags import check_mesh, default_mesh_note
from shardmuon.harness.parallel import LAYOUTS, parse_mesh_shape
from shardmuon.harness.processes import NPROC_RULE, check_process_count, check_thread_count
from shardmuon.ops.newton_schulz import NS_PRESETS
from shardmuon.ops.orthogonalizer import NS_CHOICES

DEFAULT_MODEL = "tiny-moe"

__all__ = [
    "add_parser",
    "drop_duplicate_configs",
    "parse_impls",
]


def _not_applicable(world_size: int, layout: str) -> dict[str, str]:
    """The implementations that cannot run in this setting, with why."""
    out = {}
    if world_size > 1 or layout != "none":
        out["torch-muon"] = (
            "torch.optim.Muon is not DTensor-aware: it needs --nproc 1 --layout none "
            f"(got world size {world_size}, layout {layout!r})"
        )
    if layout == "ep":
        out["dion"] = (
            "dion's Muon takes one 1-D mesh for all params; under --layout ep the expert "
            "stacks live on a 2-D mesh"
        )
    if layout == "fsdp-tp":
        out["dion"] = (
            "dion's Muon takes one 1-D mesh for all params; under --layout fsdp-tp the "
            "attention and MLP weights are sharded on a 2-D (dp, tp) mesh, on both matrix dims"
        )
    return out


OFFLOAD_MODES = ("none", "state")


def parse_offload(text: str) -> list[str]:
    """``--offload``: ``none``, ``state`` or both (``none,state``)."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not modes or any(m not in OFFLOAD_MODES for m in modes):
        raise ValueError(
            f"bad --offload {text!r}; accepted: none, state, or none,state (both, side by side)"
        )
    return modes


def with_offload(impls: list[str], modes: list[str]) -> list[str]:
    """Each shardmuon impl in each offload mode (``+offload``); others only without offload."""
    out = []
    for impl in impls:
        if "none" in modes:
            out.append(impl)
        if "state" in modes and shardmuon_options(impl) is not None:
            out.append(impl + OFFLOAD_SUFFIX)
    if not out:
        raise ValueError("--offload state: none of the chosen --impl are shardmuon's")
    return out


def with_overlap(impls: list[str], overlap: str) -> list[str]:
    """``--overlap forward``: each shardmuon impl also overlapped (``+overlap``), beside it."""
    return impls if overlap == "none" else _beside(impls, OVERLAP_SUFFIX)


def with_graphs(impls: list[str], cuda_graphs: bool) -> list[str]:
    """``--cuda-graphs``: each shardmuon impl also with ``cuda_graphs=False`` (``+eager``)
    and ``True`` (``+graphs``), beside its default row (the guarded calls captured)."""
    return _beside(impls, EAGER_SUFFIX, GRAPHS_SUFFIX) if cuda_graphs else impls


def _beside(impls: list[str], *suffixes: str) -> list[str]:
    """Each impl, and right after it each shardmuon impl with each of ``suffixes``."""
    out = []
    for impl in impls:
        out.append(impl)
        if shardmuon_options(impl) is not None:
            out.extend(impl + suffix for suffix in suffixes)
    return out


def parse_impls(text: str | None, world_size: int, layout: str) -> tuple[list[str], dict[str, str]]:
    """The implementations to run, and those skipped with why.

    ``text`` is a comma-separated subset of :data:`IMPLEMENTATIONS` or ``None`` for the
    default: all that apply, less the opt-in ones (``shardmuon-compiled``). Asking
    explicitly for one that does not apply (``torch-muon`` on DTensors) raises
    ``ValueError``; ``dion`` when the ``dion`` package is not installed is skipped.
    """
    not_applicable = _not_applicable(world_size, layout)
    if text is None:
        impls = list(IMPLEMENTATIONS)
        skipped = dict(not_applicable)
        if layout != "hsdp":
            skipped["shardmuon-split-replicas"] = "only differs from shardmuon under --layout hsdp"
        skipped.update(DEFAULT_OFF)
    else:
        impls = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
        unknown = [name for name in impls if name not in IMPLEMENTATIONS]
        if not impls or unknown:
            raise ValueError(
                f"bad --impl {text!r}; accepted: a comma-separated subset of "
                f"{', '.join(IMPLEMENTATIONS)}"
            )
        for name in impls:
            if name in not_applicable:
                raise ValueError(f"--impl {name}: {not_applicable[name]}")
        skipped = {}
    if "dion" in impls and "dion" not in skipped:
        reason = dion_unavailable()
        if reason:
            skipped["dion"] = reason
    impls = [name for name in impls if name not in skipped]
    if not impls:
        raise ValueError(f"--impl {text}: nothing to run ({'; '.join(skipped.values())})")
    return impls, skipped


# What --help prints: plain words and an example. The module docstring keeps the full
# account, in the markup the API docs read.
_DESCRIPTION = """\
The optimizer step on a real model layout, shardmuon beside the other implementations:
step time, memory and all-to-all bytes. Every implementation gets the same random
weights and gradients, on --nproc processes laid out as in training (--layout).

Prints two tables with a row per implementation: step time (median, first step,
Newton-Schulz share), then memory peak and all-to-all traffic; --json and --plot write
the figures. docs/benchmarks.md explains the columns.

Example:
  shardmuon bench step --model tiny-moe --nproc 2 --layout fsdp --steps 12
"""


def add_parser(subparsers) -> None:
    """Register ``step`` on ``subparsers`` (an argparse sub-parsers action)."""
    p = subparsers.add_parser(
        "step",
        help="optimizer step time, memory and all-to-all bytes (default)",
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    add_model_arguments(p, DEFAULT_MODEL)
    p.add_argument(
        "--vocab-size", type=positive_int, default=None, help="override the vocabulary size"
    )
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="processes to spawn (default: the GPU count on CUDA, 2 on CPU; ignored under "
        f"torchrun); {NPROC_RULE}",
    )
    p.add_argument("--layout", choices=LAYOUTS, default="fsdp", help="how params are sharded")
    p.add_argument(
        "--mesh",
        type=str,
        default=None,
        help="mesh shape, e.g. 2x1 (hsdp: REPLICATExSHARD, ep: EPxDP, fsdp-tp: DPxTP; "
        "default: from --nproc)",
    )
    p.add_argument(
        "--steps", type=int_at_least(2), default=12, help="optimizer steps per implementation"
    )
    p.add_argument(
        "--impl",
        type=str,
        default=None,
        help=f"comma-separated subset of {', '.join(IMPLEMENTATIONS)} (default: all that "
        "apply but shardmuon-compiled)",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="sequential",
        help="sequential: each impl once; abba: A B ... B A, each twice, both passes pooled",
    )
    p.add_argument(
        "--ns-repeats",
        type=positive_int,
        default=5,
        help="replays of each rank's Newton-Schulz calls for the step ÷ NS column (median)",
    )
    p.add_argument(
        "--coefficients",
        choices=sorted(NS_PRESETS),
        default=None,
        help="Newton-Schulz coefficient preset; with --ns-preconditioner aol: aol (default: dion)",
    )
    add_hidden_alias(p, "--preset", "coefficients", choices=sorted(NS_PRESETS))
    p.add_argument(
        "--ns-impl",
        choices=NS_CHOICES,
        default=None,
        help="Newton-Schulz implementation of every shardmuon impl (default: each impl's own; "
        "shardmuon-gram is 'gram')",
    )
    p.add_argument(
        "--ns-dtype",
        choices=tuple(DTYPES),
        default=None,
        help="Newton-Schulz iteration dtype of every shardmuon impl (default: bf16)",
    )
    p.add_argument(
        "--ns-preconditioner",
        choices=("aol",),
        default=None,
        help="Newton-Schulz preconditioner of every shardmuon impl: 'aol' (Turbo-Muon's row "
        "scaling, then the 4-step 'aol' schedule unless --coefficients is given; default: none)",
    )
    p.add_argument(
        "--offload",
        default="none",
        # Each choice once; both together are a comma-separated list, as --impl takes.
        metavar="{none,state}",
        help="shardmuon's optimizer-state offload: 'state' runs each shardmuon impl with "
        "offload='state' (rows 'IMPL+offload'); both, comma-separated ('none,state'), run "
        "side by side",
    )
    p.add_argument(
        "--overlap", choices=("none", "forward"), default="none",
        help="'forward': each shardmuon impl also with overlap='forward' (rows 'IMPL+overlap', "
        "beside it): 'held ms' is the time step() held the caller; with no forward here to "
        "hide behind, the step time includes the synchronize after it",
    )  # fmt: skip
    p.add_argument(
        "--cuda-graphs", action="store_true",
        help="each shardmuon impl also with cuda_graphs=False (rows 'IMPL+eager') and True "
        "('IMPL+graphs': every Newton-Schulz call replayed from a CUDA graph) beside its "
        "default row (the guarded calls replayed); ignored off CUDA",
    )  # fmt: skip
    p.add_argument("--lr", type=positive_float, default=0.02, help="learning rate")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random weights and grads")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads per process, at most max(8, 4 per core) (default: cores / processes)",
    )
    kernels = p.add_argument_group(
        "launch counts (--kernels)",
        "count what one step launches instead of timing it: one process, shardmuon only, "
        "after two warm steps; per phase, the ATen calls, the estimated device kernels and "
        "the host syncs (docs/benchmarks.md, 'Launches per step')",
    )
    kernels.add_argument(
        "--kernels", action="store_true", help="count launches instead of timing the step"
    )
    kernels.add_argument(
        "--device-path",
        choices=DEVICE_PATHS,
        default="accelerator",
        help="the path counted: 'accelerator' (the branches a CUDA tensor takes, counted on "
        "the meta device: nothing computed, any machine) or 'cpu' (the real step on CPU "
        "tensors)",
    )
    kernels.add_argument(
        "--scale",
        type=positive_int,
        default=1,
        help="divide the preset's widths (vocabulary too) by S and the workspace by S**2, so "
        "the plan keeps the full model's batches",
    )
    add_output_arguments(p, "bar chart")
    p.set_defaults(func=run)


def run_kernels(args: argparse.Namespace) -> int:
    """``--kernels``: count one step's launches and print them by phase."""
    check_outputs({"--json": args.json})
    if args.plot:
        raise ValueError("--plot draws step times; --kernels prints a table (use --json)")
    options: dict[str, object] = {}
    for key, value in (
        ("newton_schulz_impl", args.ns_impl),
        ("newton_schulz_preconditioner", args.ns_preconditioner),
    ):
        if value is not None:
            options[key] = value
    if args.coefficients is not None:
        options["newton_schulz_coefficients"] = args.coefficients
    if args.ns_dtype is not None:
        options["newton_schulz_dtype"] = DTYPES[args.ns_dtype]
    config = KernelConfig(
        model=args.model,
        layers=args.layers,
        scale=args.scale,
        device_path=args.device_path,
        seed=args.seed,
        options=tuple(sorted(options.items())),
    )
    report = measure_preset(config)
    print(
        f"launches of one step: {config.model}"
        + (f", {config.layers} layers" if config.layers else "")
        + (f", widths / {config.scale}" if config.scale > 1 else "")
        + f", {config.device_path} path: {report.batches} Muon batches"
    )
    print(report.table())
    if report.sync_sites:
        print("host syncs: " + ", ".join(f"{site} x{n}" for site, n in report.sync_sites.items()))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"config": asdict(config), **report.as_dict()}, f, indent=2, default=str)
    return 0


def drop_duplicate_configs(
    impls: list[str], overrides: dict[str, str], given: str
) -> tuple[list[str], dict[str, str]]:
    """``impls`` less each shardmuon impl that runs the configuration of an earlier one once
    ``overrides`` (the ``Muon`` keywords of ``--ns-impl``/``--ns-dtype``, spelt ``given``)
    are set on every shardmuon impl; and the dropped ones, with why.

    ``--ns-impl gram`` makes ``shardmuon-gram`` (and ``shardmuon-unfolded``) ``shardmuon``
    again: two rows of one configuration would differ by noise only.
    """
    kept: list[str] = []
    dropped: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for impl in impls:
        options = shardmuon_options(impl)
        if options is None:
            kept.append(impl)
            continue
        key = tuple(sorted({**options, **overrides}.items()))
        if key in seen:
            dropped[impl] = f"runs the same configuration as {seen[key]} under {given}"
            continue
        seen[key] = impl
        kept.append(impl)
    return kept, dropped


def run(args: argparse.Namespace) -> int:
    """Validate, launch the workers, print the table; returns the exit code.

    The numbers were checked by their argparse types; here, before any work, the outputs,
    the process count against the machine, the mesh and the implementations.
    """
    if args.kernels:
        return run_kernels(args)
    if args.scale != 1:
        raise ValueError(f"--scale {args.scale} applies to --kernels only")
    check_outputs({"--json": args.json, "--plot": args.plot})
    check_thread_count(args.threads)
    world = torchrun_world_size()
    if world is None:
        world = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
        if torch.cuda.is_available() and world > torch.cuda.device_count():
            raise ValueError(
                f"--nproc {world} needs {world} GPUs (one per process, NCCL); this machine has "
                f"{torch.cuda.device_count()}"
            )
        world_source = f"--nproc {world}" if args.nproc else f"the default --nproc {world}"
        check_process_count(world)
    else:
        world_source = f"torchrun's {world} processes"
    mesh = parse_mesh_shape(args.mesh, "dims joined by 'x', e.g. 4 or 2x2")
    plan = check_mesh(args.layout, world, mesh, world_source)
    if mesh is None and os.environ.get("RANK", "0") == "0":
        chosen = default_mesh_note([plan], [world_source])
        if chosen:
            note(chosen)
    impls, skipped = parse_impls(args.impl, world, args.layout)
    impls = with_overlap(with_offload(impls, parse_offload(args.offload)), args.overlap)
    impls = with_graphs(impls, args.cuda_graphs)
    cfg = StepConfig(
        model=args.model,
        layers=args.layers,
        vocab_size=args.vocab_size,
        layout=args.layout,
        mesh_shape=plan.mesh_shape if plan.mesh_shape else None,
        steps=args.steps,
        impls=tuple(impls),
        coefficients=args.coefficients or ("aol" if args.ns_preconditioner == "aol" else "dion"),
        lr=args.lr,
        seed=args.seed,
        progress=not args.no_progress,
        order=args.order,
        ns_repeats=args.ns_repeats,
        ns_impl=args.ns_impl,
        ns_dtype=args.ns_dtype,
        ns_preconditioner=args.ns_preconditioner,
    )
    flags = (
        ("--ns-impl", args.ns_impl),
        ("--ns-dtype", args.ns_dtype),
        ("--ns-preconditioner", args.ns_preconditioner),
    )
    given = " ".join(f"{flag} {value}" for flag, value in flags if value is not None)
    kept, duplicates = drop_duplicate_configs(impls, cfg.ns_options(), given)
    if duplicates:
        impls, skipped = kept, {**skipped, **duplicates}
        cfg = replace(cfg, impls=tuple(impls))
    runs_fp16 = DTYPES.get(args.ns_dtype) is torch.float16 and any(
        shardmuon_options(impl) is not None for impl in impls
    )
    fp16 = fp16_cpu_note(f"--ns-dtype {args.ns_dtype}") if runs_fp16 else None
    if fp16 and not torch.cuda.is_available() and os.environ.get("RANK", "0") == "0":
        note(f"bench step: {fp16}")
    needs_group = world > 1 or args.layout != "none"
    out = launch(worker, cfg, world, threads=args.threads, needs_process_group=needs_group)
    if out is None:  # a non-zero rank under torchrun
        return 0
    rows = [summarize(impl, out["per_pass"][impl]) for impl in impls]
    print_results(rows, cfg, out, skipped)
    write_outputs(
        args,
        "step",
        {
            "config": {**asdict(cfg), "mesh_shape": out["mesh_shape"]},
            "results": rows,
            "per_pass": out["per_pass"],
            "skipped": skipped,
        },
        lambda ax: draw(ax, rows),
        f"optimizer step, {cfg.model}",
        world_size=out["world_size"],
        threads=out["threads"],
    )
    return 0
