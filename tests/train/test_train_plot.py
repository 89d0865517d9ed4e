"""``shardmuon train``'s figures read as a reader would (issue #31 item 5): a log loss axis with
at least three labelled ticks over any range, the QK-clip panels (before and after the clip,
the heads clipped) only when there is something to show, non-overlapping range means."""

from __future__ import annotations

import itertools
import json

import pytest

from shardmuon.train.config import LOSS_RANGES, range_means
from shardmuon.train.plot import LogitSeries, RunCurves, log_ticks, plot_curves, read_run


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (0.03, 3.4, [0.05, 0.1, 0.2, 0.5, 1, 2]),  # reverse-text SFT: 1-2-5
        (2.0, 5.6, [2, 3, 4, 5]),  # byte-level LM: every 1..9 value
        (0.015, 0.12, [0.02, 0.05, 0.1]),
        (1.39, 3.46, [1.5, 2, 2.5, 3]),  # a 20-step SFT run: the halves, not 1.8-2.4-3-3.6
    ],
)
def test_a_log_axis_gets_at_least_three_labelled_ticks(low, high, expected):
    assert log_ticks(low, high) == pytest.approx(expected)


def test_a_narrow_log_axis_gets_round_ticks_inside_it():
    ticks = log_ticks(5.25, 5.56)
    assert len(ticks) >= 3 and all(5.25 <= t <= 5.56 for t in ticks)


def _height(path) -> int:
    import matplotlib.image

    return matplotlib.image.imread(path).shape[0]


def test_panels_only_for_what_was_recorded(tmp_path):
    steps = list(range(1, 21))
    losses = [3.0 * 0.9**s for s in steps]
    plain = RunCurves("plain", steps, losses)
    logged = RunCurves("logged", steps, losses, logits=LogitSeries(steps, losses, losses, [0] * 20))
    clipped = RunCurves(
        "clipped", steps, losses,
        logits=LogitSeries(steps, [12.0] * 20, [10.0] * 20, [2] * 20, threshold=10.0),
    )  # fmt: skip
    heights = []
    for runs in ([plain], [plain, logged], [plain, logged, clipped]):
        path = tmp_path / f"{len(runs)}.png"
        plot_curves(runs, path)
        heights.append(_height(path))
    # The loss alone; with the max-logit panel; with the clipped-heads panel too.
    assert heights[0] < heights[1] < heights[2]


def test_read_run_takes_the_after_clip_logits_and_old_flat_configs(tmp_path):
    rows = [{"step": 1, "max_logit": 12.0, "max_logit_after": 10.0, "clipped_heads": 3}]
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"losses": [{"step": 1, "loss": 1.0}], "max_logits": rows,
                               "config": {"task": "lm", "optim": {"qk_clip_threshold": 10.0}},
                               "eval": [{"step": 0, "tokens": 0, "loss": 5.5}]}))  # fmt: skip
    run = read_run(new)
    assert (run.task, run.eval_losses, run.logits.after, run.logits.clipped) == (
        "lm", [5.5], [10.0], [3],
    )  # fmt: skip
    assert run.logits.threshold == 10.0
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"losses": [{"step": 1, "loss": 1.0}], "max_logits": rows[:1],
                               "config": {"qk_clip_threshold": 7.0}}))  # fmt: skip
    assert read_run(old).logits.threshold == 7.0


def test_the_range_windows_never_overlap():
    for (_, hi), (lo, _) in itertools.pairwise(LOSS_RANGES):
        assert lo == hi + 1
    means = range_means({s: 1.0 for s in range(1, 151)})
    assert list(means) == ["1-10", "11-31", "32-62", "63-100", "101-150"]
