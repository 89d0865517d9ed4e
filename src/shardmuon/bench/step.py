"""``shardmuon bench step``: the optimizer step on a real model layout, implementations side by side.

Setup as in training: model preset (``shardmuon.models``) built on the ``meta`` device and
laid out (``shardmuon.parallel``), materialised with only this rank's shards, params routed
(``shardmuon.routing``) into ``Muon(..., nesterov=True, weight_decay=0.1)``. Weights and
grads are random from seeds that depend on the parameter name, the step and the rank only,
so every implementation sees the same weights and grads. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from shardmuon.bench.launch import RankContext, launch, torchrun_world_size
from shardmuon.bench.memory import StepMemory, live_bytes, measure_cpu_step
from shardmuon.bench.report import (
    environment,
    fmt,
    median_time,
    new_progress,
    print_table,
    save_plot,
    synchronize,
    write_json,
)
from shardmuon.bench.volume import padded_scheme_bytes
from shardmuon.cli_support import HelpFormatter, add_hidden_alias, check_outputs, note, note_written
from shardmuon.models import MODEL_PRESETS, attention_dims, model_config
from shardmuon.newton_schulz import NS_PRESETS, newton_schulz, newton_schulz_unfolded
from shardmuon.parallel import LAYOUTS, apply_layout, plan_layout

__all__ = ["IMPLEMENTATIONS", "StepConfig", "add_parser", "parse_impls", "run"]

IMPLEMENTATIONS: tuple[str, ...] = (
    "shardmuon",
    "shardmuon-unfolded",
    "shardmuon-no-rotation",
    "shardmuon-split-replicas",
    "torch-muon",
    "adamw",
)
_SHARDMUON_OPTIONS = {
    "shardmuon": {},
    "shardmuon-unfolded": {"newton_schulz_impl": "unfolded"},
    "shardmuon-no-rotation": {"rotate_owners": False},
    "shardmuon-split-replicas": {"split_replicas": True},
}
WEIGHT_DECAY = 0.1
INIT_STD = 0.02


@dataclass(frozen=True)
class StepConfig:
    """Everything a worker needs (picklable)."""

    model: str
    layers: int | None
    vocab_size: int | None
    layout: str
    mesh_shape: tuple[int, ...] | None
    steps: int
    impls: tuple[str, ...]
    coefficients: str
    lr: float
    seed: int
    progress: bool


def parse_impls(text: str | None, world_size: int, layout: str) -> tuple[list[str], dict[str, str]]:
    """The implementations to run, and those skipped with why (``torch-muon``: 1 process only).

    ``text`` is a comma-separated subset of :data:`IMPLEMENTATIONS` or ``None`` for all that
    apply. Asking explicitly for one that does not apply raises ``ValueError``.
    """
    torch_muon_reason = None
    if world_size > 1 or layout != "none":
        torch_muon_reason = (
            "torch.optim.Muon is not DTensor-aware: it needs --nproc 1 --layout none "
            f"(got world size {world_size}, layout {layout!r})"
        )
    if text is None:
        impls = list(IMPLEMENTATIONS)
        skipped = {}
        if torch_muon_reason:
            impls.remove("torch-muon")
            skipped["torch-muon"] = torch_muon_reason
        if layout != "hsdp":
            impls.remove("shardmuon-split-replicas")
            skipped["shardmuon-split-replicas"] = "only differs from shardmuon under --layout hsdp"
        return impls, skipped
    impls = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in impls if name not in IMPLEMENTATIONS]
    if not impls or unknown:
        raise ValueError(
            f"bad --impl {text!r}; accepted: a comma-separated subset of {', '.join(IMPLEMENTATIONS)}"
        )
    if "torch-muon" in impls and torch_muon_reason:
        raise ValueError(f"--impl torch-muon: {torch_muon_reason}")
    return list(dict.fromkeys(impls)), {}


# ---------------------------------------------------------------------------- worker side


def _seed(*parts: object) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode()) & 0x7FFFFFFF


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fill_normal_(t: torch.Tensor, std: float, seed: int) -> None:
    local = _local(t)
    gen = torch.Generator(device=local.device).manual_seed(seed)
    with torch.no_grad():
        local.copy_(torch.randn(local.shape, generator=gen, device=local.device) * std)


def _build(ctx: RankContext, cfg: StepConfig):
    from transformers import AutoModelForCausalLM

    config = model_config(cfg.model, num_layers=cfg.layers, vocab_size=cfg.vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layout = apply_layout(
        model,
        cfg.layout,
        world_size=ctx.world_size if ctx.distributed else 1,
        mesh_shape=cfg.mesh_shape,
        device_type=ctx.device.type,
    )
    model.to_empty(device=ctx.device)
    return model, layout


def _init_weights(model: nn.Module, ctx: RankContext, seed: int) -> None:
    for name, p in model.named_parameters():
        _fill_normal_(p, INIT_STD, _seed(seed, "w", name, ctx.rank))


def _set_grads(model: nn.Module, ctx: RankContext, seed: int, step: int) -> None:
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        _fill_normal_(p.grad, 1.0, _seed(seed, "g", step, name, ctx.rank))


def _make_optimizer(impl: str, model: nn.Module, cfg: StepConfig, expert_mesh_name):
    from shardmuon import Muon
    from shardmuon.routing import build_param_groups

    if impl == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=WEIGHT_DECAY)
    routed = build_param_groups(
        model.named_parameters(),
        lr=cfg.lr,
        weight_decay=WEIGHT_DECAY,
        expert_mesh_name=expert_mesh_name,
        **attention_dims(cfg.model),
    )
    if impl == "torch-muon":
        return _TorchMuonPair(routed.groups, cfg.lr)
    return Muon(
        routed.groups,
        lr=cfg.lr,
        nesterov=True,
        weight_decay=WEIGHT_DECAY,
        matrix_partitions=routed.partitions,
        newton_schulz_coefficients=cfg.coefficients,
        **_SHARDMUON_OPTIONS[impl],
    )


class _TorchMuonPair:
    """``torch.optim.Muon`` on the 2-D Muon params, ``torch.optim.AdamW`` on the rest.

    torch's Muon takes 2-D params only, so 3-D expert stacks go to AdamW here.
    """

    def __init__(self, groups: list[dict], lr: float) -> None:
        muon_params, other = [], []
        for group in groups:
            for p in group["params"]:
                is_matrix = group["algorithm"] == "muon" and p.dim() == 2
                (muon_params if is_matrix else other).append(p)
        self.muon = torch.optim.Muon(
            muon_params,
            lr=lr,
            weight_decay=WEIGHT_DECAY,
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = torch.optim.AdamW(other, lr=lr, weight_decay=WEIGHT_DECAY)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}


def _state_tensors(opt) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _owned_ns_seconds(
    owned_shapes: list[tuple[int, int]], impl: str, preset: str, ctx: RankContext
) -> float:
    """Seconds for Newton–Schulz on this rank's owned matrices, one batch per shape."""
    ns = newton_schulz_unfolded if impl == "shardmuon-unfolded" else newton_schulz
    batches = [
        torch.randn((count, *shape), device=ctx.device)
        for shape, count in sorted(Counter(map(tuple, owned_shapes)).items())
    ]

    def run_all() -> None:
        for G in batches:
            ns(G, preset)

    # All ranks time together, so that they share the machine as they do in the step.
    ctx.barrier()
    return median_time(run_all, ctx.device, repeats=5) if batches else 0.0


def _run_impl(impl: str, model, layout, ctx: RankContext, cfg: StepConfig, advance) -> dict:
    _init_weights(model, ctx, cfg.seed)
    for p in model.parameters():
        p.grad = None
    opt = _make_optimizer(impl, model, cfg, layout.expert_mesh_name)
    if hasattr(opt, "warmup"):
        opt.warmup()
    is_shardmuon = impl in _SHARDMUON_OPTIONS
    times, peaks, transients, stats = [], [], [], None
    for step in range(cfg.steps):
        _set_grads(model, ctx, cfg.seed, step)
        ctx.barrier()
        synchronize(ctx.device)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
            before = torch.cuda.memory_allocated(ctx.device)
        t0 = time.perf_counter()
        opt.step()
        synchronize(ctx.device)
        times.append(time.perf_counter() - t0)
        if ctx.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(ctx.device)
            peaks.append(peak)
            transients.append(peak - before)
        if is_shardmuon:
            stats = opt.last_step_stats
        advance()
    if ctx.device.type == "cuda":
        memory = StepMemory(peak_bytes=max(peaks[1:]), transient_bytes=max(transients[1:]))
    else:
        # One more, profiled step (not timed: the profiler slows it down).
        _set_grads(model, ctx, cfg.seed, cfg.steps)
        baseline = live_bytes([*model.parameters(), *(p.grad for p in model.parameters())])
        baseline += live_bytes(_state_tensors(opt))
        memory = measure_cpu_step(opt.step, baseline)
    result = {
        "step_times_s": times,
        "peak_bytes": memory.peak_bytes,
        "transient_bytes": memory.transient_bytes,
    }
    if is_shardmuon:
        rank_step = statistics.median(times[1:])
        ns_s = _owned_ns_seconds(stats.owned_shapes, impl, cfg.coefficients, ctx)
        result.update(
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            bytes_minimum=stats.bytes_minimum,
            padded_scheme_bytes=padded_scheme_bytes(opt.chunks()),
            replica_bytes_sent=stats.replica_bytes_sent,
            num_batches=stats.num_batches,
            matrices_orthogonalized=stats.matrices_orthogonalized,
            owned_ns_s=ns_s,
            step_over_ns=rank_step / ns_s if ns_s > 0 else None,
        )
    del opt
    gc.collect()
    return result


def worker(ctx: RankContext, cfg: StepConfig) -> dict | None:
    """The per-rank body: every implementation in turn; rank 0 returns all ranks' figures."""
    model, layout = _build(ctx, cfg)
    per_impl: dict[str, list[dict]] = {}
    show = cfg.progress and ctx.rank == 0
    with new_progress(show) as progress:
        task = (
            progress.add_task("optimizer steps", total=len(cfg.impls) * cfg.steps)
            if progress
            else None
        )

        def advance() -> None:
            if progress:
                progress.advance(task)

        for impl in cfg.impls:
            gathered = ctx.gather(_run_impl(impl, model, layout, ctx, cfg, advance))
            if ctx.rank == 0:
                per_impl[impl] = gathered
    if ctx.rank != 0:
        return None
    return {
        "per_rank": per_impl,
        "threads": ctx.threads,
        "device": str(ctx.device),
        "world_size": ctx.world_size,
        "mesh_shape": list(layout.plan.mesh_shape),
    }


# ---------------------------------------------------------------------------- parent side


def summarize(impl: str, ranks: list[dict]) -> dict[str, Any]:
    """One table row from every rank's figures (see ``docs/benchmarks.md`` for each column)."""
    steps = len(ranks[0]["step_times_s"])
    per_step = [max(r["step_times_s"][s] for r in ranks) for s in range(steps)]
    row: dict[str, Any] = {
        "impl": impl,
        "step_s": statistics.median(per_step[1:]),
        "step_times_s": per_step,
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        "transient_bytes": max(r["transient_bytes"] for r in ranks),
    }
    if "bytes_sent" in ranks[0]:
        sent = sum(r["bytes_sent"] for r in ranks)
        minimum = sum(r["bytes_minimum"] for r in ranks)
        padded = sum(r["padded_scheme_bytes"] for r in ranks)
        replica_sent = sum(r["replica_bytes_sent"] for r in ranks)
        ratios = [r["step_over_ns"] for r in ranks if r["step_over_ns"] is not None]
        row.update(
            a2a_gb_per_rank=max(r["bytes_sent"] for r in ranks) / 1e9,
            a2a_over_minimum=(sent / minimum) if minimum else (1.0 if sent == 0 else None),
            # With split replicas the all-to-alls shrink but broadcasts appear: not comparable.
            padded_over_minimum=(padded / minimum) if minimum and not replica_sent else None,
            replica_gb_per_rank=max(r["replica_bytes_sent"] for r in ranks) / 1e9,
            owned_ns_s=max(r["owned_ns_s"] for r in ranks),
            step_over_ns=max(ratios) if ratios else None,
            bytes_sent=[r["bytes_sent"] for r in ranks],
            bytes_received=[r["bytes_received"] for r in ranks],
            bytes_minimum=[r["bytes_minimum"] for r in ranks],
            num_batches=[r["num_batches"] for r in ranks],
            matrices_orthogonalized=[r["matrices_orthogonalized"] for r in ranks],
        )
    return row


def add_parser(subparsers) -> None:
    """Register ``step`` on ``subparsers`` (an argparse sub-parsers action)."""
    p = subparsers.add_parser(
        "step",
        help="optimizer step time, memory and all-to-all bytes (default)",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model", choices=sorted(MODEL_PRESETS), default="tiny-moe", help="model preset"
    )
    p.add_argument(
        "--layers", type=int, default=None, help="cut the model to this many layers (default: all)"
    )
    p.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary size")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes to spawn (default: the GPU count on CUDA, 2 on CPU; "
        "ignored under torchrun)",
    )
    p.add_argument("--layout", choices=LAYOUTS, default="fsdp", help="how params are sharded")
    p.add_argument(
        "--mesh",
        type=str,
        default=None,
        help="mesh shape, e.g. 2x1 (hsdp: REPLICATExSHARD, ep: EPxDP; default: from --nproc)",
    )
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per implementation")
    p.add_argument(
        "--impl",
        type=str,
        default=None,
        help=f"comma-separated subset of {', '.join(IMPLEMENTATIONS)} (default: all that apply)",
    )
    p.add_argument(
        "--coefficients",
        choices=sorted(NS_PRESETS),
        default="dion",
        help="Newton-Schulz coefficient preset",
    )
    add_hidden_alias(p, "--preset", "coefficients", choices=sorted(NS_PRESETS))
    p.add_argument("--lr", type=float, default=0.02, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and grads")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per process (default: cores / processes)",
    )
    p.add_argument(
        "--json", metavar="PATH", default=None, help="write all figures to this JSON file"
    )
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG bar chart here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _parse_mesh(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise ValueError(
            f"bad --mesh {text!r}; accepted: dims joined by 'x', e.g. 4 or 2x2"
        ) from None


def _check_positive(flag: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


def run(args: argparse.Namespace) -> int:
    """Validate, launch the workers, print the table; returns the exit code."""
    check_outputs({"--json": args.json, "--plot": args.plot})
    _check_positive("--steps", args.steps, 2)
    _check_positive("--nproc", args.nproc)
    _check_positive("--layers", args.layers)
    _check_positive("--vocab-size", args.vocab_size)
    _check_positive("--threads", args.threads)
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    world = torchrun_world_size()
    if world is None:
        world = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
        if torch.cuda.is_available() and world > torch.cuda.device_count():
            raise ValueError(
                f"--nproc {world} needs {world} GPUs (one per process, NCCL); this machine has "
                f"{torch.cuda.device_count()}"
            )
    plan = plan_layout(args.layout, world, _parse_mesh(args.mesh))
    impls, skipped = parse_impls(args.impl, world, args.layout)
    cfg = StepConfig(
        model=args.model,
        layers=args.layers,
        vocab_size=args.vocab_size,
        layout=args.layout,
        mesh_shape=plan.mesh_shape if plan.mesh_shape else None,
        steps=args.steps,
        impls=tuple(impls),
        coefficients=args.coefficients,
        lr=args.lr,
        seed=args.seed,
        progress=not args.no_progress,
    )
    needs_group = world > 1 or args.layout != "none"
    out = launch(worker, cfg, world, threads=args.threads, needs_process_group=needs_group)
    if out is None:  # a non-zero rank under torchrun
        return 0
    rows = [summarize(impl, out["per_rank"][impl]) for impl in impls]
    _print(rows, cfg, out, skipped)
    if args.json:
        env = environment(
            world_size=out["world_size"], threads=out["threads"], argv=getattr(args, "argv", None)
        )
        write_json(
            args.json,
            {
                "benchmark": "step",
                "config": {**asdict(cfg), "mesh_shape": out["mesh_shape"]},
                "environment": env,
                "results": rows,
                "per_rank": out["per_rank"],
                "skipped": skipped,
            },
        )
        note_written(args.json, "results (JSON)")
    if args.plot:
        save_plot(args.plot, lambda ax: _draw(ax, rows), f"optimizer step, {cfg.model}")
        note_written(args.plot, "plot (PNG)")
    return 0


def _print(rows: list[dict], cfg: StepConfig, out: dict, skipped: dict[str, str]) -> None:
    # Two narrow tables rather than one wide one, so that both fit 80 columns; the traffic
    # columns only mean something for shardmuon's own implementations.
    gib = 2**30
    mesh = "x".join(map(str, out["mesh_shape"])) or "-"
    memory_source = "CUDA allocator stats" if out["device"].startswith("cuda") else "CPU profiler"
    print_table(
        f"optimizer step: {cfg.model}"
        + (f" ({cfg.layers} layers)" if cfg.layers else "")
        + f", layout {cfg.layout} (mesh {mesh}), {out['world_size']} x {out['device']}, "
        f"{out['threads']} threads/rank",
        ["impl", "step\nms", "owned\nNS ms", "step\n÷ NS", "peak\nGiB", "transient\nGiB"],
        [
            [
                r["impl"],
                fmt(1e3 * r["step_s"], ".2f"),
                fmt(1e3 * r["owned_ns_s"] if "owned_ns_s" in r else None, ".2f"),
                fmt(r.get("step_over_ns"), ".2f"),
                fmt(r["peak_bytes"] / gib, ".4f"),
                fmt(r["transient_bytes"] / gib, ".4f"),
            ]
            for r in rows
        ],
        caption=f"Median over steps 2..{cfg.steps}, max over ranks; Newton-Schulz "
        f"coefficients {cfg.coefficients}; memory from {memory_source}.",
        legend=[
            ("step ms", "wall time of opt.step()"),
            ("owned NS ms", "Newton-Schulz alone on the matrices a rank orthogonalizes"),
            ("step ÷ NS", "step time over owned NS time; 1.00: the step is all Newton-Schulz"),
            ("peak GiB", "most memory live during a step"),
            ("transient GiB", "the part of the peak that the step itself allocated"),
        ],
    )
    traffic = [r for r in rows if "a2a_gb_per_rank" in r]
    if traffic:
        print_table(
            "all-to-all traffic per step",
            ["impl", "all-to-all\nGB/rank", "a2a\n÷ min", "padded\n÷ min"],
            [
                [
                    r["impl"],
                    fmt(r["a2a_gb_per_rank"], ".4f"),
                    fmt(r.get("a2a_over_minimum"), ".2f"),
                    fmt(r.get("padded_over_minimum"), ".2f"),
                ]
                for r in traffic
            ],
            legend=[
                ("all-to-all GB/rank", "bytes a rank sends to the others, max over ranks"),
                ("a2a ÷ min", "bytes sent over the least the layout needs (1.00: no waste)"),
                ("padded ÷ min", "dion's padded scheme over that least, computed from the layout"),
            ],
        )
    note("Every column is explained in docs/benchmarks.md.")
    for impl, reason in skipped.items():
        note(f"skipped {impl}: {reason}")


def _draw(ax, rows: list[dict]) -> None:
    names = [r["impl"] for r in rows]
    ax.bar(names, [1e3 * r["step_s"] for r in rows], label="step")
    ns = [1e3 * r["owned_ns_s"] if "owned_ns_s" in r else float("nan") for r in rows]
    ax.plot(names, ns, "k_", markersize=30, mew=2, label="owned Newton-Schulz")
    ax.set_ylabel("ms (median, max over ranks)")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend()
