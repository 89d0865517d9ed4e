"""The generic checks PyTorch runs on every optimizer, applied to ``shardmuon.Muon``.

PyTorch's ``test/test_optim.py`` runs the same battery of tests over every entry of
``torch.testing._internal.common_optimizers.optim_db``, each with the optimizer's list of
constructor inputs (``optim_inputs_func_*``) and generic error inputs. This file is our own
version of those checks for shardmuon: state dict round trips, copying (``copy.deepcopy``,
pickle, ``torch.save``), the six hook kinds, ``zero_grad``, closures, LR schedulers, tensor
learning rates, dtypes, ``add_param_group``, parameters without grads, non-dict entries in
``optimizer.state`` and determinism.

Two differences from ``torch.optim`` shape the tests: groups are dion-style (``algorithm`` =
``"muon"`` for matrices, ``"adamw"`` for 1-D parameters; the group keys are ``mu``,
``beta1``, ``beta2``, not ``momentum``/``betas``), and state exists for every parameter from
construction (DCP-safe), not after the first step.

Where possible a check compares against an independent reference run (a second optimizer on a
parallel copy of the parameters, stepped with the same gradients) and asks for bitwise
equality: everything here runs on one CPU process, where shardmuon is deterministic.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from copies import COPY_METHODS
from torch import Tensor
from torch.nn import Parameter
from torch.optim.lr_scheduler import (
    CyclicLR,
    ExponentialLR,
    LambdaLR,
    OneCycleLR,
    ReduceLROnPlateau,
    StepLR,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardmuon import Muon

# ---------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are tiny: intra-op threads only cost time (a lot, on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Two Muon matrices of different shapes, a stack of two matrices (3-D) and an AdamW vector.
SHAPES = [(16, 8), (8, 16), (2, 12, 6), (8,)]
BASE = dict(lr=0.02, weight_decay=0.1, nesterov=True)

# shardmuon's own public attributes (besides torch's defaults / param_groups / state).
MUON_ATTRS = (
    "update_rms",
    "coefficients",
    "max_in_flight",
    "rotate_owners",
    "split_replicas",
    "check_grads",
)


def make_params(dtype: torch.dtype | list[torch.dtype] = torch.float32, seed: int = 0):
    """Fresh parameters (same values for the same seed), one dtype or one per parameter."""
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(SHAPES)
    gen = torch.Generator().manual_seed(seed)
    return [
        Parameter((torch.randn(s, generator=gen, dtype=torch.float64) * 0.05).to(d))
        for s, d in zip(SHAPES, dtypes)
    ]


def clone_params(ps: list[Tensor]) -> list[Parameter]:
    return [Parameter(p.detach().clone()) for p in ps]


def make_groups(ps: list[Tensor], muon: dict | None = None, adamw: dict | None = None):
    return [
        dict(params=list(ps[:3]), algorithm="muon", **(muon or {})),
        dict(params=list(ps[3:]), algorithm="adamw", **(adamw or {})),
    ]


def make_opt(ps: list[Tensor], **kwargs: Any) -> Muon:
    return Muon(make_groups(ps), **{**BASE, **kwargs})


def grads_for(step: int, ps: list[Tensor]) -> list[Tensor]:
    """The gradients of step ``step``: the same values for every run, in each param's dtype."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) for p in ps]


def set_grads(ps: list[Tensor], grads: list[Tensor]) -> None:
    for p, g in zip(ps, grads):
        p.grad = g.clone()


def dion_state(opt: Muon, p: Tensor) -> list[Tensor]:
    """``p``'s state tensors under dion's keys (without shardmuon's ``step`` counter, which
    counts the group's steps for every parameter, with a grad or not)."""
    return [v for k, v in opt.state[p].items() if k != "step"]


def without_counters(state: dict) -> dict:
    """A state dict's ``state`` without the ``step`` counters."""
    return {i: {k: v for k, v in entry.items() if k != "step"} for i, entry in state.items()}


def params_of(opt: Muon) -> list[Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def snapshot(ps: list[Tensor]) -> list[Tensor]:
    return [p.detach().clone() for p in ps]


def assert_bitwise(actual: list[Tensor], expected: list[Tensor], what: str = "param") -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what} {i}: {a.dtype} vs {e.dtype}"
        diff = (a.double() - e.double()).abs().max().item()
        assert torch.equal(a, e), f"{what} {i} (shape {tuple(a.shape)}): max |diff| {diff:.3g}"


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Recursive equality for state dicts and param groups: tensors compared bitwise."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        assert isinstance(a, Tensor) and isinstance(b, Tensor), f"{path}: {a!r} vs {b!r}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype} vs {b.dtype}"
        assert torch.equal(a, b), f"{path}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a)} vs {set(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def assert_same_state(opt_a: Muon, opt_b: Muon) -> None:
    """Per-parameter state equal, matched by position (the optimizers hold different tensors)."""
    for i, (a, b) in enumerate(zip(params_of(opt_a), params_of(opt_b))):
        assert_same(opt_a.state[a], opt_b.state[b], f"state of param {i}")


def step_both(opts_and_params: list[tuple[Muon, list[Tensor]]], step: int) -> None:
    for opt, ps in opts_and_params:
        set_grads(ps, grads_for(step, ps))
        opt.step()


# Constructor inputs, in the spirit of torch's optim_inputs_func_muon / _adamw: each generic
# test below runs on every entry. Built lazily so tensor lrs are never shared between tests.
OPTIM_INPUTS: list[tuple[str, Callable[[], dict]]] = [
    ("default", lambda: {}),
    ("non-default lr", lambda: dict(lr=0.01)),
    ("tensor lr", lambda: dict(lr=torch.tensor(0.001))),
    ("weight_decay", lambda: dict(weight_decay=0.2)),
    ("no weight_decay", lambda: dict(weight_decay=0.0)),
    ("mu", lambda: dict(mu=0.8)),
    ("no nesterov", lambda: dict(nesterov=False)),
    ("betas", lambda: dict(betas=(0.8, 0.9))),
    ("epsilon", lambda: dict(epsilon=1e-6)),
    ("keller coefficients", lambda: dict(newton_schulz_coefficients="keller")),
    ("six custom triples", lambda: dict(newton_schulz_coefficients=[(3.4, -4.7, 2.0)] * 6)),
    ("spectral_norm", lambda: dict(adjust_lr="spectral_norm")),
    ("rms_norm", lambda: dict(adjust_lr="rms_norm")),
    ("keller_muon", lambda: dict(adjust_lr="keller_muon")),
    ("adjust_lr None", lambda: dict(adjust_lr=None)),
    ("update_rms", lambda: dict(update_rms=0.3)),
    ("flatten", lambda: dict(flatten=True)),
    ("max_in_flight 1", lambda: dict(max_in_flight=1)),
    ("unfolded Newton-Schulz", lambda: dict(newton_schulz_impl="unfolded")),
    ("no owner rotation, split replicas", lambda: dict(rotate_owners=False, split_replicas=True)),
    ("check_grads always", lambda: dict(check_grads="always")),
]
OPTIM_IDS = [name for name, _ in OPTIM_INPUTS]
OPTIM_FACTORIES = [factory for _, factory in OPTIM_INPUTS]


# ------------------------------------------------------------------- error inputs


def _generic_error_cases() -> list[tuple[str, Callable[[], Any], type, str]]:
    """torch's get_error_inputs_for_all_optims, for dion-style groups."""
    a = Parameter(torch.randn(2, 2))
    b = Parameter(torch.randn(2, 2))
    return [
        (
            "a tensor instead of an iterable",
            lambda: Muon(a),
            TypeError,
            r"should be an iterable of Tensors or dicts",
        ),
        (
            "a parameter in two groups",
            lambda: Muon([dict(params=[a]), dict(params=[a])]),
            ValueError,
            r"some parameters appear in more than one parameter group",
        ),
        (
            "names on some parameters only",
            lambda: Muon([("weight", a), b]),
            ValueError,
            r"all optimizer params should be with/without names",
        ),
        (
            "names in some groups only",
            lambda: Muon([dict(params=[a]), dict(params=[("weight", b)])]),
            ValueError,
            r"all optimizer param groups should be with/without names",
        ),
        (
            "a 2-element tensor lr",
            lambda: Muon([a], lr=torch.tensor([0.001, 0.001])),
            ValueError,
            r"lr",
        ),
        (
            "a 2-element tensor lr in a group",
            lambda: Muon([dict(params=[a], lr=torch.tensor([0.001, 0.001]))]),
            ValueError,
            r"lr",
        ),
        (
            "an empty parameter list",
            lambda: Muon([]),
            ValueError,
            r"optimizer got an empty parameter list",
        ),
        (
            "a set of parameters",
            lambda: Muon([dict(params={a})]),
            TypeError,
            r"ordered collections",
        ),
    ]


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [case[1:] for case in _generic_error_cases()],
    ids=[case[0] for case in _generic_error_cases()],
)
def test_generic_error_inputs(build: Callable[[], Any], error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        build()


def test_duplicate_parameter_in_a_group_is_refused() -> None:
    """torch only warns (and would step the parameter twice); shardmuon refuses it."""
    a = Parameter(torch.randn(2, 2))
    with (
        warnings.catch_warnings(),
        pytest.raises(ValueError, match=r"listed twice|duplicate"),
    ):
        warnings.simplefilter("ignore", UserWarning)
        Muon([a, a])


def test_optimizer_can_be_printed() -> None:
    text = repr(make_opt(make_params()))
    assert text.startswith("Muon (") and "Parameter Group 1" in text and "adamw" in text


# ------------------------------------------------------------------- state dicts


@pytest.mark.parametrize("kwargs", OPTIM_FACTORIES, ids=OPTIM_IDS)
def test_state_dict_round_trip_into_a_fresh_optimizer(kwargs: Callable[[], dict]) -> None:
    """Load a state dict into a fresh optimizer (same constructor arguments): same steps."""
    ps = make_params()
    opt = make_opt(ps, **kwargs())
    for step in range(2):
        step_both([(opt, ps)], step)
    saved = copy.deepcopy(opt.state_dict())
    assert_same(saved, opt.state_dict())  # deterministic, and a deep copy round-trips

    fresh_ps = clone_params(ps)
    fresh = make_opt(fresh_ps, **kwargs())
    fresh.load_state_dict(saved)
    assert_same(fresh.state_dict(), opt.state_dict())
    for step in range(2, 5):
        step_both([(opt, ps), (fresh, fresh_ps)], step)
        assert_bitwise(fresh_ps, snapshot(ps))
    assert_same(fresh.state_dict(), opt.state_dict())
    assert_same_state(fresh, opt)


def test_state_dict_holds_ids_and_copies_of_the_groups() -> None:
    ps = make_params()
    opt = make_opt(ps)
    step_both([(opt, ps)], 0)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1, 2], [3]]
    # the groups of a state dict are copies: editing them leaves the optimizer alone
    sd["param_groups"][0]["lr"] = 123.0
    sd["param_groups"][1]["params"].append(7)
    assert opt.param_groups[0]["lr"] == BASE["lr"] and len(opt.param_groups[1]["params"]) == 1
    # a snapshot (deepcopy) is unaffected by later steps, while the live state moves on
    snap = copy.deepcopy(opt.state_dict())
    step_both([(opt, ps)], 1)
    assert not torch.equal(snap["state"][0]["momentum"], opt.state[ps[0]]["momentum"])
    assert snap["param_groups"][0]["step"] == 1 and opt.param_groups[0]["step"] == 2


def test_loaded_groups_are_not_aliased_to_the_state_dict() -> None:
    ps = make_params()
    opt = make_opt(ps)
    step_both([(opt, ps)], 0)
    saved = copy.deepcopy(opt.state_dict())
    fresh_ps = clone_params(ps)
    fresh = make_opt(fresh_ps)
    fresh.load_state_dict(saved)
    saved["param_groups"][0]["lr"] = 123.0
    saved["param_groups"][1]["beta1"] = 0.0
    assert fresh.param_groups[0]["lr"] == BASE["lr"] and fresh.param_groups[1]["beta1"] == 0.9
    assert fresh.param_groups[0]["params"][0] is fresh_ps[0]  # params are the fresh ones
    # loading from a deep copy: stepping the fresh optimizer leaves the source state alone
    before = copy.deepcopy(opt.state_dict())
    step_both([(fresh, fresh_ps)], 1)
    assert_same(opt.state_dict(), before)


def test_state_dict_survives_torch_save_with_weights_only() -> None:
    """torch's test_save_load_equality_with_weights_only, with a tensor lr in one group."""
    ps = make_params()
    groups = make_groups(ps, adamw=dict(lr=torch.tensor(0.01)))
    opt = Muon(groups, **BASE)
    for step in range(2):
        step_both([(opt, ps)], step)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_same(loaded, opt.state_dict())

    fresh_ps = clone_params(ps)
    fresh = Muon(make_groups(fresh_ps, adamw=dict(lr=torch.tensor(0.01))), **BASE)
    fresh.load_state_dict(loaded)
    for step in range(2, 4):
        step_both([(opt, ps), (fresh, fresh_ps)], step)
    assert_bitwise(fresh_ps, snapshot(ps))


@pytest.mark.parametrize(
    ("save_names", "load_names"),
    [(True, False), (False, True), (True, True)],
    ids=["named to unnamed", "unnamed to named", "named to named"],
)
def test_state_dict_with_and_without_param_names(save_names: bool, load_names: bool) -> None:
    """torch's test_can_load_from_to_named_state_dict."""
    names = ["w1", "w2", "w3", "b"]

    def build(ps: list[Tensor], named: bool) -> Muon:
        items = list(zip(names, ps)) if named else list(ps)
        return Muon(
            [dict(params=items[:3], algorithm="muon"), dict(params=items[3:], algorithm="adamw")],
            **BASE,
        )

    ps = make_params()
    opt = build(ps, save_names)
    step_both([(opt, ps)], 0)
    sd = copy.deepcopy(opt.state_dict())
    assert ("param_names" in sd["param_groups"][0]) == save_names
    fresh_ps = clone_params(ps)
    fresh = build(fresh_ps, load_names)
    fresh.load_state_dict(sd)
    if save_names or load_names:
        assert fresh.param_groups[0]["param_names"] == names[:3]
    for step in range(1, 3):
        step_both([(opt, ps), (fresh, fresh_ps)], step)
    assert_bitwise(fresh_ps, snapshot(ps))


# State-dict group edits that must take effect after loading: (group index, edits). Every
# optimizer in that test is built with EDIT_SOURCE's settings, so each edit changes a value.
EDIT_SOURCE = (
    dict(adjust_lr="spectral_norm", epsilon=1e-8, flatten=False, mu=0.95, nesterov=True),
    dict(beta1=0.9, beta2=0.95, epsilon=1e-8),
)
LOAD_EDITS = [
    (0, dict(lr=0.05)),
    (0, dict(weight_decay=0.5)),
    (0, dict(mu=0.5)),
    (0, dict(nesterov=False)),
    (0, dict(epsilon=1e-2)),
    (0, dict(adjust_lr="rms_norm")),
    (0, dict(adjust_lr="keller_muon")),
    (0, dict(adjust_lr=None)),
    (0, dict(flatten=True)),
    (1, dict(lr=0.05)),
    (1, dict(weight_decay=0.5)),
    (1, dict(beta1=0.5)),
    (1, dict(beta2=0.5)),
    (1, dict(epsilon=1e-3)),
    (1, dict(step=10)),
]


@pytest.mark.parametrize(
    ("group", "edits"), LOAD_EDITS, ids=[f"group{g}-{e}" for g, e in LOAD_EDITS]
)
def test_edited_param_groups_take_effect_after_load(group: int, edits: dict) -> None:
    """Edit a group of a state dict, load it: the next steps use the edited values.

    Reference: an optimizer constructed with the edited values from the start, loading the
    same state dict; a third optimizer loading the unedited dict shows the edit matters.
    """
    ps = make_params()
    opt = Muon(make_groups(ps, *EDIT_SOURCE), **BASE)
    for step in range(2):
        step_both([(opt, ps)], step)
    plain = copy.deepcopy(opt.state_dict())
    edited = copy.deepcopy(plain)
    edited["param_groups"][group].update(edits)
    assert edited["param_groups"] != plain["param_groups"]

    runs = []
    for built_with, sd in ((None, edited), (edits, edited), (None, plain)):
        run_ps = clone_params(ps)
        extra = list(EDIT_SOURCE)
        extra[group] = {**extra[group], **(built_with or {})}
        run = Muon(make_groups(run_ps, *extra), **BASE)
        run.load_state_dict(copy.deepcopy(sd))
        for key, value in edits.items():
            expected = value if sd is edited else plain["param_groups"][group][key]
            assert run.param_groups[group][key] == expected
        runs.append((run, run_ps))
    for step in range(2, 4):
        step_both(runs, step)
    (loaded, loaded_ps), (reference, reference_ps), (_, unedited_ps) = runs
    assert_bitwise(loaded_ps, snapshot(reference_ps))
    assert_same_state(loaded, reference)
    touched = slice(0, 3) if group == 0 else slice(3, 4)
    assert any(not torch.equal(a, b) for a, b in zip(loaded_ps[touched], unedited_ps[touched])), (
        "the edit changed nothing: the test would not see it ignored"
    )


# --------------------------------------------------------------- non-dict state


def test_non_dict_entries_in_state_survive_a_round_trip() -> None:
    """A flag stored in ``optimizer.state`` (as hooks do) must not break state dicts."""
    ps = make_params()
    opt = make_opt(ps)
    opt.state["flag"] = True
    step_both([(opt, ps)], 0)
    sd = opt.state_dict()
    assert sd["state"]["flag"] is True
    assert sorted(k for k in sd["state"] if isinstance(k, int)) == [0, 1, 2, 3]

    fresh_ps = clone_params(ps)
    fresh = make_opt(fresh_ps)
    fresh.load_state_dict(copy.deepcopy(sd))
    assert fresh.state["flag"] is True
    opt.load_state_dict(copy.deepcopy(sd))  # loading into itself, too
    assert opt.state["flag"] is True
    for step in range(1, 3):
        step_both([(opt, ps), (fresh, fresh_ps)], step)
    assert_bitwise(fresh_ps, snapshot(ps))
    assert_same_state(fresh, opt)


# ------------------------------------------------------------------------ copies


COPIES = COPY_METHODS
COPY_IDS = ["deepcopy", "pickle", "torch.save"]
COPY_CONFIGS = {
    "default": lambda: {},
    "non-default attributes": lambda: dict(
        update_rms=0.3,
        newton_schulz_coefficients="keller",
        max_in_flight=1,
        rotate_owners=False,
        split_replicas=True,
        check_grads="always",
        nesterov=False,
        mu=0.8,
    ),
    "tensor lr": lambda: dict(lr=torch.tensor(0.01)),
}


@pytest.mark.parametrize("config", list(COPY_CONFIGS))
@pytest.mark.parametrize("make_copy", COPIES, ids=COPY_IDS)
def test_copy_keeps_public_attributes(make_copy: Callable[[Muon], Muon], config: str) -> None:
    """torch's test_deepcopy_copies_all_public_attrs, plus the values of shardmuon's own."""
    ps = make_params()
    opt = make_opt(ps, **COPY_CONFIGS[config]())
    step_both([(opt, ps)], 0)
    dup = make_copy(opt)
    assert type(dup) is Muon

    def public(o: Muon) -> set[str]:
        return {k for k in vars(o) if not k.startswith("_")}

    assert public(dup) == public(opt)
    for name in MUON_ATTRS:
        assert getattr(dup, name) == getattr(opt, name), name
    # torch's __setstate__ adds defaults["differentiable"] = False; nothing else may change
    assert_same({k: v for k, v in dup.defaults.items() if k in opt.defaults}, opt.defaults)
    assert set(dup.defaults) - set(opt.defaults) <= {"differentiable"}
    assert len(dup.param_groups) == len(opt.param_groups)
    for g_dup, g_opt in zip(dup.param_groups, opt.param_groups):
        assert_same(g_dup, g_opt)  # params compared by value
        assert not any(a is b for a, b in zip(g_dup["params"], g_opt["params"]))
    assert all(p in dup.state for p in params_of(dup))
    assert_same_state(dup, opt)


@pytest.mark.parametrize("config", list(COPY_CONFIGS))
@pytest.mark.parametrize("make_copy", COPIES, ids=COPY_IDS)
def test_copy_steps_like_the_original(make_copy: Callable[[Muon], Muon], config: str) -> None:
    """A copy steps its own parameters exactly as the original steps the originals."""
    ps = make_params()
    opt = make_opt(ps, **COPY_CONFIGS[config]())
    for step in range(2):
        step_both([(opt, ps)], step)
    dup = make_copy(opt)
    dup_ps = params_of(dup)
    for step in range(2, 5):
        before = snapshot(ps)
        state_before = copy.deepcopy(opt.state_dict())
        step_both([(dup, dup_ps)], step)
        assert_bitwise(ps, before)  # the copy must not touch the original's params...
        assert_same(opt.state_dict(), state_before)  # ...or its state
        step_both([(opt, ps)], step)
        assert_bitwise(dup_ps, snapshot(ps))
    assert_same_state(dup, opt)
    assert [g["step"] for g in dup.param_groups] == [g["step"] for g in opt.param_groups]


# ------------------------------------------------------------------------- hooks


def test_step_hooks_are_called_with_the_optimizer_and_arguments() -> None:
    ps = make_params()
    opt = make_opt(ps)
    calls: list[tuple[str, Any, tuple, dict, list[Tensor]]] = []

    def recorder(kind: str):
        def hook(o, args, kwargs):
            calls.append((kind, o, args, kwargs, snapshot(ps)))

        return hook

    handles = [
        register_optimizer_step_pre_hook(recorder("global pre")),
        register_optimizer_step_post_hook(recorder("global post")),
    ]
    try:
        handles.append(opt.register_step_pre_hook(recorder("pre")))
        handles.append(opt.register_step_post_hook(recorder("post")))
        before = snapshot(ps)
        set_grads(ps, grads_for(0, ps))
        opt.step()
        after = snapshot(ps)
        assert [c[0] for c in calls] == ["global pre", "pre", "post", "global post"]
        for kind, o, args, kwargs, seen in calls:
            assert o is opt and args == (opt,) and kwargs == {}, kind
            assert_bitwise(seen, before if "pre" in kind else after, kind)

        def closure() -> float:
            return 1.5

        calls.clear()
        assert opt.step(closure=closure) == 1.5
        assert [c[3] for c in calls] == [{"closure": closure}] * 4
        calls.clear()
        opt.step(closure)
        assert [c[2] for c in calls] == [(opt, closure)] * 4
    finally:
        for handle in handles:
            handle.remove()
    calls.clear()
    opt.step()
    assert calls == []


def test_step_pre_hook_can_replace_the_arguments() -> None:
    ps = make_params()
    opt = make_opt(ps)
    called = []

    def closure() -> str:
        called.append(True)
        return "sentinel"

    handle = opt.register_step_pre_hook(lambda o, args, kwargs: ((o, closure), {}))
    set_grads(ps, grads_for(0, ps))
    assert opt.step() == "sentinel" and called == [True]
    handle.remove()
    assert opt.step() is None


def test_step_pre_hook_can_modify_grads() -> None:
    """A pre-hook that doubles the grads (as a gradient transform would): the step sees it."""
    ps, ref_ps = make_params(), make_params()
    opt, ref = make_opt(ps), make_opt(ref_ps)

    def double(o, args, kwargs):
        for p in params_of(o):
            p.grad.mul_(2)

    opt.register_step_pre_hook(double)
    for step in range(3):
        grads = grads_for(step, ps)
        set_grads(ps, grads)
        set_grads(ref_ps, [2 * g for g in grads])
        opt.step()
        ref.step()
        assert_bitwise(ps, snapshot(ref_ps))


def test_state_dict_hooks() -> None:
    """torch's test_state_dict_pre_hook / _post_hook: called with the right arguments, can edit."""
    ps = make_params()
    opt = make_opt(ps)
    step_both([(opt, ps)], 0)
    order: list[str] = []

    def pre(o):
        assert o is opt
        order.append("pre")
        o.state["test"] = 1  # a non-dict state entry, removed again by the post-hook

    def post(o, sd):
        assert o is opt and set(sd) == {"state", "param_groups"}
        order.append("post")
        sd["ran_pre_hook"] = sd["state"].pop("test", None) == 1
        return None

    def post_returning_new(o, sd):
        order.append("post returning")
        new = dict(sd)
        new["extra"] = "added"
        return new

    def first(o):
        order.append("first")

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_pre_hook(first, prepend=True)
    opt.register_state_dict_post_hook(post)
    opt.register_state_dict_post_hook(post_returning_new)
    sd = opt.state_dict()
    assert order == ["first", "pre", "post", "post returning"]
    assert sd["ran_pre_hook"] is True and sd["extra"] == "added"
    assert "test" not in sd["state"] and sorted(sd["state"]) == [0, 1, 2, 3]


@pytest.mark.parametrize("prepend", [False, True])
def test_load_state_dict_hooks(prepend: bool) -> None:
    """torch's test_load_state_dict_pre_hook_and_prepend / _post_hook / _pre_post_hook."""
    ps = make_params()
    opt = make_opt(ps)
    step_both([(opt, ps)], 0)
    sd = opt.state_dict()
    fresh_ps = clone_params(ps)
    fresh = make_opt(fresh_ps)
    seen: list[Any] = []

    def edit_in_place(o, state_dict):
        assert o is fresh and state_dict is not sd  # a shallow copy of what was passed
        seen.append("in place")
        state_dict["param_groups"][0]["lr"] = 0.002

    def return_new(o, state_dict):
        seen.append("return new")
        new = copy.deepcopy(state_dict)
        new["param_groups"][0]["lr"] = 0.003
        return new

    def post(o):
        assert o is fresh
        seen.append(("post", o.param_groups[0]["lr"]))
        o.state["ran_load_state_dict_post_hook"] = True  # a flag, as torch's test does

    fresh.register_load_state_dict_pre_hook(edit_in_place)
    fresh.register_load_state_dict_pre_hook(return_new, prepend=prepend)
    fresh.register_load_state_dict_post_hook(post)
    fresh.load_state_dict(copy.deepcopy(sd))
    lr = 0.002 if prepend else 0.003  # the last pre-hook to edit wins
    order = ["return new", "in place"] if prepend else ["in place", "return new"]
    assert seen == [*order, ("post", lr)]
    assert fresh.param_groups[0]["lr"] == lr
    assert fresh.state["ran_load_state_dict_post_hook"] is True
    fresh.state_dict()
    step_both([(fresh, fresh_ps)], 1)


def test_load_state_dict_post_hook_sees_the_loaded_optimizer() -> None:
    """Post-hooks run after the load is complete: missing state already created.

    A dion checkpoint may lack state for a parameter that never had a grad, and
    microsoft/dion's carries ``step_dev``; ``Muon.load_state_dict`` fills in / drops these.
    A post-hook must see the optimizer as the load leaves it.
    """
    ps = make_params()
    opt = make_opt(ps)
    step_both([(opt, ps)], 0)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][3]
    sd["state"][2]["step_dev"] = torch.tensor(1.0)
    fresh_ps = clone_params(ps)
    fresh = make_opt(fresh_ps)
    seen = []
    fresh.register_load_state_dict_post_hook(
        lambda o: seen.append([sorted(o.state[p]) for p in params_of(o)])
    )
    fresh.load_state_dict(sd)
    expected = [["momentum", "step"]] * 3 + [["momentum", "step", "variance"]]
    assert [sorted(fresh.state[p]) for p in fresh_ps] == expected
    assert seen == [expected]


# ---------------------------------------------------------------- zero_grad / step


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none: bool) -> None:
    """torch's test_step_is_noop_when_params_have_no_grad / _for_zero_grads.

    ``set_to_none=True`` (after a first step, with weight decay): the next step skips every
    parameter, state included. ``set_to_none=False`` on a fresh optimizer without weight
    decay: zero grads give a zero update and zero state.
    """
    ps = make_params()
    opt = make_opt(ps, weight_decay=0.1 if set_to_none else 0.0)
    if set_to_none:
        step_both([(opt, ps)], 0)
    set_grads(ps, grads_for(1, ps))
    grads = [p.grad for p in ps]
    opt.zero_grad(set_to_none=set_to_none)
    if set_to_none:
        assert all(p.grad is None for p in ps)
    else:
        assert all(p.grad is g for p, g in zip(ps, grads))
        assert all(torch.count_nonzero(p.grad) == 0 for p in ps)
    before, state_before = snapshot(ps), copy.deepcopy(opt.state_dict())
    opt.step()
    assert_bitwise(ps, before)
    steps = 2 if set_to_none else 1
    assert [g["step"] for g in opt.param_groups] == [steps, steps]
    assert_same(
        without_counters(opt.state_dict()["state"]), without_counters(state_before["state"])
    )
    assert all(opt.state[p]["step"].item() == steps for p in ps)
    if not set_to_none:
        assert all(torch.count_nonzero(v) == 0 for p in ps for v in dion_state(opt, p))


SUBSETS = {
    "none": [],
    "muon only": [0, 1, 2],
    "adamw only": [3],
    "3-D only": [2],
    "all but the first": [1, 2, 3],
    "all": [0, 1, 2, 3],
}


@pytest.mark.parametrize("subset", list(SUBSETS))
def test_params_without_grad_are_skipped(subset: str) -> None:
    """No momentum, no decay, no update for a param without a grad; the others as if alone."""
    with_grad = SUBSETS[subset]
    ps = make_params()
    ps[0].requires_grad_(0 in with_grad)  # also a frozen param, kept in its group
    opt = make_opt(ps)
    ref_ps = clone_params([ps[i] for i in with_grad])
    ref_groups = [
        g
        for g in (
            dict(params=[q for i, q in zip(with_grad, ref_ps) if i < 3], algorithm="muon"),
            dict(params=[q for i, q in zip(with_grad, ref_ps) if i == 3], algorithm="adamw"),
        )
        if g["params"]
    ]
    ref = Muon(ref_groups, **BASE) if ref_groups else None
    initial = snapshot(ps)
    for step in range(3):
        grads = grads_for(step, ps)
        for i, p in enumerate(ps):
            p.grad = grads[i].clone() if i in with_grad else None
        set_grads(ref_ps, [grads[i] for i in with_grad])
        opt.step()
        if ref is not None:
            ref.step()
    for i, p in enumerate(ps):
        if i in with_grad:
            assert_bitwise([p.detach()], [ref_ps[with_grad.index(i)].detach()])
        else:
            assert_bitwise([p.detach()], [initial[i]])
            assert all(torch.count_nonzero(v) == 0 for v in dion_state(opt, p))
    assert [g["step"] for g in opt.param_groups] == [3, 3]
    assert all(opt.state[p]["step"].item() == 3 for p in ps)  # dion: the group's count


def test_closure() -> None:
    """step(closure) evaluates it once, with grad enabled, and returns its loss."""
    ps, ref_ps = make_params(), make_params()
    opt, ref = make_opt(ps), make_opt(ref_ps)
    targets = [t.detach() * 10 for t in make_params(seed=1)]

    def loss_of(params: list[Tensor]) -> Tensor:
        return sum(((p - t) ** 2).sum() for p, t in zip(params, targets))

    calls = []

    def closure() -> Tensor:
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_of(ps)
        loss.backward()
        return loss

    for _ in range(3):
        ref.zero_grad()
        expected_loss = loss_of(ref_ps)
        expected_loss.backward()
        ref.step()
        loss = opt.step(closure)
        assert isinstance(loss, Tensor) and torch.equal(loss.detach(), expected_loss.detach())
        assert_bitwise(ps, snapshot(ref_ps))
    assert calls == [True] * 3


@pytest.mark.parametrize("kwargs", OPTIM_FACTORIES, ids=OPTIM_IDS)
def test_goes_in_the_right_direction(kwargs: Callable[[], dict]) -> None:
    """torch's test_forloop_goes_right_direction: a quadratic loss decreases."""
    ps = make_params()
    opt = make_opt(ps, **kwargs())
    targets = [t.detach() * 10 for t in make_params(seed=1)]

    def closure() -> Tensor:
        opt.zero_grad()
        loss = sum(((p - t) ** 2).sum() for p, t in zip(ps, targets))
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(5):
        opt.step(closure)
    assert closure().item() < initial


@pytest.mark.parametrize("kwargs", OPTIM_FACTORIES, ids=OPTIM_IDS)
def test_two_identical_optimizers_are_bitwise_identical(kwargs: Callable[[], dict]) -> None:
    runs = []
    for _ in range(2):
        ps = make_params()
        runs.append((make_opt(ps, **kwargs()), ps))
    for step in range(3):
        step_both(runs, step)
    (a, a_ps), (b, b_ps) = runs
    assert_bitwise(a_ps, snapshot(b_ps))
    assert_same(a.state_dict(), b.state_dict())


# ------------------------------------------------------------------- param groups


@pytest.mark.parametrize("steps_before", [0, 2])
def test_add_param_group_then_step(steps_before: int) -> None:
    """Groups added later step as if they had their own optimizer from that point."""
    ps = make_params()
    opt = Muon([dict(params=ps[:1], algorithm="muon")], **BASE)
    old_ref_ps = clone_params(ps[:1])
    old_ref = Muon([dict(params=old_ref_ps, algorithm="muon")], **BASE)
    for step in range(steps_before):
        step_both([(opt, ps[:1]), (old_ref, old_ref_ps)], step)
    opt.add_param_group(dict(params=ps[1:3], algorithm="muon", lr=0.03))
    opt.add_param_group(dict(params=ps[3:], algorithm="adamw"))
    assert [g["step"] for g in opt.param_groups] == [steps_before, 0, 0]
    assert opt.param_groups[1]["lr"] == 0.03 and opt.param_groups[2]["lr"] == BASE["lr"]
    new_ref_ps = clone_params(ps[1:])
    new_ref = Muon(
        [
            dict(params=new_ref_ps[:2], algorithm="muon", lr=0.03),
            dict(params=new_ref_ps[2:], algorithm="adamw"),
        ],
        **BASE,
    )
    for step in range(steps_before, steps_before + 3):
        grads = grads_for(step, ps)
        set_grads(ps, grads)
        set_grads(old_ref_ps, grads[:1])
        set_grads(new_ref_ps, grads[1:])
        opt.step()
        old_ref.step()
        new_ref.step()
    assert_bitwise(ps, snapshot(old_ref_ps + new_ref_ps))
    assert [g["step"] for g in opt.param_groups] == [steps_before + 3, 3, 3]


# ---------------------------------------------------------------------- lr


@pytest.mark.parametrize(
    "make_lr",
    [
        lambda: torch.tensor(0.02),
        lambda: torch.tensor([0.02]),
        lambda: torch.tensor(0.02, dtype=torch.float64),
    ],
    ids=["0-d float32", "1-element 1-d", "0-d float64"],
)
@pytest.mark.parametrize("where", ["default", "group"])
def test_tensor_lr(make_lr: Callable[[], Tensor], where: str) -> None:
    """A 1-element tensor lr steps like the float it holds, and in-place changes apply."""
    lr = make_lr()
    ps, ref_ps = make_params(), make_params()
    if where == "default":
        opt = Muon(make_groups(ps), **{**BASE, "lr": lr})
    else:
        opt = Muon(make_groups(ps, dict(lr=lr), dict(lr=lr)), **BASE)
    ref = Muon(make_groups(ref_ps), **{**BASE, "lr": lr.item()})
    for step in range(2):
        step_both([(opt, ps), (ref, ref_ps)], step)
        assert_bitwise(ps, snapshot(ref_ps))
    lr.fill_(0.005)  # what schedulers do with tensor lrs
    for group in ref.param_groups:
        group["lr"] = lr.item()
    for step in range(2, 4):
        step_both([(opt, ps), (ref, ref_ps)], step)
        assert_bitwise(ps, snapshot(ref_ps))
    assert isinstance(opt.state_dict()["param_groups"][0]["lr"], Tensor)


def _step_scheduler(scheduler: Any) -> None:
    if isinstance(scheduler, ReduceLROnPlateau):
        scheduler.step(1.0)  # a metric that never improves
    else:
        scheduler.step()


SCHEDULERS = {
    "StepLR": lambda o: StepLR(o, step_size=2, gamma=0.5),
    "ExponentialLR": lambda o: ExponentialLR(o, gamma=0.7),
    "LambdaLR": lambda o: LambdaLR(o, lr_lambda=[lambda k: 1 / (k + 1), lambda k: 0.9**k]),
    "OneCycleLR": lambda o: OneCycleLR(o, max_lr=[0.05, 0.01], total_steps=8, cycle_momentum=False),
    "CyclicLR": lambda o: CyclicLR(
        o, base_lr=[0.005, 0.001], max_lr=[0.05, 0.01], step_size_up=2, cycle_momentum=False
    ),
    "ReduceLROnPlateau": lambda o: ReduceLROnPlateau(o, factor=0.5, patience=0),
}


def _lr_value(lr: float | Tensor) -> float:
    return lr.item() if isinstance(lr, Tensor) else lr


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float lr", "tensor lr"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_scheduler(name: str, tensor_lr: bool) -> None:
    """The scheduler drives each group's lr; the steps equal steps with the lrs set by hand.

    The expected lr sequence comes from the same scheduler on a torch SGD with the same group
    lrs (an independent optimizer); the reference Muon gets each lr assigned, as a float,
    before each step. Muon's groups have no 'momentum'/'betas' key, so the cyclic schedulers
    run with ``cycle_momentum=False``.
    """
    make_scheduler = SCHEDULERS[name]
    group_lrs = [0.02, 0.01]
    dummy = torch.optim.SGD(
        [dict(params=[torch.zeros(1, requires_grad=True)], lr=lr) for lr in group_lrs]
    )
    dummy_scheduler = make_scheduler(dummy)
    expected_lrs = []
    for _ in range(6):
        expected_lrs.append([g["lr"] for g in dummy.param_groups])
        dummy.step()
        _step_scheduler(dummy_scheduler)
    assert len({tuple(lrs) for lrs in expected_lrs}) > 1, "the schedule must vary"

    ps, ref_ps = make_params(), make_params()
    opt = Muon(
        make_groups(ps, *[dict(lr=torch.tensor(lr) if tensor_lr else lr) for lr in group_lrs]),
        **BASE,
    )
    ref = Muon(make_groups(ref_ps, *[dict(lr=lr) for lr in group_lrs]), **BASE)
    scheduler = make_scheduler(opt)
    rel = 1e-6 if tensor_lr else 1e-12
    for step, lrs in enumerate(expected_lrs):
        actual = [_lr_value(g["lr"]) for g in opt.param_groups]
        assert actual == pytest.approx(lrs, rel=rel)
        for group, lr in zip(ref.param_groups, actual):
            group["lr"] = lr
        step_both([(opt, ps), (ref, ref_ps)], step)
        _step_scheduler(scheduler)
        assert_bitwise(ps, snapshot(ref_ps))
    if not isinstance(scheduler, ReduceLROnPlateau):
        last = [_lr_value(lr) for lr in scheduler.get_last_lr()]
        assert last == [_lr_value(g["lr"]) for g in opt.param_groups]


# ------------------------------------------------------------------------ dtypes

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "mixed": [torch.float64, torch.float32, torch.bfloat16, torch.bfloat16],
}
# Relative distance of the update (param - initial) from a float64 run after 3 steps, by the
# param's dtype. Newton-Schulz runs in bf16 for every dtype, so float32 is near float64 (seen:
# < 1e-6; the margin allows a flipped bf16 rounding); bf16 params round each update (seen: 4%).
DTYPE_TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-3, torch.bfloat16: 0.1}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_dtypes(dtype_name: str) -> None:
    """State in each param's dtype, params keep it, updates close to a float64 run."""
    ps = make_params(DTYPES[dtype_name])
    dtypes = [p.dtype for p in ps]
    opt = make_opt(ps)
    ref_ps = [Parameter(p.detach().double()) for p in ps]
    ref = make_opt(ref_ps)
    initial = snapshot(ref_ps)
    for step in range(3):
        grads = grads_for(step, ps)
        set_grads(ps, grads)
        set_grads(ref_ps, [g.double() for g in grads])
        opt.step()
        ref.step()
    assert [p.dtype for p in ps] == dtypes
    for p in ps:
        assert all(v.dtype == p.dtype for v in dion_state(opt, p))
    for i, (p, r, x0) in enumerate(zip(ps, ref_ps, initial)):
        delta = (r.detach() - x0).norm()
        err = (p.detach().double() - r.detach()).norm() / delta
        assert err < DTYPE_TOLERANCE[p.dtype], f"param {i} ({p.dtype}): {err:.3g}"

    # a float32 state dict loaded into these params is cast to each param's dtype
    src_ps = make_params()
    src = make_opt(src_ps)
    step_both([(src, src_ps)], 0)
    opt.load_state_dict(copy.deepcopy(src.state_dict()))
    for p in ps:
        assert all(v.dtype == p.dtype for v in dion_state(opt, p))
    step_both([(opt, ps)], 3)
    assert all(torch.isfinite(p).all() for p in ps)


def test_no_warnings_on_a_plain_step() -> None:
    ps = make_params()
    opt = make_opt(ps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step_both([(opt, ps)], 0)
        opt.state_dict()


# ---------------------------------------------------------------- momentum schedulers


def _cycling_schedulers():
    from torch.optim.lr_scheduler import CyclicLR, OneCycleLR

    return {
        "OneCycleLR": lambda opt: OneCycleLR(opt, max_lr=0.05, total_steps=8),
        "CyclicLR": lambda opt: CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=3),
    }


@pytest.mark.parametrize("name", ["OneCycleLR", "CyclicLR"])
def test_momentum_cycling_schedulers_change_what_the_step_uses(name) -> None:
    """issue #20: torch's OneCycleLR and CyclicLR with their default ``cycle_momentum=True``
    (they raised "optimizer must support momentum or beta1"). Each step must use the
    scheduler's lr and momentum: Muon's ``mu`` and AdamW's ``beta1``, bit for bit like an
    optimizer given those values by hand."""
    ps, twin = make_params(), make_params()
    opt, ref = make_opt(ps), make_opt(twin)
    scheduler = _cycling_schedulers()[name](opt)
    momenta = []
    for step in range(6):
        for group, ref_group in zip(opt.param_groups, ref.param_groups):
            ref_group["lr"] = group["lr"]
            key = "beta1" if group["algorithm"] == "adamw" else "mu"
            ref_group[key] = group["momentum"]
        momenta.append(opt.param_groups[0]["momentum"])
        grads = grads_for(step, ps)
        set_grads(ps, grads)
        set_grads(twin, grads)
        opt.step()
        ref.step()
        scheduler.step()
        assert_bitwise(ps, twin)
    assert len(set(momenta)) > 2  # it really cycled


def test_groups_have_dion_keys_until_a_scheduler_sets_momentum() -> None:
    ps = make_params()
    opt = make_opt(ps)
    assert all("momentum" not in g for g in opt.param_groups)
    opt.add_param_group({"params": [Parameter(torch.zeros(3))], "algorithm": "adamw"})
    assert "momentum" not in opt.param_groups[-1]
    opt.param_groups[0]["momentum"] = 1.5
    with pytest.raises(ValueError, match=r"param group 0: momentum \(the alias of mu / beta1\)"):
        opt.step()
