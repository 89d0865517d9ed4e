"""What ``shardmuon bench lm`` makes of its runs: the summary (pure functions of the run
rows), its tables, and its three PNGs.

A run row (see :func:`shardmuon.bench.lm._run_all`) holds its setting, optimizer, lr, seed,
steps, held-out losses ``eval`` (``{"step", "tokens", "loss"}``), median step seconds, max
logits, and whether it diverged. A configuration (a setting at one lr pair) diverged when
any of its seeds did: its losses are left out of the figures (``null``, ``"diverged":
true``), it is never the best lr, and when every configuration of an optimizer diverged the
summary says so (``every_run_diverged``) and has no best lr for it. The PNGs, from
``--plot PATH``:

* ``PATH``: held-out loss against tokens, AdamW and Muon at their best lr (the mean over
  the seeds, the band from the lowest to the highest seed), AdamW's final loss dotted;
* ``PATH-engines``: every engine setting's held-out loss, and its final loss against the
  default's seed range;
* ``PATH-logits``: the max attention logit per step of the default and of the QK-clip run
  (before and after the clip), with the threshold.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardmuon.bench.report import fmt, print_table

__all__ = [
    "best_key",
    "every_run_diverged_line",
    "plot_equal_budget",
    "plot_lm",
    "print_lm_tables",
    "steps_to_reach",
    "summarize",
]

# Muon's targets against AdamW: steps to AdamW's final loss at most this share.
STEPS_RATIO_TARGET = 0.7


def final_loss(row: dict[str, Any]) -> float:
    """The last held-out loss of a run."""
    return row["eval"][-1]["loss"]


def diverged(row: dict[str, Any]) -> bool:
    """Whether a run diverged: it says so, or its last held-out loss is not finite."""
    if row.get("diverged"):
        return True
    loss = final_loss(row) if row["eval"] else None
    return loss is None or not math.isfinite(loss)


def steps_to_reach(evals: Sequence[dict[str, Any]], target: float) -> float | None:
    """The first step at which the held-out loss is at or below ``target``, interpolated
    linearly between the two evaluations around the crossing; ``None`` if never."""
    previous = None
    for point in evals:
        if point["loss"] <= target:
            if previous is None:
                return float(point["step"])
            step, loss = previous
            share = (loss - target) / (loss - point["loss"])
            return step + share * (point["step"] - step)
        previous = (point["step"], point["loss"])
    return None


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "half_range": (max(values) - min(values)) / 2,
        "min": min(values),
        "max": max(values),
    }


def _final_spread(group: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The spread of the seeds' final held-out losses; ``None`` figures when any diverged."""
    count = sum(diverged(r) for r in group)
    if count:
        figures = dict.fromkeys(("mean", "half_range", "min", "max"))
        return {**figures, "diverged": True, "diverged_seeds": count, "seeds": len(group)}
    finals = [final_loss(r) for r in group]
    return {**_spread(finals), "diverged": False, "diverged_seeds": 0, "seeds": len(group)}


Key = tuple[str, float, "float | None"]


def _groups(rows: Sequence[dict[str, Any]]) -> dict[Key, list[dict[str, Any]]]:
    """The runs by ``(setting, lr, adamw_lr)``: the seeds of one configuration."""
    out: dict[Key, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault((row["setting"], row["lr"], row["adamw_lr"]), []).append(row)
    return out


def best_key(rows: Sequence[dict[str, Any]], setting: str) -> Key | None:
    """The ``(setting, lr, adamw_lr)`` of ``setting`` with the lowest mean final held-out
    loss over its seeds, among those none of whose seeds diverged; ``None`` when every one
    diverged. Raises ``ValueError`` when ``rows`` holds no run of ``setting``."""
    groups = {key: group for key, group in _groups(rows).items() if key[0] == setting}
    if not groups:
        raise ValueError(f"no {setting} run to choose an lr from")
    means = {
        key: statistics.fmean(final_loss(r) for r in group)
        for key, group in groups.items()
        if not any(diverged(r) for r in group)
    }
    return min(means, key=means.get) if means else None


def _intervals_overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def _setting_entry(
    key: Key, group: Sequence[dict[str, Any]], target: float | None, steps: int
) -> dict[str, Any]:
    """One row of the comparison at the best lrs: ``key``'s final loss, steps to ``target``
    (AdamW's best final loss), step time and max logit."""
    name, lr, group_lr = key
    final = _final_spread(group)
    reach = None
    if name == "adamw" and not final["diverged"]:
        reach = float(steps)  # AdamW reaches its own final loss at its last step
    elif target is not None and not final["diverged"]:
        reached = [steps_to_reach(r["eval"], target) for r in group]
        reach = None if None in reached else statistics.fmean(reached)
    return {
        "setting": name,
        "lr": lr,
        "adamw_lr": group_lr,
        "diverged": final["diverged"],
        "final": final,
        "steps_to_target": reach,
        "steps_ratio": None if reach is None else reach / steps,
        "step_seconds": statistics.fmean(r["step_seconds"] for r in group),
        "max_logit": max(max(r["max_logits"], default=-math.inf) for r in group),
    }


def summarize(rows: Sequence[dict[str, Any]], qk_clip_threshold: float | None) -> dict[str, Any]:
    """The figures of the tables: the lr grid, the comparison at the best lrs, the targets.

    An optimizer every configuration of which diverged has no best lr (``None``) and is
    listed in ``every_run_diverged``; the comparison then leaves it out.
    """
    groups = _groups(rows)
    adamw, muon = best_key(rows, "adamw"), best_key(rows, "muon")
    grid = [
        {
            "setting": key[0],
            "lr": key[1],
            "adamw_lr": key[2],
            "best": key in (adamw, muon),
            **_final_spread(group),
        }
        for key, group in groups.items()
        if key[0] in ("adamw", "muon")
    ]
    # The run length (a diverged run's evaluations stop early).
    steps = max(row.get("steps", max(p["step"] for p in row["eval"])) for row in rows)
    target = None if adamw is None else statistics.fmean(final_loss(r) for r in groups[adamw])
    compared = [key for key in (adamw, muon) if key is not None]
    compared += [key for key in groups if key[0] not in ("adamw", "muon")]
    settings = [_setting_entry(key, groups[key], target, steps) for key in compared]
    by_name = {entry["setting"]: entry for entry in settings}
    default, baseline = by_name.get("muon"), by_name.get("adamw")
    engines = [entry for entry in settings if entry["setting"] not in ("adamw", "muon")]
    for entry in engines:
        entry["within_default_spread"] = (
            None
            if default is None
            else not entry["diverged"] and _intervals_overlap(entry["final"], default["final"])
        )
    muon_ratio = None if default is None else default["steps_ratio"]
    lower = default is not None and baseline is not None
    return {
        "steps": steps,
        "adamw": None if adamw is None else list(adamw),
        "muon": None if muon is None else list(muon),
        "every_run_diverged": [
            name for name, key in (("adamw", adamw), ("muon", muon)) if key is None
        ],
        "target_loss": target,
        "qk_clip_threshold": qk_clip_threshold,
        "grid": grid,
        "settings": settings,
        "targets": {
            "muon_steps_ratio": muon_ratio,
            "muon_steps_ratio_met": muon_ratio is not None and muon_ratio <= STEPS_RATIO_TARGET,
            "muon_lower_final_met": lower and default["final"]["mean"] < baseline["final"]["mean"],
            "engines_within_spread_met": all(e["within_default_spread"] for e in engines),
        },
    }


def _loss_cell(spread: dict[str, Any]) -> str:
    if spread.get("diverged"):
        count, seeds = spread["diverged_seeds"], spread["seeds"]
        return "diverged" if count == seeds else f"diverged ({count} of {seeds} seeds)"
    return f"{spread['mean']:.4f} ± {spread['half_range']:.4f}"


OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon"}


def every_run_diverged_line(summary: dict[str, Any], name: str) -> str:
    """One line saying that every run of ``name`` diverged, with its lrs."""
    lrs = ", ".join(f"{g['lr']:g}" for g in summary["grid"] if g["setting"] == name)
    return f"every {OPTIMIZER_NAMES[name]} run diverged (lr {lrs}): it has no best lr"


def print_lm_tables(summary: dict[str, Any], args) -> None:
    """The lr grid, then the comparison at the best lrs, then the targets, to stdout."""
    seeds = f"{args.seeds} seed{'s' if args.seeds > 1 else ''}"
    print_table(
        f"held-out loss after {summary['steps']} steps, by lr ({seeds})",
        ["optimizer", "lr", "AdamW\ngroup lr", "final held-out", "best"],
        [
            [
                g["setting"],
                f"{g['lr']:g}",
                fmt(g["adamw_lr"], "g"),
                _loss_cell(g),
                "*" if g["best"] else "",
            ]
            for g in summary["grid"]
        ],
        legend=[
            ("AdamW group lr", "Muon's AdamW group (embeddings, norms, head)"),
            (
                "final held-out",
                "nats per byte: mean ± half the range over the seeds; 'diverged': a seed's "
                "loss stopped being finite, or its run failed with non-finite weights",
            ),
        ],
    )
    for name in summary["every_run_diverged"]:
        print(every_run_diverged_line(summary, name))
    target = summary["target_loss"]
    rows = []
    for s in summary["settings"]:
        within = s.get("within_default_spread")
        rows.append(
            [
                s["setting"],
                f"{s['lr']:g}",
                _loss_cell(s["final"]),
                fmt(s["steps_to_target"], ".0f"),
                fmt(s["steps_ratio"], ".2f"),
                fmt(s["step_seconds"], ".2f"),
                "" if within is None else ("yes" if within else "no"),
            ]
        )
    if rows:
        group_lr = "-" if summary["muon"] is None else fmt(summary["muon"][2], "g")
        reference = (
            "no AdamW run finished"
            if target is None
            else f"AdamW's final held-out loss {target:.4f}"
        )
        print_table(
            f"at the best lrs, Muon's AdamW group at {group_lr}, {reference}",
            ["setting", "lr", "final held-out", "steps", "x AdamW", "s/step", "in\nspread"],
            rows,
            legend=[
                (
                    "steps",
                    "to reach AdamW's final held-out loss (mean over seeds; '-': not all did)",
                ),
                ("x AdamW", "steps / AdamW's steps (its run length)"),
                ("s/step", "median step time, mean over seeds (a shared CPU: noisy)"),
                ("in spread", "the seeds' range overlaps the default (muon) row's"),
            ],
        )
    met = summary["targets"]
    ratio = met["muon_steps_ratio"]
    print(
        f"targets: Muon needs {fmt(ratio, '.2f')}x AdamW's steps "
        f"(<= {STEPS_RATIO_TARGET}: {'met' if met['muon_steps_ratio_met'] else 'not met'}); "
        f"lower final loss at equal steps: {'met' if met['muon_lower_final_met'] else 'not met'}; "
        f"every engine in the default's spread: "
        f"{'met' if met['engines_within_spread_met'] else 'not met'}"
    )


def _label(key: Sequence[Any]) -> str:
    name, lr, group_lr = key
    return f"{name} (lr {lr:g}" + ("" if group_lr is None else f", AdamW group {group_lr:g}") + ")"


def _curve(
    group: Sequence[dict[str, Any]],
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Tokens, and the mean, lowest and highest held-out loss over the seeds at each."""
    tokens = [p["tokens"] for p in group[0]["eval"]]
    columns = list(zip(*[[p["loss"] for p in r["eval"]] for r in group]))
    return (
        tokens,
        [statistics.fmean(c) for c in columns],
        [min(c) for c in columns],
        [max(c) for c in columns],
    )


def _new_figure(width: float = 9.0, height: float = 5.0, columns: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(width, height), dpi=120, layout="constrained")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _legend_beside(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _token_axis(ax) -> None:
    from matplotlib.ticker import EngFormatter

    ax.set_xlabel("training tokens (bytes)")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))


def _zoom_on_tail(ax, lows: Sequence[float], highs: Sequence[float]) -> None:
    # The first evaluations (near ln 257 = 5.5) would squash the differences that matter:
    # show from a bit above the loss after a fifth of the run down to the lowest.
    top = max(h[len(h) // 5] for h in highs)
    bottom = min(min(lo) for lo in lows)
    ax.set_ylim(bottom - 0.05 * (top - bottom), top)


def plot_equal_budget(result: dict[str, Any], path: Path) -> Path | None:
    """``--budget equal``: the two best configurations' held-out loss on their seeds (mean,
    band: the seeds' range) and AdamW's mean final loss; ``None`` if a side diverged."""
    runs = result["final_runs"]
    if any(r.get("diverged") or not r["eval"] for side in runs.values() for r in side):
        return None
    curves = [
        (runs[name], f"{result['best'][name]['label']} ({len(runs[name])} seeds)")
        for name in ("adamw", "muon")
    ]
    target = (result["comparison"]["adamw"]["mean"], "AdamW's mean final")
    title = "Muon vs an equally tuned AdamW (band: seed range)"
    return _seed_bands(curves, target, title, Path(path))


def _seed_bands(
    curves: Sequence[tuple[Sequence[dict[str, Any]], str]],
    target: tuple[float, str] | None,
    title: str,
    path: Path,
) -> Path:
    """Each ``(runs, label)``'s held-out loss (mean over the seeds, band: their range)
    against training tokens, a dotted line at ``target``, zoomed on the tail."""
    fig, ax = _new_figure()
    lows, highs = [], []
    for group, label in curves:
        tokens, mean, low, high = _curve(group)
        (line,) = ax.plot(tokens, mean, marker="o", markersize=3, label=label)
        ax.fill_between(tokens, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        lows.append(low)
        highs.append(high)
    if target is not None:
        ax.axhline(target[0], color="gray", linestyle=":", label=target[1])
    _zoom_on_tail(ax, lows, highs)
    _token_axis(ax)
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    _legend_beside(ax)
    return _save(fig, path)


def _plot_optimizers(groups, summary, path: Path) -> Path | None:
    keys = [key for key in (summary["adamw"], summary["muon"]) if key is not None]
    if not keys:
        return None  # every run diverged: no curve to draw
    target = summary["target_loss"]
    return _seed_bands(
        [(groups[tuple(key)], _label(key)) for key in keys],
        None if target is None else (target, "AdamW's final"),
        "Muon vs AdamW, byte-level LM, held-out loss (band: seed range)",
        path,
    )


def _engine_entries(summary) -> list[dict[str, Any]]:
    """The default (muon) row then each engine's, when Muon has a best lr."""
    if summary["muon"] is None:
        return []
    return [s for s in summary["settings"] if s["setting"] != "adamw"]


def _plot_engines(groups, summary, path: Path) -> Path:
    fig, (ax, final_ax) = _new_figure(12.0, 5.0, 2)
    entries = _engine_entries(summary)
    names = [s["setting"] + (" (diverged)" if s["diverged"] else "") for s in entries]
    lows, highs = [], []
    for index, entry in enumerate(entries):
        if entry["diverged"]:
            continue  # named on the right, no curve
        tokens, mean, low, high = _curve(groups[(entry["setting"], entry["lr"], entry["adamw_lr"])])
        # Curves that lie on each other stay told apart by their dashes.
        dashes = ("-", "--", "-.", ":")[index % 4]
        ax.plot(tokens, mean, linewidth=1.2, linestyle=dashes, label=entry["setting"])
        lows.append(low)
        highs.append(high)
    _zoom_on_tail(ax, lows, highs)
    _token_axis(ax)
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title(f"engines at {_label(summary['muon'])}, mean over seeds", fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend_beside(ax)
    finals = [s["final"] for s in entries]
    default = finals[0]
    final_ax.axvspan(default["min"], default["max"], color="gray", alpha=0.2)
    for row, spread in enumerate(finals):
        if spread["diverged"]:
            continue
        final_ax.errorbar(
            spread["mean"], row, xerr=[[spread["mean"] - spread["min"]], [spread["max"] - spread["mean"]]],
            fmt="o", color="C0", capsize=3,
        )  # fmt: skip
    final_ax.set_yticks(range(len(names)), names)
    final_ax.invert_yaxis()
    final_ax.set_xlabel(
        f"final held-out loss at step {summary['steps']}\n(bars: seed range; shaded: muon's)"
    )
    final_ax.set_title("final loss per setting")
    final_ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


def _steps(values: Sequence[float]) -> range:
    return range(1, len(values) + 1)  # a diverged run's are fewer


def _plot_logits(rows, summary, path: Path) -> Path | None:
    if summary["muon"] is None:
        return None
    clipped = [r for r in rows if r["setting"] == "qk-clip" and r["seed"] == 0]
    default = list(summary["muon"])
    plain = [r for r in rows if [r["setting"], r["lr"], r["adamw_lr"]] == default and not r["seed"]]
    if not clipped or not plain:
        return None
    fig, ax = _new_figure()
    ax.plot(_steps(plain[0]["max_logits"]), plain[0]["max_logits"], label="muon, no clip")
    before, after = clipped[0]["max_logits"], clipped[0]["max_logits_after"]
    ax.plot(_steps(before), before, label="muon + QK-clip: before the clip")
    ax.plot(
        _steps(after),
        after,
        linestyle="--",
        label="muon + QK-clip: after the clip",
    )
    ax.axhline(summary["qk_clip_threshold"], color="gray", linestyle=":", label="tau")
    ax.set_xlabel("step")
    ax.set_ylabel("max attention logit (any head, any layer)")
    ax.set_title(f"max attention logit, seed 0, {_label(summary['muon'])}", fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend_beside(ax)
    return _save(fig, path)


def plot_lm(
    rows: Sequence[dict[str, Any]], summary: dict[str, Any], plot: str
) -> list[tuple[Path, str]]:
    """Write the PNGs (see the module docstring); ``(path, what)`` of each written (none
    of a figure whose every run diverged)."""
    base = Path(plot)
    groups = _groups(rows)
    written = []
    optimizers = _plot_optimizers(groups, summary, base)
    if optimizers is not None:
        written.append((optimizers, "Muon vs AdamW (PNG)"))
    if len(_engine_entries(summary)) > 1:
        path = base.with_name(f"{base.stem}-engines{base.suffix}")
        written.append((_plot_engines(groups, summary, path), "engines (PNG)"))
    logits = _plot_logits(rows, summary, base.with_name(f"{base.stem}-logits{base.suffix}"))
    if logits is not None:
        written.append((logits, "max attention logits (PNG)"))
    return written
