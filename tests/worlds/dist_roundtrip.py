"""Distributed Muon against one process, with DTensor's own round trip as the judge.

A parameter is laid out by torch's ``distribute_tensor`` (its default: shards scattered from
group rank 0, as a model's weights are) and read back by its ``full_tensor()``. Where that
pair gives back a tensor of distinct values on every rank, the layout is one torch can
represent, and the optimizer must step it exactly like the same ``Muon`` on the whole tensor
in one process (bitwise, with ``newton_schulz_impl="per-matrix"``, whose bits depend on the
matrix alone). Where it does not (uneven shards over a mesh dim whose ranks are not
ascending, meshes whose group ranks form no grid), the optimizer must refuse the parameter
on every rank with an error that names it. Nothing here reads shardmuon's planning: the
expectation comes from torch alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from shardmuon import Muon

__all__ = [
    "REFUSAL",
    "Outcome",
    "Param",
    "check_layouts",
    "describe_mesh",
    "refusal_problems",
    "round_trips",
    "run_against_single",
]


@dataclass(frozen=True)
class Param:
    """One parameter: global shape, placements on ``mesh`` (``None``: a plain tensor)."""

    shape: tuple[int, ...]
    placements: tuple | None = None
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    partitions: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        where = (
            "plain"
            if self.placements is None
            else f"{self.placements} on {describe_mesh(self.mesh)}"
        )
        parts = f", partitions {self.partitions}" if self.partitions else ""
        return f"{self.shape} {where}{parts}"


def describe_mesh(mesh: DeviceMesh | None) -> str:
    return "no mesh" if mesh is None else f"mesh {mesh.mesh.tolist()}"


def _place(p: Param, full: torch.Tensor) -> torch.Tensor:
    if p.placements is None:
        return full.clone()
    return distribute_tensor(full.clone(), p.mesh, list(p.placements))


def _everyone(flag: bool) -> bool:
    """``flag`` on every rank of the world (collective)."""
    value = torch.tensor([0 if flag else 1])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item() == 0


def round_trips(p: Param) -> bool:
    """Does ``distribute_tensor`` then ``full_tensor()`` give back a tensor of distinct
    values on every rank? (Collective over the world: every rank gets the same answer.)"""
    if p.placements is None:
        return True
    numel = 1
    for n in p.shape:
        numel *= n
    whole = torch.arange(numel, dtype=torch.float32).reshape(p.shape)
    try:
        back = distribute_tensor(whole.clone(), p.mesh, list(p.placements)).full_tensor()
        same = torch.equal(back, whole)
    except Exception:  # torch's own collectives refused the layout: not a round trip
        same = False
    return _everyone(same)


@dataclass
class Outcome:
    """What one run gave on this rank: refused (with the message) or stepped (with the
    differences from one process, empty when bitwise)."""

    refused: str | None = None
    problems: list[str] = field(default_factory=list)


def _optimizer(params: list[torch.Tensor], specs: Sequence[Param], **kwargs) -> Muon:
    partitions = {t: p.partitions for t, p in zip(params, specs) if p.partitions}
    return Muon(
        [{"params": params, "algorithm": "muon"}], matrix_partitions=partitions or None, **kwargs
    )


def run_against_single(
    specs: Sequence[Param], *, steps: int = 2, seed: int = 0, chunked: bool = False, **kwargs
) -> Outcome:
    """Step ``specs`` distributed and in one process on the same values and grads.

    Collective (every rank must pass the same ``specs``). Refusals are ``ValueError``s raised
    by the constructor or a step; any other exception propagates. The comparison reads the
    distributed tensors with ``full_tensor()``, so call it for layouts that round-trip.
    ``chunked``: the distributed optimizer steps through ``chunks()`` one at a time.
    """
    kwargs = {
        "lr": 0.02, "weight_decay": 0.1, "nesterov": True, "adjust_lr": "rms_norm",
        "newton_schulz_impl": "per-matrix", **kwargs,
    }  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    inits = [torch.randn(p.shape, generator=generator) for p in specs]
    grads = [[torch.randn(p.shape, generator=generator) for p in specs] for _ in range(steps)]
    ref_params = [nn.Parameter(t.clone()) for t in inits]
    dist_params = [nn.Parameter(_place(p, t)) for p, t in zip(specs, inits)]
    ref = _optimizer(ref_params, specs, **kwargs)
    try:
        opt = _optimizer(dist_params, specs, **kwargs)
        for step in range(steps):
            for p, t, g in zip(specs, dist_params, grads[step]):
                t.grad = _place(p, g)
            if chunked:
                for chunk in opt.chunks():
                    opt.step_chunk(chunk)
            else:
                opt.step()
    except ValueError as error:
        return Outcome(refused=str(error))
    for step in range(steps):
        for t, g in zip(ref_params, grads[step]):
            t.grad = g.clone()
        ref.step()
    outcome = Outcome()
    for i, (spec, got, want) in enumerate(zip(specs, dist_params, ref_params)):
        pairs = [("param", got.detach(), want.detach())]
        pairs.append(("momentum", opt.state[got]["momentum"], ref.state[want]["momentum"]))
        for what, a, b in pairs:
            a = a.full_tensor() if isinstance(a, DTensor) else a
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item()
                outcome.problems.append(f"{what} {i} {spec}: max |diff| {diff:.3g} vs one process")
    return outcome


def refusal_problems(outcome: Outcome, fragments: Sequence[str]) -> list[str]:
    """This rank's problems unless it refused with every one of ``fragments`` in its message
    (a rank that stepped while its peers refused would hang them: the harness's collective
    timeout reports that)."""
    if outcome.refused is None:
        return ["stepped, expected a refusal"]
    return [
        f"message lacks {f!r}: {outcome.refused}" for f in fragments if f not in outcome.refused
    ]


# What a refusal must name: the parameter, and the way out.
REFUSAL = ("group 0 param 0", "ascending order")


def check_layouts(label: str, params: Sequence[Param], **kwargs) -> list[str]:
    """The parameters that round-trip step together, bitwise like one process; every one
    that does not is refused when given alone. Collective (the same ``params`` on every
    rank); ``kwargs`` go to both optimizers."""
    judged = [(p, round_trips(p)) for p in params]
    good = [p for p, ok in judged if ok]
    problems = []
    if good:
        outcome = run_against_single(good, **kwargs)
        if outcome.refused is not None:
            problems.append(f"{label}: refused layouts that round-trip: {outcome.refused}")
        problems += [f"{label}: {m}" for m in outcome.problems]
    for p, ok in judged:
        if not ok:
            outcome = run_against_single([p], **kwargs)
            problems += [f"{label}, {p} alone: {m}" for m in refusal_problems(outcome, REFUSAL)]
    return problems
