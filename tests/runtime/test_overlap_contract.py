"""What ``Muon(overlap="forward")`` promises a caller between ``step()`` and the wait: the step
owns what it reads (grads, every hyperparameter), every read of a parameter by a forward
waits for it (a parent's forward reading a child's weight included), step post-hooks and
``last_step_stats`` see the finished step, and the model can be copied and saved.

Each case starts the worker late on purpose (``slow_worker``), so that a read the overlap
does not cover meets the old weights (or a write meets the step's read) every time; the
reference is the same loop run sequentially, compared bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import io
import threading
import time

import pytest
import torch
from checks import assert_same_optimizers
from overlap_setup import hold_the_last_chunk
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import shardmuon.runtime.overlap as overlap_module
import shardmuon.runtime.stepper as stepper_module
from shardmuon import Muon
from shardmuon.runtime.overlap import ReadMap

pytestmark = [pytest.mark.usefixtures("one_thread")]

WORKER_DELAY_S = 0.1
CHUNK_PAUSE_S = 0.03


@pytest.fixture
def slow_worker(monkeypatch):
    """The overlapped step's worker sleeps before it starts and after each chunk it marks
    done: whatever the caller does right after ``step()`` happens before the step reads
    anything, and a forward woken by one chunk runs before the next chunk is written."""
    run_step = stepper_module.run_step
    mark = overlap_module.OverlappedStep._mark

    def late(ctx, schedule, stager, *done):
        if done:  # the overlapped call (the sequential one passes no marker)
            time.sleep(WORKER_DELAY_S)
        return run_step(ctx, schedule, stager, *done)

    def mark_then_pause(self, key):
        mark(self, key)
        time.sleep(CHUNK_PAUSE_S)

    monkeypatch.setattr(stepper_module, "run_step", late)
    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", mark_then_pause)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 3))


def _optimizer(model: nn.Module, **kwargs) -> Muon:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return Muon(
        [dict(params=matrices), dict(params=others, algorithm="adamw", lr=kwargs.pop("adamw_lr", 0.01))],
        lr=0.02, weight_decay=0.01, **kwargs,
    )  # fmt: skip


def _pair(make=_mlp, **kwargs):
    """The same model and optimizer twice: sequential and overlapped (hooked)."""
    model, reference_model = make(), make()
    opt = _optimizer(model, overlap="forward", **kwargs)
    reference = _optimizer(reference_model, **kwargs)
    opt.overlap_with(model)
    return model, opt, reference_model, reference


def _backward(model: nn.Module, seed: int, shape=(4, 8)) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    out = model(x)
    (out[0] if isinstance(out, tuple) else out).square().mean().backward()


@pytest.mark.parametrize("offload", [None, "state"])
@pytest.mark.parametrize("zeroing", ["model.zero_grad(False)", "grad.zero_()", "backward again"])
def test_grads_written_in_place_right_after_step_do_not_reach_it(slow_worker, zeroing, offload):
    """Loops with persistent grad buffers zero or refill them in place as soon as
    ``step()`` returns; the running step reads the grads it was given."""
    model, opt, reference_model, reference = _pair(offload=offload)
    for step in range(3):
        for m, o in ((reference_model, reference), (model, opt)):
            _backward(m, step)
            o.step()
            if zeroing == "model.zero_grad(False)":
                m.zero_grad(set_to_none=False)
            elif zeroing == "grad.zero_()":
                for p in m.parameters():
                    p.grad.zero_()
            else:  # the next micro-batch accumulates into the same buffers
                _backward(m, 100 + step)
                m.zero_grad(set_to_none=False)
    opt.synchronize()
    assert_same_optimizers(
        reference, list(reference_model.parameters()), opt, list(model.parameters())
    )


def test_a_tensor_lr_filled_right_after_step_does_not_reach_it(slow_worker):
    """A scheduler ``fill_()``s a tensor lr (every group's, AdamW's included) as soon as
    ``step()`` returns; the running step uses the lr it began with."""
    model, opt, reference_model, reference = _pair()
    for group in (*opt.param_groups, *reference.param_groups):
        group["lr"] = torch.tensor(float(group["lr"]))
    for step in range(3):
        for m, o in ((reference_model, reference), (model, opt)):
            _backward(m, step)
            o.step()
            for group in o.param_groups:
                group["lr"].fill_(group["lr"].item() * 0.5)
    opt.synchronize()
    assert_same_optimizers(
        reference, list(reference_model.parameters()), opt, list(model.parameters())
    )


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    # No biases: the attention's hook then waits for its own matrix's chunk only (a bias
    # would make it wait for the AdamW chunk too, which runs after every matrix).
    return nn.TransformerEncoderLayer(
        8, 2, dim_feedforward=16, dropout=0.0, batch_first=True, bias=False
    )


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_parent_forward_reading_a_child_weight_waits_for_it(slow_worker, mode):
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` in its own forward (``out_proj``'s
    forward never runs): the forward right after ``step()`` computes with the new weights."""
    model, opt, reference_model, reference = _pair(_encoder)
    outputs = {}
    # One loop after the other: a sequential step waits for every overlapped one in flight.
    for m, o in ((reference_model, reference), (model, opt)):
        for step in range(3):
            m.train(mode == "train")
            with torch.no_grad() if mode == "eval" else torch.enable_grad():
                outputs.setdefault(id(m), []).append(m(torch.ones(2, 3, 8) * (step + 1)).clone())
            m.train()
            o.zero_grad()
            _backward(m, step, (2, 3, 8))
            o.step()
    pairs = list(zip(outputs[id(model)], outputs[id(reference_model)]))
    assert all(torch.equal(a, b) for a, b in pairs)
    opt.synchronize()
    assert_same_optimizers(
        reference, list(reference_model.parameters()), opt, list(model.parameters())
    )


def _losses_of_both(make, steps: int, warm_forwards: int = 0) -> tuple[list, list]:
    """The losses of ``steps`` steps of the overlapped and of the sequential pair (one loop
    after the other: a sequential step waits for every overlapped one in flight), after
    ``warm_forwards`` forwards without grad."""
    model, opt, reference_model, reference = _pair(make)
    losses = {id(model): [], id(reference_model): []}
    for m, o in ((reference_model, reference), (model, opt)):
        with torch.no_grad():
            for _ in range(warm_forwards):
                m(torch.ones(2, 8))
        for step in range(steps):
            loss = m(torch.ones(2, 8) * (step + 1)).square().mean()
            losses[id(m)].append(loss.item())
            o.zero_grad()
            loss.backward()
            o.step()
    return losses[id(model)], losses[id(reference_model)]


class _TiedFunctional(nn.Module):
    """A head applied functionally: the parent's forward reads a child's weight whose own
    forward never runs (and one child, unused, whose forward never runs at all)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Other shapes, other batches (chunks); no biases (see _encoder).
        self.body = nn.Linear(8, 16, bias=False)
        self.head = nn.Linear(16, 5, bias=False)
        self.unused = nn.Linear(3, 7, bias=False)

    def forward(self, x):
        out = torch.nn.functional.linear(self.body(x), self.head.weight)
        return out + self.unused.weight.sum()


def test_a_weight_read_functionally_by_the_parent_waits_for_it(slow_worker):
    overlapped, sequential = _losses_of_both(_TiedFunctional, steps=4)
    assert overlapped == sequential


def test_after_the_first_forward_each_module_waits_only_for_what_it_reads():
    """The overlap is kept: once a whole forward has shown which modules run, the root's
    hook waits for nothing and a layer's hook for its own parameters; a module skipped by
    one forward is covered by its parent from then on."""
    model = _mlp()
    reads = ReadMap(model)
    everything = sorted(id(p) for p in model.parameters())
    assert sorted(reads.reads(model)) == everything  # nothing seen yet: cover all
    for m in reads.modules:
        m.register_forward_pre_hook(lambda m, _: reads.saw_run(m))
    model(torch.ones(1, 8))
    assert sorted(reads.reads(model)) == everything  # the first pass has not ended
    model(torch.ones(1, 8))  # ends it
    assert reads.reads(model) == []
    assert reads.reads(model[2]) == [id(p) for p in model[2].parameters()]
    model[0](torch.ones(1, 8))  # a layer called alone is not a pass of the model
    assert reads.reads(model) == []
    encoder = _encoder()
    reads = ReadMap(encoder)
    for m in reads.modules:
        m.register_forward_pre_hook(lambda m, _: reads.saw_run(m))
    for _ in range(2):
        encoder(torch.ones(1, 2, 8))
    attention = encoder.self_attn
    assert {id(attention.out_proj.weight), id(attention.in_proj_weight)} <= set(
        reads.reads(attention)
    )
    assert id(attention.out_proj.weight) not in reads.reads(encoder)


class _Branchy(nn.Module):
    """A child run on odd forwards and applied functionally by its parent on even ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16, bias=False)
        self.head = nn.Linear(16, 5, bias=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.body(x)
        if self.calls % 2:
            return self.head(h)
        return torch.nn.functional.linear(h, self.head.weight)


def test_a_child_skipped_by_some_forwards_is_covered_by_its_parent(slow_worker):
    """Once a forward has skipped the child (here: the second, before any step), its parent
    waits for it in every later forward."""
    overlapped, sequential = _losses_of_both(_Branchy, steps=5, warm_forwards=2)
    assert overlapped == sequential


def test_a_layer_runs_while_later_layers_are_still_being_updated(monkeypatch):
    """Hooks on containers do not turn the overlap off: the first layer's forward runs
    while the step still holds the last layer's chunk."""
    model = _mlp()
    opt = _optimizer(model, overlap="forward")
    opt.overlap_with(model)
    model(torch.ones(1, 8)).sum().backward()  # the first forward shows what runs
    release = hold_the_last_chunk(monkeypatch, opt)
    opt.step()
    seen = []
    model[0].register_forward_hook(lambda *_: seen.append(opt.runner.overlap.pending.finished))
    threading.Timer(0.3, release.set).start()
    model(torch.ones(1, 8))
    assert seen == [False]
    opt.synchronize()


def test_step_post_hooks_see_the_finished_step(slow_worker):
    model, opt, reference_model, reference = _pair()
    seen = {}
    for o, m in ((opt, model), (reference, reference_model)):
        o.register_step_post_hook(
            lambda o, *_, m=m: seen.setdefault(id(o), []).append(m[0].weight.detach().clone())
        )
    for m, o in ((reference_model, reference), (model, opt)):  # one loop after the other
        for step in range(2):
            o.zero_grad()
            _backward(m, step)
            with (
                pytest.warns(UserWarning, match="step post-hooks")
                if (o is opt and step == 0)
                else contextlib.nullcontext()
            ):
                o.step()
    assert len(seen[id(opt)]) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen[id(opt)], seen[id(reference)]))


def test_a_global_step_post_hook_makes_the_step_wait(slow_worker):
    model, opt, _, _ = _pair()
    seen = []
    handle = register_optimizer_step_post_hook(
        lambda o, *_: seen.append(o.runner.overlap.pending is None) if o is opt else None
    )
    try:
        _backward(model, 0)
        with pytest.warns(UserWarning, match="step post-hooks"):
            opt.step()
    finally:
        handle.remove()
    assert seen == [True]


def test_last_step_stats_waits_for_the_step(slow_worker):
    """``opt.step(); print(opt.last_step_stats)``: the finished step's counters (a matrix
    whose grad holds NaN counted)."""
    model, opt, _, _ = _pair()
    _backward(model, 0)
    model[2].weight.grad[0, 0] = float("nan")
    opt.step()
    stats = opt.last_step_stats
    assert opt.runner.overlap.pending is None
    assert stats.nonfinite_matrices == 1
    assert stats.workspace_peak_bytes > 0


@pytest.mark.parametrize("copier", ["deepcopy", "torch.save", "AveragedModel", "layer deepcopy"])
def test_the_model_can_be_copied_and_saved_right_after_step(slow_worker, copier):
    """A copy holds the updated weights (it waits for the step) and gets no hooks that wait
    for this optimizer; the original keeps its hooks."""
    model, opt, reference_model, reference = _pair()
    for m, o in ((reference_model, reference), (model, opt)):
        _backward(m, 0)
        o.step()
    if copier == "deepcopy":
        copied = copy.deepcopy(model)
    elif copier == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    elif copier == "layer deepcopy":
        copied = nn.Sequential(model[0], model[1], copy.deepcopy(model[2]), model[3])
        opt.synchronize()
    else:
        copied = torch.optim.swa_utils.AveragedModel(model).module
    expected = dict(reference_model.named_parameters())
    assert all(torch.equal(p, expected[n]) for n, p in copied.named_parameters())
    copied(torch.ones(1, 8))  # its hooks are inert
    # The original still overlaps its next step.
    for m, o in ((reference_model, reference), (model, opt)):
        o.zero_grad()
        _backward(m, 1)
        o.step()
    assert opt.runner.overlap.pending is not None
    opt.synchronize()
    assert_same_optimizers(
        reference, list(reference_model.parameters()), opt, list(model.parameters())
    )


def test_a_model_compiled_before_overlap_with_waits_too(slow_worker):
    """``torch.compile`` traced the model before the hooks existed (a warm-up forward): the
    overlapped forwards still wait (compiled code guards on hooks once ``overlap_with``
    ran, and the hooks are never traced)."""
    outputs = {}
    for overlap in (None, "forward"):
        torch._dynamo.reset()
        model = _mlp()
        compiled = torch.compile(model, backend="eager")
        compiled(torch.ones(4, 8)).sum()  # traced without hooks, grad mode on
        opt = _optimizer(model, overlap=overlap)
        if overlap:
            opt.overlap_with(model)
        for step in range(3):
            out = compiled(torch.ones(4, 8) * (step + 1))
            outputs.setdefault(overlap, []).append(out.detach().clone())
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outputs[None], outputs["forward"]))


def test_a_failed_step_keeps_failing_until_a_restore(monkeypatch):
    """After the worker failed, every wait (the forward's, synchronize, a checkpoint, the
    next step) raises until ``load_state_dict`` restores: a half-applied step is never
    saved or stepped on."""
    from shardmuon.runtime.overlap import OverlapError

    model = _mlp()
    opt = _optimizer(model, overlap="forward")
    opt.overlap_with(model)
    _backward(model, 0)
    opt.step()
    opt.synchronize()
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    mark = overlap_module.OverlappedStep._mark

    def fail(self, key):
        if key == ("batch", 0):
            raise RuntimeError("injected failure")
        mark(self, key)

    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", fail)
    _backward(model, 1)
    opt.step()
    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", mark)
    with pytest.raises(OverlapError, match="injected failure"):
        model(torch.ones(1, 8))
    forward = lambda: model(torch.ones(1, 8))  # noqa: E731
    for again in (opt.synchronize, opt.state_dict, model.state_dict, opt.step, forward):
        with pytest.raises(OverlapError, match="restore a checkpoint"):
            again()
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    opt.zero_grad()
    _backward(model, 2)
    opt.step()
    opt.synchronize()


def test_the_schedule_cache_holds_its_plan_not_its_id(monkeypatch):
    """A plan rebuilt at the address of a freed one (``add_param_group``, a planned setting
    changed) gets its own schedule: the cache compares plans, not their ``id()``."""
    import shardmuon.planning.workspace as workspace

    monkeypatch.setattr(workspace, "step_schedule", lambda batches, *_: [("prepare", len(batches))])

    class Plan:
        def __init__(self, batches: int) -> None:
            self.batches, self.ns_cost = [None] * batches, None

    cache = workspace.ScheduleCache()
    plan = Plan(1)
    assert cache.get(plan, 100, 1) == [("prepare", 1)]
    freed = id(plan)
    del plan
    for _ in range(10_000):  # CPython hands a freed address out again within a few tries
        plan = Plan(2)
        if id(plan) == freed:
            break
    assert cache.get(plan, 100, 1) == [("prepare", 2)]


class _StandInStream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def _finished_step_with_stand_in_events(monkeypatch, keys):
    """A finished overlapped step made to look like a CUDA one: one stand-in event per
    chunk, and a stand-in for the caller's current stream (returned with it)."""
    step = overlap_module.OverlappedStep(
        lambda done: [done(k) for k in keys], keys, torch.device("cpu")
    )
    step.join()
    step._cuda = True
    step._events = {k: f"event of {k}" for k in keys}
    current = _StandInStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    return step, current


def test_a_wait_orders_every_stream_that_reads_the_parameters(monkeypatch):
    """On CUDA a wait is a stream wait on the chunk's event: the caller's stream and every
    other stream given (FSDP2's all-gather copy-in and all-gather streams) wait on exactly
    the events of the chunks asked for (stand-in streams and events on a CPU)."""
    keys = [("batch", 0), ("batch", 1), ("adamw", 0)]
    step, current = _finished_step_with_stand_in_events(monkeypatch, keys)
    copy_in, gather = _StandInStream(), _StandInStream()
    step.wait_for([("batch", 1), ("adamw", 0)], [copy_in, gather])
    wanted = ["event of ('batch', 1)", "event of ('adamw', 0)"]
    assert current.waited == copy_in.waited == gather.waited == wanted


def test_synchronize_orders_fsdp2s_all_gather_streams_after_the_whole_step(monkeypatch):
    """After ``synchronize()`` no hook waits, and FSDP2's root pre-forward orders its
    all-gather streams after the current stream only, or only after an event the caller
    gave (``set_post_optim_event``) that may predate the step's end: so ``synchronize``
    makes those streams of every hooked model's units wait for every chunk too (stand-in
    streams and events on a CPU)."""
    import types
    import weakref

    keys = [("batch", 0), ("adamw", 0)]
    step, current = _finished_step_with_stand_in_events(monkeypatch, keys)
    copy_in, gather = _StandInStream(), _StandInStream()
    comm = types.SimpleNamespace(all_gather_copy_in_stream=copy_in, all_gather_stream=gather)
    state = types.SimpleNamespace(_comm_ctx=comm)

    class Unit(nn.Module):
        def _get_fsdp_state(self):
            return state

    units = [Unit(), Unit()]  # two units, one comm context: each stream waits once per event
    overlap = overlap_module.ForwardOverlap()
    overlap._units = [weakref.ref(u) for u in units]
    overlap.pending, overlap._stats = step, types.SimpleNamespace(overlap_wait_seconds=0.0)
    overlap.synchronize()
    wanted = [f"event of {k}" for k in keys]
    assert current.waited == copy_in.waited == gather.waited == wanted
