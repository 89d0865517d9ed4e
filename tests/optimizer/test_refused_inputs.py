"""Bad input raises before anything changes: complex and sparse parameters or grads, bad
settings (in the constructor or edited into a group), a parameter listed twice or in two
groups. A refused input leaves params, state and step counters as they were, and the next
good step == an optimizer that never saw the bad input. Also what looks bad but is not: a
1-element tensor lr, zero-size matrices.

Single process, CPU; compared bitwise.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from checks import (
    assert_same_optimizers,
    assert_unchanged,
    clone_params,
    grads_for_shapes,
    optimizer_snapshot,
    set_grads,
)
from fidelity_setup import MIXED_SHAPES, mixed, mixed_params, param, step_with
from torch import Tensor, nn

from shardmuon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("algorithm", "shape"), [("muon", (8, 4)), ("adamw", (8,)), ("adamw", (8, 4))]
)
def test_complex_params_are_refused(algorithm: str, shape: tuple) -> None:
    p = nn.Parameter(torch.randn(shape, dtype=torch.complex64))
    pattern = r"param group 0: parameter 0 has dtype torch\.complex64; shardmuon steps real"
    with pytest.raises(TypeError, match=pattern):
        Muon([dict(params=[p], algorithm=algorithm)])
    params = mixed_params()
    opt = mixed(params)
    with pytest.raises(TypeError, match=pattern.replace("group 0", "group 2")):
        opt.add_param_group(dict(params=[p], algorithm=algorithm))
    assert len(opt.param_groups) == 2 and p not in opt.state
    step_with(opt, params, 0)


def _embedding_sparse_grad(params: list[Tensor]) -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    emb.weight = params[-1]
    emb(torch.tensor([1, 2, 2])).sum().backward()


def _coo_grad(params: list[Tensor]) -> None:
    p = params[0]
    values = torch.ones(2, p.shape[1])
    p.grad = torch.sparse_coo_tensor(
        torch.tensor([[0, 3]]), values, size=p.shape, check_invariants=True
    )


@pytest.mark.parametrize(
    ("make_sparse", "pattern"),
    [
        (
            _embedding_sparse_grad,
            r"param group 1 parameter 0 \(shape \(10, 4\)\) has a sparse grad \(layout "
            r"torch\.sparse_coo\)",
        ),
        (
            _coo_grad,
            r"param group 0 parameter 0 \(shape \(16, 8\)\) has a sparse grad \(layout "
            r"torch\.sparse_coo\)",
        ),
    ],
    ids=["embedding-adamw", "coo-muon"],
)
def test_sparse_grads_are_refused_before_anything_changes(
    make_sparse: Callable, pattern: str
) -> None:
    shapes = [(16, 8), (10, 4)]

    def build(params):
        return Muon([dict(params=params[:1]), dict(params=params[1:], algorithm="adamw")])

    params = [param(s, i) for i, s in enumerate(shapes)]
    ref_params = clone_params(params)
    opt, ref = build(params), build(ref_params)
    step_with(opt, params, 0)
    step_with(ref, ref_params, 0)
    snap = optimizer_snapshot(opt, params)
    set_grads(params, grads_for_shapes(shapes, 1))
    if make_sparse is _embedding_sparse_grad:
        params[1].grad = None
    make_sparse(params)
    with pytest.raises(TypeError, match=pattern):
        opt.step()
    assert_unchanged(opt, params, snap)
    with pytest.raises(TypeError, match=pattern):
        opt.step_chunk(opt.chunks()[-1])
    assert_unchanged(opt, params, snap)
    # Dense grads again: the optimizer steps like one that never saw the sparse grad.
    step_with(opt, params, 2)
    step_with(ref, ref_params, 2)
    assert_same_optimizers(opt, params, ref, ref_params)


# What a refused epsilon's message says is accepted (a regex).
EPSILON_ACCEPTED = re.escape(
    "a finite number >= 1.1754943508222875e-38 (float32's smallest normal number)"
)
BAD_SETTINGS = [
    # (key, value, exception, pattern after "<key> ")
    ("lr", math.inf, ValueError, r"lr must be a finite number >= 0, got inf"),
    ("lr", math.nan, ValueError, r"lr must be a finite number >= 0, got nan"),
    ("lr", -1.0, ValueError, r"lr must be a finite number >= 0, got -1\.0"),
    ("weight_decay", math.inf, ValueError, r"weight_decay must be a finite number >= 0, got inf"),
    ("epsilon", 0.0, ValueError, rf"epsilon must be {EPSILON_ACCEPTED}, got 0\.0"),
    ("epsilon", -1.0, ValueError, rf"epsilon must be {EPSILON_ACCEPTED}, got -1\.0"),
    ("epsilon", math.inf, ValueError, rf"epsilon must be {EPSILON_ACCEPTED}, got inf"),
    # 0 in float32 (and a float32 subnormal): accepted before, then NaN from a zero grad
    ("epsilon", 1e-50, ValueError, rf"epsilon must be {EPSILON_ACCEPTED}, got 1e-50"),
    ("epsilon", 1e-40, ValueError, rf"epsilon must be {EPSILON_ACCEPTED}, got 1e-40"),
    ("mu", 1.0, ValueError, r"mu must be a number in \[0, 1\), got 1\.0"),
    (
        "lr",
        torch.tensor([0.1, 0.2]),
        ValueError,
        r"lr must be a number or a 1-element tensor, got a tensor of shape \(2,\)",
    ),
    ("lr", None, TypeError, r"lr must be a finite number >= 0, got None"),
    ("adjust_lr", "max", ValueError, r"unknown adjust_lr 'max'"),
]


@pytest.mark.parametrize(("key", "value", "error", "pattern"), BAD_SETTINGS)
def test_bad_setting_in_constructor(key: str, value: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        mixed(mixed_params(), **{key: value})


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize(("key", "value", "error", "pattern"), BAD_SETTINGS)
def test_bad_setting_edited_into_a_group_raises_at_step(
    key: str, value: Any, error: type, pattern: str, index: int
) -> None:
    params, ref_params = mixed_params(), mixed_params()
    opt, ref = mixed(params), mixed(ref_params)
    step_with(opt, params, 0)
    step_with(ref, ref_params, 0)
    snap = optimizer_snapshot(opt, params)
    good = opt.param_groups[index][key]
    opt.param_groups[index][key] = value
    set_grads(params, grads_for_shapes(MIXED_SHAPES, 1))
    with pytest.raises(error, match=rf"param group {index}: {pattern}"):
        opt.step()
    assert_unchanged(opt, params, snap)
    with pytest.raises(error, match=rf"param group {index}: {pattern}"):
        opt.step_chunk(opt.chunks()[0])
    assert_unchanged(opt, params, snap)
    opt.param_groups[index][key] = good
    step_with(opt, params, 1)
    step_with(ref, ref_params, 1)
    assert_same_optimizers(opt, params, ref, ref_params)


@pytest.mark.parametrize("epsilon", [1e-50, 1e-40, torch.tensor(1e-50, dtype=torch.float64)])
def test_an_epsilon_below_the_smallest_normal_float32_is_refused_in_a_new_group(epsilon) -> None:
    """Was an escape: ``epsilon=1e-50`` is 0 in float32, and an all-zero grad (an expert that
    got no token) then gave NaN in every weight, uncounted. ``add_param_group`` refuses it
    and leaves the optimizer as it was."""
    params, ref_params = mixed_params(), mixed_params()
    opt, ref = mixed(params), mixed(ref_params)
    extra = param((4, 4), 9)
    pattern = rf"param group 2: epsilon must be {EPSILON_ACCEPTED}, got "
    with pytest.raises(ValueError, match=pattern):
        opt.add_param_group(dict(params=[extra], epsilon=epsilon))
    assert len(opt.param_groups) == 2 and extra not in opt.state
    step_with(opt, params, 0)
    step_with(ref, ref_params, 0)
    assert_same_optimizers(opt, params, ref, ref_params)


@pytest.mark.parametrize("algorithm", ["muon", "adamw"])
def test_the_smallest_accepted_epsilon_keeps_a_zero_grad_finite(algorithm: str) -> None:
    """The bound is enough: at ``epsilon = float32's smallest normal`` an all-zero grad
    leaves the weight as it was (no decay here), in both algorithms, and counts nothing."""
    smallest = torch.finfo(torch.float32).tiny
    p = param((8, 16), 3)
    start = p.detach().clone()
    opt = Muon([dict(params=[p], algorithm=algorithm)], epsilon=smallest, weight_decay=0.0)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), start) and opt.last_step_stats.nonfinite_matrices == 0


@pytest.mark.parametrize("where", ["constructor", "group"])
def test_one_element_tensor_lr_works_like_the_float(where: str) -> None:
    lr = 0.015625  # exact in float32, so the tensor holds the same number
    params, ref_params = mixed_params(), mixed_params()
    if where == "constructor":
        opt = mixed(params, lr=torch.tensor(lr))
    else:
        opt = mixed(params)
        for group in opt.param_groups:
            group["lr"] = torch.tensor([lr])
    ref = mixed(ref_params, lr=lr)
    for s in range(2):
        step_with(opt, params, s)
        step_with(ref, ref_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "keller_muon", "rms_norm", None])
def test_zero_size_matrices_step(adjust_lr: str | None) -> None:
    normal_shapes = [(16, 8), (8,)]
    empty_shapes = [(0, 8), (8, 0), (0, 4, 4), (2, 0, 4)]
    normal = [param(s, i) for i, s in enumerate(normal_shapes)]
    empty = [nn.Parameter(torch.zeros(s)) for s in empty_shapes]
    ref_normal = clone_params(normal)
    kwargs = dict(adjust_lr=adjust_lr, weight_decay=0.1)
    opt = Muon(
        [dict(params=[normal[0], *empty]), dict(params=normal[1:], algorithm="adamw")], **kwargs
    )
    ref = Muon(
        [dict(params=ref_normal[:1]), dict(params=ref_normal[1:], algorithm="adamw")], **kwargs
    )
    for s in range(2):
        step_with(opt, normal + empty, s)
        step_with(ref, ref_normal, s)
    assert_same_optimizers(opt, normal, ref, ref_normal)
    for p, shape in zip(empty, empty_shapes):
        assert p.shape == shape and opt.state[p]["momentum"].shape == shape
    assert not torch.equal(normal[0].detach(), param((16, 8), 0).detach()), "not updated"


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_parameter_listed_twice_in_a_group_is_refused() -> None:
    a, b = param((16, 8), 0), param((8, 8), 1)
    with pytest.raises(
        ValueError, match=r"param group 0: parameter 2 \(shape \(16, 8\)\) is listed twice"
    ):
        Muon([dict(params=[a, b, a])])
    params = mixed_params()
    opt = mixed(params)
    c = param((4, 4), 2)
    with pytest.raises(ValueError, match=r"param group 2: parameter 1 .* is listed twice"):
        opt.add_param_group(dict(params=[c, c]))
    assert len(opt.param_groups) == 2
    step_with(opt, params, 0)


def test_parameter_in_two_groups_is_refused() -> None:
    a, b = param((16, 8), 0), param((8, 8), 1)
    pattern = r"some parameters appear in more than one parameter group"
    with pytest.raises(ValueError, match=pattern):
        Muon([dict(params=[a]), dict(params=[a, b])])
    params, ref_params = mixed_params(), mixed_params()
    opt, ref = mixed(params), mixed(ref_params)
    with pytest.raises(ValueError, match=pattern):
        opt.add_param_group(dict(params=[params[0]]))
    assert len(opt.param_groups) == 2
    step_with(opt, params, 0)
    step_with(ref, ref_params, 0)
    assert_same_optimizers(opt, params, ref, ref_params)


@pytest.mark.parametrize(
    "setting", [("overlap", "forward"), ("offload", "state"), ("newton_schulz_impl", "gram")]
)
def test_an_optimizer_wide_setting_in_a_group_is_refused_not_ignored(setting):
    """torchtitan's container puts ``optimizer_kwargs`` into the groups: an optimizer-wide
    setting there would do nothing; refused at construction and, set later, at the step."""
    name, value = setting
    _refused_when_made_and_when_set_later(
        {name: value}, rf"param group 0 sets '{name}': optimizer-wide", "pass them to Muon"
    )


def _refused_when_made_and_when_set_later(keys: dict, at_construction: str, at_step: str):
    """A group with ``keys`` raises ``at_construction``; the keys set on a made optimizer's
    group raise ``at_step`` at the step, before any parameter changes."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    algorithm = keys.pop("algorithm", "muon")
    with pytest.raises(ValueError, match=at_construction):
        Muon([{"params": [p], "algorithm": algorithm, **keys}])
    opt = Muon([{"params": [p], "algorithm": algorithm}])
    opt.param_groups[0].update(keys)
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=at_step):
        opt.step()
    assert torch.equal(p, before)


@pytest.mark.parametrize("key", ["betas", "eps"])
@pytest.mark.parametrize("algorithm", ["adamw", "muon"])
def test_torch_names_of_adamw_settings_in_a_group_are_refused_not_ignored(key, algorithm):
    """A group with torch.optim's ``betas``/``eps`` would step with beta1/beta2/epsilon
    silently (torchtitan's AdamW configs carry them): refused, naming dion's keys."""
    value = (0.5, 0.6) if key == "betas" else 1e-2
    _refused_when_made_and_when_set_later(
        {"algorithm": algorithm, key: value},
        rf"param group 0 sets '{key}' \(torch.optim's names\)",
        "beta1 and beta2 for betas, epsilon for eps",
    )
