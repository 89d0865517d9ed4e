"""SFT loop: a tiny Qwen3 / Qwen3-MoE on the reverse-text task, on 1 process or N processes
with FSDP2 (gloo on CPU, NCCL on GPUs), optionally over tensor parallel (``fsdp-tp``), with
DCP checkpoints and exact resume.

The global batch of step k is the same at every world size (see :mod:`.data`); each
data-parallel rank trains on a contiguous slice of it (the ranks of one tensor-parallel
group share a slice), and the loss is the mean over all supervised tokens of the global
batch, so the loss curve does not depend on the world size or the layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardmuon.harness.cli_support import check_outputs, note
from shardmuon.harness.processes import threads_per_rank
from shardmuon.train import checkpoint as ckpt_io
from shardmuon.train import dion_format, recovery
from shardmuon.train.data import (
    IGNORE_INDEX,
    CharTokenizer,
    ReverseTextTask,
    num_target_tokens,
    rank_slice,
)
from shardmuon.train.resume import recorded_settings, settings_conflicts

OPTIMIZERS = ("muon", "adamw")
TRAIN_LAYOUTS = ("fsdp", "ep", "fsdp-tp")
# The seed PR's step ranges, plus 1-10 (the convergence criterion's baseline).
LOSS_RANGES: tuple[tuple[int, int], ...] = ((1, 10), (11, 31), (32, 62), (51, 100), (101, 150))
EXPERT_MESH_NAME = "ep"


@dataclass
class TrainConfig:
    """Everything a training run depends on (it is also written into checkpoints)."""

    model: str = "tiny-moe"
    num_layers: int | None = 2
    optimizer: str = "muon"
    coefficients: str = "dion"
    update_rms: float = 0.2
    lr: float = 0.01
    weight_decay: float = 0.0
    mu: float = 0.95
    nesterov: bool = False
    offload: str | None = None
    steps: int = 150
    batch_size: int = 128
    seed: int = 0
    min_len: int = 2
    max_len: int = 8
    nproc: int = 2
    layout: str = "fsdp"
    # fsdp-tp only: (dp, tp); None = shardmuon.harness.parallel's default for nproc (4 -> 2x2).
    mesh: tuple[int, ...] | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    resume_dion: str | None = None
    dion_out: str | None = None
    json_out: str | None = None
    csv_out: str | None = None
    plot_out: str | None = None
    quiet: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def _validate_mesh(self) -> None:
        if self.layout != "fsdp-tp":
            if self.mesh is not None:
                raise ValueError(
                    f"mesh {self.mesh!r} given for layout {self.layout!r}; only layout "
                    "'fsdp-tp' takes a mesh (DPxTP)"
                )
            return
        from shardmuon.harness.models import attention_dims
        from shardmuon.harness.parallel import plan_layout

        mesh = None if self.mesh is None else tuple(self.mesh)
        shape = plan_layout(self.layout, self.nproc, mesh).mesh_shape
        tp = shape[1]
        for key, heads in attention_dims(self.model).items():
            if key != "head_dim" and heads % tp:
                raise ValueError(
                    f"layout 'fsdp-tp' on mesh {shape[0]}x{tp}: tp={tp} does not divide "
                    f"{key}={heads} of model {self.model!r} (attention heads are split over "
                    "tp); give a --mesh DPxTP whose TP divides it"
                )

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what is accepted."""
        from shardmuon.harness.models import MODEL_PRESETS

        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model {self.model!r} unknown; accepted: {sorted(MODEL_PRESETS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} unknown; accepted: {OPTIMIZERS}")
        if self.layout not in TRAIN_LAYOUTS:
            raise ValueError(f"layout {self.layout!r} unknown; accepted: {TRAIN_LAYOUTS}")
        self._validate_mesh()
        for name in ("steps", "batch_size", "nproc"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.batch_size < self.nproc:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be >= nproc ({self.nproc}): "
                "every rank needs at least one sample"
            )
        if torch.cuda.is_available() and self.nproc > torch.cuda.device_count():
            raise ValueError(
                f"nproc {self.nproc} needs {self.nproc} GPUs (one per process, NCCL); this "
                f"machine has {torch.cuda.device_count()}"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if not (math.isfinite(self.update_rms) and self.update_rms > 0):
            raise ValueError(f"update_rms must be a finite number > 0, got {self.update_rms!r}")
        if self.resume and self.resume_dion:
            raise ValueError("give either resume or resume_dion, not both")
        if self.optimizer == "muon":
            from shardmuon import resolve_coefficients

            resolve_coefficients(self.coefficients)
        ReverseTextTask(self.min_len, self.max_len, self.seed)
        # Last, as it touches the disk; before any work, so that a path that cannot be
        # written fails now rather than after the training.
        check_outputs(
            {
                "--json": self.json_out,
                "--csv": self.csv_out,
                "--plot": self.plot_out,
                "--dion-out": self.dion_out,
            },
            {"--checkpoint-dir": self.checkpoint_dir},
        )


@dataclass
class TrainResult:
    """What a run produced (rank 0's view; identical on every rank)."""

    losses: dict[int, float]
    range_means: dict[str, float]
    start_step: int
    world_size: int
    seconds: float
    checkpoints: list[str]
    resumed_from: str | None = None

    def to_json(self, config: TrainConfig) -> dict[str, Any]:
        """JSON-ready dict (the ``--json`` format)."""
        return {
            "config": dataclasses.asdict(config),
            "world_size": self.world_size,
            "start_step": self.start_step,
            "resumed_from": self.resumed_from,
            "seconds": self.seconds,
            "losses": [{"step": s, "loss": v} for s, v in sorted(self.losses.items())],
            "range_means": self.range_means,
            "checkpoints": self.checkpoints,
        }


def range_means(losses: dict[int, float]) -> dict[str, float]:
    """Mean loss over each of :data:`LOSS_RANGES` that ``losses`` covers entirely."""
    out = {}
    for lo, hi in LOSS_RANGES:
        steps = range(lo, hi + 1)
        if all(s in losses for s in steps):
            out[f"{lo}-{hi}"] = sum(losses[s] for s in steps) / len(steps)
    return out


# ---------------------------------------------------------------------------- model + optimizer


def build_training_model(config: TrainConfig, tokenizer: CharTokenizer) -> nn.Module:
    """The (unsharded) model: preset ``config.model`` with the tokenizer's vocabulary."""
    from shardmuon.harness.models import build_model

    return build_model(
        config.model,
        num_layers=config.num_layers,
        vocab_size=tokenizer.vocab_size,
        seed=config.seed,
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
    """Muon through the real routing path (``build_param_groups``), or torch AdamW."""
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            model.parameters(),
            lr=config.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=config.weight_decay,
        )
    from shardmuon import Muon
    from shardmuon.harness.models import attention_dims
    from shardmuon.routing import build_param_groups

    routed = build_param_groups(
        model.named_parameters(),
        lr=config.lr,
        weight_decay=config.weight_decay,
        adjust_lr="rms_norm",
        expert_mesh_name=expert_mesh_name,
        **attention_dims(config.model),
    )
    return Muon(
        routed.groups,
        lr=config.lr,
        mu=config.mu,
        betas=(0.9, 0.95),
        weight_decay=config.weight_decay,
        epsilon=1e-8,
        nesterov=config.nesterov,
        adjust_lr="rms_norm",
        update_rms=config.update_rms,
        newton_schulz_coefficients=config.coefficients,
        matrix_partitions=routed.partitions,
        offload=config.offload,
    )


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


def _trainer_state(config: TrainConfig, step: int, world: int, losses: dict[int, float]) -> dict:
    return {
        "step": step,
        "data_position": step,  # the next batch is task.batch(step + 1)
        "seed": config.seed,
        "world_size": world,
        "model": config.model,
        "num_layers": config.num_layers,
        "optimizer": config.optimizer,
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "config": dataclasses.asdict(config),
    }


def _resume(
    config: TrainConfig, model: nn.Module, optimizer, resume_from: str | None
) -> tuple[int, dict[int, float]]:
    """Load ``resume_from`` (chosen by :func:`prepare_resume`); returns (steps already taken,
    their losses)."""
    if resume_from is None:
        return 0, {}
    if Path(resume_from).is_file():
        blob = dion_format.read_dion_file(resume_from)
        dion_format.load_dion_checkpoint(blob, model, optimizer)
        return dion_format.dion_step(blob), {}
    path = Path(resume_from)
    state = ckpt_io.read_trainer_state(path)
    ckpt_io.check_compatible(
        path, ckpt_io.expected_entries(ckpt_io.training_state_dict(model, optimizer))
    )
    ckpt_io.load_checkpoint(path, model, optimizer)
    return int(state["step"]), {int(k): v for k, v in state.get("losses", {}).items()}


def train_on_rank(
    config: TrainConfig, rank: int, world: int, resume_from: str | None = None
) -> TrainResult:
    """Run the whole training on this rank (process group already initialised if world > 1).

    ``resume_from``: the checkpoint directory or dion-format file to start from, as
    :func:`prepare_resume` chose it (every rank loads the same one).
    """
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    tokenizer = CharTokenizer()
    task = ReverseTextTask(config.min_len, config.max_len, config.seed)
    model = build_training_model(config, tokenizer).to(device)
    layout = shard_model(model, config.layout, config.mesh) if world > 1 else TrainLayout()
    if world > 1 and config.layout == "fsdp-tp":
        ignore_logits_view_warning(model)
    optimizer = build_optimizer(config, model, layout.expert_mesh_name)
    start, history = _resume(config, model, optimizer, resume_from)
    if start >= config.steps:
        raise ValueError(f"checkpoint is at step {start}, nothing to do for steps={config.steps}")
    if world > 1 and hasattr(optimizer, "warmup"):
        optimizer.warmup()

    losses: dict[int, float] = {}
    saved: list[str] = []
    progress = _progress(config, rank, start)
    began = time.perf_counter()
    model.train()
    for step in range(start + 1, config.steps + 1):
        batch = task.batch(step, config.batch_size, tokenizer)
        global_tokens = num_target_tokens(batch["labels"][:, 1:])
        part = rank_slice(batch, layout.data_rank, layout.data_world)
        local = {k: v.to(device) for k, v in part.items()}
        loss_sum = sft_loss_sum(model, local)
        # FSDP averages gradients over the data-parallel ranks; scaling by
        # data_world/global_tokens turns that average into the gradient of the global
        # per-token mean, whatever the split.
        (loss_sum * (layout.data_world / global_tokens)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss_sum.detach().to(torch.float64)
        if world > 1:
            dist.all_reduce(total, group=layout.data_group)
        losses[step] = float(total) / global_tokens
        if progress is not None:
            progress.advance(losses[step])
        if config.checkpoint_every and step % config.checkpoint_every == 0:
            trainer = _trainer_state(config, step, world, {**history, **losses})
            path = ckpt_io.save_checkpoint(config.checkpoint_dir, step, model, optimizer, trainer)
            saved.append(str(path))
    seconds = time.perf_counter() - began
    if progress is not None:
        progress.close()
    if config.dion_out:
        dion_format.save_dion_checkpoint(config.dion_out, model, optimizer, config.steps)
    return TrainResult(losses, range_means(losses), start, world, seconds, saved, resume_from)


class _Progress:
    def __init__(self, total: int, completed: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._bar = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            console=Console(stderr=True),
        )
        self._task = self._bar.add_task("train", total=total, completed=completed, loss="-")
        self._bar.start()

    def advance(self, loss: float) -> None:
        self._bar.update(self._task, advance=1, loss=f"{loss:.4f}")

    def close(self) -> None:
        self._bar.stop()


def _progress(config: TrainConfig, rank: int, start: int) -> _Progress | None:
    if config.quiet or rank != 0:
        return None
    return _Progress(config.steps, start)


# ---------------------------------------------------------------------------- a run


def prepare_resume(config: TrainConfig) -> str | None:
    """Choose and check what ``config`` resumes from, before any process starts.

    Repairs the leftovers of killed saves, picks the checkpoint (a damaged newest one is
    skipped with a warning), refuses optimizer settings that differ from the checkpoint's
    (:mod:`.resume`), and checks its tensors against an unsharded copy of this run's model
    and optimizer. Returns the checkpoint directory or dion-format file, or ``None``.
    """
    dion_path = config.resume_dion or (
        config.resume if config.resume and Path(config.resume).is_file() else None
    )
    if dion_path:
        dion_format.read_dion_file(dion_path)
        _refuse_changed_settings(config, recorded_settings(config))
        return dion_path
    if not config.resume:
        return None
    selection = recovery.find_checkpoint(config.resume, repair=True)
    for line in selection.notes:
        note(f"shardmuon train: {line}")
    path = selection.path
    _refuse_changed_settings(config, recorded_settings(config, path))
    model = build_training_model(config, CharTokenizer())
    optimizer = build_optimizer(config, model, EXPERT_MESH_NAME if config.layout == "ep" else None)
    expected = ckpt_io.expected_entries(ckpt_io.training_state_dict(model, optimizer))
    ckpt_io.check_compatible(path, expected)
    return str(path)


def _refuse_changed_settings(config: TrainConfig, recorded: dict[str, Any]) -> None:
    conflicts = settings_conflicts(config, recorded)
    if conflicts:
        raise ValueError(
            "a resume continues with the checkpoint's optimizer settings; these differ: "
            + ", ".join(conflicts)
            + ". Leave them out (they are taken from the checkpoint) or give its values"
        )


def run_training(config: TrainConfig) -> TrainResult:
    """Validate ``config``, train on ``config.nproc`` processes, write the requested outputs.

    Raises ValueError (a :class:`~.checkpoint.CheckpointError` for checkpoints) for bad input,
    before any training.
    """
    config.validate()
    if config.checkpoint_dir:
        for line in recovery.repair_checkpoints(config.checkpoint_dir):
            note(f"shardmuon train: {line}")
    resume_from = prepare_resume(config)
    if config.nproc == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(1))
        try:
            result = train_on_rank(config, 0, 1, resume_from)
        finally:
            torch.set_num_threads(threads)
    else:
        from shardmuon.train.launch import spawn_training

        result = spawn_training(config, resume_from)
    if config.json_out:
        write_losses(config.json_out, result, config)
    if config.csv_out:
        write_losses(config.csv_out, result, config, csv=True)
    if config.plot_out:
        from shardmuon.train.plot import plot_curves

        steps = sorted(result.losses)
        label = Path(config.json_out).stem if config.json_out else "this run"
        plot_curves([(steps, [result.losses[s] for s in steps], label)], config.plot_out)
    return result


def write_losses(
    path: str | os.PathLike, result: TrainResult, config: TrainConfig, *, csv: bool = False
) -> None:
    """Per-step losses as JSON (with config and range means) or, with ``csv``, ``step,loss``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if csv:
        lines = ["step,loss"] + [f"{s},{v!r}" for s, v in sorted(result.losses.items())]
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text(json.dumps(result.to_json(config), indent=2))
