"""Error against fp64 of the standard and the Gram Newton–Schulz iterations, by input kind,
aspect ratio, iteration dtype and restart schedule: the table that chose the Gram restart
defaults (``shardmuon.ops.gram_newton_schulz.DEFAULT_RESTARTS``).

    python scripts/gram_error.py [--rows 64] [--seeds 3] [--coefficients dion]

Error: ``||O - O_64|| / ||O_64||`` (Frobenius), O_64 the fp64 iteration with the same
coefficients on the same input; the worst over the seeds. Inputs (m x n, m = ``--rows``):
``gaussian`` (standard normal), ``logspaced`` (singular values log-spaced over 1e-4..1),
``lowrank`` (rank m/8 plus 1e-3 noise).
"""

from __future__ import annotations

import argparse

import torch

from shardmuon.ops.gram_newton_schulz import gram_flops, newton_schulz_gram, standard_flops
from shardmuon.ops.newton_schulz import newton_schulz, newton_schulz_reference, resolve_coefficients

KINDS = ("gaussian", "logspaced", "lowrank")
ASPECTS = (1.0, 2.0, 2.7, 4.0, 8.0)
SCHEDULES = ((), (2,), (3,), (2, 4))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_input(kind: str, m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(m, n, generator=g, dtype=torch.float64)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    if kind == "logspaced":
        s = torch.logspace(-4, 0, m, dtype=torch.float64)
        return u @ torch.diag(s) @ v.T
    rank = max(1, m // 8)
    s = torch.zeros(m, dtype=torch.float64)
    s[:rank] = 1.0
    return u @ torch.diag(s) @ v.T + 1e-3 * torch.randn(m, n, generator=g, dtype=torch.float64)


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--coefficients", default="dion")
    args = parser.parse_args()
    coeffs = resolve_coefficients(args.coefficients)
    m = args.rows
    header = ["kind", "aspect", "std bf16", "std fp16", "std fp32"]
    header += [f"gram {d} {list(r)}" for d in DTYPES for r in SCHEDULES]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for kind in KINDS:
        for aspect in ASPECTS:
            n = round(m * aspect)
            worst: dict[str, float] = {}
            for seed in range(args.seeds):
                G = make_input(kind, m, n, seed)
                ref = newton_schulz_reference(G, coeffs)
                for name, dtype in DTYPES.items():
                    key = f"std {name}"
                    out = newton_schulz(G.float(), coeffs, dtype=dtype)
                    worst[key] = max(worst.get(key, 0.0), error(out, ref))
                    for r in SCHEDULES:
                        key = f"gram {name} {list(r)}"
                        out = newton_schulz_gram(G.float(), coeffs, restarts=r, dtype=dtype)
                        worst[key] = max(worst.get(key, 0.0), error(out, ref))
            row = [kind, f"{aspect:g}"] + [f"{worst[h]:.2e}" for h in header[2:]]
            print("| " + " | ".join(row) + " |", flush=True)
    steps = len(coeffs)
    print()
    print(
        "| aspect | standard GFLOP | "
        + " | ".join(f"gram {list(r)} / standard" for r in SCHEDULES)
        + " |"
    )
    print("|" + "---|" * (2 + len(SCHEDULES)))
    for aspect in ASPECTS:
        n = round(2048 * aspect)
        std = standard_flops(2048, n, steps)
        ratios = [gram_flops(2048, n, steps, r) / std for r in SCHEDULES]
        print(f"| {aspect:g} | {std / 1e9:.1f} | " + " | ".join(f"{x:.3f}" for x in ratios) + " |")


if __name__ == "__main__":
    main()
