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
