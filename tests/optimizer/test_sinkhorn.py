"""Sinkhorn groups (``algorithm="sinkhorn"``): the update against a dense float64 reference
of the algorithm, the group keys and their checks, state and checkpoints, every way of
stepping; routing of embeddings and heads. Gloo worlds of 1-4 ranks in
``dist_sinkhorn_cases``.
"""

from __future__ import annotations

import copy
import math

import dist_sinkhorn_cases
import pytest
import torch
from dist_harness import WorldPlan
from torch import nn

from shardmuon import Muon
from shardmuon.ops.sinkhorn import (
    SINKHORN_DEFAULTS,
    sinkhorn_reference,
    sinkhorn_update_,
)
from shardmuon.routing import build_param_groups

KWARGS = dict(
    iters=SINKHORN_DEFAULTS["sinkhorn_iters"],
    tau=SINKHORN_DEFAULTS["sinkhorn_tau"],
    eps=SINKHORN_DEFAULTS["sinkhorn_eps"],
    lr_scale=SINKHORN_DEFAULTS["sinkhorn_lr_scale"],
)


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-300)


@pytest.mark.parametrize("seed", range(12))
def test_update_matches_the_fp64_reference(seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, cols = (int(x) for x in torch.randint(1, 60, (2,), generator=gen))
    iters = int(torch.randint(0, 8, (1,), generator=gen)) * 2 + 1
    scale = 10.0 ** float(torch.randint(-8, 8, (1,), generator=gen))
    weight = torch.randn(rows, cols, generator=gen)
    grad = torch.randn(rows, cols, generator=gen) * scale
    momentum = torch.randn(rows, cols, generator=gen) * scale
    if rows > 2:
        grad[1] *= 1e-6  # a row under the tau cut
        momentum[1] *= 1e-6
    kwargs = {**KWARGS, "iters": iters}
    want_w, want_m = sinkhorn_reference(weight, grad, momentum, lr=0.1, beta=0.9, **kwargs)
    got_w, got_m = weight.clone(), momentum.clone()
    sinkhorn_update_(got_w, grad, got_m, lr=0.1, beta=0.9, **kwargs)
    assert _max_rel(got_w - weight, want_w - weight.double()) <= 1e-4
    assert _max_rel(got_m, want_m) <= 1e-6


@pytest.mark.parametrize("scale", [1e-40, 1e-30, 1e-20, 1e-12, 1e12, 1e20, 1e30, 3e37])
def test_any_finite_fp32_scale_matches_the_reference(scale) -> None:
    # fp32 squares of the direction overflow above ~1e19 and vanish below ~1e-19; the
    # update must not care (only eps, which the reference also sees at this scale).
    gen = torch.Generator().manual_seed(int(math.log10(scale) + 100))
    for rows, cols in [(37, 13), (5, 40), (1, 1)]:
        weight = torch.randn(rows, cols, generator=gen)
        grad = torch.randn(rows, cols, generator=gen) * scale
        momentum = torch.randn(rows, cols, generator=gen) * scale
        want_w, want_m = sinkhorn_reference(weight, grad, momentum, lr=0.1, beta=0.9, **KWARGS)
        got_w, got_m = weight.clone(), momentum.clone()
        skipped = sinkhorn_update_(got_w, grad, got_m, lr=0.1, beta=0.9, **KWARGS)
        assert not skipped
        assert _max_rel(got_w - weight, want_w - weight.double()) <= 1e-4, (rows, cols)
        assert _max_rel(got_m, want_m) <= (1e-4 if scale < 1e-37 else 1e-6)  # denormals


@pytest.mark.parametrize("eps", [1e-3, 1e-8])
def test_an_eps_far_above_the_direction_matches_the_reference(eps) -> None:
    # The first normalisations are then divisions by eps (the update far below 1 until the
    # later ones lift it): the scales must keep their range.
    kwargs = {**KWARGS, "eps": eps}
    for scale in [1e-6, 1e-16, 1e-24]:
        gen = torch.Generator().manual_seed(int(-math.log10(scale)))
        weight = torch.randn(23, 9, generator=gen)
        grad = torch.randn(23, 9, generator=gen) * scale
        momentum = torch.zeros(23, 9)
        want_w, _ = sinkhorn_reference(weight, grad, momentum, lr=0.1, beta=0.9, **kwargs)
        got_w = weight.clone()
        sinkhorn_update_(got_w, grad, momentum.clone(), lr=0.1, beta=0.9, **kwargs)
        assert _max_rel(got_w - weight, want_w - weight.double()) <= 1e-4, scale


def test_rows_and_columns_far_apart_in_scale_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 12, generator=gen)
    grad = torch.randn(40, 12, generator=gen)
    grad[7] *= 1e25  # one row far above the rest: the others fall under the tau cut
    grad[:, 3] *= 1e-12  # one column far below: its normalisation lifts it
    want_w, _ = sinkhorn_reference(weight, grad, torch.zeros(40, 12), lr=0.1, beta=0.9, **KWARGS)
    got_w = weight.clone()
    sinkhorn_update_(got_w, grad, torch.zeros(40, 12), lr=0.1, beta=0.9, **KWARGS)
    assert _max_rel(got_w - weight, want_w - weight.double()) <= 1e-4


@pytest.mark.parametrize(
    ("where", "factor", "tau"),
    [("row", 1e-15, 0.0), ("column", 1e-15, 1e-3), ("column", 1e15, 1e-3)],
)
def test_rows_or_columns_1e15_apart_match_the_reference(where, factor, tau) -> None:
    # The documented range within one table: the scale vectors' squares stay in fp32
    # while rows (columns) are within ~1e17 of each other (tau=0 keeps a tiny row).
    grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    if where == "row":
        grad[3] *= factor
    else:
        grad[:, 3] *= factor
    weight = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    kwargs = {**KWARGS, "tau": tau}
    want_w, _ = sinkhorn_reference(weight, grad, torch.zeros(16, 8), lr=0.1, beta=0.9, **kwargs)
    got_w = weight.clone()
    sinkhorn_update_(got_w, grad, torch.zeros(16, 8), lr=0.1, beta=0.9, **kwargs)
    assert _max_rel(got_w - weight, want_w - weight.double()) <= 1e-4


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_direction_leaves_the_table_and_is_counted(bad) -> None:
    params, opt = _mixed()
    base, ref = _mixed()
    _grads(params, 0)
    _grads(base, 0)
    params[0].grad[4, 2] = bad
    before = params[0].detach().clone()
    opt.step()
    ref.step()
    assert torch.equal(params[0].detach(), before)
    assert opt.last_step_stats.nonfinite_matrices == 1
    assert ref.last_step_stats.nonfinite_matrices == 0
    for mine, other in zip(params[1:], base[1:]):  # every other parameter: its update
        assert torch.equal(mine.detach(), other.detach())
    # As for Muon matrices, the momentum keeps the non-finite entry (restore or zero it):
    # the table stays as it is, counted each step, until then.
    _grads(params, 1)
    opt.step()
    assert torch.equal(params[0].detach(), before)
    assert opt.last_step_stats.nonfinite_matrices == 1
    opt.state[params[0]]["momentum"].zero_()
    _grads(params, 2)
    opt.step()
    assert not torch.equal(params[0].detach(), before)
    assert torch.isfinite(params[0]).all() and opt.last_step_stats.nonfinite_matrices == 0


def test_zero_grad_and_zero_columns_stay_zero() -> None:
    weight = torch.randn(6, 5)
    grad = torch.randn(6, 5)
    grad[:, 2] = 0.0  # a column nobody touched
    got = weight.clone()
    sinkhorn_update_(got, grad, torch.zeros(6, 5), lr=0.1, beta=0.0, **KWARGS)
    assert torch.equal(got[:, 2], weight[:, 2])
    assert torch.isfinite(got).all()
    still = weight.clone()
    sinkhorn_update_(still, torch.zeros(6, 5), torch.zeros(6, 5), lr=0.1, beta=0.9, **KWARGS)
    assert torch.equal(still, weight)


def test_rows_and_columns_come_out_balanced() -> None:
    # After K normalisations (rows last) every kept row has unit norm and every column
    # nearly the same norm: the update is sqrt(n) * lr * lr_scale times that matrix.
    gen = torch.Generator().manual_seed(3)
    weight, grad = torch.zeros(40, 16), torch.randn(40, 16, generator=gen).exp()
    sinkhorn_update_(weight, grad, torch.zeros(40, 16), lr=1.0, beta=0.0, **KWARGS)
    u = -weight.double() / (math.sqrt(16) * KWARGS["lr_scale"])
    assert torch.allclose(u.norm(dim=1), torch.ones(40, dtype=torch.float64), atol=1e-5)
    columns = u.norm(dim=0)
    assert (columns.max() / columns.min()).item() < 1.05


def _table(shape=(20, 8), dtype=torch.float32, seed=0) -> nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(shape, generator=gen).to(dtype))


def test_optimizer_matches_the_reference_over_steps_with_group_keys() -> None:
    table = _table()
    opt = Muon([dict(params=[table], algorithm="sinkhorn", lr=0.03, mu=0.8, sinkhorn_iters=5)])
    group = opt.param_groups[0]
    assert (group["sinkhorn_iters"], group["sinkhorn_tau"]) == (5, 1e-3)
    assert group["sinkhorn_lr_scale"] == 0.18 and group["sinkhorn_eps"] == 1e-20
    ref_w, ref_m = table.detach().double(), torch.zeros(20, 8, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        table.grad = torch.randn(20, 8, generator=gen)
        before = table.detach().double()
        opt.step()
        ref_w, ref_m = sinkhorn_reference(
            ref_w, table.grad, ref_m, lr=0.03, beta=0.8, **{**KWARGS, "iters": 5}
        )
        assert _max_rel(table.detach() - before, ref_w - before) <= 1e-4
        ref_w = table.detach().double()  # each step from where shardmuon is
    assert opt.state[table]["momentum"].dtype == torch.float32
    assert _max_rel(opt.state[table]["momentum"], ref_m) <= 1e-5


def test_no_weight_decay_and_no_grad_skips() -> None:
    table = _table()
    opt = Muon([dict(params=[table], algorithm="sinkhorn", weight_decay=0.5)])
    before = table.detach().clone()
    opt.step()  # no grad: nothing changes
    assert torch.equal(table.detach(), before)
    table.grad = torch.zeros_like(table)
    opt.step()
    assert torch.equal(table.detach(), before)  # zero update, and no decay


def test_bf16_table_keeps_an_fp32_momentum_through_a_checkpoint() -> None:
    table = _table(dtype=torch.bfloat16)
    opt = Muon([dict(params=[table], algorithm="sinkhorn")])
    table.grad = torch.randn(20, 8).to(torch.bfloat16)
    opt.step()
    assert opt.state[table]["momentum"].dtype == torch.float32
    saved = copy.deepcopy(opt.state_dict())
    twin = nn.Parameter(table.detach().clone())
    other = Muon([dict(params=[twin], algorithm="sinkhorn")])
    other.load_state_dict(saved)
    assert other.state[twin]["momentum"].dtype == torch.float32
    assert torch.equal(other.state[twin]["momentum"], opt.state[table]["momentum"])


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (dict(sinkhorn_iters=10), "odd number"),
        (dict(sinkhorn_iters=0), "odd number"),
        (dict(sinkhorn_iters=3.0), "odd number"),
        (dict(sinkhorn_tau=-1.0), "sinkhorn_tau"),
        (dict(sinkhorn_eps=0.0), "sinkhorn_eps"),
        (dict(sinkhorn_lr_scale=0.0), "sinkhorn_lr_scale"),
    ],
)
def test_bad_group_keys_are_refused(group, message) -> None:
    with pytest.raises(ValueError, match=message):
        Muon([dict(params=[_table()], algorithm="sinkhorn", **group)])


def test_only_matrices_and_a_live_edit_is_checked_before_anything_changes() -> None:
    with pytest.raises(ValueError, match="2-D matrices"):
        Muon([dict(params=[nn.Parameter(torch.randn(4, 5, 6))], algorithm="sinkhorn")])
    table = _table()
    opt = Muon([dict(params=[table], algorithm="sinkhorn")])
    table.grad = torch.randn(20, 8)
    opt.param_groups[0]["sinkhorn_iters"] = 4
    before = table.detach().clone()
    with pytest.raises(ValueError, match="odd number"):
        opt.step()
    assert torch.equal(table.detach(), before)
    assert torch.equal(opt.state[table]["momentum"], torch.zeros(20, 8))


def _mixed(seed: int = 0, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    params = [
        nn.Parameter(torch.randn(shape, generator=gen))
        for shape in [(30, 6), (6, 30), (12, 6), (12, 6), (6,)]
    ]
    groups = [
        dict(params=params[:2], algorithm="sinkhorn", lr=0.05),
        dict(params=params[2:4]),
        dict(params=[params[4]], algorithm="adamw"),
    ]
    return params, Muon(groups, lr=0.02, **kwargs)


def _grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _assert_same(a, oa, b, ob) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y.detach())
        for key, value in oa.state[x].items():
            assert torch.equal(value, ob.state[y][key]), key


@pytest.mark.parametrize("way", ["step_chunk", "offload", "offload_chunks", "overlap"])
def test_every_way_of_stepping_is_bitwise_the_step(way) -> None:
    base, opt = _mixed()
    settings = {"offload": {"offload": "state"}, "offload_chunks": {"offload": "state"}}
    settings["overlap"] = {"overlap": "forward"}
    params, other = _mixed(**settings.get(way, {}))
    if way == "overlap":
        other.overlap_with(nn.Module())
    for step in range(3):
        _grads(base, step)
        opt.step()
        _grads(params, step)
        if way in ("step_chunk", "offload_chunks"):
            for chunk in reversed(other.chunks()):  # local chunks: any order
                other.step_chunk(chunk)
        else:
            other.step()
            other.synchronize()
    _assert_same(base, opt, params, other)


def test_chunk_info_and_a_failed_chunk_resumes_its_momentum_once(monkeypatch) -> None:
    import shardmuon.runtime.sinkhorn_step as step_module

    base, opt = _mixed()
    params, other = _mixed()
    info = other.chunk_info(other.chunks()[0])
    assert (info.kind, info.matrix_shapes, info.local_shape) == ("sinkhorn", ((30, 6),), (30, 6))
    assert info.state_bytes == 30 * 6 * 4 and not info.communicates
    _grads(base, 0)
    opt.step()
    _grads(params, 0)
    real = step_module.sinkhorn_apply_
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "sinkhorn_apply_", fail_once)
    chunk = other.chunks()[0]
    with pytest.raises(RuntimeError, match="injected"):
        other.step_chunk(chunk)
    other.step_chunk(chunk)  # resumes after its momentum update
    for rest in other.chunks()[1:]:
        other.step_chunk(rest)
    _assert_same(base, opt, params, other)


def test_state_dict_round_trip_resumes_bitwise() -> None:
    base, opt = _mixed()
    for step in range(4):
        _grads(base, step)
        opt.step()
    params, first = _mixed()
    for step in range(2):
        _grads(params, step)
        first.step()
    saved = copy.deepcopy(first.state_dict())
    assert saved["param_groups"][0]["algorithm"] == "sinkhorn"
    assert saved["param_groups"][0]["sinkhorn_iters"] == 11
    resumed_params = [nn.Parameter(p.detach().clone()) for p in params]
    groups = [
        dict(params=resumed_params[:2], algorithm="sinkhorn", lr=0.05),
        dict(params=resumed_params[2:4]),
        dict(params=[resumed_params[4]], algorithm="adamw"),
    ]
    resumed = Muon(groups, lr=0.02)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        _grads(resumed_params, step)
        resumed.step()
    _assert_same(base, opt, resumed_params, resumed)


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 4)
        self.layer = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 11, bias=False)


def test_routing_sends_embeddings_and_heads_to_sinkhorn() -> None:
    model = _LM()
    routed = build_param_groups(
        model.named_parameters(), lr=0.02, weight_decay=0.1, embedding_update="sinkhorn"
    )
    labels = routed.labels
    assert labels["embed_tokens.weight"] == labels["lm_head.weight"] == "sinkhorn"
    assert labels["layer.weight"] == "muon" and labels["layer.bias"] == "adamw"
    assert [g["algorithm"] for g in routed.groups] == ["muon", "sinkhorn", "adamw"]
    Muon(routed.groups)  # steps as built
    default = build_param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)
    assert default.labels["embed_tokens.weight"] == "adamw"
    with pytest.raises(ValueError, match="embedding_update"):
        build_param_groups(
            model.named_parameters(), lr=0.02, weight_decay=0.1, embedding_update="x"
        )


WORLDS = WorldPlan(
    "dist_sinkhorn_cases:CASES", dist_sinkhorn_cases.cases_for, (1, 2, 3, 4), timeout_s=240.0
)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), WORLDS.params())
def test_distributed(worlds, world, name) -> None:
    worlds[world].check(name)
