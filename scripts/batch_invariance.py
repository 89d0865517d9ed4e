"""How often does a matrix round differently alone and inside a batch?

Orthogonalizes random small matrices with ``newton_schulz`` (the default, batched GEMMs) one
at a time and as batches of 2 to 8, and counts matrices whose bf16 bits differ; then the
same with ``newton_schulz_per_matrix`` (which must count 0). One CPU thread, as the
distributed tests run. Usage: ``python scripts/batch_invariance.py [--trials N]``.
"""

from __future__ import annotations

import argparse

import torch

from shardmuon.ops.newton_schulz import newton_schulz, newton_schulz_per_matrix


def count_differences(orthogonalize, trials: int, seed: int = 0) -> tuple[int, int]:
    """``(matrices whose bits differ alone vs in their batch, matrices compared)``."""
    g = torch.Generator().manual_seed(seed)
    differ = total = 0
    for _ in range(trials):
        rows, cols = (int(v) for v in torch.randint(1, 40, (2,), generator=g))
        batch = int(torch.randint(2, 9, (1,), generator=g))
        G = torch.randn(batch, rows, cols, generator=g)
        whole = orthogonalize(G)
        for i in range(batch):
            differ += not torch.equal(orthogonalize(G[i : i + 1])[0], whole[i])
            total += 1
    return differ, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, fn in (("folded", newton_schulz), ("per-matrix", newton_schulz_per_matrix)):
        differ, total = count_differences(fn, args.trials)
        print(f"{name}: {differ} of {total} matrices differ alone vs in a batch")


if __name__ == "__main__":
    main()
