"""matrix_partitions: a fused weight steps exactly like its row blocks as separate params."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import pytest
import torch

from shardmuon import Muon

# dion's per-group defaults plus "params": partitions must not add a key here.
DION_GROUP_KEYS = {
    "params",
    "lr",
    "mu",
    "beta1",
    "beta2",
    "weight_decay",
    "algorithm",
    "step",
    "epsilon",
    "nesterov",
    "flatten",
    "adjust_lr",
}
HYPER = {"lr": 0.02, "mu": 0.95, "weight_decay": 0.1, "adjust_lr": "rms_norm"}


@dataclass(frozen=True)
class Fused:
    """A fused weight of shape ``batch + (sum(blocks), cols)`` split into row ``blocks``."""

    name: str
    batch: tuple[int, ...]
    blocks: tuple[int, ...]
    cols: int

    def block_shape(self, rows: int) -> tuple[int, ...]:
        return (*self.batch, rows, self.cols)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.block_shape(sum(self.blocks))


CASES = [
    # GQA qkv, unequal blocks; cols=48 makes q tall and k, v wide.
    Fused("qkv", (), (64, 32, 32), 48),
    Fused("gate_up", (), (48, 48), 64),  # equal blocks
    Fused("experts_gate_up", (4,), (48, 48), 64),  # 3-D expert stack [E, 2I, H]
    Fused("odd", (), (5, 17, 3, 40), 24),  # several sizes, tall and wide blocks
]


def _values(fused: Fused, seed: int) -> torch.Tensor:
    return 0.02 * torch.randn(fused.shape, generator=torch.Generator().manual_seed(seed))


def _grads(fused: Fused, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000)
    return [1e-3 * torch.randn(fused.shape, generator=g) for _ in range(steps)]


def _fused_run(
    fused: Fused, nesterov: bool, steps: int, partitioned: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.nn.Parameter(_values(fused, seed=1))
    partitions = {weight: fused.blocks} if partitioned else None
    opt = Muon(
        [{"params": [weight], "algorithm": "muon"}],
        nesterov=nesterov,
        matrix_partitions=partitions,
        **HYPER,
    )
    for grad in _grads(fused, steps):
        weight.grad = grad.clone()
        opt.step()
    return weight.detach().clone(), opt.state[weight]["momentum"].clone()


def _separate_run(fused: Fused, nesterov: bool, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = [
        torch.nn.Parameter(b.clone()) for b in _values(fused, seed=1).split(fused.blocks, dim=-2)
    ]
    opt = Muon([{"params": blocks, "algorithm": "muon"}], nesterov=nesterov, **HYPER)
    for grad in _grads(fused, steps):
        for p, g in zip(blocks, grad.split(fused.blocks, dim=-2)):
            p.grad = g.clone()
        opt.step()
    weight = torch.cat([p.detach() for p in blocks], dim=-2)
    momentum = torch.cat([opt.state[p]["momentum"] for p in blocks], dim=-2)
    return weight, momentum


@pytest.mark.parametrize("nesterov", [False, True], ids=["plain", "nesterov"])
@pytest.mark.parametrize("fused", CASES, ids=lambda f: f.name)
def test_partitioned_equals_separate_params(fused: Fused, nesterov: bool) -> None:
    weight, momentum = _fused_run(fused, nesterov, steps=3)
    separate_weight, separate_momentum = _separate_run(fused, nesterov, steps=3)
    assert weight.shape == fused.shape
    assert torch.equal(weight, separate_weight)
    assert torch.equal(momentum, separate_momentum)


@pytest.mark.parametrize("fused", CASES[:2], ids=lambda f: f.name)
def test_partitions_change_the_update(fused: Fused) -> None:
    # Guards the test above: orthogonalizing the whole fused matrix is a different update.
    partitioned, _ = _fused_run(fused, nesterov=False, steps=1)
    whole, _ = _fused_run(fused, nesterov=False, steps=1, partitioned=False)
    assert not torch.equal(partitioned, whole)


def test_partitions_survive_load_state_dict() -> None:
    fused = CASES[0]
    grads = _grads(fused, steps=4)

    def make(values: torch.Tensor) -> tuple[torch.nn.Parameter, Muon]:
        weight = torch.nn.Parameter(values.clone())
        opt = Muon(
            [{"params": [weight], "algorithm": "muon"}],
            nesterov=True,
            matrix_partitions={weight: fused.blocks},
            **HYPER,
        )
        return weight, opt

    weight, opt = make(_values(fused, seed=1))
    for grad in grads[:2]:
        weight.grad = grad.clone()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert {key for group in saved["param_groups"] for key in group} == DION_GROUP_KEYS

    resumed_weight, resumed = make(weight.detach())
    resumed.load_state_dict(copy.deepcopy(saved))
    for grad in grads[2:]:
        weight.grad = grad.clone()
        opt.step()
        resumed_weight.grad = grad.clone()
        resumed.step()
        assert torch.equal(resumed_weight, weight)
    assert torch.equal(resumed.state[resumed_weight]["momentum"], opt.state[weight]["momentum"])
    assert {key for group in resumed.state_dict()["param_groups"] for key in group} == (
        DION_GROUP_KEYS
    )


def _muon(weight: torch.Tensor, partitions: dict, extra: list | None = None) -> Muon:
    groups = [{"params": [weight], "algorithm": "muon"}]
    if extra:
        groups.append({"params": extra, "algorithm": "adamw"})
    return Muon(groups, matrix_partitions=partitions, **HYPER)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((64, 32, 30), r"64, 32, 30"),  # sums to 126
        ((64, 32, 32, 8), r"64, 32, 32, 8"),  # sums to 136
        ((128, 0), r"128, 0"),
        ((160, -32), r"160, -32"),
        ((64, 64.0), r"64, 64\.0"),
    ],
    ids=["short", "long", "zero", "negative", "float"],
)
def test_bad_sizes_raise(sizes: tuple[int, ...], message: str) -> None:
    weight = torch.nn.Parameter(torch.zeros(128, 48))
    with pytest.raises(ValueError, match=message) as info:
        _muon(weight, {weight: sizes})
    if sum(sizes) != 128 and all(s > 0 for s in sizes):
        assert "128" in str(info.value), "the message should name the row count"


def test_param_not_in_optimizer_raises() -> None:
    weight = torch.nn.Parameter(torch.zeros(128, 48))
    stranger = torch.nn.Parameter(torch.zeros(128, 48))
    with pytest.raises(ValueError, match=r"\(128, 48\).* not in"):
        _muon(weight, {stranger: (64, 64)})


def test_partitions_on_1d_param_raise() -> None:
    weight = torch.nn.Parameter(torch.zeros(128, 48))
    norm = torch.nn.Parameter(torch.ones(128))
    # A 1-D param can only live in an AdamW group, where partitions mean nothing.
    with pytest.raises(ValueError, match=r"\(128,\)"):
        _muon(weight, {norm: (64, 64)}, extra=[norm])


def test_row_scales_merge_adjacent_ranges_of_equal_scale() -> None:
    from shardmuon.ops.partitions import row_scales

    # a fused gate_up: two blocks of one shape, one range; unequal blocks stay apart
    assert row_scales((96, 96), 192, 256, [(0, 192)], "rms_norm", 0.2) == [(0, 192, 0.2 * 256**0.5)]
    qkv = row_scales((64, 16, 16), 96, 64, [(0, 96)], "spectral_norm", 0.2)
    assert [(a, b) for a, b, _ in qkv] == [(0, 64), (64, 96)]  # k and v share a scale
    # a strided shard's pieces are not adjacent in the global matrix but are locally:
    # equal scales merge there too, and the covered rows are unchanged
    pieces = row_scales((8, 8), 16, 16, [(0, 4), (8, 12)], "rms_norm", 0.2)
    assert pieces == [(0, 8, 0.2 * 16**0.5)]
    for sizes, ranges in [((5, 3, 8), [(0, 16)]), ((4, 4, 8), [(2, 6), (10, 14)])]:
        merged = row_scales(sizes, 16, 12, ranges, "spectral_norm", 0.2)
        rows = sum(b - a for a, b in ranges)
        covered = sorted(r for a, b, _ in merged for r in range(a, b))
        assert covered == list(range(rows))
        assert all(x[1] < y[0] or x[2] != y[2] for x, y in itertools.pairwise(merged))
