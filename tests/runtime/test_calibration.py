"""``newton_schulz_impl="auto"``'s measured choice: the shape classes of a plan, the faster
candidate per class, the cache, the optimizer running what was chosen, a candidate that
fails while it is timed, the table a checkpoint keeps, and (2 gloo ranks) rank 0's choice,
its failures and its loaded table on every rank."""

from __future__ import annotations

import copy
import io

import dist_calibration_cases
import pytest
import torch
from checks import set_random_grads
from dist_calibration_cases import fail_candidates
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
    classes = calibration.plan_shape_classes(opt.plan.batches)
    # Local stacks whole (the tall one joins the wide class), partition blocks per size.
    assert classes == {(16, 96): 2, (4, 40): 6, (24, 24): 1}


def test_auto_runs_the_faster_candidate_per_class_and_times_each_class_once(monkeypatch):
    timed = []

    def timer(make, shape, device, coefficients, eps, **kwargs):
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
    assert opt.auto_choices == {(16, 96): "gram", (32, 40): "folded"}
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
    assert set(opt.auto_choices) == {(8, 64), (16, 16)}
    assert set(opt.auto_choices.values()) <= {"folded", "gram"}
    assert opt.auto_choices[(16, 16)] == "folded"  # square: Gram is the folded iteration


def test_other_engines_do_not_calibrate(monkeypatch) -> None:
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    params = _params([(8, 64)])
    params[0].grad = torch.randn(8, 64)
    Muon(params, newton_schulz_impl="gram").step()


def _fixed_timer(winner: str):
    def timer(make, shape, device, coefficients, eps, **kwargs):
        return {name: 1.0 if name == winner else 2.0 for name in ("folded", "gram")}

    return timer


WIDE = [(16, 96), (16, 96), (40, 8), (24, 24)]


def _steps(opt, params, seeds) -> None:
    for seed in seeds:
        set_random_grads(params, seed)
        opt.step()


# A candidate failing while it is timed: a CUDA out-of-memory (torch.OutOfMemoryError is a
# RuntimeError) and any other error. Before, every step raised it again.
ERRORS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text"),
    RuntimeError("cuBLAS failed"),
]


@pytest.mark.parametrize("error", ERRORS, ids=["oom", "runtime"])
def test_a_candidate_that_fails_while_timed_is_skipped_with_a_warning(monkeypatch, error):
    fail_candidates(monkeypatch.setattr, {"gram": error})
    params = _params(WIDE)
    reference = copy.deepcopy(params)
    opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
    with pytest.warns(RuntimeWarning) as caught:
        _steps(opt, params, [1])
    notes = [str(w.message) for w in caught if "newton_schulz_impl" in str(w.message)]
    first_line = str(error).splitlines()[0]
    assert len(notes) == 2, notes  # (16, 96) and (8, 40); the square class is not timed
    assert "timing the 'gram' engine on shape class (16, 96) (timed as a [2, 16, 96]" in notes[1]
    assert f"{type(error).__name__}: {first_line}" in notes[1]
    assert opt.auto_choices == {(8, 40): "folded", (16, 96): "folded", (24, 24): "folded"}
    _steps(opt, params, [2])  # no error, no new timing
    ref = Muon(reference, lr=0.1)
    _steps(ref, reference, [1, 2])
    assert all(torch.equal(p, q) for p, q in zip(params, reference))


def test_when_every_candidate_fails_the_class_runs_the_default_engine(monkeypatch):
    fail_candidates(monkeypatch.setattr, {"gram": RuntimeError("a"), "folded": RuntimeError("b")})
    params = _params([(16, 96)])
    opt = Muon(params, newton_schulz_impl="auto")
    with pytest.warns(RuntimeWarning) as caught:
        _steps(opt, params, [1])
    notes = [str(w.message) for w in caught if "newton_schulz_impl" in str(w.message)]
    assert len(notes) == 3, notes
    assert "'folded' engine on shape class (16, 96)" in notes[0]
    assert "'gram' engine on shape class (16, 96)" in notes[1]
    assert "no candidate engine could be timed on shape class (16, 96)" in notes[2]
    assert "folded: RuntimeError: b; gram: RuntimeError: a" in notes[2]
    assert notes[2].endswith("it runs the default engine 'folded'")
    assert opt.auto_choices == {(16, 96): "folded"}


def test_a_timer_that_raises_falls_back_to_the_default_engine(monkeypatch):
    """A failure outside the candidates (the random input itself out of memory)."""

    def timer(*args, **kwargs):
        raise torch.OutOfMemoryError("no room for the input")

    monkeypatch.setattr(calibration, "time_engines", timer)
    params = _params([(16, 96)])
    opt = Muon(params, newton_schulz_impl="auto")
    with pytest.warns(RuntimeWarning, match="every candidate: OutOfMemoryError: no room"):
        _steps(opt, params, [1])
    assert opt.auto_choices == {(16, 96): "folded"}


def test_a_loaded_state_dict_brings_its_table_and_the_steps_stay_bitwise(monkeypatch):
    """Timings differ run to run (folded, folded, gram for one class in three runs): the
    table is part of the checkpoint. The second optimizer would measure folded for the wide
    classes; the loaded table (gram) rules, and its steps equal the uninterrupted run's."""
    monkeypatch.setattr(calibration, "time_engines", _fixed_timer("gram"))
    params = _params(WIDE)
    opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
    _steps(opt, params, [1])
    assert opt.auto_choices[(16, 96)] == "gram"
    buffer = io.BytesIO()
    torch.save({"params": params, "optimizer": opt.state_dict()}, buffer)
    saved = opt.state_dict()[calibration.STATE_DICT_KEY]
    assert saved["choices"] == [[8, 40, "gram"], [16, 96, "gram"], [24, 24, "folded"]]
    assert saved["settings"]["device_type"] == "cpu"
    _steps(opt, params, [2, 3])

    # A new process: an empty cache and timings that pick folded.
    calibration._CHOICES.clear()
    timed = []

    def folded_timer(*args, **kwargs):
        timed.append(args[1])
        return {"folded": 1.0, "gram": 2.0}

    monkeypatch.setattr(calibration, "time_engines", folded_timer)
    buffer.seek(0)
    blob = torch.load(buffer, weights_only=True)  # plain values only
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in blob["params"]]
    again = Muon(resumed, lr=0.1, newton_schulz_impl="auto")
    again.load_state_dict(blob["optimizer"])
    _steps(again, resumed, [2, 3])
    assert timed == []
    assert again.auto_choices == opt.auto_choices
    assert all(torch.equal(p, q) for p, q in zip(params, resumed))
    assert again.state_dict()[calibration.STATE_DICT_KEY] == saved

    # Without the table (dion's format, DCP), the same load measures anew: other bits.
    calibration._CHOICES.clear()
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in blob["params"]]
    measured = Muon(fresh, lr=0.1, newton_schulz_impl="auto")
    plain = {k: v for k, v in blob["optimizer"].items() if k != calibration.STATE_DICT_KEY}
    measured.load_state_dict(plain)
    _steps(measured, fresh, [2, 3])
    assert sorted(timed) == [(1, 8, 40), (2, 16, 96)]
    assert measured.auto_choices[(16, 96)] == "folded"
    assert not torch.equal(fresh[0], params[0])


def test_a_copy_keeps_the_loaded_table(monkeypatch):
    monkeypatch.setattr(calibration, "time_engines", _fixed_timer("gram"))
    params = _params(WIDE)
    opt = Muon(params, newton_schulz_impl="auto")
    _steps(opt, params, [1])
    state = opt.state_dict()
    calibration._CHOICES.clear()
    monkeypatch.setattr(calibration, "time_engines", _fixed_timer("folded"))
    other = Muon(_params(WIDE), newton_schulz_impl="auto")
    other.load_state_dict(state)
    twin = copy.deepcopy(other)
    _steps(twin, [p for g in twin.param_groups for p in g["params"]], [2])
    assert twin.auto_choices == opt.auto_choices


def test_a_table_measured_under_other_settings_is_measured_anew(monkeypatch):
    monkeypatch.setattr(calibration, "time_engines", _fixed_timer("gram"))
    params = _params([(16, 96)])
    opt = Muon(params, newton_schulz_impl="auto")
    _steps(opt, params, [1])
    state = opt.state_dict()
    monkeypatch.setattr(calibration, "time_engines", _fixed_timer("folded"))
    other = Muon(_params([(16, 96)]), newton_schulz_impl="auto", newton_schulz_dtype="float32")
    other.load_state_dict(state)
    _steps(other, [p for g in other.param_groups for p in g["params"]], [2])
    assert other.auto_choices == {(16, 96): "folded"}
    assert other.state_dict()[calibration.STATE_DICT_KEY]["settings"]["dtype"] == "torch.float32"


@pytest.mark.parametrize(
    ("table", "pattern"),
    [
        ("gram", r"must be a dict with 'settings' and 'choices', got str"),
        ({"choices": []}, r"must be a dict with 'settings' and 'choices', got \['choices'\]"),
        ({"settings": {}, "choices": [[96, 16, "gram"]]}, r"choice \[96, 16, 'gram'\] is not"),
        ({"settings": {}, "choices": [[16, 96, "unfolded"]]}, r"engine one of \['folded', 'gram'\]"),
        ({"settings": {}, "choices": [[24, 24, "gram"]]}, r"'folded' when square"),
    ],
)  # fmt: skip
def test_a_malformed_table_is_refused_before_anything_changes(table, pattern) -> None:
    params = _params([(16, 96)])
    opt = Muon(params, lr=0.1, newton_schulz_impl="auto")
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = 0.5
    state[calibration.STATE_DICT_KEY] = table
    with pytest.raises(ValueError, match=r"state dict: 'newton_schulz_auto'.*" + pattern):
        opt.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == 0.1


def test_other_engines_save_no_table() -> None:
    params = _params([(16, 96)])
    opt = Muon(params)
    _steps(opt, params, [1])
    assert set(opt.state_dict()) == {"state", "param_groups"}


WORLDS = WorldPlan(
    "dist_calibration_cases:CASES",
    lambda _: list(dist_calibration_cases.CASES),
    (2,),
    timeout_s=240.0,
    collective_timeout_s=60.0,
)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(dist_calibration_cases.CASES))
def test_two_ranks(worlds, name) -> None:
    worlds[2].check(name)
