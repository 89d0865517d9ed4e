"""Sinkhorn groups in gloo worlds of 1-4 ranks (run by ``tests/optimizer/test_sinkhorn.py``).

Every layout is held to the dense float64 reference of the algorithm
(``ops/sinkhorn.sinkhorn_reference``, which materialises and normalises the whole update)
at rtol 1e-4 on the update, over several steps; the step's other ways (``step_chunk``,
offload, the overlapped step) to plain ``step()`` bitwise; a DCP checkpoint to the
uninterrupted run bitwise; settings or grads that differ between ranks to one error on
every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from dist_checks import Context, make_context
from dist_harness import case_registry
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from shardmuon import Muon
from shardmuon.ops.sinkhorn import SINKHORN_DEFAULTS, sinkhorn_reference
from shardmuon.planning.placements import local_tensor
from shardmuon.routing import build_param_groups

__all__ = ["CASES", "cases_for", "make_context"]

CASES, case, cases_for = case_registry()

S0, S1, R = Shard(0), Shard(1), Replicate()
LR, MU = 0.05, 0.9


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _layouts(
    ctx: Context, shape: tuple[int, int]
) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """``(label, place)``: every layout this world can lay a ``shape`` matrix out in
    (``distribute_tensor`` cuts ``_StridedShard`` evenly only)."""
    world = ctx.world_size
    mesh = ctx.mesh

    def on(mesh, placements):
        return lambda full: distribute_tensor(full.clone(), mesh, placements)

    out = [("plain", lambda full: full.clone())]
    out += [(f"1-D {p}", on(mesh, [p])) for p in (S0, S1, R)]
    if world == 4:
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for placements in (
            [R, S0],  # HSDP
            [S0, S1],  # rows over dp, columns over tp
            [S1, S0],
            [S0, S0],  # rows over both dims
            [_StridedShard(0, split_factor=2), S0],  # FSDP2 over a vocab-parallel table
            [R, S1],
        ):
            if isinstance(placements[0], _StridedShard) and shape[0] % 4:
                continue
            out.append((f"2x2 {placements}", on(grid, placements)))
    return out


# Shapes: even, uneven (rows not a multiple of the ranks), fewer rows than ranks (an empty
# shard), one column, rows below the tau cut.
SHAPES = [(16, 8), (13, 6), (3, 10), (9, 1)]


def _steps(weight: torch.Tensor, grads: list[torch.Tensor], place) -> tuple:
    """(shardmuon's weights after each step, the fp64 reference's)."""
    param = place(weight)
    param = nn.Parameter(param)
    opt = Muon([dict(params=[param], algorithm="sinkhorn", lr=LR, mu=MU)])
    ref_w = weight.double()
    ref_m = torch.zeros_like(ref_w)
    got, want = [], []
    kwargs = dict(
        iters=SINKHORN_DEFAULTS["sinkhorn_iters"],
        tau=SINKHORN_DEFAULTS["sinkhorn_tau"],
        eps=SINKHORN_DEFAULTS["sinkhorn_eps"],
        lr_scale=SINKHORN_DEFAULTS["sinkhorn_lr_scale"],
    )
    for grad in grads:
        before = _full(param.detach()).double()
        param.grad = place(grad)
        opt.step()
        got.append(_full(param.detach()).double() - before)
        new_w, ref_m = sinkhorn_reference(ref_w, grad, ref_m, lr=LR, beta=MU, **kwargs)
        want.append(new_w - ref_w)
        ref_w = new_w
    return got, want


@case("every_layout_matches_the_fp64_reference", (1, 2, 3, 4))
def every_layout_matches_the_fp64_reference(ctx: Context) -> None:
    problems = []
    for shape in SHAPES:
        gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
        weight = torch.randn(shape, generator=gen)
        grads = [torch.randn(shape, generator=gen) for _ in range(3)]
        grads[1][0] *= 1e-7  # a row under tau * mean: zeroed
        for label, place in _layouts(ctx, shape):
            got, want = _steps(weight, grads, place)
            for step, (g, w) in enumerate(zip(got, want)):
                scale = w.abs().max().item()
                err = (g - w).abs().max().item()
                if not err <= 1e-4 * scale:
                    problems.append(f"{label} {shape} step {step}: {err:.3g} vs {scale:.3g}")
    assert not problems, "\n".join(problems)


@case("extreme_scales_and_a_nonfinite_entry_on_every_layout", (2, 4))
def extreme_scales_and_a_nonfinite_entry_on_every_layout(ctx: Context) -> None:
    # Directions whose fp32 squares overflow or vanish: every rank scales its own block,
    # and all must agree on the units (the sums); one NaN on one rank's shard: every rank
    # of the table skips it and counts it.
    problems = []
    shape = (13, 6)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(shape, generator=gen)
    for scale in (1e30, 1e-30):
        grads = [torch.randn(shape, generator=gen) * scale for _ in range(2)]
        grads[1][:, 3:] = 0.0  # a whole column block zero (a rank's shard when split)
        grads.append(torch.randn(shape, generator=gen) * scale)
        grads[2][:7, :3] *= 1e15  # one block of a 2x2 split far above the others
        for label, place in _layouts(ctx, shape):
            got, want = _steps(weight, grads, place)
            for step, (g, w) in enumerate(zip(got, want)):
                err = (g - w).abs().max().item()
                if not err <= 1e-4 * w.abs().max().item():
                    problems.append(f"{label} x{scale:g} step {step}: {err:.3g}")
    for label, place in _layouts(ctx, shape):
        param = nn.Parameter(place(weight))
        opt = Muon([dict(params=[param], algorithm="sinkhorn", lr=LR, mu=MU)])
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(8))
        grad[12, 5] = float("nan")  # the last rows: on the last rank of a row split
        param.grad = place(grad)
        before = local_tensor(param.detach()).clone()
        opt.step()
        if not torch.equal(local_tensor(param.detach()), before):
            problems.append(f"{label}: a table with a NaN grad changed")
        if opt.last_step_stats.nonfinite_matrices != 1:
            problems.append(f"{label}: counted {opt.last_step_stats.nonfinite_matrices}")
    assert not problems, "\n".join(problems)


@case("a_chunk_failing_before_its_sums_is_retried", (2,))
def a_chunk_failing_before_its_sums_is_retried(ctx: Context) -> None:
    # A failure before the first all-reduce (here: in the scaling) leaves nothing half
    # exchanged: the retry steps the chunk and the round goes on, bitwise the step.
    import shardmuon.ops.sinkhorn as sinkhorn_module

    base, opt = _mixed(ctx)
    _grads(ctx, base, 0)
    opt.step()
    params, other = _mixed(ctx)
    _grads(ctx, params, 0)
    real = sinkhorn_module._block_exponent
    calls = []

    def fail_once(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected before the sums")
        return real(x)

    sinkhorn_module._block_exponent = fail_once
    try:
        chunks = other.chunks()
        try:
            other.step_chunk(chunks[0])
        except RuntimeError as err:
            assert "injected" in str(err), err
        else:
            raise AssertionError("the injected failure did not raise")
        for chunk in chunks:
            other.step_chunk(chunk)
    finally:
        sinkhorn_module._block_exponent = real
    _assert_bitwise("retried", base, params, opt, other)


def _mixed(ctx: Context, seed: int = 0, **kwargs) -> tuple[list[nn.Parameter], Muon]:
    """A Sinkhorn table (rows split), a Sinkhorn head (columns split), a Muon matrix and an
    AdamW vector, all sharded on the 1-D mesh."""
    gen = torch.Generator().manual_seed(seed)
    mesh = ctx.mesh
    specs = [((11, 6), [S0]), ((6, 11), [S1]), ((12, 6), [S0]), ((6,), [S0])]
    params = [
        nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen), mesh, placements))
        for shape, placements in specs
    ]
    groups = [
        dict(params=params[:2], algorithm="sinkhorn", lr=LR, sinkhorn_iters=7),
        dict(params=[params[2]]),
        dict(params=[params[3]], algorithm="adamw"),
    ]
    return params, Muon(groups, lr=0.02, mu=MU, **kwargs)


def _grads(ctx: Context, params: list[nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        full = torch.randn(p.shape, generator=gen)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)


def _assert_bitwise(label: str, a: list[nn.Parameter], b: list[nn.Parameter], oa, ob) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(local_tensor(x.detach()), local_tensor(y.detach())), f"{label}: {i}"
        for key, value in oa.state[x].items():
            other = ob.state[y][key]
            assert torch.equal(local_tensor(value).cpu(), local_tensor(other).cpu()), (
                f"{label}: state {key} of {i}"
            )


@case("chunks_offload_and_overlap_are_bitwise_the_step", (2, 3))
def chunks_offload_and_overlap_are_bitwise_the_step(ctx: Context) -> None:
    ways: dict[str, Callable[[Muon], None]] = {
        "step_chunk": lambda opt: [opt.step_chunk(c) for c in opt.chunks()],
        "offload": lambda opt: opt.step(),
        "overlap": lambda opt: (opt.step(), opt.synchronize()),
    }
    settings = {"step_chunk": {}, "offload": {"offload": "state"}, "overlap": {}}
    settings["overlap"] = {"overlap": "forward"}
    base, opt = _mixed(ctx)
    for step in range(3):
        _grads(ctx, base, step)
        opt.step()
    for name, way in ways.items():
        params, other = _mixed(ctx, **settings[name])
        if name == "overlap":
            other.overlap_with(nn.Module())  # nothing to hook: waits by synchronize()
        kinds = [other.chunk_info(c).kind for c in other.chunks()]
        assert kinds[:2] == ["sinkhorn", "sinkhorn"], kinds
        for step in range(3):
            _grads(ctx, params, step)
            way(other)
        _assert_bitwise(name, base, params, opt, other)


@case("dcp_checkpoint_resumes_bitwise", (2,))
def dcp_checkpoint_resumes_bitwise(ctx: Context) -> None:
    import tempfile

    import torch.distributed.checkpoint as dcp

    base, opt = _mixed(ctx)
    for step in range(4):
        _grads(ctx, base, step)
        opt.step()
    params, first = _mixed(ctx)
    for step in range(2):
        _grads(ctx, params, step)
        first.step()
    model = nn.ParameterList(params)
    saved = get_optimizer_state_dict(model, first)
    momentum_keys = [k for k in saved["state"] if "momentum" in saved["state"][k]]
    assert momentum_keys, saved["state"].keys()
    folder = [tempfile.mkdtemp() if ctx.rank == 0 else None]
    dist.broadcast_object_list(folder)
    dcp.save({"optim": saved}, checkpoint_id=folder[0])
    fresh_params, fresh = _mixed(ctx)
    with torch.no_grad():
        for p, q in zip(fresh_params, params):
            p.copy_(q)
    fresh_model = nn.ParameterList(fresh_params)
    target = {"optim": get_optimizer_state_dict(fresh_model, fresh)}
    dcp.load(target, checkpoint_id=folder[0])
    set_optimizer_state_dict(fresh_model, fresh, target["optim"])
    assert fresh.state[fresh_params[0]]["momentum"].dtype == torch.float32
    for step in range(2, 4):
        _grads(ctx, fresh_params, step)
        fresh.step()
    _assert_bitwise("resumed", base, fresh_params, opt, fresh)


@case("ranks_that_differ_raise_on_every_rank", (2, 3))
def ranks_that_differ_raise_on_every_rank(ctx: Context) -> None:
    # A Sinkhorn setting edited on the last rank only, after the first agreed step.
    params, opt = _mixed(ctx)
    _grads(ctx, params, 0)
    opt.step()
    if ctx.rank == ctx.world_size - 1:
        opt.param_groups[0]["sinkhorn_tau"] = 0.01
    _grads(ctx, params, 1)
    try:
        opt.step()
    except ValueError as err:
        assert "sinkhorn_tau" in str(err), err
    else:
        raise AssertionError("a Sinkhorn setting edited on one rank stepped")
    # A grad missing on one rank at the first step of a Sinkhorn-only optimizer.
    gen = torch.Generator().manual_seed(5)
    table = nn.Parameter(distribute_tensor(torch.randn(10, 4, generator=gen), ctx.mesh, [S0]))
    opt = Muon([dict(params=[table], algorithm="sinkhorn")])
    grad = distribute_tensor(torch.ones(10, 4), ctx.mesh, [S0])
    if ctx.rank != 0:
        table.grad = grad
    try:
        opt.step()
    except ValueError as err:
        assert "grad" in str(err), err
    else:
        raise AssertionError("a grad present on some ranks only stepped")


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 19, dim: int = 8) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(torch.tanh(self.proj(self.embed_tokens(tokens)))))


def _train_lm(model: nn.Module, steps: int, world: int, rank: int, sharded: bool) -> None:
    groups = build_param_groups(
        model.named_parameters(), lr=0.02, weight_decay=0.0, embedding_update="sinkhorn"
    )
    kinds = {g["algorithm"] for g in groups.groups}
    assert kinds == {"muon", "sinkhorn", "adamw"}, kinds
    opt = Muon(groups.groups, lr=0.02, mu=MU)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 19, (world * 2, 5), generator=gen)
        if sharded:
            tokens = tokens[rank * 2 : rank * 2 + 2]
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


@case("fsdp2_model_with_routed_sinkhorn_groups_matches_one_process", (2, 4))
def fsdp2_model_with_routed_sinkhorn_groups_matches_one_process(ctx: Context) -> None:
    torch.manual_seed(0)
    single = _TinyLM()
    torch.manual_seed(0)
    sharded = _TinyLM()
    for module in (sharded.embed_tokens, sharded.proj, sharded.lm_head):
        fully_shard(module, mesh=ctx.mesh)
    fully_shard(sharded, mesh=ctx.mesh)
    _train_lm(single, 3, ctx.world_size, ctx.rank, sharded=False)
    _train_lm(sharded, 3, ctx.world_size, ctx.rank, sharded=True)
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        got = _full(b.detach())
        err = (got - a.detach()).abs().max().item()
        assert err <= 1e-4 * max(1.0, a.abs().max().item()), f"{name}: {err}"
    assert math.isfinite(err)


@case("an_edit_on_one_rank_of_a_2x2_grid_raises_on_every_rank", (4,))
def an_edit_on_one_rank_of_a_2x2_grid_raises_on_every_rank(ctx: Context) -> None:
    # Ranks 0 and 3 share no group of a (Shard(0), Shard(1)) table: the verdict must be
    # passed on, or rank 0 waits in its sums. Also a value only one rank refuses (11.0).
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for key, value in (("lr", 0.5), ("sinkhorn_iters", 11.0)):
        gen = torch.Generator().manual_seed(9)
        table = nn.Parameter(distribute_tensor(torch.randn(8, 6, generator=gen), grid, [S0, S1]))
        opt = Muon([dict(params=[table], algorithm="sinkhorn")])
        table.grad = distribute_tensor(torch.randn(8, 6, generator=gen), grid, [S0, S1])
        opt.step()
        if ctx.rank == 3:
            opt.param_groups[0][key] = value
        try:
            for chunk in opt.chunks():
                opt.step_chunk(chunk)
        except ValueError as err:
            assert "disagree" in str(err), (key, err)
        else:
            raise AssertionError(f"{key} edited on rank 3 stepped")
