"""Where a Newton–Schulz call spends its time on an accelerator, piece by piece.

Times (median of ``--repeats`` after warm-ups, device-synchronised) on each shape:

* the folded iteration as the engine runs it (``out=`` buffers reused), the same GEMMs
  writing fresh tensors, and dion's unfolded recipe — with each one's relative distance
  to the folded iteration run in fp64 on the same input;
* the whole call (normalisation included) with dion's 5 steps and with AOL's 4, and the
  normalisation alone (fp32 input, bf16 output);
* the divergence guard's pieces on a Gram result: ``O O^T`` in fp32 (the guard's product),
  the same product from the bf16 values with fp32 output where the backend has it, the
  Frobenius test, one batched ``cholesky_ex``, ``eigvalsh``, and a guarded Gram call
  beside an unguarded one (with how many matrices the Frobenius bound left undecided).

    python scripts/ns_gpu_pieces.py [--shapes 32x768x2048,16x1408x4096] [--repeats 10]

Prints one table; ``--json PATH`` writes the figures. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from shardmuon.ops.newton_schulz import (
    iterate_folded,
    iterate_unfolded,
    newton_schulz,
    resolve_coefficients,
)
from shardmuon.ops.newton_schulz_gram import newton_schulz_gram
from shardmuon.ops.newton_schulz_guard import GUARD_SLACK, band_high, guarded
from shardmuon.ops.normalize import normalize


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def iterate_fresh(X: torch.Tensor, coefficients) -> torch.Tensor:
    """The folded iteration's GEMMs, each writing a fresh tensor (no ``out=``)."""
    for a, b, c in coefficients:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def measure(shape: tuple[int, int, int], device: torch.device, repeats: int) -> dict:
    _, m, n = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    G = torch.randn(shape, generator=gen).to(device)
    coeffs = resolve_coefficients("dion")
    X0 = (G / G.norm(dim=(-2, -1), keepdim=True)).to(torch.bfloat16)
    reference = iterate_folded(X0.double().clone(), coeffs)

    def distance(out: torch.Tensor) -> float:
        return float((out.double() - reference).norm() / reference.norm())

    row: dict = {"shape": "x".join(map(str, shape))}
    variants = {
        "folded (out=)": lambda: iterate_folded(X0.clone(), coeffs),
        "folded (fresh)": lambda: iterate_fresh(X0.clone(), coeffs),
        "unfolded": lambda: iterate_unfolded(X0.clone(), coeffs),
    }
    for name, fn in variants.items():
        row[f"{name} ms"] = timed(fn, device, repeats)
        row[f"{name} err"] = distance(fn())
    row["call dion ms"] = timed(lambda: newton_schulz(G, "dion"), device, repeats)
    wide_G = G if m <= n else G.mT
    row["normalize ms"] = timed(lambda: normalize(wide_G, 1e-8), device, repeats)
    row["call aol ms"] = timed(
        lambda: newton_schulz(G, "aol", preconditioner="aol"), device, repeats
    )

    gram = newton_schulz_gram(G, "dion")
    wide = gram if m <= n else gram.mT
    row["O O^T fp32 ms"] = timed(lambda: torch.bmm(wide.float(), wide.float().mT), device, repeats)
    try:
        exact = torch.bmm(wide, wide.mT, out_dtype=torch.float32)
        row["O O^T bf16->fp32 ms"] = timed(
            lambda: torch.bmm(wide, wide.mT, out_dtype=torch.float32), device, repeats
        )
        fp32 = torch.bmm(wide.float(), wide.float().mT)
        row["bf16->fp32 vs fp32 max rel"] = float((exact - fp32).abs().max() / fp32.abs().max())
    except (RuntimeError, TypeError) as error:
        row["O O^T bf16->fp32 ms"] = f"n/a ({type(error).__name__})"
    band = band_high(coeffs)
    A = torch.bmm(wide.float(), wide.float().mT).div_(band * band)
    limit = GUARD_SLACK**2
    row["frobenius ms"] = timed(lambda: torch.linalg.matrix_norm(A), device, repeats)
    row["undecided"] = int((torch.linalg.matrix_norm(A) > limit).sum())
    shifted = torch.diag_embed(A.new_full(A.shape[:-1], limit)) - A
    row["cholesky_ex ms"] = timed(lambda: torch.linalg.cholesky_ex(shifted), device, repeats)
    row["eigvalsh ms"] = timed(lambda: torch.linalg.eigvalsh(A), device, repeats)

    def gram_call() -> torch.Tensor:
        return newton_schulz_gram(G, "dion")

    row["gram call ms"] = timed(gram_call, device, repeats)
    row["guarded gram call ms"] = timed(
        lambda: guarded(G, lambda T: newton_schulz_gram(T, "dion"), "dion", 1e-8), device, repeats
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32x768x2048,16x1408x4096,8x2048x6144")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for text in args.shapes.split(","):
        shape = tuple(int(v) for v in text.split("x"))
        rows.append(measure(shape, device, args.repeats))
        for key, value in rows[-1].items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"{rows[-1]['shape']:>14}  {key:<28} {shown}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
