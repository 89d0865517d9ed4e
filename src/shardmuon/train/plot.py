"""Loss-curve PNGs: one or several ``shardmuon train --json run.json`` files overlaid."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path


def read_max_logits(path: str | os.PathLike) -> tuple[list[int], list[float], float | None]:
    """Steps and max attention logits of a ``--json`` file (empty without ``--qk-clip-threshold``
    or ``--log-max-logit``), and the QK-clip threshold (``None``: not clipped)."""
    path = Path(path)
    if path.suffix == ".csv":
        return [], [], None
    payload = json.loads(path.read_text())
    rows = payload.get("max_logits", [])
    threshold = payload.get("config", {}).get("qk_clip_threshold")
    return [int(r["step"]) for r in rows], [float(r["max_logit"]) for r in rows], threshold


def read_run(path: str | os.PathLike) -> tuple[list[int], list[float], str]:
    """Steps, losses and a label from a ``--json`` file (or a ``--csv`` ``step,loss`` file)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"loss file {str(path)!r} does not exist")
    if path.suffix == ".csv":
        rows = [line.split(",") for line in path.read_text().splitlines()[1:] if line.strip()]
        return [int(r[0]) for r in rows], [float(r[1]) for r in rows], path.stem
    try:
        payload = json.loads(path.read_text())
        losses = payload["losses"]
        steps = [int(item["step"]) for item in losses]
        values = [float(item["loss"]) for item in losses]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(
            f"{str(path)!r} is not a shardmuon train --json file (JSON with 'losses': "
            f"[{{'step', 'loss'}}, ...]): {err}"
        ) from err
    return steps, values, path.stem


def plot_runs(
    paths: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    labels: Sequence[str] | None = None,
    title: str = "reverse-text SFT loss",
    log_scale: bool = True,
) -> Path:
    """Overlay the loss curves of ``paths`` into the PNG ``out``; returns its path."""
    if not paths:
        raise ValueError("give at least one loss file to plot")
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"got {len(labels)} labels for {len(paths)} loss files")
    runs = [read_run(p) for p in paths]
    if labels is not None:
        runs = [(steps, values, label) for (steps, values, _), label in zip(runs, labels)]
    logits = []
    for p, (_, _, label) in zip(paths, runs):
        steps, values, threshold = read_max_logits(p)
        if steps:
            logits.append((steps, values, label, threshold))
    return plot_curves(runs, out, title=title, log_scale=log_scale, max_logits=logits)


def plot_curves(
    curves: Sequence[tuple[Sequence[int], Sequence[float], str]],
    out: str | os.PathLike,
    *,
    title: str = "reverse-text SFT loss",
    log_scale: bool = True,
    max_logits: Sequence[tuple[Sequence[int], Sequence[float], str, float | None]] = (),
) -> Path:
    """Draw ``(steps, losses, label)`` curves into the PNG ``out``; returns its path.

    ``max_logits``: ``(steps, max logits, label, QK-clip threshold or None)`` per run that
    recorded them, drawn in a second panel below (the threshold as a dotted line).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if max_logits:
        fig, (ax, logit_ax) = plt.subplots(2, 1, figsize=(8, 7), dpi=120, sharex=True)
        for steps, values, label, threshold in max_logits:
            (line,) = logit_ax.plot(steps, values, label=label, linewidth=1.2)
            if threshold is not None:
                logit_ax.axhline(
                    threshold, color=line.get_color(), linestyle=":", label=f"{label}: tau"
                )
        logit_ax.set_ylabel("max attention logit (before the clip)")
        logit_ax.set_xlabel("step")
        logit_ax.grid(True, alpha=0.3)
        logit_ax.legend(fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for steps, values, label in curves:
        ax.plot(steps, values, label=label, linewidth=1.2)
    if not max_logits:
        ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over target tokens)")
    if log_scale:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out
