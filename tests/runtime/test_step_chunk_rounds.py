"""Attacks on ``Muon.step_chunk``, single process: a round in any order == ``step()``; a chunk
retried after an injected failure (before an op ran, or midway through one, as a real out of
memory) updates nothing twice; stale or repeated chunks are refused, a round whose first
chunk fails its checks is not opened, and a stuck round is ended by restoring a checkpoint.
With and without state offload.

Against independent references, as the module docstring of ``tests/support/counter_setup.py``
says; failing tests are escapes.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from checks import assert_same_optimizers, set_random_grads
from counter_setup import make_opt, make_params, step_with

import shardmuon.runtime.adamw_step as adamw_step
import shardmuon.runtime.phases as phases
from shardmuon import Muon


def _chunk_dtypes():
    return [
        torch.float32,
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.bfloat16,
        torch.float32,
    ]


def _pair(offload=None, nesterov=True, dtypes=None):
    dtypes = dtypes or _chunk_dtypes()
    ps, ref_ps = make_params(1, dtypes), make_params(1, dtypes)
    kw = dict(offload=offload, nesterov=nesterov, workspace_bytes=4096)
    return ps, make_opt(ps, **kw), ref_ps, make_opt(ref_ps, **kw)


ORDERS = {
    "forward": lambda n, r: list(range(n)),
    "reverse": lambda n, r: list(range(n))[::-1],
    "shuffled": lambda n, r: random.Random(r).sample(range(n), n),
}


@pytest.mark.parametrize("offload", [None, "state"])
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_step_chunk_in_any_order_equals_step(order, offload) -> None:
    ps, opt, ref_ps, ref = _pair(offload)
    assert len(opt.chunks()) >= 3
    for r in range(3):
        set_random_grads(ps, r)
        chunks = opt.chunks()
        for i in ORDERS[order](len(chunks), r):
            opt.step_chunk(chunks[i])
        step_with(ref, ref_ps, r)
    assert_same_optimizers(opt, ps, ref, ref_ps)


def _Once(real, at: int = 1):
    """Wrap ``real`` (a function, so that it binds as a method too): raise on call number
    ``at`` (1-based) once, then behave."""
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(*args, **kwargs)

    return wrapper


def _round_with_retries(opt: Muon, order) -> int:
    """Step a round in ``order``; a chunk that raises is retried at the end. Returns the
    number of failures seen."""
    chunks = opt.chunks()
    todo = [chunks[i] for i in order]
    failures = 0
    while todo:
        chunk = todo.pop(0)
        try:
            opt.step_chunk(chunk)
        except RuntimeError as error:
            assert "injected" in str(error)
            failures += 1
            todo.append(chunk)
    return failures


def _retry_case(monkeypatch, target, attr, make_wrapper, offload, order="reverse"):
    ps, opt, ref_ps, ref = _pair(offload)
    for r in range(3):
        set_random_grads(ps, r)
        step_with(ref, ref_ps, r)
        wrapper = make_wrapper(getattr(target, attr))
        monkeypatch.setattr(target, attr, wrapper)
        failures = _round_with_retries(opt, ORDERS[order](len(opt.chunks()), r))
        monkeypatch.undo()
        assert failures == 1
    assert_same_optimizers(opt, ps, ref, ref_ps)


@pytest.mark.parametrize("offload", [None, "state"])
@pytest.mark.parametrize("at", [1, 2])
def test_retry_after_orthogonalize_raised_before_it_ran(monkeypatch, offload, at) -> None:
    _retry_case(
        monkeypatch, phases.StepContext, "orthogonalize", lambda real: _Once(real, at), offload
    )


@pytest.mark.parametrize("offload", [None, "state"])
@pytest.mark.parametrize("at", [1, 3])
def test_retry_after_weight_update_raised_before_it_ran(monkeypatch, offload, at) -> None:
    _retry_case(monkeypatch, phases, "weight_update_", lambda real: _Once(real, at), offload)


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_adamw_raised_before_it_ran(monkeypatch, offload) -> None:
    _retry_case(monkeypatch, adamw_step, "adamw_update_", lambda real: _Once(real, 1), offload)


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_nesterov_direction_raised(monkeypatch, offload) -> None:
    """The direction allocates after the momentum update: a failure there must not update
    the momentum twice on retry."""
    _retry_case(monkeypatch, phases, "direction", lambda real: _Once(real, 2), offload)


# The failures below happen inside the ops, after some in-place writes: what a real out
# of memory does (an allocation after the first in-place op). The docstrings promise that
# a retried chunk updates nothing twice.


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_newton_schulz_ran_out_of_memory_midway(monkeypatch, offload) -> None:
    """The folded Newton–Schulz normalises the batch's own buffer in place and iterates in
    it (overwrite_input=True); an OOM in its third iteration (the 2-matrix stack's fifth
    baddbmm) leaves the buffer holding an iterate, which the retry orthogonalizes again."""
    _retry_case(monkeypatch, torch, "baddbmm", lambda real: _Once(real, 5), offload)


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_adamw_ran_out_of_memory_midway(monkeypatch, offload) -> None:
    """An OOM in AdamW's ``_foreach_sqrt`` (after the momentum and variance lerps) must not
    lerp them again on retry."""
    _retry_case(monkeypatch, torch, "_foreach_sqrt", lambda real: _Once(real, 1), offload)


class _FailingResults:
    """Stands for the bf16 results: slicing them (the fp32 cast that follows) runs out of
    memory once, as ``ortho[...].to(torch.float32)`` in weight_update_ can."""

    def __init__(self, real):
        self.real = real

    def __getitem__(self, index):
        raise RuntimeError("CUDA out of memory (injected, in weight_update_)")


@pytest.mark.parametrize("offload", [None, "state"])
def test_retry_after_weight_update_ran_out_of_memory_after_the_decay(monkeypatch, offload) -> None:
    """weight_update_ applies the decay in place, then allocates the fp32 step: an OOM
    there must not decay the parameter twice on retry."""
    real = phases.weight_update_

    def make_wrapper(_):
        state = {"fired": False}

        def wrapper(param, ortho, lr, wd, row_scales):
            if not state["fired"]:
                state["fired"] = True
                return real(param, _FailingResults(ortho), lr, wd, row_scales)
            return real(param, ortho, lr, wd, row_scales)

        return wrapper

    _retry_case(monkeypatch, phases, "weight_update_", make_wrapper, offload)


def test_a_chunk_stepped_twice_or_stale_is_refused() -> None:
    ps, opt, _, _ = _pair()
    set_random_grads(ps, 0)
    chunks = opt.chunks()
    opt.step_chunk(chunks[0])
    with pytest.raises(RuntimeError, match="already stepped in this round"):
        opt.step_chunk(chunks[0])
    with pytest.raises(RuntimeError, match="step_chunk"):
        opt.step()
    for chunk in chunks[1:]:
        opt.step_chunk(chunk)
    opt.param_groups[0]["epsilon"] = 1e-7  # a planned setting: new chunks
    with pytest.raises(ValueError, match="not in this optimizer's chunks"):
        opt.step_chunk(chunks[0])


def test_a_round_whose_first_chunk_fails_its_checks_is_not_opened() -> None:
    ps, opt, ref_ps, ref = _pair()
    set_random_grads(ps, 0)
    ps[0].grad = ps[0].grad.to_sparse()
    with pytest.raises(TypeError, match="sparse grad"):
        opt.step_chunk(opt.chunks()[0])
    assert [g["step"] for g in opt.param_groups] == [0, 0]
    set_random_grads(ps, 0)
    opt.step()
    step_with(ref, ref_ps, 0)
    assert_same_optimizers(opt, ps, ref, ref_ps)


def test_a_round_stuck_on_a_chunk_that_keeps_failing_can_be_ended_by_restoring(monkeypatch) -> None:
    """A local chunk that fails every time (a batch too large for the memory left): the
    user restores a checkpoint. load_state_dict must end the round (as it does for a
    broken one) instead of refusing forever, leaving the optimizer unusable."""
    ps, opt, ref_ps, ref = _pair()
    step_with(opt, ps, 0)
    step_with(ref, ref_ps, 0)
    saved = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in ps]

    def always(self, U, batch):
        raise RuntimeError("CUDA out of memory (injected, every time)")

    monkeypatch.setattr(phases.StepContext, "orthogonalize", always)
    set_random_grads(ps, 1)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step_chunk(opt.chunks()[0])
    monkeypatch.undo()
    with torch.no_grad():
        for p, s in zip(ps, saved_params):
            p.copy_(s)
    opt.load_state_dict(saved)
    step_with(opt, ps, 1)
    step_with(ref, ref_ps, 1)
    assert_same_optimizers(opt, ps, ref, ref_ps)
