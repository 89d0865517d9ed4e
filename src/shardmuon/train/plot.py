"""Loss-curve PNGs of ``shardmuon train``: one run (``--plot``) or several ``--json`` files
overlaid (``shardmuon train plot``).

The top panel holds the training loss per step and, for ``--task lm``, the held-out loss
(markers on a dashed line). Runs that recorded attention logits (``--qk-clip-threshold``,
``--log-max-logit``) add a panel of the max logit before the clip (solid) and after it
(dashed) with the threshold (dotted), and one of how many heads each step clipped. Legends
sit beside the panels, over no data; a log loss axis is labelled at 1-2-5 values (finer
when the curve spans less), so that it always has at least three readable ticks.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LogitSeries", "RunCurves", "plot_curves", "plot_result", "plot_runs", "read_run"]


@dataclass
class LogitSeries:
    """The max attention logit per step, before and after the clip, and the heads clipped
    (``threshold`` ``None``: recorded only)."""

    steps: list[int]
    before: list[float]
    after: list[float]
    clipped: list[int]
    threshold: float | None = None


@dataclass
class RunCurves:
    """What one run's figure shows."""

    label: str
    steps: list[int]
    losses: list[float]
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    logits: LogitSeries | None = None
    task: str = "reverse"


def _logits_from_rows(rows: list[dict], threshold: float | None) -> LogitSeries | None:
    if not rows:
        return None
    return LogitSeries(
        [int(r["step"]) for r in rows],
        [float(r["max_logit"]) for r in rows],
        [float(r.get("max_logit_after", r["max_logit"])) for r in rows],
        [int(r.get("clipped_heads", 0)) for r in rows],
        threshold,
    )


def _recorded_threshold(config: dict) -> float | None:
    # Nested under "optim" since the optimizer settings are a MuonConfig; flat before.
    optim = config.get("optim")
    return (optim if isinstance(optim, dict) else config).get("qk_clip_threshold")


def read_run(path: str | os.PathLike) -> RunCurves:
    """The curves of a ``--json`` file (or of a ``--csv`` ``step,loss`` file)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"loss file {str(path)!r} does not exist")
    if path.suffix == ".csv":
        rows = [line.split(",") for line in path.read_text().splitlines()[1:] if line.strip()]
        return RunCurves(path.stem, [int(r[0]) for r in rows], [float(r[1]) for r in rows])
    try:
        payload = json.loads(path.read_text())
        steps = [int(item["step"]) for item in payload["losses"]]
        losses = [float(item["loss"]) for item in payload["losses"]]
        evals = payload.get("eval", [])
        config = payload.get("config", {})
        logits = _logits_from_rows(payload.get("max_logits", []), _recorded_threshold(config))
        return RunCurves(
            path.stem,
            steps,
            losses,
            [int(e["step"]) for e in evals],
            [float(e["loss"]) for e in evals],
            logits,
            config.get("task", "reverse"),
        )
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{str(path)!r} is not a shardmuon train --json file (JSON with 'losses': "
            f"[{{'step', 'loss'}}, ...]): {err}"
        ) from err


def plot_runs(
    paths: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
    log_scale: bool = True,
) -> Path:
    """Overlay the curves of ``paths`` into the PNG ``out``; returns its path."""
    if not paths:
        raise ValueError("give at least one loss file to plot")
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"got {len(labels)} labels for {len(paths)} loss files")
    runs = [read_run(p) for p in paths]
    for run, label in zip(runs, labels or ()):
        run.label = label
    return plot_curves(runs, out, title=title, log_scale=log_scale)


def plot_result(result, config, label: str, out: str | os.PathLike) -> Path:
    """The ``--plot`` of one run: ``result`` (a ``TrainResult``) of ``config``."""
    steps = sorted(result.losses)
    logged = sorted(result.max_logits)
    logits = None
    if logged:
        logits = LogitSeries(
            logged,
            [result.max_logits[s] for s in logged],
            [result.max_logits_after.get(s, result.max_logits[s]) for s in logged],
            [result.clipped_heads.get(s, 0) for s in logged],
            config.optim.qk_clip_threshold,
        )
    run = RunCurves(
        label,
        steps,
        [result.losses[s] for s in steps],
        [e["step"] for e in result.eval],
        [e["loss"] for e in result.eval],
        logits,
        config.task,
    )
    return plot_curves([run], out)


def log_ticks(low: float, high: float) -> list[float]:
    """Labelled ticks for a log axis over ``[low, high]`` (> 0): the 1-2-5 values in it,
    or every 1..9 value, or those and the halves below 3 (1.5, 2.5), or evenly spaced
    round values, whichever first gives three."""
    if not (0 < low <= high):
        return []
    for mantissas in ((1, 2, 5), range(1, 10), (1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [
            m * 10.0**e
            for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
            for m in mantissas
            if low <= m * 10.0**e <= high
        ]
        if len(ticks) >= 3:
            return ticks
    from matplotlib.ticker import MaxNLocator

    return [v for v in MaxNLocator(nbins=4).tick_values(low, high) if low <= v <= high and v > 0]


def _label_log_axis(ax) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    low, high = ax.get_ylim()
    ax.yaxis.set_major_locator(FixedLocator(log_ticks(low, high)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(low, high)


# Panel count -> (height ratios, figure height in inches): the loss panel stays the largest.
_PANELS = {1: ((3,), 4.8), 2: ((3, 2), 7.5), 3: ((3, 2, 1), 8.5)}


def _legend_beside(ax) -> None:
    # Beside the axes (constrained layout makes room): never over the curves.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _draw_logits(logit_ax, heads_ax, runs: Sequence[RunCurves]) -> None:
    """The max logits into ``logit_ax``; the heads clipped into ``heads_ax`` (if not None)."""
    for run in runs:
        series = run.logits
        if series is None:
            continue
        (line,) = logit_ax.plot(
            series.steps, series.before, linewidth=1.2, label=f"{run.label}: before the clip"
        )
        color = line.get_color()
        if series.threshold is not None:
            logit_ax.plot(
                series.steps, series.after, color=color, linestyle="--", linewidth=1.0,
                label=f"{run.label}: after the clip",
            )  # fmt: skip
            logit_ax.axhline(
                series.threshold, color=color, linestyle=":", label=f"{run.label}: tau"
            )
        if heads_ax is not None and series.threshold is not None:
            heads_ax.step(series.steps, series.clipped, where="mid", color=color, label=run.label)
    logit_ax.set_ylabel("max attention logit")
    logit_ax.grid(True, alpha=0.3)
    _legend_beside(logit_ax)
    if heads_ax is not None:
        from matplotlib.ticker import MaxNLocator

        heads_ax.set_ylabel("heads clipped")
        heads_ax.set_ylim(bottom=0)
        heads_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        heads_ax.grid(True, alpha=0.3)
        _legend_beside(heads_ax)


def plot_curves(
    runs: Sequence[RunCurves],
    out: str | os.PathLike,
    *,
    title: str | None = None,
    log_scale: bool = True,
) -> Path:
    """Draw ``runs`` into the PNG ``out`` (see the module docstring); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    logged = [run.logits for run in runs if run.logits is not None]
    # The clipped-heads panel only when some run clipped (a record-only run clips none).
    panels = 1 + bool(logged) + any(series.threshold is not None for series in logged)
    ratios, height = _PANELS[panels]
    fig, axes = plt.subplots(
        panels, 1, figsize=(9, height), dpi=120, sharex=True, height_ratios=ratios,
        layout="constrained", squeeze=False,
    )  # fmt: skip
    ax, *lower = axes[:, 0]
    if logged:
        _draw_logits(lower[0], lower[1] if len(lower) > 1 else None, runs)
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    lm = any(run.task == "lm" for run in runs)
    for run in runs:
        (line,) = ax.plot(run.steps, run.losses, linewidth=1.0, label=f"{run.label}: training")
        if run.eval_steps:
            ax.plot(
                run.eval_steps, run.eval_losses, color=line.get_color(), linestyle="--",
                marker="o", markersize=3, linewidth=1.2, label=f"{run.label}: held-out",
            )  # fmt: skip
    ax.set_ylabel("loss (nats per byte)" if lm else "loss (mean over target tokens)")
    if log_scale:
        ax.set_yscale("log")
        _label_log_axis(ax)
    if title is None:
        title = "byte-level LM loss" if lm else "reverse-text SFT loss"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    _legend_beside(ax)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out
