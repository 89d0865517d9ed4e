"""``shardmuon bench lm --budget equal``: Muon against an equally tuned AdamW, with seeds and
a stated significance rule, resumable.

The comparison a reviewer accepts gives both optimizers the same tuning budget and trains to
the end of each one's schedule. Here:

1. **An equal budget.** AdamW over lr × β2 × weight decay × warm-up steps, Muon over lr ×
   the lr of its AdamW group × weight decay: the two grids must hold the same number of
   configurations (refused otherwise). Every configuration runs once (seed 0) for
   ``--sweep-steps`` steps with the cosine schedule to its end.
2. **Seeds.** The best configuration of each (lowest final held-out loss) runs again on
   ``--final-seeds`` seeds (≥ 3) for ``--steps`` steps (600 by default): the comparison.
3. **A significance rule** (modded-nanogpt's): with ``L`` AdamW's mean final held-out loss
   over its seeds, Muon *ends lower at equal steps* when ``(L - m)·√n ≥ 0.004``, ``m`` its
   mean final loss over its ``n`` seeds; it *reaches AdamW's final loss in k× the steps* at
   the first evaluation step ``k·T`` where its mean loss over the seeds ``m_k`` satisfies
   ``(L - m_k)·√n ≥ 0.004`` (``None``: it never does). ``L`` is an estimate too: ``k`` is
   also given where ``L`` lies one standard error of AdamW's mean higher and lower.

Every finished run is appended to ``--resume PATH`` (one JSON object a line) as soon as it
ends; a command started again with the same ``--resume`` skips the runs found there (same
configuration, seed and steps), so a sweep of hours survives an interruption.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Candidate",
    "ResumeLog",
    "compare",
    "grids",
    "run_equal_budget",
]

# modded-nanogpt's rule for a claimed result: (target - mean) * sqrt(n) >= this.
SIGNIFICANCE_MARGIN = 0.004


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration of the grid: the optimizer and its hyperparameters."""

    optimizer: str  # "adamw" or "muon"
    lr: float
    weight_decay: float
    beta2: float | None = None  # AdamW's
    warmup: int | None = None  # AdamW's warm-up steps (Muon keeps the base run's)
    adamw_lr: float | None = None  # Muon's AdamW group

    def label(self) -> str:
        """A short name: ``adamw lr 0.002 b2 0.95 wd 0.1 wu 20``."""
        parts = [self.optimizer, f"lr {self.lr:g}"]
        if self.beta2 is not None:
            parts.append(f"b2 {self.beta2:g}")
        if self.adamw_lr is not None:
            parts.append(f"group {self.adamw_lr:g}")
        parts.append(f"wd {self.weight_decay:g}")
        if self.warmup is not None:
            parts.append(f"wu {self.warmup}")
        return " ".join(parts)


def grids(
    adamw_lrs: Sequence[float],
    beta2s: Sequence[float],
    adamw_weight_decays: Sequence[float],
    warmups: Sequence[int],
    muon_lrs: Sequence[float],
    muon_adamw_lrs: Sequence[float],
    muon_weight_decays: Sequence[float],
) -> tuple[list[Candidate], list[Candidate]]:
    """AdamW's and Muon's candidates, the full products of their grids. Raises
    ``ValueError`` when the two counts differ (the budget is the point)."""
    adamw = [
        Candidate("adamw", lr, wd, beta2=b2, warmup=wu)
        for lr, b2, wd, wu in itertools.product(adamw_lrs, beta2s, adamw_weight_decays, warmups)
    ]
    muon = [
        Candidate("muon", lr, wd, adamw_lr=group)
        for lr, group, wd in itertools.product(muon_lrs, muon_adamw_lrs, muon_weight_decays)
    ]
    if len(adamw) != len(muon):
        raise ValueError(
            f"an equal budget needs as many AdamW as Muon configurations: AdamW's grid has "
            f"{len(adamw)} ({len(adamw_lrs)} lrs x {len(beta2s)} beta2 x "
            f"{len(adamw_weight_decays)} weight decays x {len(warmups)} warm-ups), Muon's "
            f"{len(muon)} ({len(muon_lrs)} lrs x {len(muon_adamw_lrs)} AdamW-group lrs x "
            f"{len(muon_weight_decays)} weight decays); change a grid so they match"
        )
    return adamw, muon


def run_key(candidate: Candidate, seed: int, steps: int) -> str:
    """What identifies a finished run in the resume log."""
    return json.dumps([dataclasses.asdict(candidate), seed, steps], sort_keys=True)


class ResumeLog:
    """The finished runs, one JSON object a line, appended as each run ends. The first line
    records the ``setup`` the runs were made with (model, batch, data, ...: what the
    candidates do not say): a log of another setup is refused, not silently reused."""

    def __init__(self, path: str | Path | None, setup: dict[str, Any] | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.setup = setup
        self.rows: dict[str, dict[str, Any]] = {}
        found = None
        if self.path is not None and self.path.exists():
            text = self.path.read_text()
            if text and not text.endswith("\n"):
                # A last line cut off by an interruption: dropped from the file (its run
                # runs again), so that the next run is appended on a line of its own.
                text = text[: text.rfind("\n") + 1]
                self.path.write_text(text)
            lines = text.splitlines()
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise ValueError(f"{self.path}:{number} is not a JSON line") from None
                if "setup" in row and "key" not in row:
                    found = row["setup"]
                    continue
                self.rows[row["key"]] = row
        if setup is not None and found is not None and found != setup:
            changed = sorted(k for k in {*found, *setup} if found.get(k) != setup.get(k))
            what = ", ".join(f"{k} {found.get(k)!r} then, {setup.get(k)!r} now" for k in changed)
            raise ValueError(
                f"{self.path} holds runs of another setup ({what}); give another --resume "
                "file, or the same settings"
            )
        if setup is not None and found is None and self.rows:
            raise ValueError(f"{self.path} records no setup: its runs cannot be matched")
        self._needs_header = setup is not None and found is None

    def get(self, key: str) -> dict[str, Any] | None:
        return self.rows.get(key)

    def __getitem__(self, key: str) -> dict[str, Any]:
        return self.rows[key]

    def add(self, key: str, row: dict[str, Any]) -> None:
        row = {**row, "key": key}
        self.rows[key] = row
        if self.path is not None:
            with self.path.open("a") as log:
                if self._needs_header:
                    log.write(json.dumps({"setup": self.setup}) + "\n")
                    self._needs_header = False
                log.write(json.dumps(row) + "\n")


def _final(row: dict[str, Any]) -> float:
    if row.get("diverged") or not row["eval"]:
        return math.inf
    loss = row["eval"][-1]["loss"]
    return loss if math.isfinite(loss) else math.inf


def _mean_curve(rows: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(step, mean held-out loss over the runs)`` at the steps every run evaluated."""
    per_run = [{p["step"]: p["loss"] for p in r["eval"]} for r in rows]
    steps = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    return [(s, statistics.fmean(d[s] for d in per_run)) for s in steps]


def compare(
    adamw_rows: Sequence[dict[str, Any]],
    muon_rows: Sequence[dict[str, Any]],
    margin: float = SIGNIFICANCE_MARGIN,
) -> dict[str, Any]:
    """The comparison of the seeds of the two best configurations under the rule (see the
    module docstring): each side's mean ± std final loss, whether Muon ends lower, and the
    share of the steps at which it first reaches AdamW's final loss with the margin."""
    finals_a = [_final(r) for r in adamw_rows]
    finals_m = [_final(r) for r in muon_rows]
    out: dict[str, Any] = {"margin": margin, "seeds": [len(finals_a), len(finals_m)]}
    for name, finals in (("adamw", finals_a), ("muon", finals_m)):
        finite = all(math.isfinite(f) for f in finals)
        out[name] = {
            "mean": statistics.fmean(finals) if finite else None,
            "std": statistics.stdev(finals) if finite and len(finals) > 1 else None,
            "finals": [f if math.isfinite(f) else None for f in finals],
        }
    target, mean_m = out["adamw"]["mean"], out["muon"]["mean"]
    n = len(finals_m)
    diverged = [name for name in ("adamw", "muon") if out[name]["mean"] is None]
    out["diverged"] = diverged
    if diverged:
        out.update(ends_lower=None, steps_share=None, steps_share_range=None, score=None)
        return out
    out["score"] = (target - mean_m) * math.sqrt(n)
    out["ends_lower"] = out["score"] >= margin
    steps = max(r.get("steps", r["eval"][-1]["step"]) for r in muon_rows)
    curve = _mean_curve(muon_rows)

    def share(goal: float) -> float | None:
        reached = next((s for s, m in curve if (goal - m) * math.sqrt(n) >= margin), None)
        return None if reached is None else reached / steps

    out["steps_share"] = share(target)
    # AdamW's mean is itself an estimate: the share where it lies one standard error higher
    # (reached sooner) and lower (later).
    error = (out["adamw"]["std"] or 0.0) / math.sqrt(len(finals_a))
    out["adamw"]["standard_error"] = error
    out["steps_share_range"] = [share(target + error), share(target - error)]
    return out


RunFn = Callable[[Sequence[tuple[Candidate, int, int]]], list[dict[str, Any]]]


def run_equal_budget(
    adamw: Sequence[Candidate],
    muon: Sequence[Candidate],
    *,
    sweep_steps: int,
    steps: int,
    final_seeds: int,
    log: ResumeLog,
    run: RunFn,
    progress: Callable[[int, int, tuple[Candidate, int, int]], None] | None = None,
) -> dict[str, Any]:
    """The sweep (every candidate, seed 0, ``sweep_steps``), then the best of each on
    ``final_seeds`` seeds at ``steps``; runs found in ``log`` are not run again.
    ``run(jobs)`` trains ``(candidate, seed, steps)`` jobs and returns one row each (with
    ``eval`` and ``diverged``), called with one job at a time so that each finished run is
    logged before the next starts; ``progress(k, n, job)`` before each. Returns the sweep's
    table, the bests and the comparison."""

    def rows_of(jobs: Sequence[tuple[Candidate, int, int]]) -> list[dict[str, Any]]:
        todo = [job for job in jobs if log.get(run_key(*job)) is None]
        for number, job in enumerate(todo, 1):
            if progress is not None:
                progress(number, len(todo), job)
            (row,) = run([job])  # one at a time: each is in the log as soon as it ends
            log.add(run_key(*job), row)
        return [log[run_key(*job)] for job in jobs]

    sweep = rows_of([(c, 0, sweep_steps) for c in [*adamw, *muon]])
    table = [
        {"candidate": dataclasses.asdict(c), "label": c.label(), "final": _final(row)}
        for c, row in zip([*adamw, *muon], sweep)
    ]
    best = {}
    for name, candidates in (("adamw", adamw), ("muon", muon)):
        finals = {c: _final(log[run_key(c, 0, sweep_steps)]) for c in candidates}
        chosen = min(finals, key=lambda c: finals[c])
        if not math.isfinite(finals[chosen]):
            raise RuntimeError(f"every {name} configuration diverged: no best to compare")
        best[name] = chosen
    final = {
        name: rows_of([(best[name], seed, steps) for seed in range(final_seeds)])
        for name in ("adamw", "muon")
    }
    return {
        "budget": {"adamw": len(adamw), "muon": len(muon)},
        "sweep_steps": sweep_steps,
        "steps": steps,
        "sweep": table,
        "best": {name: dataclasses.asdict(c) | {"label": c.label()} for name, c in best.items()},
        "comparison": compare(final["adamw"], final["muon"]),
        "final_runs": final,
    }
