"""The step's own overhead, where Newton–Schulz is small: 40 small fp32 matrices, one process.

    PYTHONPATH=<tree>/src python scripts/step_overhead.py

Prints the median ``Muon.step`` time in ms over 30 steps (after 3 warm-ups), one thread.
Run it alternately on two trees (a worktree of the commit before and this one) to see a
change in the per-step bookkeeping that ``scripts/step_regression.py`` would drown in
GEMM time.
"""

from __future__ import annotations

import time

import torch

from shardmuon import Muon

SHAPES = [(64, 64)] * 10 + [(32, 96)] * 10 + [(4, 32, 48)] * 10 + [(96, 32)] * 10


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = Muon(params, lr=0.01, newton_schulz_dtype="float32")
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(30):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"{times[len(times) // 2] * 1e3:.2f}")


if __name__ == "__main__":
    main()
