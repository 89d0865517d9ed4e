"""``ops.normalize``: the division's bits against an fp32 reference written out in full.

The reference is the formula the module documents — the source upcast to fp32, scaled by
the power-of-two prescale where there is one, divided by the fp32 divisor, rounded once
into the output dtype — computed whole. ``normalize`` must give exactly those bits
whatever the slicing, the source and output dtypes, and the branch (the CPU's, and the
accelerator's fp64-norm branch, run here on CPU tensors).
"""

from __future__ import annotations

import pytest
import torch

from shardmuon.ops import normalize as normalize_module
from shardmuon.ops.normalize import normalize, normalize_without_sync

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference(X: torch.Tensor, eps: float, dtype: torch.dtype, accelerator: bool) -> torch.Tensor:
    """``X / (||X|| + eps)`` as the module defines it, whole, in fp32 then ``dtype``."""
    wide = X.to(torch.float32)
    if accelerator:
        norm64 = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64)
        _, exponent = torch.frexp(norm64)
        prescale = torch.ldexp(torch.ones_like(norm64, dtype=torch.float32), -exponent)
        denom = (norm64 * prescale).to(torch.float32) + prescale * eps
        return (wide * prescale / denom).to(dtype)
    denom = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    return (wide / (denom + eps)).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu-branch", "accelerator-branch"])
@pytest.mark.parametrize("chunk", [None, 7, 96], ids=["whole", "row-slices", "matrix-slices"])
def test_the_division_gives_the_reference_bits(
    monkeypatch: pytest.MonkeyPatch, accelerator: bool, chunk: int | None
) -> None:
    if chunk is not None:  # slices of rows (7 < n) or of whole matrices (96 >= m n)
        monkeypatch.setattr(normalize_module, "NORMALIZE_CHUNK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(3)
    for trial in range(90):
        rows, cols = (int(v) for v in torch.randint(1, 12, (2,), generator=gen))
        if chunk == 96:
            rows, cols = min(rows, 8), min(cols, 12)
        batch = int(torch.randint(1, 5, (1,), generator=gen))
        source = DTYPES[trial % 3]
        target = DTYPES[(trial // 3) % 3]
        exponent = int(torch.randint(-12, 12, (1,), generator=gen))
        X = (torch.randn(batch, rows, cols, generator=gen) * 2.0**exponent).to(source)
        if accelerator:
            out = torch.empty(X.shape, dtype=target)
            got = normalize_without_sync(X, 1e-8, out)
            assert got.X is out
        else:
            got = normalize(X, 1e-8, target)
        assert not got.nonfinite.any()
        want = reference(X, 1e-8, target, accelerator)
        assert same_bits(got.X, want), (trial, source, target, (batch, rows, cols))


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "row-slices"])
def test_in_place_normalisation_gives_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    """``out=X`` (the engine's ``overwrite_input``): each slice read before it is written."""
    if chunk is not None:
        monkeypatch.setattr(normalize_module, "NORMALIZE_CHUNK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        X = torch.randn(3, 9, 13, generator=gen).to(dtype)
        want = normalize(X, 1e-8, dtype).X
        got = normalize(X, 1e-8, dtype, out=X)
        assert got.X.data_ptr() == X.data_ptr() and same_bits(got.X, want)
        Y = torch.randn(3, 9, 13, generator=gen).to(dtype)
        want = normalize_without_sync(Y.clone(), 1e-8, torch.empty_like(Y)).X
        assert same_bits(normalize_without_sync(Y, 1e-8, Y).X, want)


def test_the_accelerator_branch_rounds_a_wider_input_to_fp32_first() -> None:
    """As :func:`normalize` does: an fp64 input gives the bits of its fp32 rounding."""
    X = torch.randn(4, 10, 30, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = normalize_without_sync(X, 1e-8, torch.empty(X.shape, dtype=torch.bfloat16))
    want = normalize_without_sync(X.float(), 1e-8, torch.empty(X.shape, dtype=torch.bfloat16))
    assert same_bits(got.X, want.X)


def test_the_cpu_division_calls_and_its_flags() -> None:
    """On a CPU a narrow batch is divided in two row halves (two calls, same fp32 bytes as
    one widened copy), an fp32 one in one call; the flags are the NaN matrices'."""
    from shardmuon.bench.kernels import count_step

    gen = torch.Generator().manual_seed(9)
    for dtype, divisions in [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 1)]:
        X = torch.randn(4, 16, 24, generator=gen).to(dtype)
        report = count_step(lambda X=X: normalize(X, 1e-8, torch.bfloat16, out=None), "cpu")
        assert report.operators["aten.div.out"] == divisions, report.operators
        assert "aten._to_copy.default" not in report.operators
    got = normalize(torch.randn(3, 5, 7, generator=gen).bfloat16(), 1e-8)
    assert got.nonfinite.shape == (3,) and not got.nonfinite.any()
    X = torch.randn(3, 5, 7, generator=gen).bfloat16()
    X[1, 2, 3] = float("nan")
    flagged = normalize(X, 1e-8)
    assert flagged.nonfinite.tolist() == [False, True, False]
    assert not flagged.X[1].any() and flagged.X[0].any()
