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

On such a mesh torch has a second placement: ``distribute_tensor(..., src_data_rank=None)``
gives each rank the piece of its mesh coordinate rather than of its group rank, and no
shard says which one placed it. Where the two placements differ on some rank
(:func:`readings_agree`) a layout may also be refused (the update can depend on the
placement); what steps must then be right under both: bitwise by ``full_tensor()`` for the
scatter, and each rank's shard against the same coordinate slice of the one-process result
for the other (within :data:`COORDINATE_TOL`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from shardmuon import Muon

__all__ = [
    "COORDINATE_TOL",
    "REFUSAL",
    "Outcome",
    "Param",
    "check_layouts",
    "describe_mesh",
    "one_tensor_by_coordinate",
    "readings_agree",
    "refusal_problems",
    "round_trips",
    "run_against_single",
]

# A tensor placed by coordinate reaches the optimizer with its rows or columns permuted, so
# Newton–Schulz may sum in another order and round a bf16 unit (2**-8 relative) differently.
# Bitwise on the fixed tables of dist_rank_order_cases; the random layouts get this margin.
# The bug it guards against was 60% of the update.
COORDINATE_TOL = 2**-7


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


def _place(p: Param, full: torch.Tensor, by_coordinate: bool = False) -> torch.Tensor:
    """``full`` laid out as ``p``: scattered by group rank, or (``by_coordinate``) sliced by
    each rank's mesh coordinate (``src_data_rank=None``)."""
    if p.placements is None:
        return full.clone()
    source = {"src_data_rank": None} if by_coordinate else {}
    return distribute_tensor(full.clone(), p.mesh, list(p.placements), **source)


def _arange(p: Param) -> torch.Tensor:
    numel = 1
    for n in p.shape:
        numel *= n
    return torch.arange(numel, dtype=torch.float32).reshape(p.shape)


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
    whole = _arange(p)
    try:
        back = distribute_tensor(whole.clone(), p.mesh, list(p.placements)).full_tensor()
        same = torch.equal(back, whole)
    except Exception:  # torch's own collectives refused the layout: not a round trip
        same = False
    return _everyone(same)


def readings_agree(p: Param) -> bool:
    """Do torch's two placements (scatter by group rank, slice by mesh coordinate) give every
    rank the same shard of ``p``? (Collective.)"""
    if p.placements is None:
        return True
    whole = _arange(p)
    same = torch.equal(_place(p, whole).to_local(), _place(p, whole, True).to_local())
    return _everyone(same)


def one_tensor_by_coordinate(p: Param) -> bool:
    """Is ``p`` placed by coordinate the scatter placement of one tensor, the same on every
    rank (a permutation of the original)? (Collective.) Where it is not, ranks that hold the
    same piece by group rank hold different pieces by coordinate."""
    if p.placements is None:
        return True
    placed = _place(p, _arange(p), True)
    try:
        whole = placed.full_tensor()
        same = torch.equal(_place(p, whole).to_local(), placed.to_local())
        low, high = whole.clone(), whole.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        same = same and torch.equal(low, high)
    except Exception:
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
    specs: Sequence[Param],
    *,
    steps: int = 2,
    seed: int = 0,
    chunked: bool = False,
    by_coordinate: bool = False,
    **kwargs,
) -> Outcome:
    """Step ``specs`` distributed and in one process on the same values and grads, comparing
    after every step.

    Collective (every rank must pass the same ``specs``). Refusals are ``ValueError``s raised
    by the constructor or a step; any other exception propagates. The comparison reads the
    distributed tensors with ``full_tensor()``, so call it for layouts that round-trip.
    ``chunked``: the distributed optimizer steps through ``chunks()`` one at a time.
    ``by_coordinate``: weights and grads placed by mesh coordinate (``src_data_rank=None``),
    each rank's shards compared with the same slice of the one-process tensors (weights
    within :data:`COORDINATE_TOL` of the largest update entry, momenta bitwise).
    """
    kwargs = {
        "lr": 0.02, "weight_decay": 0.1, "nesterov": True, "adjust_lr": "rms_norm",
        "newton_schulz_impl": "per-matrix", **kwargs,
    }  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    inits = [torch.randn(p.shape, generator=generator) for p in specs]
    grads = [[torch.randn(p.shape, generator=generator) for p in specs] for _ in range(steps)]
    ref_params = [nn.Parameter(t.clone()) for t in inits]
    dist_params = [nn.Parameter(_place(p, t, by_coordinate)) for p, t in zip(specs, inits)]
    ref = _optimizer(ref_params, specs, **kwargs)
    outcome = Outcome()
    try:
        opt = _optimizer(dist_params, specs, **kwargs)
        for step in range(steps):
            for p, t, g in zip(specs, dist_params, grads[step]):
                t.grad = _place(p, g, by_coordinate)
            if chunked:
                for chunk in opt.chunks():
                    opt.step_chunk(chunk)
            else:
                opt.step()
            for t, g in zip(ref_params, grads[step]):
                t.grad = g.clone()
            ref.step()
            compare = _compare_by_coordinate if by_coordinate else _compare
            outcome.problems += compare(specs, dist_params, ref_params, inits, opt, ref, step)
    except ValueError as error:
        return Outcome(refused=str(error))
    return outcome


def _compare(specs, dist_params, ref_params, inits, opt, ref, step: int) -> list[str]:
    """Bitwise, by ``full_tensor()`` (the scatter's placement)."""
    problems = []
    for i, (spec, got, want) in enumerate(zip(specs, dist_params, ref_params)):
        pairs = [("param", got.detach(), want.detach())]
        pairs.append(("momentum", opt.state[got]["momentum"], ref.state[want]["momentum"]))
        for what, a, b in pairs:
            a = a.full_tensor() if isinstance(a, DTensor) else a
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item()
                problems.append(
                    f"{what} {i} {spec} after step {step + 1}: max |diff| {diff:.3g} vs one process"
                )
    return problems


def _compare_by_coordinate(specs, dist_params, ref_params, inits, opt, ref, step) -> list[str]:
    """This rank's shards against the coordinate slices of the one-process tensors."""
    problems = []
    for i, (spec, got, want, init) in enumerate(zip(specs, dist_params, ref_params, inits)):
        local = got.detach().to_local() if isinstance(got, DTensor) else got.detach()
        expected = _place(spec, want.detach(), True)
        expected = expected.to_local() if isinstance(expected, DTensor) else expected
        update = (want.detach() - init).abs().max().item()
        diff = (local.double() - expected.double()).abs().max().item() if local.numel() else 0.0
        if diff > COORDINATE_TOL * update:
            problems.append(
                f"param {i} {spec} placed by coordinate, after step {step + 1}: max |diff| "
                f"{diff:.3g} on rank {dist.get_rank()} for an update of {update:.3g}"
            )
        momentum = opt.state[got]["momentum"]
        momentum = momentum.to_local() if isinstance(momentum, DTensor) else momentum
        expected = _place(spec, ref.state[want]["momentum"], True)
        expected = expected.to_local() if isinstance(expected, DTensor) else expected
        if not torch.equal(momentum, expected):
            problems.append(f"momentum {i} {spec} placed by coordinate differs on this rank")
    return problems


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


def _refused_index(message: str | None) -> int | None:
    """The position of the parameter a refusal names (``group 0 param i``), if any."""
    found = re.search(r"group 0 param (\d+)", message or "")
    return int(found.group(1)) if found else None


def check_layouts(label: str, params: Sequence[Param], **kwargs) -> list[str]:
    """The parameters that round-trip step together, bitwise like one process, except those
    whose two placements differ (:func:`readings_agree`), which may be refused, each for
    itself; what steps of those must also be right when placed by coordinate. Every one that
    does not round-trip is refused when given alone. Collective (the same ``params`` on every
    rank); ``kwargs`` go to both optimizers."""
    judged = [(p, round_trips(p)) for p in params]
    good = [p for p, ok in judged if ok]
    problems = []
    # By identity: equal specs may lie on different meshes.
    ambiguous = {id(p) for p in good if not readings_agree(p)}
    while good:
        outcome = run_against_single(good, **kwargs)
        refused = _refused_index(outcome.refused)
        if refused is None or id(good[refused]) not in ambiguous:
            if outcome.refused is not None:
                problems.append(f"{label}: refused layouts that round-trip: {outcome.refused}")
            problems += [f"{label}: {m}" for m in outcome.problems]
            break
        # One whose update depends on the placement: refused for cause, naming it.
        problems += [
            f"{label}, {good[refused]}: {m}"
            for m in refusal_problems(outcome, (f"group 0 param {refused}", *REFUSAL[1:]))
        ]
        good = good[:refused] + good[refused + 1 :]
    stepped = [p for p in good if id(p) in ambiguous]
    if stepped:
        outcome = run_against_single(stepped, by_coordinate=True, **kwargs)
        if outcome.refused is not None:
            problems.append(f"{label}: refused by coordinate what it stepped: {outcome.refused}")
        problems += [f"{label}: {m}" for m in outcome.problems]
    for p, ok in judged:
        if not ok:
            outcome = run_against_single([p], **kwargs)
            problems += [f"{label}, {p} alone: {m}" for m in refusal_problems(outcome, REFUSAL)]
    return problems
