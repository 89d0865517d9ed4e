"""AOL's two ``m x m`` passes as Triton kernels (``ops/fused_aol.py``): the references are
the torch ops they replace, and the kernels give their bits under Triton's interpreter on a
CPU: bf16 and fp32 Gram-sized matrices, scales from subnormal to huge, NaN and inf, several
``a``; the fakes run on meta tensors."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from checks import same_bits
from triton_interpreter import run_interpreted

from shardmuon.ops.fused_aol import (
    aol_fold_,
    aol_fold_reference,
    aol_scale_gram_,
    aol_scale_gram_reference,
    fused_aol_supported,
)


def _cases(seed: int):
    gen = torch.Generator().manual_seed(seed)
    for k in range(16):
        batch, m = (
            int(torch.randint(1, 4, (1,), generator=gen)),
            int(torch.randint(1, 40, (1,), generator=gen)),
        )
        M = torch.randn(batch, m, m, generator=gen) * [1e-30, 1.0, 1e20][k % 3]
        d = torch.rand(batch, m, generator=gen) * [1e-10, 1.0, 1e10][k % 3]
        if k % 5 == 1:
            M[0, 0, -1] = float(["nan", "inf"][k % 2])
        yield M.to((torch.bfloat16, torch.float32)[k % 2]), d, [3.4, -4.7, 0.0, 2.0][k % 4]


def test_the_references_are_the_torch_ops_and_the_fakes_run_on_meta() -> None:
    for M, d, a in _cases(0):
        want = M.float() * (d.unsqueeze(-1) * d.unsqueeze(-2))
        got = M.clone()
        aol_scale_gram_reference(got, d)
        assert same_bits(got, want.to(M.dtype))
        wide = M.to(torch.float32, copy=True)
        wide.diagonal(dim1=-2, dim2=-1).add_(a)
        got = M.clone()
        aol_fold_reference(got, d, a)
        assert same_bits(got, (wide * d.unsqueeze(-2)).to(M.dtype))
    assert fused_aol_supported(torch.empty(2, 3, 3, dtype=torch.bfloat16))
    assert not fused_aol_supported(torch.empty(2, 3, 3, dtype=torch.float16))
    assert not fused_aol_supported(torch.empty(2, 3, 3).mT)
    meta, scales = torch.empty(2, 3, 3, device="meta"), torch.empty(2, 3, device="meta")
    aol_scale_gram_(meta, scales)
    aol_fold_(meta, scales, 1.0)


def _kernel_and_reference(M: torch.Tensor, d: torch.Tensor, a: float, fold: bool):
    """The kernel's result and the torch ops' on copies of ``M`` (``fold``: ``(M + a I) D``,
    else ``D M D``)."""
    from shardmuon.ops.fused_aol import launch

    want, got = M.clone(), M.clone()
    if fold:
        aol_fold_reference(want, d, a)
    else:
        aol_scale_gram_reference(want, d)
    launch(got, d, a if fold else None)
    return got, want


PROGRAM = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from checks import same_bits
    from test_fused_aol import _cases, _kernel_and_reference

    checked = 0
    for seed in (1, 2):
        for M, d, a in _cases(seed):
            for fold in (False, True):
                if not same_bits(*_kernel_and_reference(M, d, a, fold)):
                    sys.exit(f"{{M.dtype}} {{tuple(M.shape)}} fold={{fold}} a={{a}}")
                checked += 1
    print("checked", checked)
    """
)


def test_the_kernels_give_the_torch_ops_bits_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("triton")
    stdout = run_interpreted(PROGRAM.format(tests=os.path.dirname(__file__)), tmp_path)
    assert "checked 64" in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_kernels_give_the_torch_ops_bits() -> None:
    pytest.importorskip("triton")
    for M, d, a in _cases(3):
        for fold in (False, True):
            assert same_bits(*_kernel_and_reference(M.cuda(), d.cuda(), a, fold))
