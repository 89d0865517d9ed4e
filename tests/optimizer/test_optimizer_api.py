"""Single-process behaviour of ``shardmuon.Muon``: bad input, state layout, chunked stepping."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from checks import set_random_grads

from shardmuon import Muon, newton_schulz_reference


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(32, 16), (16, 32), (3, 24, 8), (16,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.05) for s in shapes]


def _groups(ps: list[torch.nn.Parameter]) -> list[dict]:
    return [
        dict(params=ps[:3], algorithm="muon"),
        dict(params=ps[3:], algorithm="adamw"),
    ]


_set_grads = set_random_grads


BAD_CONSTRUCTOR = [
    # (keyword arguments, exception, message pattern)
    (dict(lr=-0.1), ValueError, r"lr must be a finite number >= 0, got -0\.1"),
    (dict(mu=-0.5), ValueError, r"mu must be a number in \[0, 1\), got -0\.5"),
    (dict(mu=1.5), ValueError, r"mu must be a number in \[0, 1\), got 1\.5"),
    (dict(betas=(-0.1, 0.95)), ValueError, r"betas\[0\] must be a number in \[0, 1\), got -0\.1"),
    (dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\] must be a number in \[0, 1\), got 1\.0"),
    (dict(betas=(0.9,)), ValueError, r"betas must be a pair"),
    (dict(weight_decay=-1.0), ValueError, r"weight_decay must be a finite number >= 0, got -1\.0"),
    (dict(lr="fast"), TypeError, r"lr must be a finite number >= 0, got 'fast'"),
    (dict(adjust_lr="max"), ValueError, r"unknown adjust_lr 'max'; accepted: 'rms_norm'"),
    (dict(distributed_mesh="mesh"), TypeError, r"distributed_mesh must be None, a DeviceMesh"),
]


@pytest.mark.parametrize(("kwargs", "error", "pattern"), BAD_CONSTRUCTOR)
def test_bad_constructor_arguments(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        Muon(_groups(_params()), **kwargs)


def test_bad_groups() -> None:
    ps = _params()
    with pytest.raises(ValueError, match=r"param group 0: unknown algorithm 'sgd'"):
        Muon([dict(params=ps[:1], algorithm="sgd")])
    with pytest.raises(
        ValueError, match=r"parameter 1 has shape \(16,\); Muon needs matrices \(2-D or more\)"
    ):
        Muon([dict(params=[ps[0], ps[3]], algorithm="muon")])
    with pytest.raises(
        ValueError, match=r"param group 1: weight_decay must be a finite number >= 0, got -0\.5"
    ):
        Muon([dict(params=ps[:1]), dict(params=ps[1:2], weight_decay=-0.5)])
    with pytest.raises(ValueError, match=r"param group 0: unknown adjust_lr 'auto'"):
        Muon([dict(params=ps[:1], adjust_lr="auto")])


BAD_PARTITIONS = [
    ((10, 10), ValueError, r"= \[10, 10\] sums to 20, but the parameter has 32 rows"),
    ((32, 0), ValueError, r"must hold positive ints, got \[32, 0\]"),
    ((40, -8), ValueError, r"must hold positive ints, got \[40, -8\]"),
    ((), ValueError, r"is empty"),
    ("16,16", TypeError, r"must be a sequence of row counts, got str"),
]


@pytest.mark.parametrize(("sizes", "error", "pattern"), BAD_PARTITIONS)
def test_bad_partitions(sizes, error: type, pattern: str) -> None:
    ps = _params()
    with pytest.raises(error, match=pattern):
        Muon(_groups(ps), matrix_partitions={ps[0]: sizes})


def test_partitions_of_a_foreign_parameter() -> None:
    ps = _params()
    with pytest.raises(ValueError, match=r"not in a 'muon' param group"):
        Muon(_groups(ps), matrix_partitions={ps[3]: (16,)})


def test_state_is_created_eagerly_with_dion_keys() -> None:
    """dion's keys plus a ``step`` counter per parameter (a 0-d float32 CPU tensor)."""
    ps = _params()
    opt = Muon(_groups(ps))
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert [sorted(sd["state"][i]) for i in range(4)] == [["momentum", "step"]] * 3 + [
        ["momentum", "step", "variance"]
    ]
    counter = sd["state"][0]["step"]
    assert counter.dtype == torch.float32 and counter.dim() == 0 and counter.device.type == "cpu"
    keys = {"lr", "mu", "beta1", "beta2", "weight_decay", "algorithm", "step"}
    keys |= {"epsilon", "nesterov", "flatten", "adjust_lr", "params"}
    assert all(set(g) == keys for g in sd["param_groups"])


def test_step_counter_advances_for_every_group() -> None:
    ps = _params()
    opt = Muon(_groups(ps))
    _set_grads(ps[:3], 0)  # the adamw param has no grad: its group still counts the step
    opt.step()
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [2, 2]
    assert torch.count_nonzero(opt.state[ps[3]]["momentum"]) == 0


def test_update_matches_fp64_formula() -> None:
    """One step against the update written out in float64 (bf16 Newton-Schulz tolerance)."""
    ps = _params()
    before = [p.detach().clone().double() for p in ps]
    opt = Muon(_groups(ps), lr=0.02, weight_decay=0.1, nesterov=True, mu=0.9, adjust_lr="rms_norm")
    _set_grads(ps, 1)
    opt.step()
    for p, x0 in zip(ps[:3], before[:3]):
        g = p.grad.double()
        u = 0.9 * g + g  # momentum starts at zero: M = G, U = mu*M + G
        o = newton_schulz_reference(u)
        rows, cols = p.shape[-2:]
        expected = x0 * (1 - 0.02 * 0.1) - 0.02 * 0.2 * math.sqrt(max(rows, cols)) * o
        delta = x0 - expected
        err = (p.detach().double() - expected).norm() / delta.norm()
        assert err < 0.01, f"shape {tuple(p.shape)}: relative update error {err:.4f}"


def test_chunks_step_equals_step() -> None:
    runs = []
    for chunked in (False, True):
        ps = _params()
        opt = Muon(_groups(ps), nesterov=True)
        for step in range(3):
            _set_grads(ps, step)
            if chunked:
                for chunk in reversed(opt.chunks()):
                    opt.step_chunk(chunk)
            else:
                opt.step()
        runs.append((ps, opt))
    (ps_a, opt_a), (ps_b, opt_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(ps_a, ps_b))
    assert [g["step"] for g in opt_a.param_groups] == [g["step"] for g in opt_b.param_groups]
    for a, b in zip(ps_a, ps_b):
        for key, value in opt_a.state[a].items():
            assert torch.equal(value, opt_b.state[b][key])


def test_step_chunk_twice_in_a_round_raises() -> None:
    ps = _params()
    opt = Muon(_groups(ps))
    _set_grads(ps, 0)
    first = opt.chunks()[0]
    opt.step_chunk(first)
    with pytest.raises(RuntimeError, match=r"chunk 0 was already stepped in this round"):
        opt.step_chunk(first)
    with pytest.raises(
        RuntimeError, match=r"step\(\) called while a step_chunk\(\) round is open \(1 of"
    ):
        opt.step()


def test_nan_gradient_stays_in_its_parameter() -> None:
    """Documented behaviour: a NaN grad skips that matrix's update (counted), nothing else
    changes, and no weight becomes NaN (details in ``test_hazardous_inputs.py``)."""
    ps = _params()
    opt = Muon(_groups(ps))
    _set_grads(ps, 0)
    ps[0].grad[0, 0] = float("nan")
    opt.step()
    assert opt.last_step_stats.nonfinite_matrices == 1
    assert all(torch.isfinite(p).all() for p in ps)


def test_orthogonalize_chunk_is_newton_schulz() -> None:
    ps = _params()
    opt = Muon(_groups(ps))
    U = [torch.randn(ps[2].shape)]
    (out,) = opt.orthogonalize_chunk([ps[2]], U)
    assert out.dtype == torch.bfloat16 and out.shape == ps[2].shape
    ref = newton_schulz_reference(U[0])
    assert (out.double() - ref).norm() / ref.norm() < 0.01


def test_a_step_that_raises_changes_nothing() -> None:
    ps = _params()
    opt = Muon(_groups(ps))
    before = [p.detach().clone() for p in ps]
    _set_grads(ps, 0)
    ps[1].grad.data = torch.randn(3, 3)  # torch checks shapes only on assignment to .grad
    with pytest.raises(ValueError, match=r"parameter 1 \(shape \(16, 32\)\): grad shape \(3, 3\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert [g["step"] for g in opt.param_groups] == [0, 0]
    assert all(torch.count_nonzero(s["momentum"]) == 0 for s in opt.state.values())


def test_add_param_group_extends_the_plan_and_state() -> None:
    ps = _params()
    opt = Muon([dict(params=ps[:1])])
    opt.add_param_group(dict(params=ps[1:3]))
    opt.add_param_group(dict(params=ps[3:], algorithm="adamw"))
    assert all("momentum" in opt.state[p] for p in ps) and "variance" in opt.state[ps[3]]
    _set_grads(ps, 0)
    opt.step()
    stepped = sum(c.num_matrices for c in opt.chunks() if hasattr(c, "num_matrices"))
    assert stepped == 1 + 1 + 3  # the 3-D param is 3 matrices
    with pytest.raises(ValueError, match=r"param group 3 \(algorithm 'muon'\): parameter 0"):
        vector = torch.nn.Parameter(torch.zeros(4))
        opt.add_param_group(dict(params=[vector], algorithm="muon"))
    assert len(opt.param_groups) == 3  # the rejected group is not kept
    opt.step()


def test_loads_a_microsoft_dion_state_dict() -> None:
    """microsoft/dion adds ``cautious_wd`` (group) and ``step_dev`` (AdamW state)."""
    ps = _params()
    opt = Muon(_groups(ps))
    _set_grads(ps, 0)
    opt.step()
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        group["cautious_wd"] = False
    sd["state"][3]["step_dev"] = torch.tensor(1.0)
    fresh = Muon(_groups(_params()))
    fresh.load_state_dict(sd)
    assert all(g["cautious_wd"] is False for g in fresh.state_dict()["param_groups"])
    assert sorted(fresh.state_dict()["state"][3]) == ["momentum", "step", "variance"]
    sd["param_groups"][1]["cautious_wd"] = True
    with pytest.raises(ValueError, match=r"state dict: param group 1 has cautious_wd=True"):
        fresh.load_state_dict(sd)


def _copy_in_place(target: dict, source: dict) -> None:
    """What DCP's load does to ``target = opt.state_dict()``: its tensors overwritten in
    place; the dict's other values replaced, which never reaches the optimizer's groups."""
    for index, entry in source["state"].items():
        for key, value in entry.items():
            target["state"][index][key].copy_(value)
    target["param_groups"] = source["param_groups"]


@pytest.mark.parametrize("offload", [None, "state"])
def test_a_state_loaded_in_place_resumes_bitwise_with_its_step_count(offload) -> None:
    """prime-rl's resume path (no ``load_state_dict``): the counters restore the step, so
    AdamW's bias correction continues; an uninterrupted run is matched bit for bit."""
    ps, twin = _params(), _params()
    opt, ref = Muon(_groups(ps), offload=offload), Muon(_groups(twin), offload=offload)
    for seed in range(3):
        for params, o in ((ps, opt), (twin, ref)):
            _set_grads(params, seed)
            o.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fresh = Muon(_groups(fresh_ps), offload=offload)
    _copy_in_place(fresh.state_dict(), saved)
    assert [g["step"] for g in fresh.param_groups] == [0, 0]
    for seed in range(3, 5):
        for params, o in ((fresh_ps, fresh), (twin, ref)):
            _set_grads(params, seed)
            o.step()
    assert [g["step"] for g in fresh.param_groups] == [5, 5]
    for p, q in zip(fresh_ps, twin):
        assert torch.equal(p, q)
        assert all(torch.equal(fresh.state[p][k], ref.state[q][k]) for k in ref.state[q])


def test_an_edited_group_step_wins_over_the_counters() -> None:
    """The counters only override the group's ``step`` when they were loaded in place; a
    user who sets ``group["step"]`` (to restart AdamW's bias correction) is obeyed."""
    ps = _params()
    opt = Muon(_groups(ps))
    _set_grads(ps, 0)
    opt.step()
    opt.param_groups[1]["step"] = 0
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [2, 1]
    assert opt.state[ps[3]]["step"].item() == 1 and opt.state[ps[0]]["step"].item() == 2


@pytest.mark.parametrize(
    ("counter", "error", "pattern"),
    [
        (torch.tensor([1.0, 2.0]), ValueError, r"state 'step' must be a number or a 1-element"),
        (torch.tensor(-1.0), ValueError, r"state 'step' must be a finite number >= 0, got -1\.0"),
        (torch.tensor(1.5), ValueError, r"state .step. must be a whole number >= 0, got 1\.5"),
        ("3", TypeError, r"state 'step' must be a finite number >= 0, got '3'"),
    ],
)
def test_a_bad_step_counter_is_refused_on_load(counter, error, pattern) -> None:
    ps = _params()
    opt = Muon(_groups(ps))
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][3]["step"] = counter
    with pytest.raises(error, match=rf"param group 1 parameter 0: {pattern}"):
        opt.load_state_dict(sd)
    assert opt.state[ps[3]]["step"].item() == 0  # nothing loaded


def test_a_dion_state_dict_without_counters_makes_them_from_the_group_step() -> None:
    ps = _params()
    opt = Muon(_groups(ps))
    _set_grads(ps, 0)
    opt.step()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        del entry["step"]
    fresh = Muon(_groups(_params()))
    fresh.load_state_dict(sd)
    assert [fresh.state[p]["step"].item() for p in fresh.param_groups[1]["params"]] == [2.0]
