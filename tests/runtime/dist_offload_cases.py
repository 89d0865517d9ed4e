"""``offload="state"`` on 2 gloo ranks (run by ``test_offload.py``): bitwise equal to one
process and to no offload, under FSDP2 placements and a real ``fully_shard`` model, and
DCP's optimizer state dict round trip keeps the state in host memory."""

from __future__ import annotations

from collections.abc import Callable

import torch
from dist_checks import (
    S0,
    S1,
    Context,
    Spec,
    assert_same_local_optimizers,
    assert_same_locals,
    compare_with_single,
    make_context,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from shardmuon import Muon
from shardmuon.planning.placements import local_tensor

__all__ = ["CASES", "make_context"]

SPECS = [
    *[Spec((40, 24), (S0,))] * 3,  # exchanged (rows)
    Spec((30, 16), (S0,)),  # 15 + 15 rows
    Spec((24, 36), (S1,)),  # exchanged (columns)
    Spec((4, 16, 24), (S0,)),  # expert stack: local
    Spec((24,), (S0,), algorithm="adamw"),
]


def bitwise_with_one_process(ctx: Context) -> None:
    # The distributed optimizer and a one-process one, both offloaded, from the same
    # weights and grads: params, momentum, variance, counters and bytes checked.
    _, problems = compare_with_single(ctx, SPECS, steps=3, offload="state", offload_prefetch=2)
    assert not problems, "\n".join(problems)


def _model(ctx: Context) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 24), nn.LayerNorm(24))
    fully_shard(model, mesh=ctx.mesh)
    return model


def _optimizer(model: nn.Module, **kwargs) -> Muon:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return Muon(
        [dict(params=matrices), dict(params=others, algorithm="adamw")],
        lr=0.02,
        nesterov=True,
        weight_decay=0.1,
        **kwargs,
    )


def _train(model: nn.Module, opt: Muon, steps: range) -> None:
    for step in steps:
        torch.manual_seed(1000 + step)
        x = torch.randn(8, 24)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def fully_shard_model_bitwise(ctx: Context) -> None:
    plain, offloaded = _model(ctx), _model(ctx)
    a, b = _optimizer(plain), _optimizer(offloaded, offload="state")
    _train(plain, a, range(3))
    _train(offloaded, b, range(3))
    assert_same_local_optimizers(a, list(plain.parameters()), b, list(offloaded.parameters()))
    stats = b.last_step_stats
    assert stats.offload_bytes_loaded == stats.offload_bytes_stored > 0


def dcp_state_dict_round_trip(ctx: Context) -> None:
    reference = _model(ctx)
    ref_opt = _optimizer(reference)
    _train(reference, ref_opt, range(4))

    model = _model(ctx)
    opt = _optimizer(model, offload="state")
    _train(model, opt, range(2))
    saved = get_optimizer_state_dict(model, opt)
    for entry in saved["state"].values():
        for key in ("momentum", "variance"):
            if key in entry:
                assert local_tensor(entry[key]).device.type == "cpu"
    saved = {
        "state": {
            k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in e.items()}
            for k, e in saved["state"].items()
        },
        "param_groups": saved["param_groups"],
    }
    resumed_model = _model(ctx)
    with torch.no_grad():
        for p, q in zip(model.parameters(), resumed_model.parameters()):
            local_tensor(q).copy_(local_tensor(p))
    resumed = _optimizer(resumed_model, offload="state")
    set_optimizer_state_dict(resumed_model, resumed, saved)
    _train(resumed_model, resumed, range(2, 4))
    assert_same_locals("params", zip(reference.parameters(), resumed_model.parameters()))


def _shared_dir() -> str:
    """A fresh folder, the same path on every rank (rank 0 makes it)."""
    import tempfile

    import torch.distributed as dist

    path = [tempfile.mkdtemp(prefix="shardmuon-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def prime_rl_in_place_dcp_resume_bitwise(ctx: Context) -> None:
    """prime-rl's checkpoint path (issue #20): DCP saves ``optimizer.state_dict()`` and loads
    *in place* into the tensors of a fresh optimizer's ``state_dict()``, never calling
    ``load_state_dict`` (the param groups, and dion's group ``step``, are not restored).
    The per-parameter ``step`` counters carry AdamW's bias correction over: steps 4-6 of
    the resumed run are bitwise those of an uninterrupted one, with and without offload."""
    import torch.distributed.checkpoint as dcp

    for offload in (None, "state"):
        reference = _model(ctx)
        ref_opt = _optimizer(reference, offload=offload)
        _train(reference, ref_opt, range(6))

        model = _model(ctx)
        opt = _optimizer(model, offload=offload)
        _train(model, opt, range(3))
        folder = _shared_dir()
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=folder)

        resumed_model = _model(ctx)
        resumed = _optimizer(resumed_model, offload=offload)
        loaded = {"model": resumed_model.state_dict(), "optimizer": resumed.state_dict()}
        dcp.load(loaded, checkpoint_id=folder)
        resumed_model.load_state_dict(loaded["model"])
        assert [g["step"] for g in resumed.param_groups] == [0, 0]  # not restored, as in prime-rl
        _train(resumed_model, resumed, range(3, 6))
        assert [g["step"] for g in resumed.param_groups] == [6, 6], offload
        assert_same_local_optimizers(
            ref_opt,
            list(reference.parameters()),
            resumed,
            list(resumed_model.parameters()),
            f"offload={offload}",
        )


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(13, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 13, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(torch.tanh(self.proj(self.embed_tokens(tokens)))))


def _lm(ctx: Context) -> nn.Module:
    torch.manual_seed(0)
    model = _LM()
    for module in (model.embed_tokens, model.proj, model.lm_head):
        fully_shard(module, mesh=ctx.mesh)
    return fully_shard(model, mesh=ctx.mesh)


def _lm_step(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(50 + step)
    tokens = torch.randint(0, 13, (4, 6), generator=gen)
    logits = model(tokens)
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten()).backward()


def prime_rl_streamed_loop_bitwise(ctx: Context) -> None:
    """prime-rl's own streamed offload through the chunk API (each chunk's state brought
    back right before ``step_chunk`` and parked after it, AdamW one parameter per chunk),
    Sinkhorn groups for the embedding and the head: bitwise ``step()`` under FSDP2, and no
    parked state touched (``tests/support/streaming.py``)."""
    from streaming import ParkedState, streamed_step

    from shardmuon.routing import build_param_groups

    models = [_lm(ctx), _lm(ctx)]
    opts = [
        Muon(
            build_param_groups(
                m.named_parameters(), lr=0.02, weight_decay=0.1, embedding_update="sinkhorn"
            ).groups,
            max_concurrent_tasks=2,
            **kwargs,
        )
        for m, kwargs in zip(models, ({}, {"adamw_chunks": "parameter"}))
    ]
    parked = ParkedState(opts[1])
    parked.park_all()
    for step in range(3):
        for model in models:
            _lm_step(model, step)
        opts[0].step()
        streamed_step(opts[1], parked)
        for opt in opts:
            opt.zero_grad()
    parked.unpark([p for g in opts[1].param_groups for p in g["params"]])
    assert_same_local_optimizers(
        opts[0], list(models[0].parameters()), opts[1], list(models[1].parameters())
    )


CASES: dict[str, Callable[[Context], None]] = {
    "prime_rl_streamed_loop_bitwise": prime_rl_streamed_loop_bitwise,
    "prime_rl_in_place_dcp_resume_bitwise": prime_rl_in_place_dcp_resume_bitwise,
    "bitwise_with_one_process": bitwise_with_one_process,
    "fully_shard_model_bitwise": fully_shard_model_bitwise,
    "dcp_state_dict_round_trip": dcp_state_dict_round_trip,
}
