"""``newton_schulz_impl="auto"``'s measured choice: the shape classes of a plan, the faster
candidate per class, the cache, the optimizer running what was chosen, and (2 gloo ranks)
rank 0's choice on every rank."""

from __future__ import annotations

import dist_calibration_cases
import pytest
import torch
from dist_harness import WorldPlan

import shardmuon.runtime.calibration as calibration
from shardmuon import Muon
from shardmuon.ops.newton_schulz import newton_schulz
from shardmuon.ops.newton_schulz_gram import newton_schulz_gram


@pytest.fixture(autouse=True)
def _fresh_cache():
    calibration._CHOICES.clear()
    yield
    calibration._CHOICES.clear()


def _params(shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def test_the_shape_classes_of_a_plan() -> None:
    params = _params([(16, 96), (16, 96), (3, 8, 40), (96, 16), (24, 24)])
    opt = Muon(params, matrix_partitions={params[2]: (4, 4)})
    classes = calibration.plan_shape_classes(opt._plan.batches)
    # Local stacks whole (the tall one joins the wide class), partition blocks per size.
    assert classes == {(16, 96): 2, (4, 40): 6, (24, 24): 1}


def test_auto_runs_the_faster_candidate_per_class_and_times_each_class_once(monkeypatch):
    timed = []

    def timer(make, shape, device, coefficients, eps):
        timed.append(shape)
        if shape[1:] == (16, 96):
            return {"gram": 1.0, "folded": 2.0}
        return {"gram": 2.0, "folded": 1.0}

    monkeypatch.setattr(calibration, "time_engines", timer)
    params = _params([(16, 96), (32, 40)])
    for p in params:
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
    grads = [p.grad.clone() for p in params]
    start = [p.detach().clone() for p in params]
    opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
    opt.step()
    assert opt._auto_choices == {(16, 96): "gram", (32, 40): "folded"}
    assert sorted(timed) == [(1, 16, 96), (1, 32, 40)]
    # What ran: Gram for the wide class, folded for the other (the pure functions' bits).
    U = [grads[0].bfloat16(), grads[1].bfloat16()]
    got = opt.orthogonalize_chunk([params[0]], [U[0]])[0]
    assert torch.equal(got, newton_schulz_gram(U[0]).to(torch.bfloat16))
    assert torch.equal(opt.orthogonalize_chunk([params[1]], [U[1]])[0], newton_schulz(U[1]))
    assert not torch.equal(params[0].detach(), start[0])
    # A second optimizer with the same settings reuses the cache: nothing timed again.
    Muon(params, lr=0.1, newton_schulz_impl="auto").step()
    assert len(timed) == 2


def test_real_timings_choose_a_candidate_for_every_class() -> None:
    params = _params([(8, 64), (16, 16)])
    for p in params:
        p.grad = torch.randn(p.shape)
    opt = Muon(params, newton_schulz_impl="auto")
    opt.step()
    assert set(opt._auto_choices) == {(8, 64), (16, 16)}
    assert set(opt._auto_choices.values()) <= {"folded", "gram"}
    assert opt._auto_choices[(16, 16)] == "folded"  # square: Gram is the folded iteration


def test_other_engines_do_not_calibrate(monkeypatch) -> None:
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    params = _params([(8, 64)])
    params[0].grad = torch.randn(8, 64)
    Muon(params, newton_schulz_impl="gram").step()


WORLDS = WorldPlan(
    "dist_calibration_cases:CASES",
    lambda _: list(dist_calibration_cases.CASES),
    (2,),
    timeout_s=240.0,
    collective_timeout_s=60.0,
)


@pytest.mark.slow
def test_every_rank_runs_rank_0s_choice(worlds) -> None:
    worlds[2].check(*dist_calibration_cases.CASES)
