"""dion's ``split_sizes`` / ``num_heads`` group keys: a fused parameter steps bitwise like its
row blocks stepped as separate parameters (loaded keys too); bad keys are refused naming
the group, at construction or at the step, with nothing changed.

Single process, CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from checks import (
    assert_bitwise,
    assert_same_optimizers,
    assert_unchanged,
    clone_params,
    differs,
    grads_for_shapes,
    optimizer_snapshot,
    set_grads,
)
from fidelity_setup import copy_state, param, step_with
from torch import Tensor, nn

from shardmuon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")


def _split_rows(t: Tensor, sizes: tuple[int, ...]) -> list[Tensor]:
    return [b.clone() for b in torch.split(t, list(sizes), dim=0)]


def _fused_vs_separate(
    shape: tuple[int, int],
    blocks: tuple[int, ...],
    fused_group: dict,
    kwargs: dict,
    steps: int = 3,
    fused_kwargs: Callable[[Tensor], dict] | None = None,
) -> tuple[Muon, Tensor, Muon, list[Tensor]]:
    """A fused param (with ``fused_group`` keys) vs its row blocks as separate params."""
    fused = param(shape, 7)
    parts = [nn.Parameter(b) for b in _split_rows(fused.detach(), blocks)]
    extra = fused_kwargs(fused) if fused_kwargs else {}
    opt = Muon([dict(params=[fused], **fused_group)], **kwargs, **extra)
    ref = Muon([dict(params=parts)], **kwargs)
    for s in range(steps):
        (g,) = grads_for_shapes([shape], s)
        fused.grad = g.clone()
        set_grads(parts, _split_rows(g, blocks))
        opt.step()
        ref.step()
    return opt, fused, ref, parts


def _assert_fused_equals_parts(opt: Muon, fused: Tensor, ref: Muon, parts: list[Tensor]) -> None:
    assert_bitwise(fused.detach(), torch.cat([p.detach() for p in parts]), "param")
    assert_bitwise(
        opt.state[fused]["momentum"], torch.cat([ref.state[p]["momentum"] for p in parts]), "mom"
    )


DION_KWARGS = dict(lr=0.02, weight_decay=0.1, nesterov=True, mu=0.95)


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm"])
@pytest.mark.parametrize("as_list", [False, True])
def test_split_sizes_step_like_separate_params(adjust_lr: str, as_list: bool) -> None:
    sizes = (64, 32, 32)
    opt, fused, ref, parts = _fused_vs_separate(
        (128, 64),
        sizes,
        dict(split_sizes=list(sizes) if as_list else sizes),
        dict(DION_KWARGS, adjust_lr=adjust_lr),
    )
    _assert_fused_equals_parts(opt, fused, ref, parts)
    # Control: the same fused matrix without split_sizes steps differently.
    _, plain_fused, _, _ = _fused_vs_separate(
        (128, 64), sizes, {}, dict(DION_KWARGS, adjust_lr=adjust_lr)
    )
    assert not torch.equal(plain_fused, fused)


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm"])
def test_num_heads_step_like_separate_heads(adjust_lr: str) -> None:
    opt, fused, ref, parts = _fused_vs_separate(
        (64, 32), (16,) * 4, dict(num_heads=4), dict(DION_KWARGS, adjust_lr=adjust_lr)
    )
    _assert_fused_equals_parts(opt, fused, ref, parts)


def test_num_heads_one_is_a_no_op() -> None:
    runs = []
    for group in (dict(num_heads=1), dict(num_heads=None), {}):
        fused = param((64, 32), 7)
        opt = Muon([dict(params=[fused], **group)], **DION_KWARGS)
        for s in range(2):
            step_with(opt, [fused], s)
        runs.append((opt, [fused]))
    assert_same_optimizers(*runs[0], *runs[2])
    assert_same_optimizers(*runs[1], *runs[2])


@pytest.mark.parametrize("steps_before", [0, 1])
def test_loaded_split_sizes_are_applied(steps_before: int) -> None:
    sizes = (64, 32, 32)
    fused = param((128, 64), 7)
    opt = Muon([dict(params=[fused])], **DION_KWARGS)
    for s in range(steps_before):
        step_with(opt, [fused], s)
    ref_fused, old_fused = clone_params([fused]), clone_params([fused])
    ref = Muon([dict(params=ref_fused, split_sizes=sizes)], **DION_KWARGS)
    old = Muon([dict(params=old_fused)], **DION_KWARGS)
    copy_state(opt, [fused], ref, ref_fused)
    copy_state(opt, [fused], old, old_fused)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["split_sizes"] = list(sizes)
    opt.load_state_dict(sd)
    for s in range(steps_before, steps_before + 2):
        step_with(opt, [fused], s)
        step_with(ref, ref_fused, s)
        step_with(old, old_fused, s)
    assert_same_optimizers(opt, [fused], ref, ref_fused)
    assert differs([fused], old_fused)


SPLIT_ERRORS = [
    # (param shape, group keys, matrix_partitions for the param, message pattern)
    (
        (128, 64),
        dict(split_sizes=(64, 32)),
        None,
        r"param group 0: split_sizes = \[64, 32\] sums to 96, but the parameter has 128 rows",
    ),
    (
        (128, 64),
        dict(split_sizes=(128,)),
        None,
        r"param group 0: split_sizes must hold at least 2 block sizes, got \[128\]",
    ),
    (
        (128, 64),
        dict(split_sizes=(True, 127)),
        None,
        r"param group 0: split_sizes must hold positive ints, got \[True, 127\]",
    ),
    (
        (128, 64),
        dict(split_sizes=(0, 128)),
        None,
        r"param group 0: split_sizes must hold positive ints, got \[0, 128\]",
    ),
    (
        (128, 64),
        dict(split_sizes=(64, 64), flatten=True),
        None,
        r"param group 0: split_sizes needs flatten=False",
    ),
    (
        (128, 64),
        dict(split_sizes=(64, 64), num_heads=2),
        None,
        r"param group 0: split_sizes and num_heads > 1 are both set",
    ),
    (
        (128, 64),
        dict(num_heads=3),
        None,
        r"param group 0: num_heads=3 does not divide dim 0 of the parameter \(shape \(128, 64\)\)",
    ),
    (
        (2, 128, 64),
        dict(split_sizes=(64, 64)),
        None,
        r"param group 0: split_sizes applies to 2-D parameters, got shape \(2, 128, 64\)",
    ),
    (
        (128, 64),
        dict(num_heads=0),
        None,
        r"param group 0: num_heads must be a positive int or None, got 0",
    ),
    (
        (128, 64),
        dict(split_sizes=(64, 32, 32)),
        (64, 64),
        r"matrix_partitions gives \[64, 64\] but the group's split_sizes/num_heads give "
        r"\[64, 32, 32\]",
    ),
    (
        (128, 64),
        dict(split_sizes="64,64"),
        None,
        r"param group 0: split_sizes must be a list of row counts, got '64,64'",
    ),
]


@pytest.mark.parametrize(("shape", "group", "partitions", "pattern"), SPLIT_ERRORS)
def test_bad_dion_group_keys_are_refused(
    shape: tuple, group: dict, partitions: tuple | None, pattern: str
) -> None:
    p = param(shape, 0)
    kwargs = {} if partitions is None else dict(matrix_partitions={p: partitions})
    with pytest.raises(ValueError, match=pattern):
        Muon([dict(params=[p], **group)], **kwargs)


def test_bad_split_sizes_set_after_construction_raise_at_step() -> None:
    fused = param((128, 64), 7)
    opt = Muon([dict(params=[fused])], **DION_KWARGS)
    step_with(opt, [fused], 0)
    snap = optimizer_snapshot(opt, [fused])
    opt.param_groups[0]["split_sizes"] = (64, 32)
    set_grads([fused], grads_for_shapes([(128, 64)], 1))
    with pytest.raises(ValueError, match=r"split_sizes = \[64, 32\] sums to 96"):
        opt.step()
    assert_unchanged(opt, [fused], snap)
