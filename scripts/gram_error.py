"""Error against fp64 of the standard and the Gram Newton–Schulz iterations, by input kind,
aspect ratio, iteration dtype and restart schedule: the table that chose the Gram restart
defaults (``shardmuon.ops.newton_schulz_gram.DEFAULT_RESTARTS``).

    python scripts/gram_error.py [--rows 64] [--seeds 3] [--coefficients dion] [--time]

Error: ``||O - O_64|| / ||O_64||`` (Frobenius), O_64 the fp64 iteration with the same
coefficients on the same input; the worst over the seeds. Inputs (m x n, m = ``--rows``):
``gaussian`` (standard normal), ``logspaced`` (singular values log-spaced over 1e-4..1),
``lowrank`` (rank m/8 plus 1e-3 noise). Gram columns are named by the dtype X is held in
and, after a slash, the dtype of its GEMMs when not the default (bf16's default GEMMs are
fp32 on a CPU, fp16 on CUDA). ``--time`` adds the median time of a call of each iteration
on CPU-sized MoE and attention shapes (bf16, this process's threads).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shardmuon.bench.matrices import INPUT_KINDS, make_input
from shardmuon.bench.matrices import relative_error as error
from shardmuon.ops.newton_schulz import newton_schulz, newton_schulz_reference, resolve_coefficients
from shardmuon.ops.newton_schulz_gram import gram_flops, newton_schulz_gram, standard_flops

KINDS = INPUT_KINDS
ASPECTS = (1.0, 2.0, 2.7, 4.0, 8.0)
SCHEDULES = ((), (2,), (3,), (2, 4))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Gram variants: (the dtype X is held in, the dtype its GEMMs run in; None: the default,
# fp32 for bf16 on a CPU). "bf16/fp16" is bf16's default on CUDA, "bf16/bf16" the
# all-bf16 iteration.
GRAM_VARIANTS = {
    "bf16": (torch.bfloat16, None),
    "bf16/fp16": (torch.bfloat16, torch.float16),
    "bf16/bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, None),
    "fp32": (torch.float32, None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--coefficients", default="dion")
    parser.add_argument("--time", action="store_true", help="also time both iterations")
    args = parser.parse_args()
    coeffs = resolve_coefficients(args.coefficients)
    m = args.rows
    header = ["kind", "aspect", "std bf16", "std fp16", "std fp32"]
    header += [f"gram {d} {list(r)}" for d in GRAM_VARIANTS for r in SCHEDULES]
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
                for name, (dtype, gemm_dtype) in GRAM_VARIANTS.items():
                    for r in SCHEDULES:
                        key = f"gram {name} {list(r)}"
                        out = newton_schulz_gram(
                            G.float(), coeffs, restarts=r, dtype=dtype, gemm_dtype=gemm_dtype
                        )
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
    if args.time:
        print_times(coeffs)


TIMED_SHAPES = ((8, 256, 704), (8, 512, 1408), (16, 128, 512), (4, 512, 512))


def print_times(coeffs) -> None:
    print()
    print(
        "| shape | standard bf16 ms | gram bf16 ms | gram / standard | gram bf16/bf16 ms "
        "| gram bf16/bf16 / standard | FLOPs gram / standard |"
    )
    print("|---|---|---|---|---|---|---|")
    for shape in TIMED_SHAPES:
        G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        times = {}

        def bf16_gemms(X, coeffs):
            return newton_schulz_gram(X, coeffs, gemm_dtype=torch.bfloat16)

        for name, fn in (
            ("std", newton_schulz),
            ("gram", newton_schulz_gram),
            ("gram bf16", bf16_gemms),
        ):
            fn(G, coeffs)  # warm-up
            runs = []
            for _ in range(5):
                start = time.perf_counter()
                fn(G, coeffs)
                runs.append(time.perf_counter() - start)
            times[name] = statistics.median(runs) * 1e3
        m, n = sorted(shape[-2:])
        flops = gram_flops(m, n, len(coeffs), (2,)) / standard_flops(m, n, len(coeffs))
        print(f"| {shape} | {times['std']:.2f} | {times['gram']:.2f} | "
              f"{times['gram'] / times['std']:.2f} | {times['gram bf16']:.2f} | "
              f"{times['gram bf16'] / times['std']:.2f} | {flops:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
