"""A run told to stop when it diverges (``STOP_ON_DIVERGENCE`` in its ``extra``, as every run
of ``shardmuon bench lm`` is) stops at the first non-finite loss, or at an error raised once
its loss or weights are no longer finite, and returns what it trained with
``TrainResult.diverged`` saying where and why. An error with finite weights and loss is
still raised. One rank, a tiny model, a few steps."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from shardmuon.train import loop
from shardmuon.train.config import optim_settings, task_config
from shardmuon.train.loop import STOP_ON_DIVERGENCE, train_on_rank

STEPS = 4


@pytest.fixture
def config(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"f{i}.py").write_text(f"x{i} = {i}\n" * 60)
    base = task_config(
        "lm", num_layers=1, steps=STEPS, batch_size=2, seq_len=16, warmup_steps=1,
        eval_every=100, eval_sequences=2, data=str(data), nproc=1, quiet=True,
    )  # fmt: skip
    return dataclasses.replace(base, extra={STOP_ON_DIVERGENCE: True})


def _failing_step(monkeypatch, error: Exception, *, blow_up: bool) -> None:
    """Every optimizer step runs, then (``blow_up``) fills a weight with inf, then raises."""
    build = loop.build_optimizer

    def build_failing(config, model, expert_mesh_name):
        optimizer = build(config, model, expert_mesh_name)
        step = optimizer.step

        def failing_step(*args, **kwargs):
            step(*args, **kwargs)
            if blow_up:
                with torch.no_grad():
                    next(model.parameters()).fill_(math.inf)
            raise error

        optimizer.step = failing_step
        return optimizer

    monkeypatch.setattr(loop, "build_optimizer", build_failing)


def test_a_non_finite_loss_stops_the_run_and_says_where(config):
    config = dataclasses.replace(config, optim=optim_settings(config.optim, lr=1e20))
    result = train_on_rank(config, 0, 1)
    stop = result.diverged
    assert stop is not None, "lr 1e20 trained all its steps without diverging"
    assert max(result.losses) == stop["step"] < STEPS
    assert not math.isfinite(result.losses[stop["step"]])
    assert re.fullmatch(rf"training loss (nan|inf) at step {stop['step']}", stop["reason"])


def test_without_the_flag_a_non_finite_loss_trains_on(config):
    config = dataclasses.replace(config, extra={}, optim=optim_settings(config.optim, lr=1e20))
    result = train_on_rank(config, 0, 1)
    assert result.diverged is None and sorted(result.losses) == list(range(1, STEPS + 1))


def test_an_error_raised_with_non_finite_weights_is_a_divergence(config, monkeypatch):
    # At the first step: no step time was recorded yet, the medians are NaN.
    _failing_step(monkeypatch, OverflowError("the update overflowed"), blow_up=True)
    result = train_on_rank(config, 0, 1)
    assert result.diverged == {"step": 1, "reason": "OverflowError: the update overflowed"}
    assert result.losses == {} and math.isnan(result.step_seconds)


def test_an_error_with_finite_weights_is_still_raised(config, monkeypatch):
    _failing_step(monkeypatch, RuntimeError("a bug, not a divergence"), blow_up=False)
    with pytest.raises(RuntimeError, match="a bug, not a divergence"):
        train_on_rank(config, 0, 1)


def test_without_the_flag_an_error_is_raised(config, monkeypatch):
    _failing_step(monkeypatch, OverflowError("the update overflowed"), blow_up=True)
    with pytest.raises(OverflowError, match="the update overflowed"):
        train_on_rank(dataclasses.replace(config, extra={}), 0, 1)
