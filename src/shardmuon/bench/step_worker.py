"""The rank side of ``shardmuon bench step``: build, lay out, step, time, replay Newton–Schulz.

Weights and grads are random from seeds made of the parameter name, the step and the rank
only, so every implementation (and both passes of an ABBA run) sees the same weights and
grads. Plain (non-DTensor) parameters (``--layout none``) are DDP replicas: their seeds
leave the rank out, so every rank holds the same weights and grads.
"""

from __future__ import annotations

import gc
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardmuon.bench.common import name_seed
from shardmuon.bench.floor import measure_floor, optimizer_params
from shardmuon.bench.launch import RankContext
from shardmuon.bench.memory import StepMemory, live_bytes, measure_cpu_step
from shardmuon.bench.optimizers import make_optimizer, shardmuon_options
from shardmuon.bench.report import new_progress, repeat_times, synchronize
from shardmuon.bench.volume import padded_scheme_bytes
from shardmuon.harness.machine import DTYPES
from shardmuon.harness.models import model_config
from shardmuon.harness.parallel import apply_layout
from shardmuon.ops.orthogonalizer import NS_DTYPES
from shardmuon.planning.placements import local_tensor

__all__ = ["ORDERS", "StepConfig", "replay_newton_schulz", "run_order", "worker"]

ORDERS: tuple[str, ...] = ("sequential", "abba")
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
    order: str = "sequential"
    ns_repeats: int = 5
    # Newton-Schulz engine of every shardmuon impl (``None``: each impl's own).
    ns_impl: str | None = None
    ns_dtype: str | None = None
    ns_preconditioner: str | None = None

    def ns_options(self) -> dict[str, str]:
        """The ``Muon`` keywords that ``ns_impl`` / ``ns_dtype`` / ``ns_preconditioner`` set
        (``--ns-impl``, ``--ns-dtype``, ``--ns-preconditioner``)."""
        options = {}
        if self.ns_impl is not None:
            options["newton_schulz_impl"] = self.ns_impl
        if self.ns_dtype is not None:
            dtype = DTYPES[self.ns_dtype]
            options["newton_schulz_dtype"] = next(k for k, v in NS_DTYPES.items() if v == dtype)
        if self.ns_preconditioner is not None:
            options["newton_schulz_preconditioner"] = self.ns_preconditioner
        return options


def run_order(impls: tuple[str, ...] | list[str], order: str) -> list[str]:
    """The passes to run: each impl once, or mirrored (``abba``: A B C C B A)."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; accepted: {', '.join(ORDERS)}")
    impls = list(impls)
    return impls + impls[::-1] if order == "abba" else impls


def _fill_normal_(t: torch.Tensor, std: float, seed: int) -> None:
    local = local_tensor(t)
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


def _rank_of(p: torch.Tensor, ctx: RankContext) -> int:
    """The rank in a parameter's seeds: none for a plain parameter (a DDP replica)."""
    return ctx.rank if isinstance(p, DTensor) else -1


def _init_weights(model: nn.Module, ctx: RankContext, seed: int) -> None:
    for name, p in model.named_parameters():
        _fill_normal_(p, INIT_STD, name_seed(seed, "w", name, _rank_of(p, ctx)))


def _set_grads(model: nn.Module, ctx: RankContext, seed: int, step: int) -> None:
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        _fill_normal_(p.grad, 1.0, name_seed(seed, "g", step, name, _rank_of(p, ctx)))


def _state_tensors(opt) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def replay_newton_schulz(
    opt, calls: list[tuple[int, int, int]], ctx: RankContext, repeats: int
) -> list[float]:
    """Seconds of each of ``repeats`` replays of the Newton–Schulz calls ``calls`` made.

    ``calls``: ``last_step_stats.ns_calls`` of a step of ``opt`` (a ``shardmuon.Muon``),
    the ``(batch, rows, cols)`` of every call in order. Each is made again, in that order,
    with the optimizer's own Newton–Schulz engine (implementation, dtype, restarts, guard),
    coefficients and eps, on random bf16 inputs of those shapes (one input
    per call, made beforehand), without autograd. Every replay starts after a barrier, so
    all ranks run theirs at the same time, as in the step; a rank with no calls still joins
    the barriers.
    """
    implementation = opt.settings.newton_schulz.orthogonalizer(opt.auto_choices)
    eps = float(opt.defaults["epsilon"])
    gen = torch.Generator(device=ctx.device).manual_seed(name_seed("ns", ctx.rank))
    inputs = [
        torch.randn(shape, generator=gen, device=ctx.device).to(torch.bfloat16) for shape in calls
    ]

    def replay() -> None:
        # Without autograd, as in the step (for the compiled implementation, grad mode is
        # part of what a compiled graph is reused for).
        with torch.no_grad():
            for X in inputs:
                implementation(X, opt.coefficients, eps)

    # No warm-up call: the step already ran these shapes (compiled ones included).
    return repeat_times(replay, ctx.device, repeats, warmup=0, before=ctx.barrier)


class _Bar:
    """Rank 0's progress bar (``progress`` ``None`` elsewhere): steps counted, phase named.

    The bar counts timed steps only; after the last one it would sit full while the
    profiled step and the Newton–Schulz replay run, so :meth:`phase` names what runs.
    """

    def __init__(self, progress, total: int) -> None:
        self._progress = progress
        self._task = progress.add_task("optimizer steps", total=total) if progress else None

    def phase(self, description: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=description)

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)


def _step_and_wait(opt):
    """``opt.step`` and the wait for its overlapped work, as one call (what is profiled)."""

    def run() -> None:
        opt.step()
        opt.synchronize()

    return run


def _run_impl(impl: str, model, layout, ctx: RankContext, cfg: StepConfig, bar: _Bar) -> dict:
    bar.phase(f"{impl}: optimizer steps")
    _init_weights(model, ctx, cfg.seed)
    for p in model.parameters():
        p.grad = None
    opt = make_optimizer(
        impl,
        model,
        model_name=cfg.model,
        lr=cfg.lr,
        coefficients=cfg.coefficients,
        shardmuon_overrides=cfg.ns_options(),
        expert_mesh_name=layout.expert_mesh_name,
        meshes=layout.meshes,
    )
    if hasattr(opt, "warmup"):
        opt.warmup()
    if getattr(opt, "overlap", None) is not None:
        # No forward here: every step is followed by synchronize() instead of hooks.
        warnings.filterwarnings("ignore", "Muon.overlap='forward'. stepped before overlap_with")
    is_shardmuon = shardmuon_options(impl) is not None
    overlapped = is_shardmuon and shardmuon_options(impl).get("overlap") is not None
    times, held, peaks, transients, stats = [], [], [], [], None
    for step in range(cfg.steps):
        _set_grads(model, ctx, cfg.seed, step)
        ctx.barrier()
        synchronize(ctx.device)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
            before = torch.cuda.memory_allocated(ctx.device)
        t0 = time.perf_counter()
        opt.step()
        if overlapped:  # no forward to hide behind here: the rest of the step, waited for
            held.append(time.perf_counter() - t0)
            opt.synchronize()
        synchronize(ctx.device)
        times.append(time.perf_counter() - t0)
        if ctx.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(ctx.device)
            peaks.append(peak)
            transients.append(peak - before)
        if is_shardmuon:
            stats = opt.last_step_stats
        bar.advance()
    if ctx.device.type == "cuda":
        memory = StepMemory(peak_bytes=max(peaks[1:]), transient_bytes=max(transients[1:]))
    else:
        # One more, profiled step (not timed: the profiler slows it down).
        bar.phase(f"{impl}: memory profile of one more step")
        _set_grads(model, ctx, cfg.seed, cfg.steps)
        baseline = live_bytes([*model.parameters(), *(p.grad for p in model.parameters())])
        baseline += live_bytes(_state_tensors(opt))
        memory = measure_cpu_step(_step_and_wait(opt) if overlapped else opt.step, baseline)
    result = {
        "step_times_s": times,
        **({"held_times_s": held} if overlapped else {}),
        "peak_bytes": memory.peak_bytes,
        "transient_bytes": memory.transient_bytes,
    }
    if is_shardmuon:
        bar.phase(f"{impl}: Newton-Schulz replay x{cfg.ns_repeats}")
        result.update(
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            bytes_minimum=stats.bytes_minimum,
            padded_scheme_bytes=padded_scheme_bytes(opt.chunks()),
            replica_bytes_sent=stats.replica_bytes_sent,
            workspace_peak_bytes=stats.workspace_peak_bytes,
            offload_bytes_loaded=stats.offload_bytes_loaded,
            offload_bytes_stored=stats.offload_bytes_stored,
            offload_workspace_peak_bytes=stats.offload_workspace_peak_bytes,
            num_batches=stats.num_batches,
            matrices_orthogonalized=stats.matrices_orthogonalized,
            ns_calls=[list(c) for c in stats.ns_calls],
            ns_times_s=replay_newton_schulz(opt, stats.ns_calls, ctx, cfg.ns_repeats),
        )
        bar.phase(f"{impl}: the step's floor (GEMM rates, bandwidth)")
        ctx.barrier()  # every rank probes at once, as every rank steps at once
        floor = measure_floor(stats.ns_calls, opt.plan.ns_cost, optimizer_params(opt), ctx.device)
        result["floor"] = floor.as_dict()
    del opt
    gc.collect()
    return result


def worker(ctx: RankContext, cfg: StepConfig) -> dict | None:
    """The per-rank body: every pass of :func:`run_order`; rank 0 returns all ranks' figures.

    ``per_pass[impl]`` is a list with one entry per pass of ``impl`` (two under ``abba``),
    each the list of every rank's figures.
    """
    model, layout = _build(ctx, cfg)
    passes = run_order(cfg.impls, cfg.order)
    per_pass: dict[str, list[list[dict]]] = {}
    show = cfg.progress and ctx.rank == 0
    with new_progress(show) as progress:
        bar = _Bar(progress, total=len(passes) * cfg.steps)
        for impl in passes:
            gathered = ctx.gather(_run_impl(impl, model, layout, ctx, cfg, bar))
            if ctx.rank == 0:
                per_pass.setdefault(impl, []).append(gathered)
    if ctx.rank != 0:
        return None
    return {
        "per_pass": per_pass,
        "threads": ctx.threads,
        "device": str(ctx.device),
        "world_size": ctx.world_size,
        "mesh_shape": list(layout.plan.mesh_shape),
    }
