"""A ``step_chunk`` that fails midway (an injected failure in Newton–Schulz, the weight or
momentum update, or AdamW) resumes without stepping anything twice: the finished round ==
an uninterrupted ``step()``, bitwise. An open round refuses ``step()``, ``add_param_group``,
stepping a chunk twice and planned settings edited mid-round.

Single process, CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from checks import (
    assert_same_optimizers,
    assert_unchanged,
    grads_for_shapes,
    optimizer_snapshot,
    set_grads,
)
from fidelity_setup import param, step_with
from torch import Tensor, nn

import shardmuon.runtime.adamw_step as adamw_step_module
import shardmuon.runtime.phases as phases_module
from shardmuon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")


# Optimizer for these tests: two [16, 8] matrices (one batch of two segments), an [8, 8]
# matrix (its own batch), one adamw group of two vectors.
SIX_SHAPES = [(16, 8), (16, 8), (8, 8), (8,), (4,)]


def _six_params() -> list[nn.Parameter]:
    return [param(s, i) for i, s in enumerate(SIX_SHAPES)]


def _six(params: list[Tensor]) -> Muon:
    return Muon(
        [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw")],
        lr=0.02,
        weight_decay=0.1,
        nesterov=True,
    )


class _Injected(RuntimeError):
    pass


class _FailOnce:
    """Wraps ``fn``: the ``nth`` call after arming raises (once); every other call passes."""

    def __init__(self, fn: Callable, nth: int = 1, before: bool = True) -> None:
        self.fn, self.nth, self.before = fn, nth, before
        self.armed, self.calls, self.fired = False, 0, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.armed or self.fired:
            return self.fn(*args, **kwargs)
        self.calls += 1
        if self.calls == self.nth:
            self.fired = True
            if self.before:
                raise _Injected("injected failure")
            self.fn(*args, **kwargs)
            raise _Injected("injected failure")
        return self.fn(*args, **kwargs)


def _adamw_failing_after_first_param(real: Callable) -> Callable:
    state = {"armed": False, "fired": False}

    def wrapper(*args: Any, on_param_done: Callable | None = None, **kwargs: Any) -> None:
        def done(i: int) -> None:
            if on_param_done is not None:
                on_param_done(i)
            if state["armed"] and not state["fired"]:
                state["fired"] = True
                raise _Injected("injected failure")

        # One parameter per _foreach run, so that "after the first parameter" is a point
        # between runs (the unit a resumed chunk skips).
        real(*args, on_param_done=done, **{**kwargs, "max_temp_bytes": 1})

    wrapper.state = state
    return wrapper


INJECTIONS = [
    # (id, index of the chunk that fails)
    ("orthogonalize", 0),  # Newton–Schulz of the two-segment batch
    ("weight_update-second-segment", 0),  # after the first segment's params were updated
    ("weight_updates-batch", 0),  # the batch's update in _foreach_ passes, before it writes
    ("momentum_update-second-segment", 0),  # after the first segment's momentum was updated
    ("adamw-after-first-param", 2),
    ("adamw-before-any-param", 2),
]


def _inject(kind: str, opt: Muon, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Install the failure; return a function that arms it."""
    if kind == "orthogonalize":
        fail = _FailOnce(phases_module.StepContext.orthogonalize)
        monkeypatch.setattr(
            phases_module.StepContext, "orthogonalize", lambda ctx, *args: fail(ctx, *args)
        )
    elif kind == "weight_update-second-segment":
        # segment by segment (as for bf16 parameters): the batch path stands aside
        monkeypatch.setattr(phases_module, "_update_all_at_once", lambda ctx, run: False)
        fail = _FailOnce(phases_module.weight_update_, nth=2)
        monkeypatch.setattr(phases_module, "weight_update_", fail)
    elif kind == "weight_updates-batch":
        fail = _FailOnce(phases_module.weight_updates_)
        monkeypatch.setattr(phases_module, "weight_updates_", fail)
    elif kind == "momentum_update-second-segment":
        fail = _FailOnce(phases_module.momentum_update_, nth=2)
        monkeypatch.setattr(phases_module, "momentum_update_", fail)
    elif kind == "adamw-after-first-param":
        wrapper = _adamw_failing_after_first_param(adamw_step_module.adamw_update_)
        monkeypatch.setattr(adamw_step_module, "adamw_update_", wrapper)
        return lambda: wrapper.state.update(armed=True)
    else:
        fail = _FailOnce(adamw_step_module.adamw_update_)
        monkeypatch.setattr(adamw_step_module, "adamw_update_", fail)

    def arm() -> None:
        fail.armed = True

    return arm


@pytest.mark.parametrize("position", ["first", "last"])
@pytest.mark.parametrize(("kind", "target"), INJECTIONS, ids=[i[0] for i in INJECTIONS])
def test_failed_chunk_resumes_without_stepping_twice(
    kind: str, target: int, position: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    params, ref_params = _six_params(), _six_params()
    opt, ref = _six(params), _six(ref_params)
    step_with(opt, params, 0)
    step_with(ref, ref_params, 0)
    arm = _inject(kind, opt, monkeypatch)
    chunks = opt.chunks()
    assert len(chunks) == 3 and len(chunks[0].segments) == 2
    others = [c for i, c in enumerate(chunks) if i != target]
    order_before = [] if position == "first" else others
    order_after = others if position == "first" else []

    set_grads(params, grads_for_shapes(SIX_SHAPES, 1))
    for chunk in order_before:
        opt.step_chunk(chunk)
    arm()
    with pytest.raises(_Injected):
        opt.step_chunk(chunks[target])
    assert opt.runner.rounds.is_open and target not in opt.runner.rounds.stepped, (
        "a failed chunk is not done"
    )
    with pytest.raises(RuntimeError, match=r"step\(\) called while a step_chunk\(\) round is open"):
        opt.step()
    opt.step_chunk(chunks[target])  # resumes
    for chunk in order_after:
        opt.step_chunk(chunk)
    assert not opt.runner.rounds.is_open

    set_grads(ref_params, grads_for_shapes(SIX_SHAPES, 1))
    ref.step()
    assert_same_optimizers(opt, params, ref, ref_params)
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in ref.param_groups]
    step_with(opt, params, 2)
    step_with(ref, ref_params, 2)
    assert_same_optimizers(opt, params, ref, ref_params)


def test_open_round_refuses_step_add_group_and_load() -> None:
    params, ref_params = _six_params(), _six_params()
    opt, ref = _six(params), _six(ref_params)
    step_with(opt, params, 0)
    step_with(ref, ref_params, 0)
    chunks = opt.chunks()
    set_grads(params, grads_for_shapes(SIX_SHAPES, 1))
    opt.step_chunk(chunks[1])
    snap = optimizer_snapshot(opt, params)
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(RuntimeError, match=r"step\(\) called while a step_chunk\(\) round is open"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"add_param_group during a step_chunk round"):
        opt.add_param_group(dict(params=[param((4, 4), 9)]))
    with pytest.raises(RuntimeError, match=r"chunk 1 was already stepped in this round"):
        opt.step_chunk(chunks[1])
    assert_unchanged(opt, params, snap)
    assert len(opt.param_groups) == 2
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == (
        groups_before
    )
    opt.step_chunk(chunks[0])
    opt.step_chunk(chunks[2])
    set_grads(ref_params, grads_for_shapes(SIX_SHAPES, 1))
    ref.step()
    assert_same_optimizers(opt, params, ref, ref_params)


@pytest.mark.parametrize(("key", "value"), [("adjust_lr", "rms_norm"), ("lr", 0.5)])
def test_a_setting_edited_during_an_open_round_takes_effect_at_the_next(key, value) -> None:
    """A round reads its settings (and keeps its plan) when it opens: an edit between its
    chunks, which on one rank only would make the ranks step with different settings or
    refuse alone, applies from the next round, where the ranks compare it."""
    params, ref_params = _six_params(), _six_params()
    opt, ref = _six(params), _six(ref_params)
    chunks = opt.chunks()
    set_grads(params, grads_for_shapes(SIX_SHAPES, 0))
    opt.step_chunk(chunks[0])
    opt.param_groups[0][key] = value
    assert opt.chunks() == chunks
    for chunk in chunks[1:]:
        opt.step_chunk(chunk)
    step_with(ref, ref_params, 0)
    assert_same_optimizers(opt, params, ref, ref_params)
    ref.param_groups[0][key] = value
    set_grads(params, grads_for_shapes(SIX_SHAPES, 1))
    for chunk in opt.chunks():
        opt.step_chunk(chunk)
    step_with(ref, ref_params, 1)
    assert_same_optimizers(opt, params, ref, ref_params)
