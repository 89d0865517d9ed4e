"""The accelerator normalisation's one-kernel pass (``ops/fused_normalize.py``) gives the
bits of the torch ops it replaces (``normalize_without_sync``): the Triton kernel run by
Triton's interpreter on a CPU (a fresh process: ``TRITON_INTERPRET`` is read at import) on
random inputs of every dtype pair, strided views, scales from 1e-40 to 1e38, NaN/inf and
zero matrices, several ``eps``; the custom op's torch implementation and its fake (meta)
one beside it."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from checks import same_bits
from triton_interpreter import run_interpreted

from shardmuon.ops.fused_normalize import (
    normalize_into,
    normalize_into_reference,
    normalize_unit_into,
    normalize_unit_into_reference,
)
from shardmuon.ops.normalize import _normalize_without_sync, normalize_without_sync

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cases(seed: int):
    """(X, eps, out dtype) drawn at random: shapes, dtypes, views, scales, non-finite."""
    gen = torch.Generator().manual_seed(seed)
    for k in range(24):
        batch, rows, cols = (int(v) for v in torch.randint(1, 9, (3,), generator=gen))
        rows, cols = rows * 5, cols * 7
        X = torch.randn(batch, rows, cols, generator=gen, dtype=torch.float64)
        scales = torch.tensor([1e-40, 1e-20, 1e-3, 1.0, 1e20, 1e37])
        X = X * scales[torch.randint(0, len(scales), (batch, 1, 1), generator=gen)]
        if k % 3 == 0:
            X[0] = 0.0  # an expert without tokens
        if k % 4 == 1:
            X[-1, 0, 0] = float(["nan", "inf", "-inf"][k % 3])
        dtype = DTYPES[k % 3]
        X = X.to(dtype)
        if k % 2:
            X = X.mT.contiguous().mT  # a strided view, as a tall matrix turned wide
        eps = [1e-8, 0.0, 1e-3, 1e-30, 1e30, 1e39][k % 6]  # the last two: prescale * eps overflows
        yield X, eps, DTYPES[(k // 3) % 3]


def test_the_reference_is_normalize_without_sync_and_the_fake_runs_on_meta() -> None:
    for X, eps, out_dtype in _cases(0):
        want = normalize_without_sync(X, eps, torch.empty(X.shape, dtype=out_dtype))
        out = torch.empty(X.shape, dtype=out_dtype)
        flags = torch.empty(X.size(0), dtype=torch.bool)
        normalize_into_reference(
            X, torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64), eps, out, flags
        )
        same_nan = out.isnan() & want.X.isnan()
        assert torch.equal(
            out.masked_fill(same_nan, 0).view(torch.uint8),
            want.X.masked_fill(same_nan, 0).view(torch.uint8),
        )
        assert torch.equal(flags, want.nonfinite)
    meta = torch.empty(3, 4, 5, device="meta")
    normalize_into(meta, torch.empty(3, device="meta", dtype=torch.float64), 1e-8, meta,
                   torch.empty(3, device="meta", dtype=torch.bool))  # fmt: skip


PROGRAM = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_fused_normalize import _cases
    from shardmuon.ops.fused_normalize import launch
    from shardmuon.ops.normalize import normalize_without_sync

    checked = 0
    for seed in (1, 2):
        for X, eps, out_dtype in _cases(seed):
            want = normalize_without_sync(X, eps, torch.empty(X.shape, dtype=out_dtype))
            out = torch.full(X.shape, 7.0, dtype=out_dtype)
            flags = torch.ones(X.size(0), dtype=torch.bool)
            norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
            launch(X, norm, eps, out, flags)
            same_nan = out.isnan() & want.X.isnan()  # NaN payloads differ by platform
            if not torch.equal(out.masked_fill(same_nan, 0).view(torch.uint8),
                               want.X.masked_fill(same_nan, 0).view(torch.uint8)):
                bad = (out.float() != want.X.float()) & ~(out.isnan() & want.X.isnan())
                sys.exit(f"{{X.dtype}}->{{out_dtype}} {{tuple(X.shape)}} eps={{eps}}: "
                         f"{{int(bad.sum())}} elements differ, e.g. {{out[bad][:3]}} vs {{want.X[bad][:3]}}")
            if not torch.equal(flags, want.nonfinite):
                sys.exit(f"flags {{flags}} vs {{want.nonfinite}}")
            checked += 1
    # in place, as the engines call it on a contiguous X of the iteration's dtype
    X = torch.randn(3, 40, 56).bfloat16()
    want = normalize_without_sync(X.clone(), 1e-8, torch.empty(X.shape, dtype=torch.bfloat16))
    flags = torch.empty(3, dtype=torch.bool)
    launch(X, torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64), 1e-8, X, flags)
    assert torch.equal(X, want.X)
    print("checked", checked)
    """
)


def test_the_triton_kernel_gives_the_torch_ops_bits_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("triton")
    stdout = run_interpreted(PROGRAM.format(tests=os.path.dirname(__file__)), tmp_path)
    assert "checked 48" in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_kernel_gives_the_torch_ops_bits() -> None:
    pytest.importorskip("triton")
    from shardmuon.ops.fused_normalize import launch

    for X, eps, out_dtype in _cases(3):
        X = X.cuda()
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
        want = torch.empty(X.shape, dtype=out_dtype, device="cuda")
        want_flags = torch.empty(X.size(0), dtype=torch.bool, device="cuda")
        normalize_into_reference(X, norm, eps, want, want_flags)
        out = torch.empty_like(want)
        flags = torch.empty_like(want_flags)
        launch(X, norm, eps, out, flags)
        same_nan = out.isnan() & want.isnan()
        assert torch.equal(out.masked_fill(same_nan, 0), want.masked_fill(same_nan, 0))
        assert torch.equal(flags, want_flags)


def test_a_kernel_that_fails_falls_back_to_the_torch_ops_once_and_for_all(monkeypatch) -> None:
    """A GPU Triton cannot compile for: a warning, the torch ops (the same bits), and no
    further attempt in the process."""
    pytest.importorskip("triton")
    from shardmuon.ops import fused_normalize

    monkeypatch.setattr(fused_normalize, "_DISABLED", [])
    ran = []

    def failing() -> None:
        raise RuntimeError("no kernel image is available for execution on the device")

    with pytest.warns(RuntimeWarning, match="the torch ops run instead"):
        fused_normalize.run_or_fall_back(failing, lambda: ran.append("reference"))
    assert ran == ["reference"]
    assert not fused_normalize.kernels_enabled()
    assert not fused_normalize.fused_normalize_available(torch.device("meta"))
    fused_normalize.run_or_fall_back(lambda: ran.append("kernel"), lambda: ran.append("ref"))
    assert ran == ["reference", "ref"]


def _unit_torch_ops(X, eps, out_dtype):
    """AOL's normalisation by the torch ops the kernel replaces (the branch without Triton)."""
    (out, flags), floor = _normalize_without_sync(
        X, eps, torch.empty(X.shape, dtype=out_dtype), unit=True
    )
    return out, flags, floor


def test_the_unit_reference_is_the_torch_ops_and_the_fake_runs_on_meta() -> None:
    """AOL's variant (``X / ||X||`` and the floor ``||X|| / (||X|| + eps)``)."""
    for X, eps, out_dtype in _cases(4):
        want, want_flags, want_floor = _unit_torch_ops(X, eps, out_dtype)
        out = torch.empty(X.shape, dtype=out_dtype)
        flags = torch.empty(X.size(0), dtype=torch.bool)
        floor = torch.empty(X.size(0))
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
        normalize_unit_into_reference(X, norm, eps, out, flags, floor)
        assert same_bits(out, want) and same_bits(floor, want_floor)
        assert torch.equal(flags, want_flags)
        assert not out[~flags].isnan().any()  # a zero matrix stays zero (no 0 / 0)
    meta = torch.empty(3, 4, 5, device="meta")
    normalize_unit_into(meta, torch.empty(3, device="meta", dtype=torch.float64), 1e-8, meta,
                        torch.empty(3, device="meta", dtype=torch.bool),
                        torch.empty(3, device="meta"))  # fmt: skip


UNIT_PROGRAM = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from checks import same_bits
    from test_fused_normalize import _cases, _unit_torch_ops
    from shardmuon.ops.fused_normalize import launch

    checked = 0
    for seed in (5, 6):
        for X, eps, out_dtype in _cases(seed):
            want, want_flags, want_floor = _unit_torch_ops(X, eps, out_dtype)
            out = torch.full(X.shape, 7.0, dtype=out_dtype)
            flags = torch.ones(X.size(0), dtype=torch.bool)
            floor = torch.full((X.size(0),), 7.0)
            norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
            launch(X, norm, eps, out, flags, floor)
            if not (same_bits(out, want) and same_bits(floor, want_floor)):
                sys.exit(f"{{X.dtype}}->{{out_dtype}} {{tuple(X.shape)}} eps={{eps}}: "
                         f"floor {{floor}} vs {{want_floor}}")
            if not torch.equal(flags, want_flags):
                sys.exit(f"flags {{flags}} vs {{want_flags}}")
            checked += 1
    print("checked", checked)
    """
)


def test_the_unit_kernel_gives_the_torch_ops_bits_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("triton")
    stdout = run_interpreted(UNIT_PROGRAM.format(tests=os.path.dirname(__file__)), tmp_path)
    assert "checked 48" in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_unit_kernel_gives_the_torch_ops_bits() -> None:
    pytest.importorskip("triton")
    from shardmuon.ops.fused_normalize import launch

    for X, eps, out_dtype in _cases(7):
        X = X.cuda()
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
        want = torch.empty(X.shape, dtype=out_dtype, device="cuda")
        want_flags = torch.empty(X.size(0), dtype=torch.bool, device="cuda")
        want_floor = torch.empty(X.size(0), device="cuda")
        normalize_unit_into_reference(X, norm, eps, want, want_flags, want_floor)
        out, flags, floor = (
            torch.empty_like(want),
            torch.empty_like(want_flags),
            torch.empty_like(want_floor),
        )
        launch(X, norm, eps, out, flags, floor)
        assert same_bits(out, want) and same_bits(floor, want_floor)
        assert torch.equal(flags, want_flags)
