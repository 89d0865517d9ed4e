"""What the divergence guard adds to a Gram Newton–Schulz call, per batch shape.

    python scripts/guard_cost.py [--repeats 5] [--threads 1]

Prints, for a few batches of Gaussian matrices, the best-of-N time of ``newton_schulz_gram``
alone and under ``guarded`` (the fp32 ``O O^T`` plus the Cholesky certificate), and their
ratio. Run it at two commits to compare guards.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from shardmuon.ops.newton_schulz_gram import newton_schulz_gram
from shardmuon.ops.newton_schulz_guard import guarded

SHAPES = ((16, 64, 256), (8, 128, 512), (12, 128, 384), (4, 256, 1024))


def best_ms(work: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``work`` (after one warm-up), in ms."""
    work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _gram(X: torch.Tensor) -> torch.Tensor:
    return newton_schulz_gram(X, "dion")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, choices=range(1, 101), metavar="N")
    parser.add_argument("--threads", type=int, default=1, choices=range(1, 65), metavar="T")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for batch, m, n in SHAPES:
        G = torch.randn(batch, m, n, generator=torch.Generator().manual_seed(0))

        alone = best_ms(functools.partial(_gram, G), args.repeats)
        checked = best_ms(functools.partial(guarded, G, _gram, "dion", 1e-8), args.repeats)
        print(
            f"{batch:>3} x {m:>4} x {n:>5}   gram {alone:8.1f} ms   guarded {checked:8.1f} ms"
            f"   ratio {checked / alone:5.2f}"
        )


if __name__ == "__main__":
    main()
