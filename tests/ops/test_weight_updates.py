"""``weight_updates_`` (a batch's decay and update in ``_foreach_`` passes) gives the bits of
``weight_update_`` applied segment by segment, on random batches: partitioned rows, zero and
non-zero decay, per-parameter learning rates, bf16 and fp32 results, and leaves the results
untouched."""

from __future__ import annotations

import random

import torch

from shardmuon.ops.update import weight_update_, weight_updates_


def _batch(rng: random.Random, gen: torch.Generator):
    rows, cols = rng.randint(1, 24), rng.randint(1, 24)
    counts = [rng.randint(1, 3) for _ in range(rng.randint(2, 5))]
    params = [torch.randn(c, rows, cols, generator=gen) for c in counts]
    dtype = rng.choice([torch.bfloat16, torch.float32])
    results = torch.randn(sum(counts), rows, cols, generator=gen).to(dtype)
    lrs = [rng.choice([0.02, 1e-3, 0.37]) for _ in counts]
    decays = [rng.choice([0.0, 0.1, 0.01]) for _ in counts]
    scales = []
    for _ in counts:
        if rng.random() < 0.3 and rows > 2:
            cut = rng.randint(1, rows - 1)
            scales.append([(0, cut, rng.random() + 0.5), (cut, rows, rng.random() + 0.5)])
        else:
            scales.append([(0, rows, rng.random() * 3)])
    return params, results, lrs, decays, scales


def test_the_batched_update_gives_the_per_segment_bits() -> None:
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for _ in range(60):
        params, results, lrs, decays, scales = _batch(rng, gen)
        want = [p.clone() for p in params]
        offset = 0
        for p, lr, wd, ranges in zip(want, lrs, decays, scales):
            weight_update_(p, results[offset : offset + p.size(0)], lr, wd, ranges)
            offset += p.size(0)
        kept = results.clone()
        weight_updates_(params, results, lrs, decays, scales)
        assert torch.equal(results, kept)
        for got, expected in zip(params, want):
            assert torch.equal(got, expected)
    # parameters whose ranges are all empty are still decayed
    params = [torch.randn(2, 4, 3), torch.randn(1, 4, 3)]
    before = [p.clone() for p in params]
    want = [p.clone() for p in params]
    for p, ranges in zip(want, [[], [(2, 2, 1.0)]]):
        weight_update_(p, torch.zeros(p.shape), 0.02, 0.1, ranges)
    weight_updates_(params, torch.zeros(3, 4, 3), [0.02, 0.02], [0.1, 0.1], [[], [(2, 2, 1.0)]])
    assert all(torch.equal(a, b) for a, b in zip(params, want))
    assert not any(torch.equal(a, b) for a, b in zip(params, before))  # decayed indeed
    # the test can tell: another lr changes the bits
    params, results, lrs, decays, scales = _batch(rng, gen)
    want = [p.clone() for p in params]
    weight_updates_(want, results, lrs, decays, scales)
    weight_updates_(params, results, [lr * 1.001 for lr in lrs], decays, scales)
    assert not all(torch.equal(a, b) for a, b in zip(params, want))


def _reference_update(param, ortho, lr, weight_decay, ranges):
    """The update's arithmetic spelled out in fp64-free torch ops, one range at a time:
    ``fl(fl(P * fl32(1 - lr*wd)) + fl(fl32(O) * fl32(-lr*scale)))``."""
    out = param.clone()
    if weight_decay != 0.0:
        out.mul_(1.0 - lr * weight_decay)
    for start, end, scale in ranges:
        if end > start:
            step = ortho[..., start:end, :].to(torch.float32, copy=True).mul_(-lr * scale)
            out[..., start:end, :].add_(step)
    return out


def test_the_update_against_its_spelled_out_roundings() -> None:
    """``weight_update_`` (its one-pass fp32 step on a CPU) gives the bits of the widened copy
    multiplied in place, for bf16 and fp32 results, factors of either sign and -0.0, and
    leaves an fp32 results buffer untouched."""
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    for trial in range(80):
        count, rows, cols = rng.randint(1, 3), rng.randint(1, 20), rng.randint(1, 20)
        param = torch.randn(count, rows, cols, generator=gen)
        dtype = rng.choice([torch.bfloat16, torch.float32])
        ortho = (torch.randn(count, rows, cols, generator=gen) * 10 ** rng.uniform(-3, 3)).to(dtype)
        lr = rng.choice([0.02, 1e-3, -0.37, 0.0, -0.0, 3.3e-5, 1e39, -1e300, 1e-45])
        wd = rng.choice([0.0, 0.1])
        cut = rng.randint(0, rows)
        ranges = [(0, cut, rng.random() * 3), (cut, rows, rng.random() * 3)]
        want = _reference_update(param, ortho, lr, wd, ranges)
        kept = ortho.clone()
        weight_update_(param, ortho, lr, wd, ranges)
        assert torch.equal(ortho, kept)
        # bitwise, signed zeros included
        assert torch.equal(param.view(torch.int32), want.view(torch.int32)), trial
    # the test can tell: a factor off by one ulp changes the bits
    param = torch.randn(2, 8, 8, generator=gen)
    ortho = torch.randn(2, 8, 8, generator=gen).bfloat16()
    want = _reference_update(param, ortho, 0.02, 0.1, [(0, 8, 1.0)])
    weight_update_(param, ortho, 0.02 * (1 + 2**-20), 0.1, [(0, 8, 1.0)])
    assert not torch.equal(param, want)
