"""AOL's input without a normalisation pass (``normalize.gram_ready``; on accelerators the
``shardmuon::gram_ready_into`` kernel): a matrix whose norm lies in ``GRAM_READY_RANGE``
is left as it is (in place: not written), one out of range is scaled by the power of two
that brings its norm into [0.5, 1) (exact), a non-finite one is zeroed and flagged, and the
floor is ``||X|| / (||X|| + eps)`` — checked against fp64 on random inputs at scales from
1e-45 to 1e37, NaN/inf and zero matrices, in place and not, on the CPU branch, the torch
ops of the accelerator branch and (under Triton's interpreter) the kernel, which must give
the torch ops' bits."""

from __future__ import annotations

import math
import os
import textwrap

import pytest
import torch
from checks import same_bits
from triton_interpreter import run_interpreted

from shardmuon.ops.fused_normalize import (
    GRAM_READY_RANGE,
    gram_ready_into,
    gram_ready_reference,
)
from shardmuon.ops.normalize import gram_ready

LOW, HIGH = GRAM_READY_RANGE


def _cases(seed: int):
    """(X, eps, out dtype): shapes, dtypes, strided views, scales, non-finite and zeros."""
    gen = torch.Generator().manual_seed(seed)
    for k in range(24):
        batch, rows, cols = (int(v) for v in torch.randint(1, 7, (3,), generator=gen))
        rows, cols = rows * 3, cols * 5
        X = torch.randn(batch, rows, cols, generator=gen, dtype=torch.float64)
        scales = torch.tensor([1e-45, 1e-20, 1e-12, 1e-3, 1.0, 1e3, 1e12, 1e20, 1e37])
        X = X * scales[torch.randint(0, len(scales), (batch, 1, 1), generator=gen)]
        if k % 3 == 0:
            X[0] = 0.0
        if k % 4 == 1:
            X[-1, 0, 0] = float(["nan", "inf", "-inf"][k % 3])
        source = (torch.bfloat16, torch.float32)[k % 2]
        X = X.to(source)
        if k % 5 == 2:
            X = X.mT.contiguous().mT
        yield X, [1e-8, 0.0, 1e-3][k % 3], (torch.bfloat16, torch.float32)[(k // 2) % 2]


def _check(X, eps, got, nonfinite, floor, unit_norm: bool = True) -> None:
    """The promises, against fp64 from ``X`` as given (``unit_norm``: an out-of-range matrix
    lands in [0.5, 1); the accelerator's single fp32 prescale stops at 2^-126, in range)."""
    X64 = X.double()
    norms = X64.norm(dim=(-2, -1))
    bad = ~torch.isfinite(norms)
    assert torch.equal(nonfinite, bad)
    for i in range(X.size(0)):
        if bad[i]:
            assert not got[i].any() and floor[i] == 0
            continue
        n = float(norms[i])
        want_floor = n / (n + eps) if n + eps > 0 else 0.0
        assert float(floor[i]) == pytest.approx(want_floor, rel=1e-6, abs=1e-37), (i, n)
        if LOW <= n <= HIGH:
            assert torch.equal(got[i], X[i].to(got.dtype)), i  # as it is
        elif n > 0:
            # an exact power-of-two multiple of X (rounded once into got's dtype), in range
            k = round(math.log2(float(got[i].double().norm()) / n))
            assert torch.equal(got[i], (X[i].double() * 2.0**k).to(got.dtype)), (i, n, k)
            scaled = float(got[i].double().norm())
            assert (0.5 <= scaled < 1.0) if unit_norm else (LOW <= scaled <= HIGH), (i, n)
        else:
            assert not got[i].any()


@pytest.mark.parametrize("in_place", [False, True], ids=["into-out", "in-place"])
def test_the_cpu_branch(in_place: bool) -> None:
    for X, eps, dtype in _cases(0):
        if in_place:
            X = X.contiguous()
            dtype = X.dtype
        given = X.clone()
        (got, nonfinite), floor = gram_ready(X, eps, dtype, out=X if in_place else None)
        assert got.dtype == dtype and got.is_contiguous()
        _check(given, eps, got, nonfinite, floor)
        if in_place:
            assert got.data_ptr() == X.data_ptr()


def test_the_accelerator_branchs_torch_ops_and_the_fake_on_meta() -> None:
    for X, eps, dtype in _cases(1):
        out = torch.empty(X.shape, dtype=dtype)
        flags = torch.empty(X.size(0), dtype=torch.bool)
        floor = torch.empty(X.size(0))
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
        gram_ready_reference(X, norm, eps, out, flags, floor)
        _check(X, eps, out, flags, floor, unit_norm=False)
    meta = torch.empty(3, 4, 5, device="meta")
    gram_ready_into(meta, torch.empty(3, device="meta", dtype=torch.float64), 1e-8, meta,
                    torch.empty(3, device="meta", dtype=torch.bool),
                    torch.empty(3, device="meta"))  # fmt: skip


def test_fp16_is_refused() -> None:
    with pytest.raises(ValueError, match="fp16 needs the unit normalisation"):
        gram_ready(torch.randn(2, 3, 4), 1e-8, torch.float16)


PROGRAM = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from checks import same_bits
    from test_gram_ready import _cases
    from shardmuon.ops.fused_normalize import gram_ready_reference, launch

    checked = 0
    for seed in (2, 3):
        for X, eps, dtype in _cases(seed):
            for in_place in (False, True):
                if in_place:
                    X = X.contiguous()
                    dtype = X.dtype
                norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
                want = torch.empty(X.shape, dtype=dtype)
                want_flags = torch.empty(X.size(0), dtype=torch.bool)
                want_floor = torch.empty(X.size(0))
                gram_ready_reference(X.clone(), norm, eps, want, want_flags, want_floor)
                source = X.clone()
                out = source if in_place else torch.full(X.shape, 7.0, dtype=dtype)
                flags = torch.ones(X.size(0), dtype=torch.bool)
                floor = torch.full((X.size(0),), 7.0)
                launch(source, norm, eps, out, flags, floor, gram_ready=True)
                if not (same_bits(out, want) and same_bits(floor, want_floor)):
                    sys.exit(f"{{X.dtype}}->{{dtype}} {{tuple(X.shape)}} eps={{eps}} "
                             f"in_place={{in_place}}: floor {{floor}} vs {{want_floor}}")
                if not torch.equal(flags, want_flags):
                    sys.exit(f"flags {{flags}} vs {{want_flags}}")
                checked += 1
    print("checked", checked)
    """
)


def test_the_kernel_gives_the_torch_ops_bits_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("triton")
    stdout = run_interpreted(PROGRAM.format(tests=os.path.dirname(__file__)), tmp_path)
    assert "checked 96" in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_kernel_gives_the_torch_ops_bits() -> None:
    pytest.importorskip("triton")
    from shardmuon.ops.fused_normalize import launch

    for X, eps, _ in _cases(4):
        X = X.contiguous().cuda()
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
        want = X.clone()
        want_flags = torch.empty(X.size(0), dtype=torch.bool, device="cuda")
        want_floor = torch.empty(X.size(0), device="cuda")
        gram_ready_reference(want.clone(), norm, eps, want, want_flags, want_floor)
        flags, floor = torch.empty_like(want_flags), torch.empty_like(want_floor)
        launch(X, norm, eps, X, flags, floor, gram_ready=True)  # in place
        assert same_bits(X, want) and same_bits(floor, want_floor)
        assert torch.equal(flags, want_flags)
