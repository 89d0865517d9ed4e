"""``shardmuon train`` (and ``shardmuon train plot``): argument parsing only; the work is in
:mod:`shardmuon.train.loop` and :mod:`shardmuon.train.plot`.

Usable on its own as ``python -m shardmuon.train ...`` as well as through the project CLI,
which calls :func:`add_parser`. The flags share their names with ``shardmuon bench``:
``--json PATH`` and ``--plot PATH`` for outputs, ``--layers``, ``--coefficients``,
``--no-progress``. The old spellings (``--out``, ``--num-layers``, ``--quiet``) still work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from shardmuon.harness.cli_support import (
    LAYERS_HELP,
    ArgumentParser,
    HelpFormatter,
    Number,
    add_hidden_alias,
    check_outputs,
    nonnegative_float,
    nonnegative_int,
    note,
    note_written,
    positive_float,
    positive_int,
    seed_int,
    unit_interval,
)
from shardmuon.harness.machine import DTYPES, fp16_cpu_note
from shardmuon.harness.mesh_flags import default_mesh_note
from shardmuon.harness.models import MODEL_PRESETS
from shardmuon.harness.parallel import parse_mesh_shape, plan_layout
from shardmuon.harness.processes import NPROC_RULE
from shardmuon.ops.engines import NS_CHOICES
from shardmuon.ops.newton_schulz import NS_PRESETS
from shardmuon.train.config import OPTIMIZERS, TRAIN_LAYOUTS, TrainConfig, TrainResult
from shardmuon.train.resume import RESUME_FIXED, adopt_checkpoint_settings
from shardmuon.train.run import run_training

_DESCRIPTION = """\
Supervised fine-tuning of a tiny random-init Qwen3 / Qwen3-MoE on a synthetic
reverse-text task, with FSDP2 over N processes (or over tensor parallel:
--layout fsdp-tp --mesh DPxTP) and DCP checkpoints
(docs/training.md).

On --resume / --resume-dion the optimizer settings (--optimizer, --coefficients,
--update-rms, --lr, --weight-decay, --mu, --nesterov) are the checkpoint's:
leave them out and they are taken from it; give one with another value and the
run is refused, since the checkpoint's param groups would override it. --json
records the settings that ran.

'shardmuon train plot RUN.json ... --plot curve.png' overlays loss curves.
"""


def _resume_fixed_help(text: str, default: object) -> str:
    return f"{text} (default: {default}; on --resume: the checkpoint's)"


def add_parser(subparsers) -> None:
    """Register ``train`` (with the nested ``train plot``) on an argparse subparsers object."""
    defaults = TrainConfig()
    train = subparsers.add_parser(
        "train",
        help="reverse-text SFT of a tiny Qwen3/Qwen3-MoE (FSDP2, DCP checkpoints)",
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    train.add_argument(
        "--model", choices=sorted(MODEL_PRESETS), default=defaults.model, help="model preset"
    )
    train.add_argument(
        "--layers",
        dest="num_layers",
        metavar="N",
        type=positive_int,
        default=defaults.num_layers,
        help=LAYERS_HELP,
    )
    add_hidden_alias(train, "--num-layers", "num_layers", type=positive_int)
    train.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help=_resume_fixed_help("optimizer", defaults.optimizer),
    )
    train.add_argument(
        "--coefficients",
        choices=sorted(NS_PRESETS),
        default=None,
        help=_resume_fixed_help("Newton-Schulz coefficient preset", defaults.coefficients),
    )
    train.add_argument(
        "--ns-impl",
        choices=NS_CHOICES,
        default=None,
        help=_resume_fixed_help("Newton-Schulz engine", defaults.ns_impl),
    )
    train.add_argument(
        "--ns-dtype",
        choices=tuple(DTYPES),
        default=None,
        help=_resume_fixed_help("Newton-Schulz iteration dtype", defaults.ns_dtype),
    )
    train.add_argument(
        "--ns-preconditioner",
        choices=("aol",),
        default=None,
        help=_resume_fixed_help(
            "Newton-Schulz preconditioner ('aol': Turbo-Muon's row scaling, then the 4-step "
            "'aol' coefficients unless --coefficients is given)",
            "none",
        ),
    )
    train.add_argument(
        "--update-rms",
        type=positive_float,
        default=None,
        help=_resume_fixed_help("update RMS of Muon's rms_norm scaling", defaults.update_rms),
    )
    train.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help=_resume_fixed_help("learning rate", defaults.lr),
    )
    train.add_argument(
        "--weight-decay",
        type=nonnegative_float,
        default=None,
        help=_resume_fixed_help("decoupled weight decay", defaults.weight_decay),
    )
    train.add_argument(
        "--mu",
        type=Number(float, 0, 1, high_open=True),
        default=None,
        help=_resume_fixed_help("Muon momentum, in [0, 1)", defaults.mu),
    )
    train.add_argument(
        "--nesterov",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_resume_fixed_help("Nesterov momentum", "off"),
    )
    train.add_argument(
        "--offload",
        choices=("none", "state"),
        default="none",
        help="Muon's optimizer-state offload: 'state' keeps momentum/variance in host memory, "
        "streamed chunk by chunk (the same update, bit for bit; may differ from the checkpoint's)",
    )
    train.add_argument(
        "--qk-clip-threshold",
        type=positive_float,
        default=None,
        metavar="TAU",
        help="QK-clip: after each step, scale the query/key rows of every attention head whose "
        "max logit exceeded TAU (shardmuon.qk_clip.QKClip; Kimi K2 uses 100); off by default",
    )
    train.add_argument(
        "--qk-clip-alpha",
        type=unit_interval,
        default=None,
        metavar="A",
        help=f"QK-clip: the query's share of the scale, in [0, 1] (default {defaults.qk_clip_alpha})",
    )
    train.add_argument(
        "--log-max-logit",
        action="store_true",
        help="record every head's max attention logit per step (in --json and --plot) "
        "without clipping; always on with --qk-clip-threshold",
    )
    train.add_argument(
        "--steps", type=positive_int, default=defaults.steps, help="train up to this step"
    )
    train.add_argument(
        "--batch-size", type=positive_int, default=defaults.batch_size, help="global batch size"
    )
    train.add_argument("--seed", type=seed_int, default=defaults.seed, help="model init and data")
    train.add_argument(
        "--min-len", type=positive_int, default=defaults.min_len, help="shortest string"
    )
    train.add_argument(
        "--max-len", type=positive_int, default=defaults.max_len, help="longest string"
    )
    train.add_argument(
        "--nproc",
        type=positive_int,
        default=defaults.nproc,
        help=f"processes (ranks); {NPROC_RULE}",
    )
    train.add_argument(
        "--layout",
        choices=TRAIN_LAYOUTS,
        default=defaults.layout,
        help="how params are sharded (fsdp-tp: tensor parallel over TP ranks, FSDP2 over DP)",
    )
    train.add_argument(
        "--mesh",
        metavar="DPxTP",
        default=None,
        help="fsdp-tp's mesh shape, e.g. 2x2 (default: TP 2 when --nproc is even)",
    )
    train.add_argument("--checkpoint-dir", metavar="PATH", default=None, help="DCP checkpoints")
    train.add_argument(
        "--checkpoint-every",
        metavar="N",
        type=nonnegative_int,
        default=defaults.checkpoint_every,
        help="save every N steps (0: never)",
    )
    train.add_argument(
        "--resume",
        metavar="PATH",
        default=None,
        help="DCP checkpoint dir, or a root of step-* dirs (the newest undamaged one); "
        "a file = dion format",
    )
    train.add_argument(
        "--resume-dion",
        metavar="PATH",
        default=None,
        help="torch.save file {'model', 'optimizer', 'step'}",
    )
    train.add_argument(
        "--dion-out",
        metavar="PATH",
        default=None,
        help="also write a dion-format file at the end of the run",
    )
    train.add_argument(
        "--json", metavar="PATH", default=None, help="write per-step losses and the config here"
    )
    train.add_argument("--csv", metavar="PATH", default=None, help="write step,loss rows here")
    train.add_argument("--plot", metavar="PATH", default=None, help="write the loss curve (PNG)")
    train.add_argument("--no-progress", dest="quiet", action="store_true", help="no progress bar")
    add_hidden_alias(train, "--quiet", "quiet", action="store_true")
    # Deprecated spelling of --json / --csv (by the file's suffix).
    add_hidden_alias(train, "--out", "deprecated_out")
    train.set_defaults(func=_run_train)

    nested = train.add_subparsers(dest="train_command", metavar="{plot}")
    plot = nested.add_parser(
        "plot",
        help="overlay loss curves of --json (or --csv) files",
        description="Overlay the loss curves of files written by shardmuon train --json/--csv.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    plot.add_argument("runs", nargs="+", help="loss files written by shardmuon train --json")
    # Not required=True: argparse would not count the --out alias as giving it.
    plot.add_argument("--plot", metavar="PATH", default=None, help="PNG to write (required)")
    add_hidden_alias(plot, "--out", "plot")
    plot.add_argument("--labels", nargs="+", default=None, help="one label per run")
    plot.add_argument("--title", default="reverse-text SFT loss", help="title of the figure")
    plot.add_argument("--linear", action="store_true", help="linear y axis (default: log)")
    plot.set_defaults(func=_run_plot)


def _outputs_from_args(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(json, csv)`` paths, the deprecated ``--out`` going to one of them by its suffix."""
    json_out, csv_out = args.json, args.csv
    out = getattr(args, "deprecated_out", None)
    if out is None:
        return json_out, csv_out
    suffix = Path(out).suffix
    if suffix not in (".json", ".csv"):
        raise ValueError(f"--out must end in .json or .csv, got {out!r}; use --json or --csv")
    replacement = "--json" if suffix == ".json" else "--csv"
    if (json_out if suffix == ".json" else csv_out) is not None:
        raise ValueError(f"give {replacement} only (--out is its old name)")
    note(f"shardmuon train: warning: --out is deprecated; use {replacement} {out}")
    return (out, csv_out) if suffix == ".json" else (json_out, out)


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    json_out, csv_out = _outputs_from_args(args)
    given = {name for name in RESUME_FIXED if getattr(args, name) is not None}
    config = TrainConfig(
        model=args.model,
        num_layers=args.num_layers,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        min_len=args.min_len,
        max_len=args.max_len,
        nproc=args.nproc,
        layout=args.layout,
        mesh=parse_mesh_shape(args.mesh, "DPxTP, e.g. 2x2"),
        offload=None if args.offload == "none" else args.offload,
        qk_clip_threshold=args.qk_clip_threshold,
        qk_clip_alpha=TrainConfig.qk_clip_alpha
        if args.qk_clip_alpha is None
        else args.qk_clip_alpha,
        log_max_logit=args.log_max_logit,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        resume_dion=args.resume_dion,
        dion_out=args.dion_out,
        json_out=json_out,
        csv_out=csv_out,
        plot_out=args.plot,
        quiet=args.quiet,
        **{name: getattr(args, name) for name in given},
    )
    if config.ns_preconditioner == "aol" and "coefficients" not in given:
        config = replace(config, coefficients="aol")
    if config.ns_dtype == "fp16" and not torch.cuda.is_available():
        slow = fp16_cpu_note("--ns-dtype fp16")
        if slow is not None:
            note(slow)
    if config.resume and config.resume_dion:
        raise ValueError("give either --resume or --resume-dion, not both")
    if args.qk_clip_alpha is not None and args.qk_clip_threshold is None:
        raise ValueError(
            f"--qk-clip-alpha {args.qk_clip_alpha} given without --qk-clip-threshold: alpha only "
            "matters when clipping; give the threshold too"
        )
    return adopt_checkpoint_settings(config, given)


def _report_outputs(config: TrainConfig, result: TrainResult) -> None:
    if result.checkpoints:
        names = [Path(p).name for p in result.checkpoints]
        shown = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
        count = f"{len(names)} checkpoint{'s' if len(names) > 1 else ''}"
        note_written(config.checkpoint_dir, f"{count} ({shown})")
    if config.dion_out:
        note_written(config.dion_out, "dion-format checkpoint")
    if config.json_out:
        note_written(config.json_out, "losses and config (JSON)")
    if config.csv_out:
        note_written(config.csv_out, "losses (CSV)")
    if config.plot_out:
        note_written(config.plot_out, "loss curve (PNG)")


def _run_train(args: argparse.Namespace) -> int:
    try:
        config = _config_from_args(args)
        if config.layout == "fsdp-tp" and config.mesh is None:
            config.validate()  # a bad value is reported alone, before the note
            plan = plan_layout(config.layout, config.nproc)
            note(default_mesh_note([plan], [f"--nproc {config.nproc}"]))
        result = run_training(config)
    except ValueError as err:
        print(f"shardmuon train: error: {err}", file=sys.stderr)
        return 2
    first, last = min(result.losses), max(result.losses)
    print(
        f"steps {first}-{last} on {result.world_size} rank(s) in {result.seconds:.1f} s; "
        f"loss {result.losses[first]:.4f} -> {result.losses[last]:.4f}"
    )
    for name, value in result.range_means.items():
        print(f"  mean loss steps {name}: {value:.4f}")
    _report_outputs(config, result)
    return 0


def _run_plot(args: argparse.Namespace) -> int:
    from shardmuon.train.plot import plot_runs

    try:
        if args.plot is None:
            raise ValueError("give --plot PATH, the PNG to write")
        check_outputs({"--plot": args.plot})
        path = plot_runs(
            args.runs, args.plot, labels=args.labels, title=args.title, log_scale=not args.linear
        )
    except ValueError as err:
        print(f"shardmuon train plot: error: {err}", file=sys.stderr)
        return 2
    note_written(path, "loss curves (PNG)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardmuon.train [plot] ...``: parse ``argv`` and run; returns the exit code."""
    parser = ArgumentParser(prog="shardmuon", formatter_class=HelpFormatter, allow_abbrev=False)
    add_parser(parser.add_subparsers(dest="command"))
    try:
        args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    except SystemExit as exc:  # a bad argument (2) or --help (0): argparse has said why
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return args.func(args)
