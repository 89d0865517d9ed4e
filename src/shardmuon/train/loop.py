"""The training loop: a tiny Hugging Face model on one of :mod:`.tasks` (reverse-text SFT or
byte-level LM pretraining), on 1 process or N processes with FSDP2 (gloo on CPU, NCCL on
GPUs), optionally over tensor parallel (``fsdp-tp``), with DCP checkpoints and exact resume.

The global batch of step k is the same at every world size (see :mod:`.tasks`); each
data-parallel rank trains on a contiguous slice of it (the ranks of one tensor-parallel
group share a slice), and the loss is the mean over all supervised tokens of the global
batch, so the loss curve does not depend on the world size or the layout. The held-out
loss (task ``lm``) is measured the same way, on a fixed batch, every ``eval_every`` steps.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardmuon.train import checkpoint as ckpt_io
from shardmuon.train import dion_format
from shardmuon.train.config import (
    EXPERT_MESH_NAME,
    TrainConfig,
    TrainResult,
    config_dict,
    range_means,
)
from shardmuon.train.data import IGNORE_INDEX, num_target_tokens, rank_slice
from shardmuon.train.schedule import set_learning_rates
from shardmuon.train.tasks import build_task

# ---------------------------------------------------------------------------- model + optimizer


def build_training_model(config: TrainConfig, vocab_size: int) -> nn.Module:
    """The (unsharded) model: preset ``config.model`` with the task's vocabulary."""
    from shardmuon.harness.models import build_model

    return build_model(
        config.model, num_layers=config.num_layers, vocab_size=vocab_size, seed=config.seed
    )


@dataclass(frozen=True)
class TrainLayout:
    """What :func:`shard_model` built that the loop needs.

    ``data_rank`` / ``data_world``: which slice of the global batch this rank trains on, out
    of how many (the data-parallel ranks; the ranks of a tensor-parallel group share one).
    ``data_group``: the process group the per-slice loss sums are added over (``None``: the
    whole world).
    """

    expert_mesh_name: str | None = None
    data_rank: int = 0
    data_world: int = 1
    data_group: Any = None


def shard_model(model: nn.Module, layout: str, mesh: tuple[int, ...] | None = None) -> TrainLayout:
    """Apply ``layout`` over the default process group; returns what the loop needs.

    ``fsdp``: ``shardmuon.harness.parallel.apply_layout(model, "fsdp")``. ``ep``: each MoE ``experts``
    module is its own FSDP unit on a mesh named ``"ep"`` (expert stacks ``Shard(0)`` over the
    expert dim, so each rank owns whole experts and Muon orthogonalizes them locally); the
    rest as ``fsdp``. The forward all-gathers the experts (no token all-to-all), which trains
    exactly like EP while giving the optimizer EP's placements. ``fsdp-tp``:
    ``apply_layout(model, "fsdp-tp", mesh_shape=mesh)`` (tensor parallel over ``tp``, FSDP2
    over ``dp``); the batch is split over ``dp`` only.
    """
    from shardmuon.harness.parallel import apply_layout, decoder_layers, expert_modules

    rank, world = dist.get_rank(), dist.get_world_size()
    if layout == "fsdp":
        apply_layout(model, "fsdp")
        return TrainLayout(None, rank, world)
    if layout == "fsdp-tp":
        dp = apply_layout(model, "fsdp-tp", mesh_shape=mesh).meshes["dp"]
        return TrainLayout(None, dp.get_local_rank(), dp.size(), dp.get_group())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    expert_mesh = init_device_mesh(device, (world,), mesh_dim_names=(EXPERT_MESH_NAME,))
    dense_mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp_shard",))
    for module in expert_modules(model):
        fully_shard(module, mesh=expert_mesh)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dense_mesh)
    fully_shard(model, mesh=dense_mesh)
    return TrainLayout(EXPERT_MESH_NAME, rank, world)


def build_optimizer(
    config: TrainConfig, model: nn.Module, expert_mesh_name: str | None
) -> torch.optim.Optimizer:
    """Muon through ``shardmuon.config.build_optimizer`` (the routing users get; the
    embedding and the head in a Sinkhorn group under ``embedding_update="sinkhorn"``), or
    torch AdamW."""
    optim = config.optim
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            model.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.epsilon,
            weight_decay=optim.weight_decay,
        )
    from shardmuon.config import build_optimizer as build_muon
    from shardmuon.harness.models import attention_dims

    return build_muon(
        model,
        optim,
        expert_mesh_name=expert_mesh_name,
        embedding_update=config.embedding_update,
        **attention_dims(config.model),
    )


def build_qk_clip(config: TrainConfig, model: nn.Module):
    """A :class:`shardmuon.qk_clip.QKClip` when the run clips (through ``MuonConfig``'s
    fields, as a user's trainer would) or logs max logits (a record-only clip), else None."""
    from shardmuon.config import build_qk_clip as build_from_config

    clip = build_from_config(model, config.optim)
    if clip is None and config.log_max_logit:
        from shardmuon.qk_clip import QKClip

        clip = QKClip(model, threshold=None)
    return clip


def sft_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the supervised tokens of ``batch`` (fp32 scalar)."""
    logits = model(input_ids=batch["input_ids"]).logits
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def ignore_logits_view_warning(model: nn.Module) -> None:
    """Silence FSDP2's "returned a view tensor" warning for ``model``'s root, and only it.

    Under ``fsdp-tp`` the logits are ``lm_head``'s ``ColwiseParallel`` output, which
    ``DTensor.to_local()`` returns as a view of the all-gathered logits; FSDP2 warns, once
    per rank, that an in-place op on a view its root returned would drop its pre-backward
    hook. Harmless here: :func:`sft_loss_sum` reads the logits out of place only (slice,
    float, reshape, cross-entropy), so the hook runs. Copying the logits to avoid the view
    would cost a logits-sized buffer every step. The filter is process-wide: install it in
    a rank process (:func:`train_on_rank` at world > 1), not in a caller's.
    """
    warnings.filterwarnings(
        "ignore",
        message=rf"FSDP2-wrapped module \({re.escape(type(model).__name__)}\) returned a "
        "view tensor",
        category=UserWarning,
    )


# ---------------------------------------------------------------------------- one rank

# A config whose extra holds this key (true) stops at the first sign that it diverged: a
# training or held-out loss that is not finite, or an error raised while this rank's loss
# or weights are no longer finite (QKClip refuses an infinite logit, for one). Its result
# says where and why (TrainResult.diverged), so that a sweep goes on to its next run.
# Without it such a run trains on (non-finite losses) or raises.
STOP_ON_DIVERGENCE = "stop_on_divergence"


def _trainer_state(
    config: TrainConfig, step: int, world: int, losses: dict[int, float], evals: list[dict]
) -> dict:
    return {
        "step": step,
        "data_position": step,  # the next batch is the task's batch(step + 1)
        "seed": config.seed,
        "world_size": world,
        "task": config.task,
        "model": config.model,
        "num_layers": config.num_layers,
        "optimizer": config.optimizer,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "eval": evals,
        "config": config_dict(config),
    }


def _resume(
    config: TrainConfig, model: nn.Module, optimizer, resume_from: str | None
) -> tuple[int, dict[int, float], list[dict]]:
    """Load ``resume_from`` (chosen by :func:`prepare_resume`); returns (steps already taken,
    their losses, their held-out losses)."""
    if resume_from is None:
        return 0, {}, []
    if Path(resume_from).is_file():
        blob = dion_format.read_dion_file(resume_from)
        dion_format.load_dion_checkpoint(blob, model, optimizer)
        return dion_format.dion_step(blob), {}, []
    path = Path(resume_from)
    state = ckpt_io.read_trainer_state(path)
    ckpt_io.check_compatible(
        path, ckpt_io.expected_entries(ckpt_io.training_state_dict(model, optimizer))
    )
    ckpt_io.load_checkpoint(path, model, optimizer)
    losses = {int(k): v for k, v in state.get("losses", {}).items()}
    return int(state["step"]), losses, list(state.get("eval", []))


def held_out_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], layout: TrainLayout, device: torch.device
) -> float:
    """Mean next-token loss over every target of the fixed held-out ``batch`` (each
    data-parallel rank scores its slice; eval mode, so QK-clip records nothing)."""
    tokens = num_target_tokens(batch["labels"][:, 1:])
    part = rank_slice(batch, layout.data_rank, layout.data_world)
    model.eval()
    try:
        with torch.no_grad():
            total = sft_loss_sum(model, {k: v.to(device) for k, v in part.items()})
    finally:
        model.train()
    total = total.to(torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, group=layout.data_group)
    return float(total) / tokens


def _tokens_seen(config: TrainConfig, step: int) -> int:
    return step * config.batch_size * (config.seq_len if config.task == "lm" else 0)


def _blown_up(model: nn.Module, loss_sum: torch.Tensor | None) -> bool:
    """Whether this rank's loss of the step or any of its weights is no longer finite."""
    if loss_sum is not None and not bool(torch.isfinite(loss_sum.detach()).all()):
        return True
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            if not bool(torch.isfinite(local).all()):
                return True
    return False


def _non_finite_loss(step: int, loss: float, evals: list[dict]) -> dict[str, Any] | None:
    """``{"step", "reason"}`` when the training loss of ``step`` or its held-out loss is
    not finite (the same on every rank: both are reduced over the ranks)."""
    if not math.isfinite(loss):
        return {"step": step, "reason": f"training loss {loss} at step {step}"}
    if evals and evals[-1]["step"] == step and not math.isfinite(evals[-1]["loss"]):
        return {"step": step, "reason": f"held-out loss {evals[-1]['loss']} at step {step}"}
    return None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


# Steps timed for the time estimate, after the first (which pays for lazy optimizer state,
# the first collectives and allocations, and so says little about the others).
ESTIMATE_STEPS = 3


@dataclass(frozen=True)
class EstimatePlan:
    """The time estimate rank 0 prints once it has timed :data:`ESTIMATE_STEPS` steps of a
    run (after the first), through :func:`shardmuon.harness.jobs.estimate_line`.

    The estimate: what the run has taken so far, plus its remaining steps and held-out
    evaluations, plus ``later_steps`` steps and ``later_evals`` evaluations of runs after
    it, each at the cost measured here (a step: the median of the timed steps; an
    evaluation: the first one's time). ``label`` starts the line, ``basis`` follows what
    was measured in its parentheses, ``left`` says the time is what remains of a job that
    ran before this run. ``min_seconds``: as :func:`~shardmuon.harness.jobs.estimate_line`'s
    (``None``: its default).
    """

    label: str
    later_steps: int = 0
    later_evals: int = 0
    basis: str = ""
    left: bool = False
    min_seconds: float | None = None


def evaluations(config: TrainConfig, after: int = 0) -> int:
    """Held-out evaluations a run of ``config`` makes after step ``after`` (task ``lm``:
    every ``eval_every`` steps and at the last; the one at step 0 not counted)."""
    if config.task != "lm" or after >= config.steps:
        return 0
    every = config.eval_every
    return config.steps // every - after // every + (1 if config.steps % every else 0)


def _estimate(
    plan: EstimatePlan,
    config: TrainConfig,
    step: int,
    step_times: list[float],
    eval_times: list[float],
    took: float,
) -> str | None:
    from shardmuon.harness.jobs import estimate_line

    # A run of one or two steps has no step after the first that is not also its last.
    timed = step_times[1:] or step_times
    per_step = statistics.median(timed)
    # Not timed (a resumed run skips the evaluation at step 0): counted as one step each,
    # which a forward over the held-out batch costs about.
    per_eval = eval_times[0] if eval_times else per_step
    steps = config.steps - step + plan.later_steps
    evals = evaluations(config, step) + plan.later_evals
    seconds = took + steps * per_step + evals * per_eval
    basis = f"{len(timed)} step{'s' if len(timed) > 1 else ''}"
    basis += (" and a held-out evaluation" if eval_times else "") + " measured"
    return estimate_line(
        plan.label, seconds, basis + plan.basis, left=plan.left, min_seconds=plan.min_seconds
    )


def train_on_rank(
    config: TrainConfig,
    rank: int,
    world: int,
    resume_from: str | None = None,
    *,
    estimate: EstimatePlan | None = None,
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Run the whole training on this rank (process group already initialised if world > 1).

    ``resume_from``: the checkpoint directory or dion-format file to start from, as
    :func:`prepare_resume` chose it (every rank loads the same one). A config with
    :data:`STOP_ON_DIVERGENCE` in its ``extra`` stops where it diverges. ``estimate``:
    rank 0 prints that time estimate once measured (:class:`EstimatePlan`). ``on_step``:
    called with each step's number once the step (and its checkpoint) is done.
    """
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    task = build_task(config)
    model = build_training_model(config, task.vocab_size).to(device)
    layout = shard_model(model, config.layout, config.mesh) if world > 1 else TrainLayout()
    if world > 1 and config.layout == "fsdp-tp":
        ignore_logits_view_warning(model)
    optimizer = build_optimizer(config, model, layout.expert_mesh_name)
    if getattr(optimizer, "overlap", None) is not None:
        optimizer.overlap_with(model)
    start, history, eval_history = _resume(config, model, optimizer, resume_from)
    if start >= config.steps:
        raise ValueError(f"checkpoint is at step {start}, nothing to do for steps={config.steps}")
    if world > 1 and hasattr(optimizer, "warmup"):
        optimizer.warmup()

    held_out = task.held_out_batch()
    evals: list[dict] = []
    eval_times: list[float] = []

    def evaluate(step: int) -> None:
        eval_began = time.perf_counter()
        loss = held_out_loss(model, held_out, layout, device)
        eval_times.append(time.perf_counter() - eval_began)
        evals.append({"step": step, "tokens": _tokens_seen(config, step), "loss": loss})

    if held_out is not None and start == 0:
        evaluate(0)
    clip = build_qk_clip(config, model)
    max_logits: dict[int, float] = {}
    max_logits_after: dict[int, float] = {}
    clipped_heads: dict[int, int] = {}
    losses: dict[int, float] = {}
    step_times: list[float] = []
    # Per step: seconds optimizer.step() held the loop, and (overlap) the step's waits.
    optimizer_times: list[float] = []
    waits: list[object] = []
    saved: list[str] = []
    if rank != 0:
        estimate = None
    estimate_after = min(1 + ESTIMATE_STEPS, config.steps - start)
    stop_on_divergence = bool(config.extra.get(STOP_ON_DIVERGENCE))
    diverged: dict[str, Any] | None = None
    began = time.perf_counter()
    progress = _progress(config, rank, start)
    model.train()
    try:
        for step in range(start + 1, config.steps + 1):
            loss_sum = None
            try:
                step_began = time.perf_counter()
                batch = task.batch(step, config.batch_size)
                global_tokens = num_target_tokens(batch["labels"][:, 1:])
                part = rank_slice(batch, layout.data_rank, layout.data_world)
                local = {k: v.to(device) for k, v in part.items()}
                loss_sum = sft_loss_sum(model, local)
                # FSDP averages gradients over the data-parallel ranks; scaling by
                # data_world/global_tokens turns that average into the gradient of the global
                # per-token mean, whatever the split.
                (loss_sum * (layout.data_world / global_tokens)).backward()
                set_learning_rates(optimizer, config, step)
                if len(waits) < len(optimizer_times):  # the previous step's (an overlapped one:
                    # read once the forward has waited for it; reading waits for the rest)
                    waits.append(getattr(optimizer, "last_step_stats", None))
                optimizer_began = time.perf_counter()
                optimizer.step()
                optimizer_times.append(time.perf_counter() - optimizer_began)
                optimizer.zero_grad(set_to_none=True)
                if clip is not None:
                    stats = clip.apply()
                    max_logits[step] = stats.max_logit
                    max_logits_after[step] = stats.max_logit_after
                    clipped_heads[step] = stats.clipped_heads
                total = loss_sum.detach().to(torch.float64)
                if world > 1:
                    dist.all_reduce(total, group=layout.data_group)
                losses[step] = float(total) / global_tokens
                step_times.append(time.perf_counter() - step_began)
                if held_out is not None and (step % config.eval_every == 0 or step == config.steps):
                    evaluate(step)
            except Exception as err:
                if not (stop_on_divergence and _blown_up(model, loss_sum)):
                    raise
                diverged = {"step": step, "reason": f"{type(err).__name__}: {err}"}
                break
            if stop_on_divergence:
                diverged = _non_finite_loss(step, losses[step], evals)
                if diverged is not None:
                    break
            if progress is not None:
                progress.advance(losses[step], evals[-1]["loss"] if evals else None)
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                trainer = _trainer_state(
                    config, step, world, {**history, **losses}, eval_history + evals
                )
                path = ckpt_io.save_checkpoint(
                    config.checkpoint_dir, step, model, optimizer, trainer
                )
                saved.append(str(path))
            if estimate is not None and len(step_times) == estimate_after:
                took = time.perf_counter() - began
                line = _estimate(estimate, config, step, step_times, eval_times, took)
                if line:
                    print(line, file=sys.stderr, flush=True)
            if on_step is not None:
                on_step(step)
    except BaseException:
        # Ctrl-C or an error: take the bar down first, leaving the terminal as it was.
        if progress is not None:
            progress.close()
        raise
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    if len(waits) < len(optimizer_times):  # the last step's
        waits.append(getattr(optimizer, "last_step_stats", None))
    seconds = time.perf_counter() - began
    if progress is not None:
        progress.close()
    if config.dion_out:
        dion_format.save_dion_checkpoint(config.dion_out, model, optimizer, config.steps)
    if clip is not None:
        clip.remove()
    return TrainResult(
        losses,
        range_means(losses),
        start,
        world,
        seconds,
        saved,
        resume_from,
        max_logits,
        max_logits_after,
        clipped_heads,
        evals,
        _median(step_times),
        _median(optimizer_times),
        _median([getattr(s, "overlap_wait_seconds", 0.0) for s in waits]),
        diverged,
    )


class _Progress:
    def __init__(self, total: int, completed: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._bar = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}{task.fields[held_out]}"),
            console=Console(stderr=True),
        )
        self._task = self._bar.add_task(
            "train", total=total, completed=completed, loss="-", held_out=""
        )
        self._bar.start()

    def advance(self, loss: float, held_out: float | None = None) -> None:
        shown = "" if held_out is None else f"  held-out {held_out:.4f}"
        self._bar.update(self._task, advance=1, loss=f"{loss:.4f}", held_out=shown)

    def close(self) -> None:
        self._bar.stop()


def _progress(config: TrainConfig, rank: int, start: int) -> _Progress | None:
    if config.quiet or rank != 0:
        return None
    return _Progress(config.steps, start)
