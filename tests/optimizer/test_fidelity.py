"""Fidelity of ``shardmuon.Muon``: every setting takes effect, every bad input is refused early.

Each test compares against an independent reference, bitwise:

* a loaded or edited setting == an optimizer constructed with that setting from the start
  (same params, grads and state), and != one that kept the old setting (so the test would
  fail if the setting were silently ignored);
* dion's ``split_sizes`` / ``num_heads`` == the blocks stepped as separate parameters;
* a strided parameter (channels_last, permuted) == its contiguous copy;
* a refused input leaves params, state and step counters as they were, and the next good
  step == an optimizer that never saw the bad input;
* a resumed chunk / a copied optimizer == an uninterrupted / the original optimizer.

Single process, CPU.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from checks import assert_bitwise, assert_same_optimizers, state_tensor_keys
from copies import COPY_METHODS
from torch import Tensor, nn

import shardmuon.runtime.phases as phases_module
from shardmuon import Muon
from shardmuon.config import MuonConfig

# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These matrices are tiny: one intra-op thread is much faster (no thread hand-off).

    Every comparison runs its subject and its reference under the same setting.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _param(shape: tuple[int, ...], seed: int) -> nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(shape, generator=gen) * 0.1)


def _grads(shapes: list[tuple[int, ...]], seed: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def _set_grads(params: list[Tensor], grads: list[Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _clones(params: list[Tensor]) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


_assert_bitwise = assert_bitwise
_state_keys = state_tensor_keys


def _differs(params_a: list[Tensor], params_b: list[Tensor]) -> bool:
    return any(not torch.equal(a.detach(), b.detach()) for a, b in zip(params_a, params_b))


def _copy_state(src: Muon, src_params: list[Tensor], dst: Muon, dst_params: list[Tensor]) -> None:
    """``dst`` gets ``src``'s state tensors and group step counters (by hand, no load)."""
    for ps, pd in zip(src_params, dst_params):
        for key in _state_keys(src, ps):
            dst.state[pd][key].copy_(src.state[ps][key])
    for gs, gd in zip(src.param_groups, dst.param_groups):
        gd["step"] = gs["step"]


def _snapshot(opt: Muon, params: list[Tensor]) -> tuple[list[Tensor], list[dict], list[Any]]:
    return (
        [p.detach().clone() for p in params],
        [{k: opt.state[p][k].clone() for k in _state_keys(opt, p)} for p in params],
        [g["step"] for g in opt.param_groups],
    )


def _assert_unchanged(opt: Muon, params: list[Tensor], snap) -> None:
    values, states, steps = snap
    for i, (p, v, s) in enumerate(zip(params, values, states)):
        _assert_bitwise(p.detach(), v, f"param {i}")
        assert _state_keys(opt, p) == sorted(s)
        for key, value in s.items():
            _assert_bitwise(opt.state[p][key], value, f"param {i} {key}")
    assert [g["step"] for g in opt.param_groups] == steps


def _assert_state_dicts_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"], key=repr) == sorted(b["state"], key=repr)
    for key, entry in a["state"].items():
        other = b["state"][key]
        if not isinstance(entry, dict):
            assert entry == other
            continue
        assert sorted(entry) == sorted(other)
        for name, value in entry.items():
            if isinstance(value, Tensor):
                _assert_bitwise(value, other[name], f"state {key} {name}")
            else:
                assert value == other[name]


# A mixed optimizer: a muon group (a matrix and a 3-D stack) and an adamw group.
MIXED_SHAPES = [(16, 8), (3, 8, 4), (8,)]
MIXED_KWARGS = dict(
    lr=0.02,
    mu=0.9,
    weight_decay=0.1,
    nesterov=False,
    adjust_lr="rms_norm",
    epsilon=1e-8,
    flatten=False,
)


def _mixed_params(seed: int = 0) -> list[nn.Parameter]:
    return [_param(s, seed + i) for i, s in enumerate(MIXED_SHAPES)]


def _mixed_groups(params: list[Tensor], overrides: dict | None = None) -> list[dict]:
    groups = [
        dict(params=params[:2], algorithm="muon"),
        dict(params=params[2:], algorithm="adamw"),
    ]
    for index, extra in (overrides or {}).items():
        groups[index].update(extra)
    return groups


def _mixed(params: list[Tensor], overrides: dict | None = None, **kwargs: Any) -> Muon:
    return Muon(_mixed_groups(params, overrides), **{**MIXED_KWARGS, **kwargs})


def _step(opt: Muon, params: list[Tensor], seed: int) -> None:
    _set_grads(params, _grads([tuple(p.shape) for p in params], seed))
    opt.step()


# --------------------------------------------- 1. group settings are live (edit and load)

LIVE_SETTINGS = [
    # (group index, key, new value); the optimizer starts with MIXED_KWARGS
    (0, "adjust_lr", "spectral_norm"),
    (0, "adjust_lr", "keller_muon"),
    (0, "adjust_lr", None),
    (0, "epsilon", 1.0),
    (0, "flatten", True),
    (0, "lr", 0.05),
    (0, "weight_decay", 0.0),
    (0, "mu", 0.5),
    (0, "nesterov", True),
    (1, "lr", 0.05),
    (1, "epsilon", 0.01),
    (1, "beta1", 0.5),
    (1, "beta2", 0.5),
    (1, "weight_decay", 0.3),
]


@pytest.mark.parametrize("steps_before", [0, 1])
@pytest.mark.parametrize("how", ["edit", "load_state_dict"])
@pytest.mark.parametrize(("index", "key", "value"), LIVE_SETTINGS)
def test_changed_group_setting_takes_effect(
    index: int, key: str, value: Any, how: str, steps_before: int
) -> None:
    params = _mixed_params()
    opt = _mixed(params)
    for s in range(steps_before):
        _step(opt, params, s)
    # References from the same point: constructed with the new value, and with the old one.
    ref_params, old_params = _clones(params), _clones(params)
    ref = _mixed(ref_params, {index: {key: value}})
    old = _mixed(old_params)
    _copy_state(opt, params, ref, ref_params)
    _copy_state(opt, params, old, old_params)

    if how == "edit":
        opt.param_groups[index][key] = value
    else:
        sd = copy.deepcopy(opt.state_dict())
        sd["param_groups"][index][key] = value
        opt.load_state_dict(sd)
    assert opt.param_groups[index][key] == value
    for s in range(steps_before, steps_before + 2):
        _step(opt, params, s)
        _step(ref, ref_params, s)
        _step(old, old_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)
    assert _differs(params, old_params), "the new value must change the update"


def test_update_rms_edit_takes_effect() -> None:
    params = _mixed_params()
    opt = _mixed(params, update_rms=0.2)
    _step(opt, params, 0)
    ref_params, old_params = _clones(params), _clones(params)
    ref = _mixed(ref_params, update_rms=0.35)
    old = _mixed(old_params, update_rms=0.2)
    _copy_state(opt, params, ref, ref_params)
    _copy_state(opt, params, old, old_params)
    opt.update_rms = 0.35
    for s in (1, 2):
        _step(opt, params, s)
        _step(ref, ref_params, s)
        _step(old, old_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)
    assert _differs(params, old_params)


def test_update_rms_edit_to_a_bad_value_raises_before_stepping() -> None:
    params = _mixed_params()
    opt = _mixed(params)
    _step(opt, params, 0)
    snap = _snapshot(opt, params)
    opt.update_rms = -1.0
    _set_grads(params, _grads(MIXED_SHAPES, 1))
    with pytest.raises(ValueError, match=r"update_rms must be a finite number > 0, got -1\.0"):
        opt.step()
    _assert_unchanged(opt, params, snap)


@pytest.mark.parametrize(
    ("index", "saved", "pattern"),
    [
        (
            0,
            "adamw",
            r"param group 0 of the state dict is a 'adamw' group, this optimizer's is 'muon'",
        ),
        (
            1,
            "muon",
            r"param group 1 of the state dict is a 'muon' group, this optimizer's is 'adamw'",
        ),
    ],
)
def test_state_dict_with_another_algorithm_is_refused(index: int, saved: str, pattern: str) -> None:
    params = _mixed_params()
    opt = _mixed(params)
    _step(opt, params, 0)
    before = copy.deepcopy(opt.state_dict())
    sd = copy.deepcopy(before)
    sd["param_groups"][index]["algorithm"] = saved
    with pytest.raises(ValueError, match=pattern):
        opt.load_state_dict(sd)
    _assert_state_dicts_equal(opt.state_dict(), before)
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw"]


# ----------------------------------------------------------- 2. dion / prime-rl call sites


def _one_matrix(seed: int = 0) -> list[nn.Parameter]:
    return [_param((16, 8), seed), _param((8, 16), seed + 1)]


@pytest.mark.parametrize(
    ("args", "kwargs", "same_as"),
    [
        ((), dict(world_mesh=None, fsdp_mesh_dim=0), {}),
        ((), dict(world_mesh=None, fsdp_mesh_dim="dp_shard"), {}),
        ((None, 0.02), {}, dict(lr=0.02)),  # dion: (params, distributed_mesh, lr, ...)
        ((None, 0.02, 0.9), {}, dict(lr=0.02, mu=0.9)),
        ((), dict(use_triton=True), {}),
        ((), dict(distributed_mesh=None), {}),
    ],
)
def test_dion_call_sites_are_accepted(args: tuple, kwargs: dict, same_as: dict) -> None:
    params, ref_params = _one_matrix(), _one_matrix()
    opt = Muon(params, *args, **kwargs)
    ref = Muon(ref_params, **same_as)
    for key, value in same_as.items():
        assert opt.defaults[key] == value
    for s in range(2):
        _step(opt, params, s)
        _step(ref, ref_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            dict(world_mesh="x"),
            TypeError,
            r"world_mesh must be None, a DeviceMesh or a ProcessGroup, got str",
        ),
        (dict(distributed_mesh="x"), TypeError, r"distributed_mesh must be None, a DeviceMesh"),
        (
            dict(fsdp_mesh_dim=1.5),
            TypeError,
            r"fsdp_mesh_dim must be None, an int or a mesh dim name, got 1\.5",
        ),
        (dict(use_triton="yes"), TypeError, r"use_triton must be True or False, got 'yes'"),
        (
            dict(newton_schulz_func=lambda x: x),
            ValueError,
            r"newton_schulz_func \(dion's custom orthogonalization\) is not supported",
        ),
    ],
)
def test_dion_call_site_refusals(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        Muon(_one_matrix(), **kwargs)


def test_default_adjust_lr_is_spectral_norm() -> None:
    assert Muon(_one_matrix()).defaults["adjust_lr"] == "spectral_norm"
    runs = {}
    for name, kwargs in (
        ("default", {}),
        ("spectral", dict(adjust_lr="spectral_norm")),
        ("rms", dict(adjust_lr="rms_norm")),
    ):
        params = _one_matrix()
        opt = Muon(params, **kwargs)
        for s in range(2):
            _step(opt, params, s)
        runs[name] = (opt, params)
    assert_same_optimizers(*runs["default"], *runs["spectral"])
    assert _differs(runs["default"][1], runs["rms"][1])


def test_config_default_adjust_lr_is_rms_norm() -> None:
    assert MuonConfig().adjust_lr == "rms_norm"


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
    fused = _param(shape, 7)
    parts = [nn.Parameter(b) for b in _split_rows(fused.detach(), blocks)]
    extra = fused_kwargs(fused) if fused_kwargs else {}
    opt = Muon([dict(params=[fused], **fused_group)], **kwargs, **extra)
    ref = Muon([dict(params=parts)], **kwargs)
    for s in range(steps):
        (g,) = _grads([shape], s)
        fused.grad = g.clone()
        _set_grads(parts, _split_rows(g, blocks))
        opt.step()
        ref.step()
    return opt, fused, ref, parts


def _assert_fused_equals_parts(opt: Muon, fused: Tensor, ref: Muon, parts: list[Tensor]) -> None:
    _assert_bitwise(fused.detach(), torch.cat([p.detach() for p in parts]), "param")
    _assert_bitwise(
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
        fused = _param((64, 32), 7)
        opt = Muon([dict(params=[fused], **group)], **DION_KWARGS)
        for s in range(2):
            _step(opt, [fused], s)
        runs.append((opt, [fused]))
    assert_same_optimizers(*runs[0], *runs[2])
    assert_same_optimizers(*runs[1], *runs[2])


@pytest.mark.parametrize("steps_before", [0, 1])
def test_loaded_split_sizes_are_applied(steps_before: int) -> None:
    sizes = (64, 32, 32)
    fused = _param((128, 64), 7)
    opt = Muon([dict(params=[fused])], **DION_KWARGS)
    for s in range(steps_before):
        _step(opt, [fused], s)
    ref_fused, old_fused = _clones([fused]), _clones([fused])
    ref = Muon([dict(params=ref_fused, split_sizes=sizes)], **DION_KWARGS)
    old = Muon([dict(params=old_fused)], **DION_KWARGS)
    _copy_state(opt, [fused], ref, ref_fused)
    _copy_state(opt, [fused], old, old_fused)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["split_sizes"] = list(sizes)
    opt.load_state_dict(sd)
    for s in range(steps_before, steps_before + 2):
        _step(opt, [fused], s)
        _step(ref, ref_fused, s)
        _step(old, old_fused, s)
    assert_same_optimizers(opt, [fused], ref, ref_fused)
    assert _differs([fused], old_fused)


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
    p = _param(shape, 0)
    kwargs = {} if partitions is None else dict(matrix_partitions={p: partitions})
    with pytest.raises(ValueError, match=pattern):
        Muon([dict(params=[p], **group)], **kwargs)


def test_bad_split_sizes_set_after_construction_raise_at_step() -> None:
    fused = _param((128, 64), 7)
    opt = Muon([dict(params=[fused])], **DION_KWARGS)
    _step(opt, [fused], 0)
    snap = _snapshot(opt, [fused])
    opt.param_groups[0]["split_sizes"] = (64, 32)
    _set_grads([fused], _grads([(128, 64)], 1))
    with pytest.raises(ValueError, match=r"split_sizes = \[64, 32\] sums to 96"):
        opt.step()
    _assert_unchanged(opt, [fused], snap)


def test_cautious_wd_is_refused_at_construction_and_on_load() -> None:
    with pytest.raises(ValueError, match=r"param group 0 has cautious_wd=True"):
        Muon([dict(params=_one_matrix(), cautious_wd=True)])
    params, ref_params = _one_matrix(), _one_matrix()
    opt = Muon([dict(params=params, cautious_wd=False)])
    ref = Muon([dict(params=ref_params)])
    _step(opt, params, 0)
    _step(ref, ref_params, 0)
    assert_same_optimizers(opt, params, ref, ref_params)
    before = copy.deepcopy(opt.state_dict())
    sd = copy.deepcopy(before)
    sd["param_groups"][0]["cautious_wd"] = True
    with pytest.raises(ValueError, match=r"state dict: param group 0 has cautious_wd=True"):
        opt.load_state_dict(sd)
    _assert_state_dicts_equal(opt.state_dict(), before)
    opt.param_groups[0]["cautious_wd"] = True
    snap = _snapshot(opt, params)
    _set_grads(params, _grads([(16, 8), (8, 16)], 1))
    with pytest.raises(ValueError, match=r"param group 0 has cautious_wd=True"):
        opt.step()
    _assert_unchanged(opt, params, snap)


# ---------------------------------------------------- 3. every parameter is really updated


def _channels_last_conv() -> Tensor:
    t = torch.randn(8, 4, 3, 3, generator=torch.Generator().manual_seed(3))
    return t.to(memory_format=torch.channels_last)


def _permuted_stack() -> Tensor:
    t = torch.randn(3, 2, 16, 8, generator=torch.Generator().manual_seed(4))
    return t.permute(1, 0, 2, 3)


def _transposed() -> Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(5)).t()


@pytest.mark.parametrize(
    ("make", "flatten"),
    [
        (_channels_last_conv, True),
        (_channels_last_conv, False),
        (_permuted_stack, False),
        (_permuted_stack, True),
        (_transposed, False),
    ],
    ids=["channels_last-flatten", "channels_last", "permuted", "permuted-flatten", "transposed"],
)
def test_strided_params_update_like_contiguous_copies(make: Callable, flatten: bool) -> None:
    data = make()
    assert not data.is_contiguous()
    strided = nn.Parameter(data.clone(memory_format=torch.preserve_format))
    assert strided.stride() == data.stride()
    contiguous = nn.Parameter(data.contiguous())
    other, other_ref = _param((16, 8), 9), _param((16, 8), 9)
    kwargs = dict(lr=0.02, weight_decay=0.1, flatten=flatten, adjust_lr="rms_norm")
    opt = Muon([strided, other], **kwargs)
    ref = Muon([contiguous, other_ref], **kwargs)
    for s in range(3):
        g, g_other = _grads([tuple(data.shape), (16, 8)], s)
        strided.grad = torch.empty_like(strided).copy_(g)  # laid out like the param
        contiguous.grad = g.clone()
        other.grad, other_ref.grad = g_other.clone(), g_other.clone()
        opt.step()
        ref.step()
    assert_same_optimizers(opt, [strided, other], ref, [contiguous, other_ref])
    assert not torch.equal(strided.detach(), data), "the update was lost"
    assert torch.count_nonzero(opt.state[strided]["momentum"]) > 0, "the momentum was lost"
    assert strided.stride() == data.stride()


# ----------------------------------------------- 4. bad input raises before anything changes


@pytest.mark.parametrize(
    ("algorithm", "shape"), [("muon", (8, 4)), ("adamw", (8,)), ("adamw", (8, 4))]
)
def test_complex_params_are_refused(algorithm: str, shape: tuple) -> None:
    p = nn.Parameter(torch.randn(shape, dtype=torch.complex64))
    pattern = r"param group 0: parameter 0 has dtype torch\.complex64; shardmuon steps real"
    with pytest.raises(TypeError, match=pattern):
        Muon([dict(params=[p], algorithm=algorithm)])
    params = _mixed_params()
    opt = _mixed(params)
    with pytest.raises(TypeError, match=pattern.replace("group 0", "group 2")):
        opt.add_param_group(dict(params=[p], algorithm=algorithm))
    assert len(opt.param_groups) == 2 and p not in opt.state
    _step(opt, params, 0)


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

    params = [_param(s, i) for i, s in enumerate(shapes)]
    ref_params = _clones(params)
    opt, ref = build(params), build(ref_params)
    _step(opt, params, 0)
    _step(ref, ref_params, 0)
    snap = _snapshot(opt, params)
    _set_grads(params, _grads(shapes, 1))
    if make_sparse is _embedding_sparse_grad:
        params[1].grad = None
    make_sparse(params)
    with pytest.raises(TypeError, match=pattern):
        opt.step()
    _assert_unchanged(opt, params, snap)
    with pytest.raises(TypeError, match=pattern):
        opt.step_chunk(opt.chunks()[-1])
    _assert_unchanged(opt, params, snap)
    # Dense grads again: the optimizer steps like one that never saw the sparse grad.
    _step(opt, params, 2)
    _step(ref, ref_params, 2)
    assert_same_optimizers(opt, params, ref, ref_params)


BAD_SETTINGS = [
    # (key, value, exception, pattern after "<key> ")
    ("lr", math.inf, ValueError, r"lr must be a finite number >= 0, got inf"),
    ("lr", math.nan, ValueError, r"lr must be a finite number >= 0, got nan"),
    ("lr", -1.0, ValueError, r"lr must be a finite number >= 0, got -1\.0"),
    ("weight_decay", math.inf, ValueError, r"weight_decay must be a finite number >= 0, got inf"),
    ("epsilon", 0.0, ValueError, r"epsilon must be a finite number > 0, got 0\.0"),
    ("epsilon", -1.0, ValueError, r"epsilon must be a finite number > 0, got -1\.0"),
    ("epsilon", math.inf, ValueError, r"epsilon must be a finite number > 0, got inf"),
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
        _mixed(_mixed_params(), **{key: value})


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize(("key", "value", "error", "pattern"), BAD_SETTINGS)
def test_bad_setting_edited_into_a_group_raises_at_step(
    key: str, value: Any, error: type, pattern: str, index: int
) -> None:
    params, ref_params = _mixed_params(), _mixed_params()
    opt, ref = _mixed(params), _mixed(ref_params)
    _step(opt, params, 0)
    _step(ref, ref_params, 0)
    snap = _snapshot(opt, params)
    good = opt.param_groups[index][key]
    opt.param_groups[index][key] = value
    _set_grads(params, _grads(MIXED_SHAPES, 1))
    with pytest.raises(error, match=rf"param group {index}: {pattern}"):
        opt.step()
    _assert_unchanged(opt, params, snap)
    with pytest.raises(error, match=rf"param group {index}: {pattern}"):
        opt.step_chunk(opt.chunks()[0])
    _assert_unchanged(opt, params, snap)
    opt.param_groups[index][key] = good
    _step(opt, params, 1)
    _step(ref, ref_params, 1)
    assert_same_optimizers(opt, params, ref, ref_params)


@pytest.mark.parametrize("where", ["constructor", "group"])
def test_one_element_tensor_lr_works_like_the_float(where: str) -> None:
    lr = 0.015625  # exact in float32, so the tensor holds the same number
    params, ref_params = _mixed_params(), _mixed_params()
    if where == "constructor":
        opt = _mixed(params, lr=torch.tensor(lr))
    else:
        opt = _mixed(params)
        for group in opt.param_groups:
            group["lr"] = torch.tensor([lr])
    ref = _mixed(ref_params, lr=lr)
    for s in range(2):
        _step(opt, params, s)
        _step(ref, ref_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "keller_muon", "rms_norm", None])
def test_zero_size_matrices_step(adjust_lr: str | None) -> None:
    normal_shapes = [(16, 8), (8,)]
    empty_shapes = [(0, 8), (8, 0), (0, 4, 4), (2, 0, 4)]
    normal = [_param(s, i) for i, s in enumerate(normal_shapes)]
    empty = [nn.Parameter(torch.zeros(s)) for s in empty_shapes]
    ref_normal = _clones(normal)
    kwargs = dict(adjust_lr=adjust_lr, weight_decay=0.1)
    opt = Muon(
        [dict(params=[normal[0], *empty]), dict(params=normal[1:], algorithm="adamw")], **kwargs
    )
    ref = Muon(
        [dict(params=ref_normal[:1]), dict(params=ref_normal[1:], algorithm="adamw")], **kwargs
    )
    for s in range(2):
        _step(opt, normal + empty, s)
        _step(ref, ref_normal, s)
    assert_same_optimizers(opt, normal, ref, ref_normal)
    for p, shape in zip(empty, empty_shapes):
        assert p.shape == shape and opt.state[p]["momentum"].shape == shape
    assert not torch.equal(normal[0].detach(), _param((16, 8), 0).detach()), "not updated"


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_parameter_listed_twice_in_a_group_is_refused() -> None:
    a, b = _param((16, 8), 0), _param((8, 8), 1)
    with pytest.raises(
        ValueError, match=r"param group 0: parameter 2 \(shape \(16, 8\)\) is listed twice"
    ):
        Muon([dict(params=[a, b, a])])
    params = _mixed_params()
    opt = _mixed(params)
    c = _param((4, 4), 2)
    with pytest.raises(ValueError, match=r"param group 2: parameter 1 .* is listed twice"):
        opt.add_param_group(dict(params=[c, c]))
    assert len(opt.param_groups) == 2
    _step(opt, params, 0)


def test_parameter_in_two_groups_is_refused() -> None:
    a, b = _param((16, 8), 0), _param((8, 8), 1)
    pattern = r"some parameters appear in more than one parameter group"
    with pytest.raises(ValueError, match=pattern):
        Muon([dict(params=[a]), dict(params=[a, b])])
    params, ref_params = _mixed_params(), _mixed_params()
    opt, ref = _mixed(params), _mixed(ref_params)
    with pytest.raises(ValueError, match=pattern):
        opt.add_param_group(dict(params=[params[0]]))
    assert len(opt.param_groups) == 2
    _step(opt, params, 0)
    _step(ref, ref_params, 0)
    assert_same_optimizers(opt, params, ref, ref_params)


# --------------------------------------------------------- 5. load_state_dict is atomic

# Optimizer for these tests: muon group (a [16, 8], b [8, 8]), adamw group (c [8], d [4]);
# saved state ids 0, 1 (muon), 2, 3 (adamw).
FIVE_SHAPES = [(16, 8), (8, 8), (8,), (4,)]


def _five_params(seed: int = 0) -> list[nn.Parameter]:
    return [_param(s, seed + i) for i, s in enumerate(FIVE_SHAPES)]


def _five(params: list[Tensor]) -> Muon:
    return Muon(
        [dict(params=params[:2]), dict(params=params[2:], algorithm="adamw")],
        lr=0.02,
        weight_decay=0.1,
    )


def _set(path: tuple, value: Any) -> Callable[[dict], dict]:
    def edit(sd: dict) -> dict:
        target = sd
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return sd

    return edit


def _delete(path: tuple) -> Callable[[dict], dict]:
    def edit(sd: dict) -> dict:
        target = sd
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return sd

    return edit


def _pop_group(sd: dict) -> dict:
    sd["param_groups"].pop()
    return sd


def _pop_param(sd: dict) -> dict:
    sd["param_groups"][0]["params"].pop()
    return sd


def _torch_adamw(_: dict) -> dict:
    params = _five_params()
    other = torch.optim.AdamW(params)
    _set_grads(params, _grads(FIVE_SHAPES, 0))
    other.step()
    return other.state_dict()


def _torch_muon(_: dict) -> dict:
    params = _five_params()[:2]
    other = torch.optim.Muon(params)
    _set_grads(params, _grads(FIVE_SHAPES[:2], 0))
    other.step()
    return other.state_dict()


BAD_STATE_DICTS = [
    # (id, defect, exception, message pattern)
    ("groups", _pop_group, ValueError, r"the state dict has 1 param groups, this optimizer has 2"),
    (
        "params",
        _pop_param,
        ValueError,
        r"param group 0 of the state dict has 1 parameters, this optimizer's has 2",
    ),
    (
        "algorithm",
        _set(("param_groups", 0, "algorithm"), "adamw"),
        ValueError,
        r"param group 0 of the state dict is a 'adamw' group, this optimizer's is 'muon'",
    ),
    (
        "unknown-algorithm",
        _set(("param_groups", 1, "algorithm"), "lion"),
        ValueError,
        r"param group 1 of the state dict is a 'lion' group, this optimizer's is 'adamw'",
    ),
    (
        "no-variance",
        _delete(("state", 2, "variance")),
        ValueError,
        r"param group 1 parameter 0 \('adamw'\): saved state has keys \['momentum'\], "
        r"expected \['momentum', 'variance'\]",
    ),
    (
        "extra-key",
        _set(("state", 0, "extra"), torch.zeros(16, 8)),
        ValueError,
        r"param group 0 parameter 0 \('muon'\): saved state has keys \['extra', 'momentum'\], "
        r"expected \['momentum'\]",
    ),
    (
        "no-state-entry-dict",
        _set(("state", 1), [1, 2]),
        ValueError,
        r"param group 0 parameter 1: saved state must be a dict, got list",
    ),
    (
        "momentum-shape",
        _set(("state", 1, "momentum"), torch.zeros(8, 4)),
        ValueError,
        r"param group 0 parameter 1: state 'momentum' has shape \(8, 4\), the parameter has "
        r"\(8, 8\)",
    ),
    (
        "momentum-transposed",
        _set(("state", 0, "momentum"), torch.zeros(8, 16)),
        ValueError,
        r"param group 0 parameter 0: state 'momentum' has shape \(8, 16\), the parameter has "
        r"\(16, 8\)",
    ),
    (
        "variance-shape",
        _set(("state", 3, "variance"), torch.zeros(5)),
        ValueError,
        r"param group 1 parameter 1: state 'variance' has shape \(5,\), the parameter has \(4,\)",
    ),
    (
        "momentum-not-tensor",
        _set(("state", 0, "momentum"), [[0.0] * 8] * 16),
        TypeError,
        r"param group 0 parameter 0: state 'momentum' must be a tensor, got list",
    ),
    (
        "momentum-int",
        _set(("state", 0, "momentum"), torch.zeros(16, 8, dtype=torch.int64)),
        TypeError,
        r"param group 0 parameter 0: state 'momentum' has dtype torch\.int64; expected a real "
        r"floating dtype",
    ),
    (
        "lr",
        _set(("param_groups", 0, "lr"), -1),
        ValueError,
        r"state dict: param group 0: lr must be a finite number >= 0, got -1",
    ),
    (
        "mu",
        _set(("param_groups", 0, "mu"), 1.5),
        ValueError,
        r"state dict: param group 0: mu must be a number in \[0, 1\), got 1\.5",
    ),
    (
        "epsilon",
        _set(("param_groups", 1, "epsilon"), 0),
        ValueError,
        r"state dict: param group 1: epsilon must be a finite number > 0, got 0",
    ),
    (
        "adjust_lr",
        _set(("param_groups", 0, "adjust_lr"), "max"),
        ValueError,
        r"state dict: param group 0: unknown adjust_lr 'max'",
    ),
    (
        "step",
        _set(("param_groups", 1, "step"), -3),
        ValueError,
        r"state dict: param group 1: step must be an int >= 0, got -3",
    ),
    (
        "split_sizes",
        _set(("param_groups", 0, "split_sizes"), [8, 4]),
        ValueError,
        r"param group 0: split_sizes = \[8, 4\] sums to 12, but the parameter has 16 rows",
    ),
    (
        "cautious_wd",
        _set(("param_groups", 1, "cautious_wd"), True),
        ValueError,
        r"state dict: param group 1 has cautious_wd=True",
    ),
    (
        "not-a-dict",
        lambda sd: [sd],
        ValueError,
        r"not an optimizer state dict \(expected the keys 'state' and 'param_groups', got list\)",
    ),
    (
        "no-state",
        _delete(("state",)),
        ValueError,
        r"not an optimizer state dict \(expected the keys 'state' and 'param_groups', got "
        r"\['param_groups'\]\)",
    ),
    (
        "torch-adamw",
        _torch_adamw,
        ValueError,
        r"holds the state key 'exp_avg': it comes from torch\.optim\.Adam/AdamW",
    ),
    (
        "torch-muon",
        _torch_muon,
        ValueError,
        r"holds the state key 'momentum_buffer': it comes from torch\.optim\.Muon",
    ),
]


@pytest.mark.parametrize(
    ("defect", "error", "pattern"),
    [case[1:] for case in BAD_STATE_DICTS],
    ids=[case[0] for case in BAD_STATE_DICTS],
)
def test_bad_state_dict_changes_nothing(defect: Callable, error: type, pattern: str) -> None:
    params, ref_params = _five_params(), _five_params()
    opt, ref = _five(params), _five(ref_params)
    _step(opt, params, 0)
    _step(ref, ref_params, 0)
    before = copy.deepcopy(opt.state_dict())
    bad = defect(copy.deepcopy(before))
    with pytest.raises(error, match=pattern):
        opt.load_state_dict(bad)
    _assert_state_dicts_equal(opt.state_dict(), before)
    for s in (1, 2):
        _step(opt, params, s)
        _step(ref, ref_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)
    assert [g["step"] for g in opt.param_groups] == [3, 3]


def test_good_state_dict_round_trip() -> None:
    """Control for the table above: the unedited state dict loads into a fresh optimizer."""
    params = _five_params()
    opt = _five(params)
    _step(opt, params, 0)
    sd = copy.deepcopy(opt.state_dict())
    other_params = [nn.Parameter(p.detach().clone()) for p in params]
    other = _five(other_params)
    other.load_state_dict(sd)
    assert_same_optimizers(opt, params, other, other_params)
    for s in (1, 2):
        _step(opt, params, s)
        _step(other, other_params, s)
    assert_same_optimizers(opt, params, other, other_params)


def test_non_dict_state_entry_survives_round_trip() -> None:
    params, ref_params = _five_params(), _five_params()
    opt, ref = _five(params), _five(ref_params)
    _step(opt, params, 0)
    _step(ref, ref_params, 0)
    opt.state["flag"] = True
    sd = opt.state_dict()
    assert sd["state"]["flag"] is True
    opt.load_state_dict(copy.deepcopy(sd))
    assert opt.state["flag"] is True
    copy_params = _clones(params)
    other = _five(copy_params)
    other.load_state_dict(copy.deepcopy(sd))
    assert other.state["flag"] is True
    for s in (1, 2):
        _step(opt, params, s)
        _step(ref, ref_params, s)
        _step(other, copy_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)
    assert_same_optimizers(other, copy_params, ref, ref_params)
    assert opt.state["flag"] is True and opt.state_dict()["state"]["flag"] is True


def test_missing_state_entries_are_created_as_zeros() -> None:
    params = _five_params()
    opt = _five(params)
    _step(opt, params, 0)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]  # a muon parameter
    del sd["state"][2]  # an adamw parameter
    # Reference: the full state, with the two missing entries zeroed by hand.
    ref_params = _clones(params)
    ref = _five(ref_params)
    _copy_state(opt, params, ref, ref_params)
    ref.state[ref_params[0]]["momentum"].zero_()
    ref.state[ref_params[2]]["momentum"].zero_()
    ref.state[ref_params[2]]["variance"].zero_()
    opt.load_state_dict(sd)
    assert _state_keys(opt, params[0]) == ["momentum", "step"]
    assert _state_keys(opt, params[2]) == ["momentum", "step", "variance"]
    assert opt.state[params[0]]["step"].item() == 1  # made from the group's step
    for i, key in ((0, "momentum"), (2, "momentum"), (2, "variance")):
        value = opt.state[params[i]][key]
        assert value.shape == params[i].shape and value.dtype == params[i].dtype
        assert torch.count_nonzero(value) == 0
    assert torch.count_nonzero(opt.state[params[1]]["momentum"]) > 0
    assert_same_optimizers(opt, params, ref, ref_params)
    for s in (1, 2):
        _step(opt, params, s)
        _step(ref, ref_params, s)
    assert_same_optimizers(opt, params, ref, ref_params)


# -------------------------------------------------------------------- 6. failed steps

# Optimizer for these tests: two [16, 8] matrices (one batch of two segments), an [8, 8]
# matrix (its own batch), one adamw group of two vectors.
SIX_SHAPES = [(16, 8), (16, 8), (8, 8), (8,), (4,)]


def _six_params() -> list[nn.Parameter]:
    return [_param(s, i) for i, s in enumerate(SIX_SHAPES)]


def _six(params: list[Tensor]) -> Muon:
    return Muon(
        [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw")],
        lr=0.02,
        weight_decay=0.1,
        nesterov=True,
    )


class _Injected(RuntimeError):
    pass


class _FailOnce:
    """Wraps ``fn``: the ``nth`` call after arming raises (once); every other call passes."""

    def __init__(self, fn: Callable, nth: int = 1, before: bool = True) -> None:
        self.fn, self.nth, self.before = fn, nth, before
        self.armed, self.calls, self.fired = False, 0, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.armed or self.fired:
            return self.fn(*args, **kwargs)
        self.calls += 1
        if self.calls == self.nth:
            self.fired = True
            if self.before:
                raise _Injected("injected failure")
            self.fn(*args, **kwargs)
            raise _Injected("injected failure")
        return self.fn(*args, **kwargs)


def _adamw_failing_after_first_param(real: Callable) -> Callable:
    state = {"armed": False, "fired": False}

    def wrapper(*args: Any, on_param_done: Callable | None = None, **kwargs: Any) -> None:
        def done(i: int) -> None:
            if on_param_done is not None:
                on_param_done(i)
            if state["armed"] and not state["fired"]:
                state["fired"] = True
                raise _Injected("injected failure")

        # One parameter per _foreach run, so that "after the first parameter" is a point
        # between runs (the unit a resumed chunk skips).
        real(*args, on_param_done=done, **{**kwargs, "max_temp_bytes": 1})

    wrapper.state = state
    return wrapper


INJECTIONS = [
    # (id, index of the chunk that fails)
    ("orthogonalize", 0),  # Newton–Schulz of the two-segment batch
    ("weight_update-second-segment", 0),  # after the first segment's params were updated
    ("momentum_update-second-segment", 0),  # after the first segment's momentum was updated
    ("adamw-after-first-param", 2),
    ("adamw-before-any-param", 2),
]


def _inject(kind: str, opt: Muon, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Install the failure; return a function that arms it."""
    if kind == "orthogonalize":
        fail = _FailOnce(phases_module.StepContext.orthogonalize)
        monkeypatch.setattr(
            phases_module.StepContext, "orthogonalize", lambda ctx, *args: fail(ctx, *args)
        )
    elif kind == "weight_update-second-segment":
        fail = _FailOnce(phases_module.weight_update_, nth=2)
        monkeypatch.setattr(phases_module, "weight_update_", fail)
    elif kind == "momentum_update-second-segment":
        fail = _FailOnce(phases_module.momentum_update_, nth=2)
        monkeypatch.setattr(phases_module, "momentum_update_", fail)
    elif kind == "adamw-after-first-param":
        wrapper = _adamw_failing_after_first_param(phases_module.adamw_update_)
        monkeypatch.setattr(phases_module, "adamw_update_", wrapper)
        return lambda: wrapper.state.update(armed=True)
    else:
        fail = _FailOnce(phases_module.adamw_update_)
        monkeypatch.setattr(phases_module, "adamw_update_", fail)

    def arm() -> None:
        fail.armed = True

    return arm


@pytest.mark.parametrize("position", ["first", "last"])
@pytest.mark.parametrize(("kind", "target"), INJECTIONS, ids=[i[0] for i in INJECTIONS])
def test_failed_chunk_resumes_without_stepping_twice(
    kind: str, target: int, position: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    params, ref_params = _six_params(), _six_params()
    opt, ref = _six(params), _six(ref_params)
    _step(opt, params, 0)
    _step(ref, ref_params, 0)
    arm = _inject(kind, opt, monkeypatch)
    chunks = opt.chunks()
    assert len(chunks) == 3 and len(chunks[0].segments) == 2
    others = [c for i, c in enumerate(chunks) if i != target]
    order_before = [] if position == "first" else others
    order_after = others if position == "first" else []

    _set_grads(params, _grads(SIX_SHAPES, 1))
    for chunk in order_before:
        opt.step_chunk(chunk)
    arm()
    with pytest.raises(_Injected):
        opt.step_chunk(chunks[target])
    assert opt._rounds.is_open and target not in opt._rounds.stepped, "a failed chunk is not done"
    with pytest.raises(RuntimeError, match=r"step\(\) called while a step_chunk\(\) round is open"):
        opt.step()
    opt.step_chunk(chunks[target])  # resumes
    for chunk in order_after:
        opt.step_chunk(chunk)
    assert not opt._rounds.is_open

    _set_grads(ref_params, _grads(SIX_SHAPES, 1))
    ref.step()
    assert_same_optimizers(opt, params, ref, ref_params)
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in ref.param_groups]
    _step(opt, params, 2)
    _step(ref, ref_params, 2)
    assert_same_optimizers(opt, params, ref, ref_params)


def test_open_round_refuses_step_add_group_and_load() -> None:
    params, ref_params = _six_params(), _six_params()
    opt, ref = _six(params), _six(ref_params)
    _step(opt, params, 0)
    _step(ref, ref_params, 0)
    chunks = opt.chunks()
    _set_grads(params, _grads(SIX_SHAPES, 1))
    opt.step_chunk(chunks[1])
    snap = _snapshot(opt, params)
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(RuntimeError, match=r"step\(\) called while a step_chunk\(\) round is open"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"add_param_group during a step_chunk round"):
        opt.add_param_group(dict(params=[_param((4, 4), 9)]))
    with pytest.raises(RuntimeError, match=r"chunk 1 was already stepped in this round"):
        opt.step_chunk(chunks[1])
    _assert_unchanged(opt, params, snap)
    assert len(opt.param_groups) == 2
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == (
        groups_before
    )
    opt.step_chunk(chunks[0])
    opt.step_chunk(chunks[2])
    _set_grads(ref_params, _grads(SIX_SHAPES, 1))
    ref.step()
    assert_same_optimizers(opt, params, ref, ref_params)


def test_planned_setting_edited_during_an_open_round_raises() -> None:
    params, ref_params = _six_params(), _six_params()
    opt, ref = _six(params), _six(ref_params)
    chunks = opt.chunks()
    _set_grads(params, _grads(SIX_SHAPES, 0))
    opt.step_chunk(chunks[0])
    opt.param_groups[0]["adjust_lr"] = "rms_norm"
    with pytest.raises(RuntimeError, match=r"planned settings or parameters changed during a"):
        opt.step_chunk(chunks[1])
    opt.param_groups[0]["adjust_lr"] = "spectral_norm"
    opt.step_chunk(chunks[1])
    opt.step_chunk(chunks[2])
    _step(ref, ref_params, 0)
    assert_same_optimizers(opt, params, ref, ref_params)


# ------------------------------------------------------------------------------ 7. copies

COPY_SHAPES = [(16, 8), (16, 8), (3, 8, 4), (8,)]
COPY_SETTINGS = dict(
    update_rms=0.3,
    newton_schulz_coefficients="keller",
    max_in_flight=1,
    rotate_owners=False,
    split_replicas=True,
    check_grads="always",
    newton_schulz_impl="unfolded",
)
PARTITIONS = (4, 12)


def _copy_params() -> list[nn.Parameter]:
    return [_param(s, i) for i, s in enumerate(COPY_SHAPES)]


def _copy_opt(params: list[Tensor], partitions: bool = True, **overrides: Any) -> Muon:
    settings = {**COPY_SETTINGS, **overrides}
    return Muon(
        [dict(params=params[:3]), dict(params=params[3:], algorithm="adamw")],
        lr=0.02,
        weight_decay=0.1,
        adjust_lr="rms_norm",
        matrix_partitions={params[1]: PARTITIONS} if partitions else None,
        **settings,
    )


@pytest.mark.parametrize("duplicate", COPY_METHODS, ids=lambda f: f.__name__)
def test_copied_optimizer_steps_like_the_original(duplicate: Callable) -> None:
    params = _copy_params()
    opt = _copy_opt(params)
    _step(opt, params, 0)
    copy_params, copied = duplicate((params, opt))
    assert copied is not opt and all(c is not p for c, p in zip(copy_params, params))
    for name in (*COPY_SETTINGS, "coefficients"):
        if name != "newton_schulz_coefficients":
            assert getattr(copied, name) == getattr(opt, name), name
    assert list(copied._raw_partitions.values()) == [PARTITIONS]
    assert next(iter(copied._raw_partitions)) is copy_params[1]
    assert all(p in copied.state for p in copy_params)
    assert copied.param_groups[0]["params"][0] is copy_params[0]
    assert_same_optimizers(opt, params, copied, copy_params)
    # Controls from the same point: each setting that changes bits, left at its default.
    controls = []
    for overrides, partitions in (
        (dict(update_rms=0.2), True),
        (dict(newton_schulz_coefficients="dion"), True),
        (dict(newton_schulz_impl="folded"), True),
        ({}, False),
    ):
        control_params = _clones(params)
        control = _copy_opt(control_params, partitions, **overrides)
        _copy_state(opt, params, control, control_params)
        controls.append((control, control_params))
    for s in (1, 2):
        _step(opt, params, s)
        _step(copied, copy_params, s)
        for control, control_params in controls:
            _step(control, control_params, s)
    assert_same_optimizers(opt, params, copied, copy_params)
    for _, control_params in controls:
        assert _differs(params, control_params)
    # The copy is independent: stepping it does not move the original.
    before = [p.detach().clone() for p in params]
    _step(copied, copy_params, 3)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
