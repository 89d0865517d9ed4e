"""``shardmuon train``'s configuration and result: :class:`TrainConfig` (validated, every
option of the command line) and :class:`TrainResult` (per-step losses, held-out losses,
range means).

As torchtitan nests its ``[optimizer]`` section, the optimizer's settings are one
:class:`shardmuon.config.MuonConfig` (``TrainConfig.optim``), validated by pydantic when it
is built: the command line, the library call and a checkpoint's recorded settings all go
through it. ``torch.optim.AdamW`` (``optimizer="adamw"``) reads its ``lr``, ``betas``,
``epsilon`` and ``weight_decay``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic
import torch

from shardmuon.config import MuonConfig, NumberRange, config_error
from shardmuon.harness.cli_support import check_outputs
from shardmuon.harness.processes import check_process_count
from shardmuon.routing import EMBEDDING_UPDATES as ROUTING_EMBEDDING_UPDATES
from shardmuon.train.schedule import SCHEDULES
from shardmuon.train.tasks import TASKS

__all__ = [
    "EMBEDDING_UPDATES",
    "EXPERT_MESH_NAME",
    "OPTIMIZERS",
    "TRAIN_LAYOUTS",
    "TRAIN_LR_RANGE",
    "TrainConfig",
    "TrainResult",
    "check_train_lr",
    "config_dict",
    "optim_settings",
    "range_means",
    "task_config",
]


OPTIMIZERS = ("muon", "adamw")


# How Muon updates the embedding table and the output head (``embed_tokens``, ``lm_head``):
# "adamw" (its AdamW group, prime-rl's routing) or "sinkhorn" (a Sinkhorn group); see
# shardmuon.routing.build_param_groups(embedding_update=...).
EMBEDDING_UPDATES: tuple[str, ...] = ROUTING_EMBEDDING_UPDATES


TRAIN_LAYOUTS = ("fsdp", "ep", "fsdp-tp")


# Contiguous step windows, none overlapping: prime-rl's first three (1-10 is the convergence
# criterion's baseline), then on to the longest runs.
LOSS_RANGES: tuple[tuple[int, int], ...] = (
    (1, 10), (11, 31), (32, 62), (63, 100), (101, 150), (151, 300), (301, 600), (601, 1000),
)  # fmt: skip


EXPERT_MESH_NAME = "ep"


# Training needs a positive lr (MuonConfig takes 0: a frozen optimizer): the range of
# optim.lr and adamw_lr, checked by TrainConfig.validate() and by --lr / --adamw-lr.
TRAIN_LR_RANGE = NumberRange(0.0, low_open=True)


def check_train_lr(name: str, value: Any) -> None:
    """``ValueError`` in one line unless ``value`` is a learning rate training takes."""
    if value not in TRAIN_LR_RANGE:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def optim_settings(base: MuonConfig | None = None, **changes: Any) -> MuonConfig:
    """A :class:`MuonConfig`: ``base``'s explicitly set fields with ``changes`` on top.

    Raises ``ValueError`` in one line (:func:`shardmuon.config.config_error`: the field,
    what was given and what is accepted) instead of pydantic's multi-line report.
    """
    given = {} if base is None else base.model_dump(exclude_unset=True)
    try:
        return MuonConfig(**{**given, **changes})
    except pydantic.ValidationError as err:
        raise ValueError(config_error(err)) from None


def _train_optim() -> MuonConfig:
    # shardmuon train's defaults: no weight decay, the dion coefficients named (what old
    # checkpoints recorded).
    return optim_settings(weight_decay=0.0, newton_schulz_coefficients="dion")


# What --task lm changes of TrainConfig's defaults (the reverse-text task's). The learning
# rates are the best of the sweep in docs/benchmarks.md ("shardmuon bench lm").
LM_DEFAULTS: dict[str, Any] = {
    "model": "lm-llama",
    "num_layers": None,
    "steps": 300,
    "batch_size": 16,
    "warmup_steps": 20,
    "schedule": "cosine",
}
LM_LEARNING_RATES: dict[str, dict[str, float]] = {
    "muon": {"lr": 0.01, "adamw_lr": 0.008},
    "adamw": {"lr": 0.002},
}


def task_config(task: str = "reverse", optimizer: str = "muon", **changes: Any) -> TrainConfig:
    """A :class:`TrainConfig` with ``task``'s defaults for ``optimizer``, ``changes`` on top
    (``optim``: a mapping of ``MuonConfig`` fields, applied over the defaults)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} unknown; accepted: {TASKS}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} unknown; accepted: {OPTIMIZERS}")
    fields: dict[str, Any] = {"task": task, "optimizer": optimizer}
    optim: dict[str, Any] = {}
    if task == "lm":
        fields.update(LM_DEFAULTS)
        rates = dict(LM_LEARNING_RATES[optimizer])
        optim["lr"] = rates.pop("lr")
        fields.update(rates)
    given = changes.pop("optim", None) or {}
    if isinstance(given, MuonConfig):
        given = given.model_dump(exclude_unset=True)
    fields["optim"] = optim_settings(_train_optim(), **{**optim, **given})
    return TrainConfig(**{**fields, **changes})


@dataclass
class TrainConfig:
    """Everything a training run depends on (it is also written into checkpoints)."""

    task: str = "reverse"
    model: str = "tiny-moe"
    num_layers: int | None = 2
    optimizer: str = "muon"
    # The optimizer's settings; a mapping of MuonConfig fields is taken too (over these
    # defaults: no weight decay, the dion coefficients).
    optim: MuonConfig = field(default_factory=_train_optim)
    # The peak lr of Muon's AdamW group (embeddings, norms, head); None: optim.lr.
    adamw_lr: float | None = None
    # Muon's update of the embedding table and the output head: "adamw" (its AdamW group,
    # at adamw_lr) or "sinkhorn" (a Sinkhorn group at optim.lr, Muon's own lr, no weight
    # decay; the norms stay in the AdamW group). optimizer "adamw" takes "adamw" only.
    embedding_update: Literal["adamw", "sinkhorn"] = "adamw"
    warmup_steps: int = 0
    schedule: str = "constant"
    steps: int = 150
    batch_size: int = 128
    seed: int = 0
    # task "reverse": string lengths.
    min_len: int = 2
    max_len: int = 8
    # task "lm": the corpus (None: the standard library's source), its byte cap, the
    # sequence length, and the held-out evaluation.
    data: str | None = None
    data_bytes: int | None = None
    seq_len: int = 256
    eval_every: int = 25
    eval_sequences: int = 32
    nproc: int = 2
    layout: str = "fsdp"
    # fsdp-tp only: (dp, tp); None = shardmuon.harness.parallel's default for nproc (4 -> 2x2).
    mesh: tuple[int, ...] | None = None
    # Record every head's max logit per step without clipping (always on when
    # optim.qk_clip_threshold clips).
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

    def __post_init__(self) -> None:
        if isinstance(self.optim, Mapping):  # fields over shardmuon train's defaults
            self.optim = optim_settings(_train_optim(), **self.optim)

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

    def _validate_schedule(self) -> None:
        check_train_lr("lr", self.optim.lr)
        if self.adamw_lr is not None:
            check_train_lr("adamw_lr", self.adamw_lr)
        if self.adamw_lr is not None and self.optimizer == "adamw":
            raise ValueError(
                f"adamw_lr {self.adamw_lr!r} is the lr of Muon's AdamW group; optimizer "
                "'adamw' has one lr: give lr"
            )
        if self.embedding_update not in EMBEDDING_UPDATES:
            raise ValueError(
                f"embedding_update {self.embedding_update!r} unknown; accepted: {EMBEDDING_UPDATES}"
            )
        if self.embedding_update != "adamw" and self.optimizer == "adamw":
            raise ValueError(
                f"embedding_update {self.embedding_update!r} is how Muon updates the "
                "embedding and the head; optimizer 'adamw' updates every parameter with "
                "AdamW: give optimizer 'muon' or leave embedding_update 'adamw'"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} unknown; accepted: {SCHEDULES}")

    def _validate_counts(self) -> None:
        minimums = {"steps": 1, "batch_size": 1, "nproc": 1, "seq_len": 2, "eval_every": 1,
                    "eval_sequences": 1, "warmup_steps": 0, "checkpoint_every": 0}  # fmt: skip
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if self.data_bytes is not None and (
            not isinstance(self.data_bytes, int) or self.data_bytes < 1
        ):
            raise ValueError(f"data_bytes must be an int >= 1 or None, got {self.data_bytes!r}")

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what is accepted."""
        from shardmuon.harness.models import MODEL_PRESETS, model_config

        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} unknown; accepted: {TASKS}")
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model {self.model!r} unknown; accepted: {sorted(MODEL_PRESETS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} unknown; accepted: {OPTIMIZERS}")
        if not isinstance(self.optim, MuonConfig):
            raise ValueError(f"optim must be a shardmuon.MuonConfig, got {self.optim!r}")
        if self.layout not in TRAIN_LAYOUTS:
            raise ValueError(f"layout {self.layout!r} unknown; accepted: {TRAIN_LAYOUTS}")
        self._validate_mesh()
        self._validate_counts()
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
        if self.task == "lm" and self.eval_sequences < self.nproc:
            raise ValueError(
                f"eval_sequences ({self.eval_sequences}) must be >= nproc ({self.nproc}): "
                "every rank scores at least one held-out sequence"
            )
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        self._validate_schedule()
        if self.resume and self.resume_dion:
            raise ValueError("give either resume or resume_dion, not both")
        if self.task == "reverse":
            from shardmuon.train.data import ReverseTextTask

            ReverseTextTask(self.min_len, self.max_len, self.seed)
        else:
            positions = model_config(self.model).max_position_embeddings
            if self.seq_len > positions:
                raise ValueError(
                    f"seq_len {self.seq_len} is longer than model {self.model!r} takes "
                    f"({positions} positions)"
                )
        # Last, as they touch the disk; before any work, so that a path that cannot be
        # read or written fails now rather than after the training.
        if self.task == "lm":
            from shardmuon.train.lm_data import plan_corpus
            from shardmuon.train.tasks import check_corpus

            check_corpus(plan_corpus(self.data, self.data_bytes), self.batch_size, self.seq_len)
        check_outputs(
            {
                "--json": self.json_out,
                "--csv": self.csv_out,
                "--plot": self.plot_out,
                "--dion-out": self.dion_out,
            },
            {"--checkpoint-dir": self.checkpoint_dir},
        )


def config_dict(config: TrainConfig) -> dict[str, Any]:
    """``config`` as JSON-ready values (``optim``: the MuonConfig's fields)."""
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out["optim"] = config.optim.model_dump(mode="json")
    out["extra"] = dict(config.extra)
    return out


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
    # Held-out losses (task "lm"): {"step", "tokens", "loss"} rows, nats per byte.
    eval: list[dict[str, Any]] = field(default_factory=list)
    # Median wall-clock seconds of one training step (held-out losses and saves left out).
    step_seconds: float = math.nan
    # Medians per step: seconds optimizer.step() held the loop; with overlap="forward", the
    # seconds the loop then waited for that step (the next forward's hooks, synchronize).
    optimizer_seconds: float = math.nan
    overlap_wait_seconds: float = math.nan
    # A run told to stop when it diverges (see shardmuon.train.loop.STOP_ON_DIVERGENCE) and
    # that did: {"step", "reason"}; None otherwise.
    diverged: dict[str, Any] | None = None

    def to_json(self, config: TrainConfig) -> dict[str, Any]:
        """JSON-ready dict (the ``--json`` format)."""
        return {
            "config": config_dict(config),
            "world_size": self.world_size,
            "start_step": self.start_step,
            "resumed_from": self.resumed_from,
            "seconds": self.seconds,
            "step_seconds": self.step_seconds,
            "optimizer_seconds": self.optimizer_seconds,
            "overlap_wait_seconds": self.overlap_wait_seconds,
            "losses": [{"step": s, "loss": v} for s, v in sorted(self.losses.items())],
            "eval": self.eval,
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
