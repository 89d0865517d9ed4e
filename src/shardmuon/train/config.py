"""``shardmuon train``'s configuration and result: :class:`TrainConfig` (validated, every
option of the command line) and :class:`TrainResult` (per-step losses, range means)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shardmuon.harness.cli_support import check_outputs
from shardmuon.harness.processes import check_process_count
from shardmuon.train.data import (
    ReverseTextTask,
)

__all__ = [
    "EXPERT_MESH_NAME",
    "OPTIMIZERS",
    "TRAIN_LAYOUTS",
    "TrainConfig",
    "TrainResult",
    "range_means",
]


OPTIMIZERS = ("muon", "adamw")


TRAIN_LAYOUTS = ("fsdp", "ep", "fsdp-tp")


# The step ranges prime-rl's Muon runs are reported over, plus 1-10 (the convergence
# criterion's baseline).
LOSS_RANGES: tuple[tuple[int, int], ...] = ((1, 10), (11, 31), (32, 62), (51, 100), (101, 150))


EXPERT_MESH_NAME = "ep"


@dataclass
class TrainConfig:
    """Everything a training run depends on (it is also written into checkpoints)."""

    model: str = "tiny-moe"
    num_layers: int | None = 2
    optimizer: str = "muon"
    coefficients: str = "dion"
    # The Newton-Schulz engine (shardmuon.ops.engines), its dtype and preconditioner.
    ns_impl: str = "folded"
    ns_dtype: str = "bf16"
    ns_preconditioner: str | None = None
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
    # QK-clip: None = off; log_max_logit records every head's max logit per step without
    # clipping (on whenever the clip is).
    qk_clip_threshold: float | None = None
    qk_clip_alpha: float = 0.5
    log_max_logit: bool = False
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
        if torch.cuda.is_available() and self.nproc > torch.cuda.device_count():
            raise ValueError(
                f"nproc {self.nproc} needs {self.nproc} GPUs (one per process, NCCL); this "
                f"machine has {torch.cuda.device_count()}"
            )
        # Before anything that depends on nproc is reported: what the machine holds first.
        check_process_count(self.nproc)
        if self.batch_size < self.nproc:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be >= nproc ({self.nproc}): "
                "every rank needs at least one sample"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if not (math.isfinite(self.update_rms) and self.update_rms > 0):
            raise ValueError(f"update_rms must be a finite number > 0, got {self.update_rms!r}")
        if self.qk_clip_threshold is not None or self.log_max_logit:
            from shardmuon.qk_clip import check_qk_clip_settings

            threshold = 100.0 if self.qk_clip_threshold is None else self.qk_clip_threshold
            try:
                check_qk_clip_settings(threshold, self.qk_clip_alpha)
            except (TypeError, ValueError) as err:
                raise ValueError(f"qk_clip_{err}") from None
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
    # Per step, what QKClip.apply saw before clipping (empty without QK-clip / logging).
    max_logits: dict[int, float] = field(default_factory=dict)
    max_logits_after: dict[int, float] = field(default_factory=dict)
    clipped_heads: dict[int, int] = field(default_factory=dict)

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
            "max_logits": [
                {
                    "step": s,
                    "max_logit": v,
                    "max_logit_after": self.max_logits_after.get(s, v),
                    "clipped_heads": self.clipped_heads.get(s, 0),
                }
                for s, v in sorted(self.max_logits.items())
            ],
        }


def range_means(losses: dict[int, float]) -> dict[str, float]:
    """Mean loss over each of :data:`LOSS_RANGES` that ``losses`` covers entirely."""
    out = {}
    for lo, hi in LOSS_RANGES:
        steps = range(lo, hi + 1)
        if all(s in losses for s in steps):
            out[f"{lo}-{hi}"] = sum(losses[s] for s in steps) / len(steps)
    return out
