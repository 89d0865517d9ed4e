"""Attacks on the agreement check (``runtime/agreement.py``): ranks of a gloo world that
disagree on purpose. Every case expects the same ``ValueError`` on every rank (the
messages are gathered and compared), naming the field that differs, before any
all-to-all. ``RISKY`` cases may leave the world out of step; they run in a world of
their own.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
from dist_checks import S0, Context, Spec, counting_all_to_all, make_context, place, random_tensors
from torch import nn

from shardmuon import Muon
from shardmuon.runtime.stepper import StepRunner

__all__ = ["CASES", "RISKY", "cases_for", "make_context"]

CASES: dict[str, Callable[[Context], None]] = {}
WORLDS: dict[str, tuple[int, ...]] = {}
RISKY: dict[str, Callable[[Context], None]] = {}


def case(name: str, worlds: tuple[int, ...] = (2, 3), registry: dict | None = None):
    def register(fn):
        (CASES if registry is None else registry)[name] = fn
        WORLDS[name] = worlds
        return fn

    return register


def cases_for(world_size: int) -> list[str]:
    return [name for name in CASES if world_size in WORLDS[name]]


def _last(ctx: Context) -> bool:
    return ctx.rank == ctx.world_size - 1


def _build(ctx: Context, muon: list[Spec], adamw: list[Spec] = (), dtypes=None, **kwargs):
    specs = [*muon, *adamw]
    init = random_tensors([s.shape for s in specs], 3)
    dtypes = dtypes or [torch.float32] * len(specs)
    params = [nn.Parameter(place(ctx, s, t.to(d))) for s, t, d in zip(specs, init, dtypes)]
    groups = [{"params": params[: len(muon)], "algorithm": "muon"}]
    if adamw:
        groups.append({"params": params[len(muon) :], "algorithm": "adamw"})
    opt = Muon(groups, lr=0.01, **kwargs)
    for i, (p, s) in enumerate(zip(params, specs)):
        p.grad = place(ctx, s, torch.full(s.shape, 0.1 * (i + 1)).to(p.dtype))
    return params, opt


def _every_rank_refuses(ctx: Context, opt: Muon, fragments: list[str]) -> None:
    """``opt.step()`` raises ValueError on every rank, no all-to-all first, the same
    message everywhere, holding every fragment."""
    with counting_all_to_all() as calls:
        try:
            opt.step()
            message = None
        except ValueError as error:
            message = str(error)
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (message, len(calls)))
    problems = []
    for rank, (text, count) in enumerate(gathered):
        if text is None:
            problems.append(f"rank {rank} stepped without an error")
        if count:
            problems.append(f"rank {rank} ran {count} all-to-alls before the error")
    texts = {text for text, _ in gathered if text is not None}
    if len(texts) > 1:
        listing = "\n".join(f"  rank {r}: {t}" for r, (t, _) in enumerate(gathered))
        problems.append(f"the ranks' messages differ:\n{listing}")
    for text in texts:
        missing = [f for f in fragments if f not in text]
        if missing:
            problems.append(f"message {text!r} lacks {missing}")
    if problems:
        raise AssertionError("\n".join(problems))


MUON = [Spec((8, 6), (S0,)), Spec((10, 6), (S0,))]


@case("lr_differs_same_message_everywhere")
def _lr(ctx: Context) -> None:
    _, opt = _build(ctx, MUON)
    if _last(ctx):
        opt.param_groups[0]["lr"] = 0.02
    last = ctx.world_size - 1
    _every_rank_refuses(ctx, opt, ["lr (", f"rank {last}: 0.02", ": 0.01"])


@case("auto_workspace_differs_names_it_and_says_pass_an_int")
def _auto_workspace(ctx: Context) -> None:
    """GPUs of different sizes: ``workspace_bytes="auto"`` resolves differently (stood in
    for here); every rank refuses the step, naming the setting and the way out."""
    budget = 2**20 if _last(ctx) else 2**21
    with mock.patch.object(StepRunner, "auto_workspace_bytes", lambda self: budget):
        _, opt = _build(ctx, MUON, workspace_bytes="auto")
    assert opt.workspace_bytes == budget
    _every_rank_refuses(ctx, opt, ["workspace_bytes (", "pass the same int on every rank"])


@case("momentum_alias_differs_names_mu")
def _alias(ctx: Context) -> None:
    """A scheduler that ran on one rank only: its ``momentum`` becomes that rank's mu."""
    _, opt = _build(ctx, MUON)
    if ctx.rank == 0:
        opt.param_groups[0]["momentum"] = 0.5
    _every_rank_refuses(ctx, opt, ["mu (", "rank 0: 0.5"])


@case("matrix_shape_differs_same_message_everywhere")
def _shape(ctx: Context) -> None:
    specs = [MUON[0], Spec((7, 6) if _last(ctx) else (6, 6), (S0,))]
    _, opt = _build(ctx, specs)
    _every_rank_refuses(ctx, opt, ["7x6", "6x6"])


@case("param_count_differs_same_message_everywhere")
def _count(ctx: Context) -> None:
    specs = MUON + [Spec((8, 6), (S0,))] * _last(ctx)
    _, opt = _build(ctx, specs)
    _every_rank_refuses(ctx, opt, ["(rank"])


@case("extra_shape_on_one_rank_same_message_everywhere")
def _extra_shape(ctx: Context) -> None:
    specs = MUON + [Spec((12, 4), (S0,))] * _last(ctx)
    _, opt = _build(ctx, specs)
    _every_rank_refuses(ctx, opt, ["12x4"])


@case("dtype_differs_names_dtype")
def _dtype(ctx: Context) -> None:
    dtype = torch.bfloat16 if _last(ctx) else torch.float32
    _, opt = _build(ctx, MUON, dtypes=[dtype, torch.float32])
    _every_rank_refuses(ctx, opt, ["dtype (", "torch.bfloat16", "torch.float32"])


@case("grad_missing_on_one_rank_same_message_everywhere")
def _grad_missing(ctx: Context) -> None:
    params, opt = _build(ctx, MUON)
    if _last(ctx):
        params[1].grad = None
    _every_rank_refuses(ctx, opt, ["disagree on which Muon parameters have a grad"])


ADAMW = [Spec((12,), (S0,)), Spec((6,), (S0,))]


@case("adamw_lr_differs_on_a_sharded_param")
def _adamw_lr(ctx: Context) -> None:
    """A sharded AdamW parameter (FSDP2 norms) whose group lr differs between ranks: its
    shards would be updated with different lrs — a silently inconsistent update."""
    _, opt = _build(ctx, MUON, ADAMW)
    if _last(ctx):
        opt.param_groups[1]["lr"] = 0.05
    _every_rank_refuses(ctx, opt, ["lr ("])


@case("adamw_step_differs_on_a_sharded_param")
def _adamw_step(ctx: Context) -> None:
    """One rank's AdamW group resumed at another step: its shards get another bias
    correction."""
    _, opt = _build(ctx, MUON, ADAMW)
    if _last(ctx):
        opt.param_groups[1]["step"] = 5
    _every_rank_refuses(ctx, opt, ["step"])


@case("adamw_betas_differ_on_a_sharded_param")
def _adamw_betas(ctx: Context) -> None:
    _, opt = _build(ctx, MUON, ADAMW)
    if _last(ctx):
        opt.param_groups[1]["momentum"] = 0.5  # a scheduler on one rank: beta1
    _every_rank_refuses(ctx, opt, ["beta1"])


@case("check_grads_never_on_one_rank", (2,), registry=RISKY)
def _check_grads_never(ctx: Context) -> None:
    """check_grads is an agreed setting, but a rank with ``"never"`` skips the very check
    that would compare it: the others' all-reduce meets its all-to-all."""
    _, opt = _build(ctx, MUON, check_grads="never" if _last(ctx) else "first")
    _every_rank_refuses(ctx, opt, ["check_grads"])
