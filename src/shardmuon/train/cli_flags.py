"""The flags of ``shardmuon train`` (registered by :mod:`shardmuon.train.cli`), grouped, with
the tables that say where each one goes: a ``MuonConfig`` field (``TrainConfig.optim``), a
setting a resume fixes, a default that depends on ``--task``, a flag of one task only."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from shardmuon.config import FIELD_RANGES, NumberRange, check_setting
from shardmuon.harness.cli_support import (
    LAYERS_HELP,
    Number,
    add_hidden_alias,
    int_at_least,
    nonnegative_int,
    positive_int,
    seed_int,
)
from shardmuon.harness.machine import DTYPE_NAMES, DTYPES
from shardmuon.harness.models import MODEL_PRESETS
from shardmuon.harness.processes import NPROC_RULE
from shardmuon.ops.engines import NS_CHOICES
from shardmuon.ops.newton_schulz import NS_PRESETS
from shardmuon.settings import setting_summary
from shardmuon.train.config import (
    EMBEDDING_UPDATES,
    LM_DEFAULTS,
    LM_LEARNING_RATES,
    OPTIMIZERS,
    TRAIN_LAYOUTS,
    TRAIN_LR_RANGE,
    TrainConfig,
    check_train_lr,
)
from shardmuon.train.lm_data import DATA_SUFFIXES
from shardmuon.train.schedule import MIN_LR_FRACTION, SCHEDULES
from shardmuon.train.tasks import TASKS

__all__ = [
    "FIXED_FIELDS",
    "OPTIM_FLAGS",
    "TASK_ONLY",
    "SettingNumber",
    "add_data_flags",
    "add_model_flags",
    "add_optimizer_flags",
    "add_run_flags",
    "setting_type",
]

# Flags whose default depends on --task: dest -> (reverse's default, lm's default).
TASK_DEFAULTS = {
    "model": (TrainConfig.model, LM_DEFAULTS["model"]),
    "num_layers": (TrainConfig.num_layers, "the preset's"),
    "steps": (TrainConfig.steps, LM_DEFAULTS["steps"]),
    "batch_size": (TrainConfig.batch_size, LM_DEFAULTS["batch_size"]),
    "warmup": (TrainConfig.warmup_steps, LM_DEFAULTS["warmup_steps"]),
    "schedule": (TrainConfig.schedule, LM_DEFAULTS["schedule"]),
}
# Flags that set a MuonConfig field (TrainConfig.optim): dest -> field.
OPTIM_FLAGS = {
    "coefficients": "newton_schulz_coefficients",
    "ns_impl": "newton_schulz_impl",
    "ns_dtype": "newton_schulz_dtype",
    "ns_preconditioner": "newton_schulz_preconditioner",
    "update_rms": "update_rms",
    "lr": "lr",
    "weight_decay": "weight_decay",
    "mu": "mu",
    "nesterov": "nesterov",
    "qk_clip_threshold": "qk_clip_threshold",
    "qk_clip_alpha": "qk_clip_alpha",
}
# Flags that set a TrainConfig field a resume fixes: dest -> field.
FIXED_FIELDS = {
    "optimizer": "optimizer",
    "adamw_lr": "adamw_lr",
    "embedding_update": "embedding_update",
    "warmup": "warmup_steps",
    "schedule": "schedule",
}
# Flags of one task only: dest -> (flag, task).
TASK_ONLY = {
    "min_len": ("--min-len", "reverse"),
    "max_len": ("--max-len", "reverse"),
    "data": ("--data", "lm"),
    "data_bytes": ("--data-bytes", "lm"),
    "seq_len": ("--seq-len", "lm"),
    "eval_every": ("--eval-every", "lm"),
    "eval_sequences": ("--eval-sequences", "lm"),
}


class SettingNumber(Number):
    """The ``type=`` of a float flag whose range is owned by the config it sets: described
    by ``limits`` (a :class:`~shardmuon.config.NumberRange`) and decided by ``checks``
    (callables of the value that raise ``ValueError``: ``MuonConfig``'s own validation,
    training's lr rule), so that the flag takes what the config takes and nothing else. A
    refusal is :class:`Number`'s one line: ``--mu must be in [0, 1), got 2.0``."""

    def __init__(self, limits: NumberRange, *checks: Callable[[Any], object]) -> None:
        super().__init__(
            float, limits.low, limits.high, low_open=limits.low_open, high_open=limits.high_open
        )
        self.checks = checks

    def accepts(self, value) -> bool:
        try:
            for check in self.checks:
                check(value)
        except ValueError:
            return False
        return True


def setting_type(field: str, *checks: Callable[[Any], object]) -> SettingNumber:
    """The ``type=`` of the flag that sets ``MuonConfig``'s numeric setting ``field``: its
    range (``FIELD_RANGES``), checked by ``MuonConfig``'s validators, then ``checks``."""
    return SettingNumber(FIELD_RANGES[field], functools.partial(check_setting, field), *checks)


def _fixed_help(text: str, default: object) -> str:
    return f"{text} (default: {default}; on --resume: the checkpoint's)"


def _task_help(text: str, dest: str) -> str:
    reverse, lm = TASK_DEFAULTS[dest]
    fixed = "; on --resume: the checkpoint's" if dest in FIXED_FIELDS else ""
    return f"{text} (default: {reverse}; --task lm: {lm}{fixed})"


def _lm_rates() -> str:
    muon, adamw = LM_LEARNING_RATES["muon"], LM_LEARNING_RATES["adamw"]
    return f"--task lm: {muon['lr']} (muon), {adamw['lr']} (adamw)"


def add_model_flags(train) -> None:
    train.add_argument(
        "--task", choices=TASKS, default="reverse", help="what to train on (see above)"
    )
    train.add_argument(
        "--model", choices=sorted(MODEL_PRESETS), default=None,
        help=_task_help("model preset", "model"),
    )  # fmt: skip
    train.add_argument(
        "--layers", dest="num_layers", metavar="N", type=positive_int, default=None,
        help=_task_help(LAYERS_HELP, "num_layers"),
    )  # fmt: skip
    add_hidden_alias(train, "--num-layers", "num_layers", type=positive_int)


# --lr sets MuonConfig's lr and --adamw-lr TrainConfig's adamw_lr: training's range, > 0.
_TRAIN_LR = SettingNumber(
    TRAIN_LR_RANGE,
    functools.partial(check_setting, "lr"),
    functools.partial(check_train_lr, "lr"),
)
_TRAIN_ADAMW_LR = SettingNumber(TRAIN_LR_RANGE, functools.partial(check_train_lr, "adamw_lr"))


def add_optimizer_flags(train) -> None:
    optim = TrainConfig().optim
    train.add_argument(
        "--optimizer", choices=OPTIMIZERS, default=None,
        help=_fixed_help("optimizer", TrainConfig.optimizer),
    )  # fmt: skip
    train.add_argument(
        "--coefficients", choices=sorted(NS_PRESETS), default=None,
        help=_fixed_help(
            setting_summary("newton_schulz_coefficients"), optim.newton_schulz_coefficients),
    )  # fmt: skip
    train.add_argument(
        "--ns-impl", choices=NS_CHOICES, default=None,
        help=_fixed_help(setting_summary("newton_schulz_impl"), optim.newton_schulz_impl),
    )  # fmt: skip
    train.add_argument(
        "--ns-dtype", choices=tuple(DTYPES), default=None,
        help=_fixed_help(setting_summary("newton_schulz_dtype"), DTYPE_NAMES[DTYPES["bf16"]]),
    )  # fmt: skip
    train.add_argument(
        "--ns-preconditioner", choices=("aol",), default=None,
        help=_fixed_help(setting_summary("newton_schulz_preconditioner"), "none"),
    )  # fmt: skip
    train.add_argument(
        "--update-rms", type=setting_type("update_rms"), default=None,
        help=_fixed_help(setting_summary("update_rms"), optim.update_rms),
    )  # fmt: skip
    train.add_argument(
        "--lr", type=_TRAIN_LR, default=None,
        help=_fixed_help("peak learning rate", f"{optim.lr}; {_lm_rates()}"),
    )  # fmt: skip
    lm_adamw_lr = LM_LEARNING_RATES["muon"]["adamw_lr"]
    train.add_argument(
        "--adamw-lr", type=_TRAIN_ADAMW_LR, default=None,
        help=_fixed_help(
            "peak lr of Muon's AdamW group (embeddings, norms, head)",
            f"--lr; --task lm: {lm_adamw_lr}"),
    )  # fmt: skip
    train.add_argument(
        "--embedding-update", choices=EMBEDDING_UPDATES, default=None,
        help=_fixed_help(
            "Muon's update of the embedding table and the output head: 'adamw' (its AdamW "
            "group, at --adamw-lr) or 'sinkhorn' (a Sinkhorn group at --lr, no weight decay; "
            "the norms stay AdamW); --optimizer muon only", TrainConfig.embedding_update),
    )  # fmt: skip
    train.add_argument(
        "--warmup", metavar="N", type=nonnegative_int, default=None,
        help=_task_help("linear lr warmup over the first N steps", "warmup"),
    )  # fmt: skip
    train.add_argument(
        "--schedule", choices=SCHEDULES, default=None,
        help=_task_help(
            f"lr after the warmup: constant, or a cosine down to {MIN_LR_FRACTION:g} of the "
            "peak at the last step", "schedule"),
    )  # fmt: skip
    train.add_argument(
        "--weight-decay", type=setting_type("weight_decay"), default=None,
        help=_fixed_help("decoupled weight decay", optim.weight_decay),
    )  # fmt: skip
    train.add_argument(
        "--mu", type=setting_type("mu"), default=None,
        help=_fixed_help("Muon momentum, in [0, 1)", optim.mu),
    )  # fmt: skip
    train.add_argument(
        "--nesterov", action=argparse.BooleanOptionalAction, default=None,
        help=_fixed_help("Nesterov momentum", "off"),
    )  # fmt: skip
    train.add_argument(
        "--offload",
        choices=("none", "state"),
        default="none",
        help="Muon's optimizer-state offload: 'state' keeps momentum/variance in host memory, "
        "streamed chunk by chunk (the same update, bit for bit; may differ from the checkpoint's)",
    )
    train.add_argument(
        "--overlap",
        choices=("none", "forward"),
        default="none",
        help="Muon's step behind the next forward: step() returns at once and each layer waits "
        "for its own update (the same update, bit for bit); the summary shows the time step() "
        "held the loop and the forward waited",
    )
    train.add_argument(
        "--qk-clip-threshold", type=setting_type("qk_clip_threshold"), default=None, metavar="TAU",
        help="QK-clip: after each step, scale the query/key rows of every attention head whose "
        "max logit exceeded TAU (shardmuon.qk_clip.QKClip; Kimi K2 uses 100); off by default",
    )  # fmt: skip
    train.add_argument(
        "--qk-clip-alpha", type=setting_type("qk_clip_alpha"), default=None, metavar="A",
        help="QK-clip: the query's share of the scale, in [0, 1] "
        f"(default {optim.qk_clip_alpha})",
    )  # fmt: skip
    train.add_argument(
        "--log-max-logit", action="store_true",
        help="record every head's max attention logit per step (in --json and --plot) "
        "without clipping; always on with --qk-clip-threshold",
    )  # fmt: skip


def add_data_flags(train) -> None:
    defaults = TrainConfig()
    train.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=_task_help("train up to this step", "steps"),
    )
    train.add_argument(
        "--batch-size", type=positive_int, default=None,
        help=_task_help("global batch size (sequences)", "batch_size"),
    )  # fmt: skip
    train.add_argument("--seed", type=seed_int, default=defaults.seed, help="model init and data")
    train.add_argument(
        "--min-len", type=positive_int, default=None,
        help=f"--task reverse: shortest string (default: {defaults.min_len})",
    )  # fmt: skip
    train.add_argument(
        "--max-len", type=positive_int, default=None,
        help=f"--task reverse: longest string (default: {defaults.max_len})",
    )  # fmt: skip
    train.add_argument(
        "--data", metavar="PATH", default=None,
        help="--task lm: a text file, or a directory read recursively for "
        f"{' '.join(DATA_SUFFIXES)} files (default: this Python's standard library)",
    )  # fmt: skip
    train.add_argument(
        "--data-bytes", metavar="N", type=positive_int, default=None,
        help="--task lm: read at most N bytes of --data (default: all)",
    )  # fmt: skip
    train.add_argument(
        "--seq-len", metavar="N", type=int_at_least(2), default=None,
        help=f"--task lm: bytes per sequence (default: {defaults.seq_len})",
    )  # fmt: skip
    train.add_argument(
        "--eval-every", metavar="N", type=positive_int, default=None,
        help=f"--task lm: held-out loss every N steps (default: {defaults.eval_every})",
    )  # fmt: skip
    train.add_argument(
        "--eval-sequences", metavar="N", type=positive_int, default=None,
        help="--task lm: held-out sequences scored each time, the same every time "
        f"(default: {defaults.eval_sequences})",
    )  # fmt: skip


def add_run_flags(train) -> None:
    defaults = TrainConfig()
    train.add_argument(
        "--nproc", type=positive_int, default=defaults.nproc,
        help=f"processes (ranks); {NPROC_RULE}",
    )  # fmt: skip
    train.add_argument(
        "--layout", choices=TRAIN_LAYOUTS, default=defaults.layout,
        help="how params are sharded (fsdp-tp: tensor parallel over TP ranks, FSDP2 over DP)",
    )  # fmt: skip
    train.add_argument(
        "--mesh", metavar="DPxTP", default=None,
        help="fsdp-tp's mesh shape, e.g. 2x2 (default: TP 2 when --nproc is even)",
    )  # fmt: skip
    train.add_argument("--checkpoint-dir", metavar="PATH", default=None, help="DCP checkpoints")
    train.add_argument(
        "--checkpoint-every", metavar="N", type=nonnegative_int,
        default=defaults.checkpoint_every, help="save every N steps (0: never)",
    )  # fmt: skip
    train.add_argument(
        "--resume", metavar="PATH", default=None,
        help="DCP checkpoint dir, or a root of step-* dirs (the newest undamaged one); "
        "a file = dion format",
    )  # fmt: skip
    train.add_argument(
        "--resume-dion", metavar="PATH", default=None,
        help="torch.save file {'model', 'optimizer', 'step'}",
    )  # fmt: skip
    train.add_argument(
        "--dion-out", metavar="PATH", default=None,
        help="also write a dion-format file at the end of the run",
    )  # fmt: skip
    train.add_argument(
        "--json", metavar="PATH", default=None,
        help="write per-step losses, held-out losses and the config here",
    )  # fmt: skip
    train.add_argument("--csv", metavar="PATH", default=None, help="write step,loss rows here")
    train.add_argument("--plot", metavar="PATH", default=None, help="write the loss curve (PNG)")
    train.add_argument("--no-progress", dest="quiet", action="store_true", help="no progress bar")
    add_hidden_alias(train, "--quiet", "quiet", action="store_true")
    # Deprecated spelling of --json / --csv (by the file's suffix).
    add_hidden_alias(train, "--out", "deprecated_out")
