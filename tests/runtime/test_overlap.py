"""``Muon(overlap="forward")`` in one process (issue #32; the gloo worlds are in
``test_overlap_distributed.py``): every step bitwise the sequential step's, with gradient
clipping, accumulation and random delays in the background; each layer's forward waits for
its own chunks only; everything that reads parameters, grads or state waits; a failure in
the background is raised at the next wait, and a restore recovers."""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch
from checks import assert_same_optimizers
from overlap_setup import hold_the_last_chunk
from torch import nn

import shardmuon.runtime.overlap as overlap_module
from shardmuon import Muon
from shardmuon.runtime.overlap import OverlapError, forward_order

# Several tests step without overlap_with on purpose (they wait explicitly).
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:Muon.overlap='forward'. stepped before overlap_with"),
]

WIDTH = 24


def _model(layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)]
    return nn.Sequential(nn.Linear(8, WIDTH), *blocks, nn.Linear(WIDTH, 3))


def _optimizer(model: nn.Module, **kwargs) -> Muon:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return Muon(
        [dict(params=matrices), dict(params=others, algorithm="adamw")],
        lr=0.02, weight_decay=0.01, nesterov=True, **kwargs,
    )  # fmt: skip


def _train(model, opt, steps, seed: int = 0, zero_to_none: bool = True) -> list[float]:
    """``steps`` steps; even steps accumulate two micro-batches, every step clips, and an lr
    scheduler changes every group's lr (and OneCycle's momentum alias) right after it."""
    generator = torch.Generator().manual_seed(seed)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps + 1)
    losses = []
    for step in range(steps):
        for _ in range(2 if step % 2 == 0 else 1):
            x = torch.randn(6, 8, generator=generator)
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=zero_to_none)
    return losses


@pytest.fixture
def random_delays(monkeypatch):
    """Sleep 0-3 ms in the background before each chunk is marked done (the worker waits
    too): the forward and the worker interleave differently every run."""
    mark = overlap_module.OverlappedStep._mark
    rng = random.Random(7)

    def delayed(self, key):
        time.sleep(rng.random() * 0.003)
        mark(self, key)

    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", delayed)


@pytest.mark.parametrize("zero_to_none", [True, False])
def test_twenty_steps_are_bitwise_the_sequential_ones(random_delays, zero_to_none):
    plain, overlapped = _model(), _model()
    a, b = _optimizer(plain), _optimizer(overlapped, overlap="forward")
    b.overlap_with(overlapped)
    hooked = [m for m in overlapped.modules() if m._forward_pre_hooks]
    assert hooked == [m for m in overlapped.modules() if list(m.parameters())]
    losses_a = _train(plain, a, 20, zero_to_none=zero_to_none)
    losses_b = _train(overlapped, b, 20, zero_to_none=zero_to_none)
    assert losses_a == losses_b  # each forward saw the updated weights
    b.synchronize()
    assert_same_optimizers(a, list(plain.parameters()), b, list(overlapped.parameters()))


def test_step_returns_before_the_step_is_done_and_each_layer_waits_for_its_own(monkeypatch):
    model = _model(layers=6)
    opt = _optimizer(model, overlap="forward")
    opt.overlap_with(model)
    release = hold_the_last_chunk(monkeypatch, opt)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    pending = opt.runner.overlap.pending
    assert pending is not None and not pending.finished  # the caller was not held
    # The first layer's chunk is done before the last one's: its wait returns at once.
    first_param = next(model.parameters())
    opt.runner.overlap.wait_for_params([id(first_param)])
    assert not pending.finished
    release.set()
    opt.synchronize()
    assert pending.finished


def test_the_schedule_takes_the_batches_in_parameter_order():
    model = _model(layers=5)
    opt = _optimizer(model, overlap="forward")
    batches = opt.plan.batches
    order = forward_order(batches)
    firsts = [min(s.param_index for s in batches[i].segments) for i in order]
    assert firsts == sorted(firsts)
    prepares = [i for phase, i in opt.runner.schedule() if phase == "prepare"]
    assert prepares == order


def _one_step_each(monkeypatch, before_each_chunk):
    """An overlapped optimizer and a sequential one, one step each from the same grads, the
    worker calling ``before_each_chunk()`` before it marks a chunk done (a delay, a hold)."""
    model, reference_model = _model(), _model()
    opt, reference = _optimizer(model, overlap="forward"), _optimizer(reference_model)
    mark = overlap_module.OverlappedStep._mark

    def delayed(self, key):
        before_each_chunk()
        mark(self, key)

    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", delayed)
    opt.overlap_with(model)
    for m in (model, reference_model):
        m(torch.ones(2, 8)).sum().backward()
    reference.step()
    opt.step()
    return model, opt, reference_model, reference


READERS = ["state_dict", "zero_grad", "step_chunk", "qk_clip", "copy"]
MODEL_READERS = ["model.state_dict", "model.load_state_dict", "layer.state_dict"]


@pytest.mark.parametrize("reader", READERS + MODEL_READERS)
def test_everything_that_reads_the_step_waits_for_it(monkeypatch, reader):
    model, opt, reference_model, reference = _one_step_each(monkeypatch, lambda: time.sleep(0.01))
    pending = opt.runner.overlap.pending
    if reader in MODEL_READERS:
        # A trainer's weight broadcast or checkpoint right after step() (prime-rl's loop).
        if reader == "model.load_state_dict":
            model.load_state_dict(reference_model.state_dict())
        else:
            module, other = (
                (model, reference_model) if reader[0] == "m" else (model[3], reference_model[3])
            )
            saved, expected = module.state_dict(), other.state_dict()
            assert all(torch.equal(saved[k], expected[k]) for k in expected)
        assert pending.finished
    elif reader == "state_dict":
        saved = opt.state_dict()
        assert pending.finished
        assert saved["state"].keys() == reference.state_dict()["state"].keys()
    elif reader == "zero_grad":
        opt.zero_grad(set_to_none=False)
        assert pending.finished
    elif reader == "step_chunk":
        opt.step_chunk(opt.chunks()[0])
        assert pending.finished
    elif reader == "qk_clip":
        overlap_module.synchronize_all()  # what QKClip.apply calls first
        assert pending.finished
    else:
        copy.deepcopy(opt)
        assert pending.finished
    if reader != "step_chunk":
        assert_same_optimizers(
            reference, list(reference_model.parameters()), opt, list(model.parameters())
        )


def test_a_failure_in_the_background_is_raised_at_the_next_wait_and_a_restore_recovers(
    monkeypatch,
):
    model, reference_model = _model(), _model()
    opt = _optimizer(model, overlap="forward")
    reference = _optimizer(reference_model)
    opt.overlap_with(model)
    _train(model, opt, 2)
    _train(reference_model, reference, 2)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    mark = overlap_module.OverlappedStep._mark

    def fail_on_second(self, key):
        if key == ("batch", 1):
            raise RuntimeError("injected failure in batch 1")
        mark(self, key)

    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", fail_on_second)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # returns: the failure is in the background
    with pytest.raises(OverlapError, match="RuntimeError: injected failure in batch 1"):
        model(torch.ones(2, 8))  # some layer's wait meets it
    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", mark)
    # A restore recovers: the same steps as the uninterrupted reference from there.
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    opt.zero_grad()  # the failed step's grads
    _train(model, opt, 2, seed=5)
    _train(reference_model, reference, 2, seed=5)
    opt.synchronize()
    assert_same_optimizers(
        reference, list(reference_model.parameters()), opt, list(model.parameters())
    )


def test_a_checkpoint_of_a_failed_step_raises_and_a_restore_waits_without_raising(monkeypatch):
    model = _model()
    opt = _optimizer(model, overlap="forward")
    opt.overlap_with(model)
    _train(model, opt, 1)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    mark = overlap_module.OverlappedStep._mark

    def slow_then_fail(self, key):
        time.sleep(0.01)
        if key == ("batch", 1):
            raise RuntimeError("injected failure in batch 1")
        mark(self, key)

    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", slow_then_fail)
    for _ in range(2):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        with pytest.raises(OverlapError, match="injected failure in batch 1"):
            model.state_dict()  # a checkpoint would hold a half-applied step
        opt.load_state_dict(saved_opt)
        model.load_state_dict(saved_model)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    model.load_state_dict(saved_model)  # the restore waits for the worker's last write
    assert opt.runner.overlap.pending is not None and opt.runner.overlap.pending.finished
    assert all(torch.equal(p, saved_model[n]) for n, p in model.named_parameters())
    opt.load_state_dict(saved_opt)  # discards the failure the load left pending
    model(torch.ones(2, 8))


def test_a_refused_step_raises_in_the_caller_and_starts_nothing():
    model, reference_model = _model(), _model()
    opt, reference = _optimizer(model, overlap="forward"), _optimizer(reference_model)
    model(torch.ones(2, 8)).sum().backward()
    opt.param_groups[0]["lr"] = -1.0  # group settings are checked before each step
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert opt.runner.overlap.pending is None
    opt.param_groups[0]["lr"] = reference.param_groups[0]["lr"]
    reference_model(torch.ones(2, 8)).sum().backward()
    opt.step()
    reference.step()
    opt.synchronize()
    assert_same_optimizers(
        reference, list(reference_model.parameters()), opt, list(model.parameters())
    )


@pytest.mark.parametrize("bad", ["backward", True, 1])
def test_a_bad_overlap_is_refused_naming_what_is_accepted(bad):
    with pytest.raises(ValueError, match=r"unknown overlap .*; accepted: None, 'forward'"):
        _optimizer(_model(), overlap=bad)


def test_overlap_with_needs_overlap():
    model = _model()
    with pytest.raises(ValueError, match="overlap_with needs Muon"):
        _optimizer(model).overlap_with(model)


def test_ctrl_c_interrupts_a_wait_and_the_step_still_completes(monkeypatch):
    """A KeyboardInterrupt while the caller waits (Ctrl-C) is raised at once; the worker goes
    on, and a later wait finds the whole, correct step."""
    import _thread

    release = threading.Event()
    model, opt, reference_model, reference = _one_step_each(monkeypatch, lambda: release.wait(10))
    threading.Timer(0.2, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        opt.synchronize()
    assert opt.runner.overlap.pending is not None  # still waited for by what comes next
    release.set()
    opt.state_dict()
    assert opt.runner.overlap.pending is None
    assert_same_optimizers(
        reference, list(reference_model.parameters()), opt, list(model.parameters())
    )


def test_stepping_without_hooks_warns_once():
    model = _model()
    opt = _optimizer(model, overlap="forward")
    model(torch.ones(2, 8)).sum().backward()
    with pytest.warns(UserWarning, match=r"stepped before overlap_with\(model\)"):
        opt.step()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once per optimizer
    opt.synchronize()
