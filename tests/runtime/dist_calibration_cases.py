"""``newton_schulz_impl="auto"`` across ranks: rank 0's measured choices reach every rank,
whatever each rank's own timings say; a candidate that fails on rank 0 is skipped on every
rank, with the same warnings, and no rank waits for a broadcast that never comes; a loaded
table rules on every rank (cases for a world of 2; ``test_calibration``)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from dist_checks import Context, make_context
from torch.distributed.tensor import Replicate, distribute_tensor

import shardmuon.runtime.calibration as calibration
from shardmuon import Muon
from shardmuon.ops.orthogonalizer import NewtonSchulzSettings

__all__ = ["CASES", "fail_candidates", "make_context"]


class _Failing:
    """A candidate engine that raises ``error`` when called (out of memory while timed)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __call__(self, *args, **kwargs):
        raise self.error

    def take_report(self):
        return [], []


def fail_candidates(setattr_: Callable, errors: dict[str, BaseException]) -> None:
    """Make the candidates named in ``errors`` raise while ``"auto"`` times them (the
    engine a step runs is built without ``impl`` and is left alone). ``setattr_``:
    ``monkeypatch.setattr`` or :func:`setattr`."""
    original = NewtonSchulzSettings.orthogonalizer

    def orthogonalizer(self, choices=None, impl=None):
        if impl in errors:
            return _Failing(errors[impl])
        return original(self, choices, impl)

    setattr_(NewtonSchulzSettings, "orthogonalizer", orthogonalizer)


@contextlib.contextmanager
def _restored(*targets: tuple[object, str]) -> Iterator[None]:
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    calibration._CHOICES.clear()
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        calibration._CHOICES.clear()


def _rank_biased_timer(make, shape, device, coefficients, eps, **kwargs):
    """A timer that disagrees across ranks: rank 0 finds gram faster, the others folded."""
    gram_fast = dist.get_rank() == 0
    return {"gram": 1.0 if gram_fast else 2.0, "folded": 2.0 if gram_fast else 1.0}


def every_rank_runs_rank_0s_choice(ctx: Context) -> None:
    calibration._CHOICES.clear()
    original = calibration.time_engines
    calibration.time_engines = _rank_biased_timer
    try:
        g = torch.Generator().manual_seed(0)
        # Replicated weights (HSDP replicas without split_replicas): every rank computes
        # the same matrices, so the engines must agree or the replicas drift apart.
        full = [torch.randn(s, generator=g) for s in ((16, 96), (24, 24))]
        params = [
            torch.nn.Parameter(distribute_tensor(t.clone(), ctx.mesh, [Replicate()])) for t in full
        ]
        grads = [torch.randn(t.shape, generator=g) for t in full]
        for p, grad in zip(params, grads):
            p.grad = distribute_tensor(grad, ctx.mesh, [Replicate()])
        opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
        opt.step()
        assert opt.auto_choices == {(16, 96): "gram", (24, 24): "folded"}, opt.auto_choices
        # The same bits on every rank, and those of one process with gram for (16, 96).
        reference = [torch.nn.Parameter(t.clone()) for t in full]
        for p, grad in zip(reference, grads):
            p.grad = grad.clone()
        Muon(reference, lr=0.1, newton_schulz_impl="gram").step()
        for p, want in zip(params, reference):
            got = p.to_local()
            gathered = [torch.empty_like(got) for _ in range(ctx.world_size)]
            dist.all_gather(gathered, got)
            assert all(torch.equal(x, gathered[0]) for x in gathered)
            assert torch.equal(got, want.detach())
    finally:
        calibration.time_engines = original
        calibration._CHOICES.clear()


def _replicated(ctx: Context, shapes) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        full = torch.randn(shape, generator=g)
        params.append(torch.nn.Parameter(distribute_tensor(full, ctx.mesh, [Replicate()])))
    return params


def _step(params, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        grad = torch.randn(p.shape, generator=g)
        p.grad = distribute_tensor(grad, p.device_mesh, [Replicate()])
    opt.step()


def _same_on_every_rank(ctx: Context, notes: list[str], tensors=()) -> None:
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (notes, list(tensors)))
    for other_notes, other_tensors in gathered[1:]:
        assert other_notes == gathered[0][0], gathered
        assert all(map(torch.equal, other_tensors, gathered[0][1]))


def _auto_notes(caught) -> list[str]:
    return [str(w.message) for w in caught if "newton_schulz_impl" in str(w.message)]


def a_candidate_failing_on_rank_0_is_skipped_on_every_rank(ctx: Context) -> None:
    """Rank 0 runs out of memory timing Gram: before, it raised before its broadcast and
    rank 1 waited in it until the process group's timeout."""
    with _restored((NewtonSchulzSettings, "orthogonalizer")):
        if ctx.rank == 0:
            fail_candidates(setattr, {"gram": torch.OutOfMemoryError("CUDA out of memory")})
        params = _replicated(ctx, [(16, 96), (24, 24)])
        opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(params, opt, 1)
        notes = _auto_notes(caught)
        assert len(notes) == 1 and "'gram' engine on shape class (16, 96)" in notes[0], notes
        assert "OutOfMemoryError: CUDA out of memory" in notes[0], notes
        assert opt.auto_choices == {(16, 96): "folded", (24, 24): "folded"}, opt.auto_choices
        _step(params, opt, 2)
        _same_on_every_rank(ctx, notes, [p.to_local() for p in params])


def every_candidate_failing_on_rank_0_runs_folded_on_every_rank(ctx: Context) -> None:
    with _restored((NewtonSchulzSettings, "orthogonalizer")):
        if ctx.rank == 0:
            fail_candidates(setattr, {n: RuntimeError(f"{n} broke") for n in ("folded", "gram")})
        params = _replicated(ctx, [(16, 96)])
        opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(params, opt, 1)
        notes = _auto_notes(caught)
        assert len(notes) == 3 and "runs the default engine 'folded'" in notes[2], notes
        assert opt.auto_choices == {(16, 96): "folded"}, opt.auto_choices
        _same_on_every_rank(ctx, notes)


def rank_0_raising_while_it_decides_raises_on_every_rank(ctx: Context) -> None:
    """An error outside the candidates (a bug, an interrupt) on rank 0 only: every rank
    raises, none waits; the world is usable afterwards (the collectives paired)."""

    def broken(*args, **kwargs):
        raise ValueError("broken decision")

    with _restored((calibration, "_choose")):
        if ctx.rank == 0:
            calibration._choose = broken
        params = _replicated(ctx, [(16, 96)])
        opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
        try:
            _step(params, opt, 1)
        except (ValueError, RuntimeError) as err:
            message = str(err)
        else:
            raise AssertionError("the step did not raise")
        want = "broken decision" if ctx.rank == 0 else "rank 0 raised while it measured"
        assert want in message, message
    dist.barrier()


def a_loaded_table_rules_on_every_rank(ctx: Context) -> None:
    """The checkpoint's table (gram), whatever the new timings (folded) say."""
    with _restored((calibration, "time_engines")):
        calibration.time_engines = _rank_biased_timer
        params = _replicated(ctx, [(16, 96), (24, 24)])
        opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
        _step(params, opt, 1)
        state = opt.state_dict()
        calibration._CHOICES.clear()
        calibration.time_engines = lambda *a, **k: {"folded": 1.0, "gram": 2.0}
        again = Muon(_replicated(ctx, [(16, 96), (24, 24)]), lr=0.1, newton_schulz_impl="auto")
        again.load_state_dict(state)
        _step([p for p in again.param_groups[0]["params"]], again, 2)
        assert again.auto_choices == {(16, 96): "gram", (24, 24): "folded"}, again.auto_choices


CASES: dict[str, Callable[[Context], None]] = {
    "every_rank_runs_rank_0s_choice": every_rank_runs_rank_0s_choice,
    "a_candidate_failing_on_rank_0_is_skipped_on_every_rank": (
        a_candidate_failing_on_rank_0_is_skipped_on_every_rank
    ),
    "every_candidate_failing_on_rank_0_runs_folded_on_every_rank": (
        every_candidate_failing_on_rank_0_runs_folded_on_every_rank
    ),
    "rank_0_raising_while_it_decides_raises_on_every_rank": (
        rank_0_raising_while_it_decides_raises_on_every_rank
    ),
    "a_loaded_table_rules_on_every_rank": a_loaded_table_rules_on_every_rank,
}
