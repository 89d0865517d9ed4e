"""``shardmuon train`` (and ``shardmuon train plot``): argument parsing only; the work is in
:mod:`shardmuon.train.loop` and :mod:`shardmuon.train.plot`.

Usable on its own as ``python -m shardmuon.train ...`` as well as through the project CLI,
which calls :func:`add_parser`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardmuon.train.loop import OPTIMIZERS, TRAIN_LAYOUTS, TrainConfig, run_training


def add_parser(subparsers) -> None:
    """Register ``train`` (with the nested ``train plot``) on an argparse subparsers object."""
    defaults = TrainConfig()
    train = subparsers.add_parser(
        "train",
        help="reverse-text SFT of a tiny Qwen3/Qwen3-MoE (FSDP2, DCP checkpoints)",
        description=(
            "Supervised fine-tuning of a tiny random-init Qwen3 / Qwen3-MoE on a synthetic "
            "reverse-text task, with FSDP2 over N processes and DCP checkpoints. "
            "'shardmuon train plot RUN.json ... --out curve.png' overlays loss curves."
        ),
    )
    train.add_argument("--model", default=defaults.model, help="model preset (default %(default)s)")
    train.add_argument(
        "--num-layers", type=int, default=defaults.num_layers, help="decoder layers (%(default)s)"
    )
    train.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
    train.add_argument(
        "--coefficients",
        default=defaults.coefficients,
        help="Newton-Schulz preset: dion, keller, deepseek-v4, polar-express (%(default)s)",
    )
    train.add_argument("--update-rms", type=float, default=defaults.update_rms)
    train.add_argument("--lr", type=float, default=defaults.lr)
    train.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    train.add_argument("--mu", type=float, default=defaults.mu, help="Muon momentum")
    train.add_argument("--nesterov", action="store_true")
    train.add_argument("--steps", type=int, default=defaults.steps)
    train.add_argument("--batch-size", type=int, default=defaults.batch_size, help="global")
    train.add_argument("--seed", type=int, default=defaults.seed, help="model init and data")
    train.add_argument("--min-len", type=int, default=defaults.min_len, help="shortest string")
    train.add_argument("--max-len", type=int, default=defaults.max_len, help="longest string")
    train.add_argument("--nproc", type=int, default=defaults.nproc, help="processes (ranks)")
    train.add_argument("--layout", choices=TRAIN_LAYOUTS, default=defaults.layout)
    train.add_argument("--checkpoint-dir", default=None)
    train.add_argument(
        "--checkpoint-every", type=int, default=0, help="save every N steps (0: never)"
    )
    train.add_argument(
        "--resume",
        default=None,
        help="DCP checkpoint dir, or a root of step-* dirs (newest); a file = dion format",
    )
    train.add_argument(
        "--resume-dion", default=None, help="torch.save file {'model', 'optimizer', 'step'}"
    )
    train.add_argument(
        "--dion-out", default=None, help="also write a dion-format file at the end of the run"
    )
    train.add_argument("--out", default=None, help="per-step losses: .json or .csv")
    train.add_argument("--plot", default=None, help="write this run's loss curve to a PNG")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.set_defaults(func=_run_train)

    nested = train.add_subparsers(dest="train_command", metavar="{plot}")
    plot = nested.add_parser("plot", help="overlay loss curves of --out JSON/CSV files")
    plot.add_argument("runs", nargs="+", help="loss files written by shardmuon train --out")
    plot.add_argument("--out", required=True, help="PNG to write")
    plot.add_argument("--labels", nargs="+", default=None, help="one label per run")
    plot.add_argument("--title", default="reverse-text SFT loss")
    plot.add_argument("--linear", action="store_true", help="linear y axis (default: log)")
    plot.set_defaults(func=_run_plot)


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        num_layers=args.num_layers,
        optimizer=args.optimizer,
        coefficients=args.coefficients,
        update_rms=args.update_rms,
        lr=args.lr,
        weight_decay=args.weight_decay,
        mu=args.mu,
        nesterov=args.nesterov,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        min_len=args.min_len,
        max_len=args.max_len,
        nproc=args.nproc,
        layout=args.layout,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        resume_dion=args.resume_dion,
        dion_out=args.dion_out,
        out=args.out,
        quiet=args.quiet,
    )


def _run_train(args: argparse.Namespace) -> int:
    try:
        config = _config_from_args(args)
        result = run_training(config)
        if args.plot:
            if not config.out:
                raise ValueError("--plot needs --out (the plot is drawn from that file)")
            from shardmuon.train.plot import plot_runs

            plot_runs([config.out], args.plot)
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
    return 0


def _run_plot(args: argparse.Namespace) -> int:
    from shardmuon.train.plot import plot_runs

    try:
        path = plot_runs(
            args.runs, args.out, labels=args.labels, title=args.title, log_scale=not args.linear
        )
    except ValueError as err:
        print(f"shardmuon train plot: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardmuon.train [plot] ...``: parse ``argv`` and run; returns the exit code."""
    parser = argparse.ArgumentParser(prog="shardmuon")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
