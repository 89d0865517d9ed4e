"""The hook kinds: step pre- and post-hooks (global and per optimizer, with their arguments,
replacing arguments, editing grads), state-dict and load-state-dict pre- and post-hooks.

One of PyTorch's generic optimizer checks applied to ``shardmuon.Muon``, as the module
docstring of ``tests/support/generic_setup.py`` describes them.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from checks import assert_all_bitwise, clone_params, grads_for, params_of, set_grads, snapshot
from generic_setup import make_opt, make_params, step_both
from torch import Tensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

pytestmark = pytest.mark.usefixtures("one_thread")


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
            assert_all_bitwise(seen, before if "pre" in kind else after, kind)

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
        assert_all_bitwise(ps, snapshot(ref_ps))


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
