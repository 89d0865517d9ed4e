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
from pathlib import Path
from typing import Any

import torch

from shardmuon.harness.cli_support import (
    ArgumentParser,
    HelpFormatter,
    add_hidden_alias,
    check_outputs,
    note,
    note_written,
)
from shardmuon.harness.jobs import finish_job, interrupted, start_job
from shardmuon.harness.machine import DTYPES, fp16_cpu_note
from shardmuon.harness.mesh_flags import default_mesh_note
from shardmuon.harness.parallel import parse_mesh_shape, plan_layout
from shardmuon.train.cli_flags import (
    FIXED_FIELDS,
    OPTIM_FLAGS,
    TASK_ONLY,
    add_data_flags,
    add_model_flags,
    add_optimizer_flags,
    add_run_flags,
)
from shardmuon.train.config import TrainConfig, TrainResult, task_config
from shardmuon.train.resume import adopt_checkpoint_settings
from shardmuon.train.run import run_training

_DESCRIPTION = """\
Train a tiny random-init Hugging Face model with FSDP2 over N processes (or over
tensor parallel: --layout fsdp-tp --mesh DPxTP) and DCP checkpoints
(docs/training.md). Two tasks:

  --task reverse  supervised fine-tuning of a tiny Qwen3 / Qwen3-MoE on a
                  synthetic reverse-text task (the default)
  --task lm       byte-level causal LM pretraining of a small Llama on real text
                  (--data: a file or a directory of .py .md .txt .rst files;
                  default: this Python's standard library), with a held-out loss
                  every --eval-every steps on text it never trains on

On --resume / --resume-dion the optimizer settings (--optimizer, --coefficients,
--ns-impl, --ns-dtype, --ns-preconditioner, --update-rms, --lr, --adamw-lr,
--embedding-update, --weight-decay, --mu, --nesterov, --warmup, --schedule) are
the checkpoint's: leave them out and they are taken from it; give one with
another value and the run is refused, since the checkpoint's param groups would
override it. --json records the settings that ran.

'shardmuon train plot RUN.json ... --plot curve.png' overlays loss curves.
"""


def add_parser(subparsers) -> None:
    """Register ``train`` (with the nested ``train plot``) on an argparse subparsers object."""
    train = subparsers.add_parser(
        "train",
        help="reverse-text SFT or byte-level LM pretraining of a tiny model (FSDP2, DCP)",
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    add_model_flags(train)
    add_optimizer_flags(train)
    add_data_flags(train)
    add_run_flags(train)
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
    plot.add_argument(
        "--title", default=None, help="title of the figure (default: the task's loss)"
    )
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


def _optim_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The MuonConfig fields the flags set (the aol preset follows --ns-preconditioner)."""
    optim = {
        field: getattr(args, dest)
        for dest, field in OPTIM_FLAGS.items()
        if getattr(args, dest) is not None
    }
    if "newton_schulz_dtype" in optim:
        dtype = DTYPES[optim["newton_schulz_dtype"]]
        optim["newton_schulz_dtype"] = str(dtype).removeprefix("torch.")
    if optim.get("newton_schulz_preconditioner") == "aol" and args.coefficients is None:
        optim["newton_schulz_coefficients"] = "aol"
    if args.offload != "none":
        optim["offload"] = args.offload
    if args.overlap != "none":
        optim["overlap"] = args.overlap
    return optim


def _check_task_flags(args: argparse.Namespace) -> None:
    for dest, (flag, task) in TASK_ONLY.items():
        if getattr(args, dest) is not None and args.task != task:
            raise ValueError(f"{flag} is a --task {task} flag; this run is --task {args.task}")
    if args.qk_clip_alpha is not None and args.qk_clip_threshold is None:
        raise ValueError(
            f"--qk-clip-alpha {args.qk_clip_alpha} given without --qk-clip-threshold: alpha only "
            "matters when clipping; give the threshold too"
        )


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    _check_task_flags(args)
    json_out, csv_out = _outputs_from_args(args)
    given = {f"optim.{OPTIM_FLAGS[d]}" for d in OPTIM_FLAGS if getattr(args, d) is not None}
    given |= {FIXED_FIELDS[d] for d in FIXED_FIELDS if getattr(args, d) is not None}
    if args.ns_preconditioner == "aol":
        given.add("optim.newton_schulz_coefficients")
    # TrainConfig fields set by the flag of the same name, when given (the rest keep the
    # task's defaults).
    same_name = ("model", "num_layers", "steps", "batch_size", "adamw_lr", "embedding_update",
                 "schedule", *TASK_ONLY)  # fmt: skip
    fields = {dest: getattr(args, dest) for dest in same_name if getattr(args, dest) is not None}
    if args.warmup is not None:
        fields["warmup_steps"] = args.warmup
    config = task_config(
        args.task,
        args.optimizer or TrainConfig.optimizer,
        optim=_optim_from_args(args),
        seed=args.seed,
        nproc=args.nproc,
        layout=args.layout,
        mesh=parse_mesh_shape(args.mesh, "DPxTP, e.g. 2x2"),
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
        **fields,
    )
    if config.optim.newton_schulz_dtype == "float16" and not torch.cuda.is_available():
        slow = fp16_cpu_note("--ns-dtype fp16")
        if slow is not None:
            note(slow)
    if config.resume and config.resume_dion:
        raise ValueError("give either --resume or --resume-dion, not both")
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
    waited = "" if config.optim.overlap is None else (
        f", then the forward waited {1e3 * result.overlap_wait_seconds:.1f} ms for it"
    )  # fmt: skip
    print(
        f"  per step (medians): {1e3 * result.step_seconds:.1f} ms; optimizer.step() held the "
        f"loop {1e3 * result.optimizer_seconds:.1f} ms{waited}"
    )
    if result.eval:
        first_eval, last_eval = result.eval[0], result.eval[-1]
        print(
            f"  held-out loss (nats per byte) {first_eval['loss']:.4f} at step "
            f"{first_eval['step']} -> {last_eval['loss']:.4f} at step {last_eval['step']}"
        )
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
    name = "shardmuon train" + (" plot" if args.train_command else "")
    start_job(name)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # as the project CLI reports it: one line, status 130
        return interrupted(name)
    finally:
        finish_job()
