"""``shardmuon bench lm``: Muon against AdamW, and every Newton-Schulz engine against Muon's
default, on byte-level language-model pretraining (``shardmuon train --task lm``).

Four sweeps, each on one set of ranks: AdamW over ``--adamw-lrs``; Muon over ``--muon-lrs``,
its AdamW group (embeddings, norms, head) at the first of ``--muon-adamw-lrs``; at Muon's
best lr, its AdamW group at the others; then, at Muon's best pair, each other update of the
embedding and the head in ``--embedding-updates`` (setting ``<name>-embeddings``; the first
is every Muon run's, ``TrainConfig.embedding_update``) and each of ``--engines``.
Every run has ``--seeds`` seeds (model init and data order) and records the max attention
logit per step (recording changes no loss). "Best" is the lowest final held-out loss, the
mean over the seeds. A run whose loss stops being finite, or that fails with non-finite
weights, stops there and is recorded as diverged; the sweep goes on, and a setting with a
diverged seed is never the best. When every Muon lr diverges there is no best lr, and the
runs at it (its AdamW group's lrs, the engines) are left out. The tables: the final held-out loss of every run (mean and half the
range over the seeds); per setting, the steps it needs to reach AdamW's best final held-out
loss (interpolated between held-out evaluations) and its median step time. ``--plot``
writes three PNGs (see :mod:`.lm_report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

from shardmuon.bench.lm_report import (
    best_key,
    every_run_diverged_line,
    plot_lm,
    print_lm_tables,
    summarize,
)
from shardmuon.bench.report import write_json
from shardmuon.harness.cli_support import (
    HelpFormatter,
    check_outputs,
    int_at_least,
    note,
    note_written,
    positive_float,
    positive_int,
)
from shardmuon.harness.models import MODEL_PRESETS
from shardmuon.harness.processes import NPROC_RULE

__all__ = ["add_parser", "sweep_configs"]

# The settings compared at Muon's best lr: MuonConfig fields changed from the default
# (folded engine, bf16, dion coefficients). "qk-clip" takes --qk-clip-threshold.
ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    "per-matrix": {"newton_schulz_impl": "per-matrix"},
    "gram": {"newton_schulz_impl": "gram"},
    "fp32": {"newton_schulz_dtype": "float32"},
    "aol": {"newton_schulz_preconditioner": "aol", "newton_schulz_coefficients": "aol"},
    "polar-express": {"newton_schulz_coefficients": "polar-express"},
    "deepseek-v4": {"newton_schulz_coefficients": "deepseek-v4"},
    "qk-clip": {},
}
# The grids bracket the best lrs of a first, one-seed sweep (docs/benchmarks.md).
# (As flag text: argparse parses a string default with the flag's type.)
DEFAULT_ADAMW_LRS = "0.001,0.002,0.004"
DEFAULT_MUON_LRS = "0.005,0.01,0.02"
DEFAULT_MUON_ADAMW_LRS = "0.004,0.008"  # the best (0.008) is the top: a wider grid may do better
DEFAULT_STEPS = 150
# --budget equal: 4 x 2 x 2 x 2 = 32 AdamW configurations, 4 x 4 x 2 = 32 Muon ones; the
# comparison at 600 steps.
EQUAL_ADAMW_LRS = "0.001,0.002,0.004,0.008"
EQUAL_MUON_LRS = "0.005,0.01,0.02,0.04"
EQUAL_MUON_ADAMW_LRS = "0.002,0.004,0.008,0.016"
EQUAL_BETA2S = "0.95,0.99"
EQUAL_WEIGHT_DECAYS = "0,0.1"
EQUAL_WARMUPS = "20,60"
EQUAL_SWEEP_STEPS = 150
EQUAL_STEPS = 600
DEFAULT_EVAL_EVERY = 10
# Chosen to bind: Muon's max logit passes it about halfway through the default run.
DEFAULT_QK_CLIP_THRESHOLD = 15.0


def _lrs(text: str) -> tuple[float, ...]:
    """``--adamw-lrs`` / ``--muon-lrs``: comma-separated numbers > 0."""
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(
                f"must be comma-separated numbers > 0 (e.g. 0.01,0.02), got {text!r}"
            )
        values.append(value)
    return tuple(dict.fromkeys(values))


def _numbers(text: str, check, accepted: str, kind=float) -> tuple:
    values = []
    for item in text.split(","):
        try:
            value = kind(item)
        except ValueError:
            value = None
        if value is None or not check(value):
            raise argparse.ArgumentTypeError(f"must be comma-separated {accepted}, got {text!r}")
        values.append(value)
    return tuple(dict.fromkeys(values))


def _fractions(text: str) -> tuple[float, ...]:
    """``--adamw-beta2s``: comma-separated numbers in [0, 1)."""
    return _numbers(text, lambda v: 0 <= v < 1, "numbers in [0, 1) (e.g. 0.95,0.99)")


def _decays(text: str) -> tuple[float, ...]:
    """Weight-decay grids: comma-separated finite numbers >= 0."""
    return _numbers(text, lambda v: 0 <= v < math.inf, "numbers >= 0 (e.g. 0,0.1)")


def _counts(text: str) -> tuple[int, ...]:
    """``--adamw-warmups``: comma-separated ints >= 0."""
    return _numbers(text, lambda v: v >= 0, "ints >= 0 (e.g. 20,60)", kind=int)


def _embedding_updates(text: str) -> tuple[str, ...]:
    """``--embedding-updates``: comma-separated names of ``EMBEDDING_UPDATES``."""
    from shardmuon.train.config import EMBEDDING_UPDATES

    names = tuple(dict.fromkeys(n for n in text.split(",") if n))
    unknown = [n for n in names if n not in EMBEDDING_UPDATES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown embedding update {unknown[0] if unknown else text!r}; accepted: "
            f"comma-separated names of {', '.join(EMBEDDING_UPDATES)}"
        )
    return names


def embedding_setting(name: str) -> str:
    """The setting of the runs at Muon's best pair with embedding update ``name``."""
    return f"{name}-embeddings"


def _engines(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n for n in text.split(",") if n)) if text != "none" else ()
    unknown = [n for n in names if n not in ENGINE_SETTINGS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown engine setting {unknown[0]!r}; accepted: comma-separated names of "
            f"{', '.join(ENGINE_SETTINGS)}, or 'none'"
        )
    return names


# What --help prints: plain words and an example. The module docstring keeps the full
# account, in the markup the API docs read.
_DESCRIPTION = """\
Muon against AdamW, and every Newton-Schulz engine against Muon's default, on
byte-level language-model pretraining (the runs of shardmuon train --task lm).

Sweeps AdamW's lrs (--adamw-lrs), then Muon's (--muon-lrs), then the lr of Muon's
AdamW group (--muon-adamw-lrs) at Muon's best lr, then, at Muon's best pair, the
other updates of the embedding and the head (--embedding-updates) and each of
--engines, --seeds seeds each. A run that diverges is recorded as such and the
sweep goes on.

Prints the final held-out loss of every run, and per setting the steps it needs to
reach AdamW's best loss and its median step time. --plot writes three PNGs.

Examples:
  shardmuon bench lm --steps 150 --seeds 2 --json lm.json --plot lm.png
  shardmuon bench lm --embedding-updates adamw,sinkhorn --engines none
"""


def add_parser(subparsers) -> None:
    """Register ``lm`` on ``subparsers`` (an argparse sub-parsers action)."""
    from shardmuon.train.config import LM_DEFAULTS

    p = subparsers.add_parser(
        "lm",
        help="Muon vs AdamW and every engine on byte-level LM pretraining (held-out loss)",
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--model", choices=sorted(MODEL_PRESETS), default=LM_DEFAULTS["model"],
        help="model preset",
    )  # fmt: skip
    p.add_argument("--layers", type=positive_int, default=None, metavar="N",
                   help="only the preset's first N decoder layers (default: all)")  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=None,
                   help=f"steps per run (default: {DEFAULT_STEPS}; --budget equal: "
                   f"{EQUAL_STEPS}, the seeded comparison's)")  # fmt: skip
    p.add_argument("--seeds", type=positive_int, default=2, help="seeds per setting (0, 1, ...)")
    p.add_argument(
        "--budget", choices=("grid", "equal"), default="grid",
        help="grid: the lr sweeps below, then the engines; equal: AdamW and Muon each tuned "
        "over as many configurations (lr x beta2 x weight decay x warm-up against lr x "
        "AdamW-group lr x weight decay), then each best on --final-seeds seeds, compared "
        "under a significance rule (docs/benchmarks.md)",
    )  # fmt: skip
    p.add_argument("--adamw-lrs", type=_lrs, default=None, metavar="LR,...",
                   help=f"AdamW's lr grid (default: {DEFAULT_ADAMW_LRS}; "
                   f"--budget equal: {EQUAL_ADAMW_LRS})")  # fmt: skip
    p.add_argument("--muon-lrs", type=_lrs, default=None, metavar="LR,...",
                   help=f"Muon's lr grid (default: {DEFAULT_MUON_LRS}; "
                   f"--budget equal: {EQUAL_MUON_LRS})")  # fmt: skip
    p.add_argument(
        "--muon-adamw-lrs", type=_lrs, default=None, metavar="LR,...",
        help="lr grid of Muon's AdamW group: the first with every --muon-lrs, the others at "
        f"Muon's best lr (default: {DEFAULT_MUON_ADAMW_LRS}; --budget equal: every one with "
        f"every Muon lr, {EQUAL_MUON_ADAMW_LRS})",
    )  # fmt: skip
    p.add_argument("--adamw-beta2s", type=_fractions, default=EQUAL_BETA2S, metavar="B,...",
                   help="--budget equal: AdamW's beta2 grid")  # fmt: skip
    p.add_argument("--adamw-weight-decays", type=_decays, default=EQUAL_WEIGHT_DECAYS,
                   metavar="WD,...", help="--budget equal: AdamW's weight-decay grid")  # fmt: skip
    p.add_argument("--adamw-warmups", type=_counts, default=EQUAL_WARMUPS, metavar="N,...",
                   help="--budget equal: AdamW's warm-up grid (steps)")  # fmt: skip
    p.add_argument("--muon-weight-decays", type=_decays, default=EQUAL_WEIGHT_DECAYS,
                   metavar="WD,...", help="--budget equal: Muon's weight-decay grid")  # fmt: skip
    p.add_argument("--sweep-steps", type=positive_int, default=EQUAL_SWEEP_STEPS,
                   help="--budget equal: steps of each configuration's tuning run")  # fmt: skip
    p.add_argument("--final-seeds", type=int_at_least(3), default=3,
                   help="--budget equal: seeds of each best configuration")  # fmt: skip
    p.add_argument(
        "--resume", metavar="PATH", default=None,
        help="--budget equal: append each finished run to PATH (JSON lines) and skip the "
        "runs already there: an interrupted sweep goes on where it stopped",
    )  # fmt: skip
    p.add_argument(
        "--embedding-updates", type=_embedding_updates, default="adamw", metavar="NAME,...",
        help="Muon's update of the embedding and the head (adamw: its AdamW group; sinkhorn: "
        "a Sinkhorn group at Muon's lr): the first in every Muon run, the others at Muon's "
        "best pair (setting NAME-embeddings)",
    )  # fmt: skip
    p.add_argument(
        "--engines", type=_engines, default=",".join(ENGINE_SETTINGS), metavar="NAME,...",
        help="settings run at Muon's best lr, or 'none'",
    )  # fmt: skip
    p.add_argument(
        "--qk-clip-threshold", type=positive_float, default=DEFAULT_QK_CLIP_THRESHOLD,
        metavar="TAU", help="the 'qk-clip' setting's threshold",
    )  # fmt: skip
    p.add_argument("--batch-size", type=positive_int, default=LM_DEFAULTS["batch_size"],
                   help="global batch size (sequences)")  # fmt: skip
    p.add_argument("--seq-len", type=int_at_least(2), default=256, help="bytes per sequence")
    p.add_argument("--warmup", type=positive_int, default=LM_DEFAULTS["warmup_steps"],
                   metavar="N", help="linear lr warmup steps")  # fmt: skip
    p.add_argument("--eval-every", type=positive_int, default=DEFAULT_EVAL_EVERY, metavar="N",
                   help="held-out loss every N steps")  # fmt: skip
    p.add_argument("--eval-sequences", type=positive_int, default=32, metavar="N",
                   help="held-out sequences scored each time")  # fmt: skip
    p.add_argument("--data", metavar="PATH", default=None,
                   help="text file or directory (default: this Python's standard library)")  # fmt: skip
    p.add_argument("--data-bytes", type=positive_int, default=None, metavar="N",
                   help="read at most N bytes of --data")  # fmt: skip
    p.add_argument("--nproc", type=positive_int, default=2, help=f"ranks per run; {NPROC_RULE}")
    p.add_argument("--json", metavar="PATH", default=None, help="write every run and the summary")
    p.add_argument(
        "--plot", metavar="PATH", default=None,
        help="write PATH (Muon vs AdamW), PATH-engines and PATH-logits (PNGs)",
    )  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _base_config(args: argparse.Namespace):
    from shardmuon.train.config import task_config

    return task_config(
        "lm",
        "muon",
        model=args.model,
        num_layers=args.layers,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        warmup_steps=args.warmup,
        eval_every=args.eval_every,
        eval_sequences=args.eval_sequences,
        data=args.data,
        data_bytes=args.data_bytes,
        nproc=args.nproc,
        log_max_logit=True,
        quiet=args.no_progress,
        embedding_update=args.embedding_updates[0],
    )


def sweep_configs(base, setting: str, optimizer: str, lr: float, seeds: int, **changes):
    """The configs of one setting at one lr, one per seed (labelled in ``extra``)."""
    from shardmuon.train.config import optim_settings
    from shardmuon.train.launch import ANNOUNCE
    from shardmuon.train.loop import STOP_ON_DIVERGENCE

    optim = optim_settings(base.optim, lr=lr, **changes.pop("optim", {}))
    if optimizer == "adamw":
        changes["adamw_lr"] = None  # one lr for every group
        changes["embedding_update"] = "adamw"  # AdamW updates every parameter
    configs = []
    for seed in range(seeds):
        extra = {
            "setting": setting,
            "seed": seed,
            ANNOUNCE: f"{setting}, lr {lr:g}, seed {seed}",
            STOP_ON_DIVERGENCE: True,  # a diverged run is a result; the sweep goes on
        }
        configs.append(
            dataclasses.replace(
                base, optimizer=optimizer, optim=optim, seed=seed, extra=extra, **changes
            )
        )
    return configs


class _Sweep:
    """Where the sweep stands, for the time estimate and for what Ctrl-C reports: the runs
    of the whole command, those finished, and the runs now on the ranks."""

    def __init__(self, args: argparse.Namespace, runs: int, base) -> None:
        from shardmuon.harness.jobs import start_job

        self.args, self.runs, self.base = args, runs, base
        self.rows: list[dict[str, Any]] = []
        self.counter: Any = [0, 0]
        self.job = start_job("shardmuon bench lm")
        self.job.done = self.done
        self.job.partial = self.write_partial

    def done(self) -> str:
        finished = len(self.rows) + self.counter[0]
        now = f", step {self.counter[1]} of the next" if self.counter[1] else ""
        return f"{finished} of {self.runs} runs{now}"

    def estimates(self, configs) -> dict:
        """The estimate of the first run of the first sweep (the whole command, Muon's
        steps counted at AdamW's cost) and of Muon's first (what is left)."""
        from shardmuon.train.loop import EstimatePlan, evaluations

        later = self.runs - len(self.rows) - 1
        per_run = evaluations(self.base) + 1  # and the one at step 0
        if not self.rows:
            basis = "; Muon's steps counted at AdamW's cost until timed"
            plan = EstimatePlan(
                "shardmuon bench lm", later * self.base.steps, later * per_run, basis,
                min_seconds=0,  # the header said an estimate follows
            )  # fmt: skip
            return {0: plan}
        if configs[0].optimizer == "muon" and all(r["optimizer"] == "adamw" for r in self.rows):
            plan = EstimatePlan(
                "shardmuon bench lm", later * self.base.steps, later * per_run, left=True
            )
            return {0: plan}
        return {}

    def write_partial(self) -> str | None:
        """The finished runs to ``--json`` (no summary: the sweep did not get to its end)."""
        if not (self.args.json and self.rows):
            return None
        from shardmuon.bench.report import environment

        environ = environment(world_size=self.args.nproc, argv=getattr(self.args, "argv", None))
        payload = {"benchmark": "lm", "interrupted": True, "environment": environ,
                   "runs": self.rows}  # fmt: skip
        write_json(self.args.json, payload)
        return f"{self.args.json} ({len(self.rows)} of {self.runs} runs)"


def _run_all(configs, sweep: _Sweep | None = None) -> list[dict[str, Any]]:
    """Train every config (one set of ranks for all); one row per run, each diverged one
    noted on stderr. ``sweep``: gets the time estimates, follows the runs."""
    from shardmuon.train.launch import new_counter, run_sequentially, spawn_runs

    estimates = sweep.estimates(configs) if sweep else None
    counter = new_counter(shared=configs[0].nproc > 1)
    if sweep is not None:
        sweep.counter = counter
    if configs[0].nproc == 1:
        runs = [(config, None) for config in configs]
        results = run_sequentially(runs, 0, 1, estimates, counter)
    else:
        results = spawn_runs(configs, estimates, counter)
    rows = []
    for config, result in zip(configs, results):
        stop = result.diverged or {}
        if stop:
            note(
                f"shardmuon bench lm: {config.extra['setting']}, lr {config.optim.lr:g}, seed "
                f"{config.seed} diverged at step {stop['step']} ({stop['reason']}); it is "
                "recorded as diverged and the sweep goes on"
            )
        rows.append(
            {
                "setting": config.extra["setting"],
                "optimizer": config.optimizer,
                "lr": config.optim.lr,
                "adamw_lr": config.adamw_lr,
                "embedding_update": config.embedding_update,
                "seed": config.seed,
                "steps": config.steps,
                "diverged": bool(stop),
                "diverged_step": stop.get("step"),
                "diverged_reason": stop.get("reason"),
                "optim": config.optim.model_dump(mode="json"),
                "eval": result.eval,
                "losses": [result.losses[s] for s in sorted(result.losses)],
                "step_seconds": result.step_seconds,
                "max_logits": [result.max_logits[s] for s in sorted(result.max_logits)],
                "max_logits_after": [
                    result.max_logits_after[s] for s in sorted(result.max_logits_after)
                ],
                "clipped_heads": [result.clipped_heads[s] for s in sorted(result.clipped_heads)],
            }
        )
    if sweep is not None:
        sweep.rows += rows
        sweep.counter = [0, 0]
    return rows


def _run_at_muons_best(base, args, rows, others, sweep: _Sweep) -> list[dict[str, Any]]:
    """The runs at Muon's best lr: its AdamW group at ``others``, then, at the best pair,
    each other of ``--embedding-updates`` and each of ``--engines``."""
    _, muon_lr, _ = best_key(rows, "muon")
    more = []
    if others:
        more += _run_all(
            [
                c
                for group_lr in others
                for c in sweep_configs(base, "muon", "muon", muon_lr, args.seeds, adamw_lr=group_lr)
            ],
            sweep,
        )
    _, muon_lr, adamw_lr = best_key(rows + more, "muon")
    engine_configs = []
    for name in args.embedding_updates[1:]:
        engine_configs += sweep_configs(
            base, embedding_setting(name), "muon", muon_lr, args.seeds, adamw_lr=adamw_lr,
            embedding_update=name,
        )  # fmt: skip
    for name in args.engines:
        optim = dict(ENGINE_SETTINGS[name])
        if name == "qk-clip":
            optim["qk_clip_threshold"] = args.qk_clip_threshold
        engine_configs += sweep_configs(
            base, name, "muon", muon_lr, args.seeds, adamw_lr=adamw_lr, optim=optim
        )
    if engine_configs:
        more += _run_all(engine_configs, sweep)
    return more


def _resolve_grids(args: argparse.Namespace) -> None:
    """The lr grids not given: the grid sweep's defaults, or the equal budget's."""
    equal = args.budget == "equal"
    for name, grid, equal_grid in (
        ("adamw_lrs", DEFAULT_ADAMW_LRS, EQUAL_ADAMW_LRS),
        ("muon_lrs", DEFAULT_MUON_LRS, EQUAL_MUON_LRS),
        ("muon_adamw_lrs", DEFAULT_MUON_ADAMW_LRS, EQUAL_MUON_ADAMW_LRS),
    ):
        if getattr(args, name) is None:
            setattr(args, name, _lrs(equal_grid if equal else grid))
    if args.steps is None:
        args.steps = EQUAL_STEPS if equal else DEFAULT_STEPS


def run(args: argparse.Namespace) -> int:
    """Check everything, run the sweeps, print the tables, write the outputs."""
    _resolve_grids(args)
    if args.budget == "equal":
        return _run_equal(args)
    check_outputs({"--json": args.json, "--plot": args.plot})
    base = _base_config(args)
    base.validate()  # the corpus, the process count, the model's positions: before any run
    first, *others = args.muon_adamw_lrs
    updates = args.embedding_updates
    runs = len(args.adamw_lrs) + len(args.muon_lrs) + len(others) + len(updates) - 1
    runs += len(args.engines)
    sweep = _Sweep(args, runs * args.seeds, base)
    note(
        f"shardmuon bench lm: {runs * args.seeds} runs of {args.steps} steps at "
        f"{args.nproc} rank(s): AdamW lrs {list(args.adamw_lrs)}, Muon lrs "
        f"{list(args.muon_lrs)} (AdamW group {first}; embeddings by {updates[0]}), Muon's "
        f"AdamW group {others}, then embeddings by {list(updates[1:])} and "
        f"{len(args.engines)} engine settings; their time is estimated after the first "
        "run's first steps"
    )
    rows = _run_all(
        [c for lr in args.adamw_lrs for c in sweep_configs(base, "adamw", "adamw", lr, args.seeds)],
        sweep,
    )
    rows += _run_all(
        [
            c
            for lr in args.muon_lrs
            for c in sweep_configs(base, "muon", "muon", lr, args.seeds, adamw_lr=first)
        ],
        sweep,
    )
    if best_key(rows, "muon") is not None:
        rows += _run_at_muons_best(base, args, rows, others, sweep)
    summary = summarize(rows, args.qk_clip_threshold)
    for name in summary["every_run_diverged"]:
        skipped = " (no AdamW-group or engine runs)" if name == "muon" else ""
        note(f"shardmuon bench lm: {every_run_diverged_line(summary, name)}{skipped}")
    print_lm_tables(summary, args)
    if args.json:
        from shardmuon.bench.report import environment

        environ = environment(world_size=args.nproc, argv=getattr(args, "argv", None))
        payload = {"benchmark": "lm", "environment": environ, "summary": summary, "runs": rows}
        write_json(args.json, payload)
        note_written(args.json, "results (JSON)")
    if args.plot:
        written = plot_lm(rows, summary, args.plot)
        for path, what in written:
            note_written(path, what)
        if not written:
            note(f"shardmuon bench lm: no plot written to {args.plot}: every run diverged")
    return 0


def _tune_configs(base, jobs) -> list:
    """One training config per ``(candidate, seed, steps)`` job of the equal budget."""
    from shardmuon.train.config import optim_settings
    from shardmuon.train.launch import ANNOUNCE
    from shardmuon.train.loop import STOP_ON_DIVERGENCE

    configs = []
    for candidate, seed, steps in jobs:
        optim = {"lr": candidate.lr, "weight_decay": candidate.weight_decay}
        changes: dict[str, Any] = {}
        if candidate.optimizer == "adamw":
            optim["betas"] = (base.optim.betas[0], candidate.beta2)
            changes.update(adamw_lr=None, embedding_update="adamw")
            changes["warmup_steps"] = candidate.warmup
        else:
            changes["adamw_lr"] = candidate.adamw_lr
        label = candidate.label()
        extra = {
            "setting": label,
            "seed": seed,
            ANNOUNCE: f"{label}, seed {seed}, {steps} steps",
            STOP_ON_DIVERGENCE: True,
        }
        configs.append(
            dataclasses.replace(
                base,
                optimizer=candidate.optimizer,
                optim=optim_settings(base.optim, **optim),
                seed=seed,
                steps=steps,
                extra=extra,
                **changes,
            )
        )
    return configs


def _setup(base) -> dict[str, Any]:
    """What every run of the equal budget shares besides its candidate, seed and steps: a
    resume log of another setup is refused."""
    return {
        "model": base.model,
        "num_layers": base.num_layers,
        "batch_size": base.batch_size,
        "seq_len": base.seq_len,
        "warmup_steps": base.warmup_steps,  # Muon's (AdamW's is a candidate's)
        "eval_every": base.eval_every,
        "eval_sequences": base.eval_sequences,
        "data": base.data,
        # The default corpus is this Python's standard library.
        "python": None if base.data else ".".join(map(str, sys.version_info[:2])),
        "data_bytes": base.data_bytes,
        "nproc": base.nproc,
        "embedding_update": base.embedding_update,
        "optim": base.optim.model_dump(mode="json"),
    }


def _run_equal(args: argparse.Namespace) -> int:
    """``--budget equal``: the tuning sweep, the best of each on seeds, the comparison."""
    from shardmuon.bench.lm_tune import ResumeLog, grids, run_equal_budget

    check_outputs({"--json": args.json, "--plot": args.plot})
    adamw, muon = grids(
        args.adamw_lrs, args.adamw_beta2s, args.adamw_weight_decays, args.adamw_warmups,
        args.muon_lrs, args.muon_adamw_lrs, args.muon_weight_decays,
    )  # fmt: skip
    base = _base_config(args)
    base.validate()
    log = ResumeLog(args.resume, _setup(base))
    total = 2 * len(adamw) + 2 * args.final_seeds
    kept = (
        f"; {len(log.rows)} found in {args.resume})"
        if args.resume
        else "); --resume PATH keeps each finished run"
    )
    note(
        f"shardmuon bench lm --budget equal: {len(adamw)} AdamW and {len(muon)} Muon "
        f"configurations of {args.sweep_steps} steps, then each best on {args.final_seeds} "
        f"seeds of {args.steps} steps ({total} runs at {args.nproc} rank(s){kept}"
    )
    result = run_equal_budget(
        adamw,
        muon,
        sweep_steps=args.sweep_steps,
        steps=args.steps,
        final_seeds=args.final_seeds,
        log=log,
        run=lambda jobs: _run_all(_tune_configs(base, jobs)),
        progress=lambda k, n, job: note(f"shardmuon bench lm: run {k} of {n} to go"),
    )
    _print_equal(result)
    if args.json:
        from shardmuon.bench.report import environment

        environ = environment(world_size=args.nproc, argv=getattr(args, "argv", None))
        write_json(args.json, {"benchmark": "lm-equal-budget", "environment": environ, **result})
        note_written(args.json, "results (JSON)")
    if args.plot:
        from shardmuon.bench.lm_report import plot_equal_budget

        written = plot_equal_budget(result, args.plot)
        if written is None:
            note(f"shardmuon bench lm: no plot written to {args.plot}: a best run diverged")
        else:
            note_written(written, "the two best on their seeds (PNG)")
    return 0


def _print_equal(result: dict[str, Any]) -> None:
    from shardmuon.bench.report import print_table

    for name in ("adamw", "muon"):
        rows = sorted((r for r in result["sweep"] if r["candidate"]["optimizer"] == name),
                      key=lambda r: r["final"])  # fmt: skip
        print_table(
            f"{name}: the {len(rows)} configurations, {result['sweep_steps']} steps, seed 0 "
            "(final held-out loss, nats per byte; best first)",
            ["configuration", "final"],
            [[r["label"], f"{r['final']:.4f}" if math.isfinite(r["final"]) else "diverged"]
             for r in rows],
        )  # fmt: skip
    c = result["comparison"]

    def cell(side: dict[str, Any]) -> str:
        if side["mean"] is None:
            return "diverged"
        std = "" if side["std"] is None else f" ± {side['std']:.4f}"
        return f"{side['mean']:.4f}{std}"

    print_table(
        f"the best of each on {c['seeds'][0]} seeds, {result['steps']} steps",
        ["optimizer", "configuration", "final held-out (mean ± std)"],
        [[name, result["best"][name]["label"], cell(c[name])] for name in ("adamw", "muon")],
    )
    if c["score"] is None:
        print(f"no comparison: a seed of {' and '.join(c['diverged'])}'s best diverged")
        return

    def share(value: float | None) -> str:
        return "never" if value is None else f"{value:.2f}x"

    low, high = c["steps_share_range"]
    print(
        f"rule: (AdamW's mean final - Muon's mean) x sqrt(n) >= {c['margin']}: "
        f"{c['score']:.4f} -> Muon ends lower: {'yes' if c['ends_lower'] else 'no'}; "
        f"reaches AdamW's final loss with that margin at {share(c['steps_share'])} its steps "
        f"({share(low)}-{share(high)} with AdamW's mean one standard error either way)"
    )
