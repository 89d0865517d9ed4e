"""The fused decay-and-update kernel (``ops/fused_update.py``) gives ``weight_update_``'s bits:
the Triton kernel under Triton's interpreter on a CPU (a fresh process) on random fp32
parameters (strided row ranges included), bf16/fp32/fp16 results, decayed or not; the custom
op's torch implementation is ``weight_update_``'s own sequence."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from triton_interpreter import run_interpreted

from shardmuon.ops.fused_update import update_into, update_into_reference
from shardmuon.ops.update import weight_update_


def _cases(seed: int):
    gen = torch.Generator().manual_seed(seed)
    for k in range(18):
        batch, rows, cols = (int(v) for v in torch.randint(1, 6, (3,), generator=gen))
        rows, cols = rows * 7, cols * 9
        P = torch.randn(batch, rows, cols, generator=gen) * [1e-3, 1.0, 30.0][k % 3]
        R = torch.randn(batch, rows, cols, generator=gen).to(
            [torch.bfloat16, torch.float32, torch.float16][k % 3]
        )
        lr = [0.02, 3e-4, 0.7][(k // 3) % 3]
        wd = [0.0, 0.1, 0.013][k % 3]
        if k % 2:
            cut = rows // 2
            ranges = [(0, cut, 1.3), (cut, rows, 0.21)]  # a partitioned matrix
        else:
            ranges = [(0, rows, [0.2 * 7.0, 1.0, 0.5][k % 3])]
        yield P, R, lr, wd, ranges


def test_the_reference_is_weight_update_and_the_fake_runs_on_meta() -> None:
    for P, R, lr, wd, ranges in _cases(0):
        want = P.clone()
        weight_update_(want, R, lr, wd, ranges)
        decay = 1.0 - lr * wd if wd else 1.0
        for start, end, scale in ranges:
            update_into_reference(P[..., start:end, :], R[..., start:end, :], -lr * scale, decay)
        assert torch.equal(P, want)
    meta = torch.empty(2, 3, 4, device="meta")
    update_into(meta, meta, -0.1, 0.99)


PROGRAM = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_fused_update import _cases
    from shardmuon.ops.fused_update import launch
    from shardmuon.ops.update import weight_update_

    checked = 0
    for seed in (1, 2):
        for P, R, lr, wd, ranges in _cases(seed):
            want = P.clone()
            weight_update_(want, R, lr, wd, ranges)
            decay = 1.0 - lr * wd if wd else 1.0
            for start, end, scale in ranges:
                launch(P[..., start:end, :], R[..., start:end, :], -lr * scale, decay)
            if not torch.equal(P, want):
                bad = P != want
                sys.exit(f"{{R.dtype}} {{tuple(P.shape)}} lr={{lr}} wd={{wd}} {{ranges}}: "
                         f"{{int(bad.sum())}} differ, e.g. {{P[bad][:3]}} vs {{want[bad][:3]}}")
            checked += 1
    print("checked", checked)
    """
)


def test_the_triton_kernel_gives_weight_update_bits_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("triton")
    stdout = run_interpreted(PROGRAM.format(tests=os.path.dirname(__file__)), tmp_path)
    assert "checked 36" in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_kernel_gives_the_torch_ops_bits() -> None:
    pytest.importorskip("triton")
    from shardmuon.ops.fused_update import launch

    for P, R, lr, wd, ranges in _cases(3):
        P, R = P.cuda(), R.cuda()
        want = P.clone()
        decay = 1.0 - lr * wd if wd else 1.0
        for start, end, scale in ranges:
            update_into_reference(want[..., start:end, :], R[..., start:end, :], -lr * scale, decay)
            launch(P[..., start:end, :], R[..., start:end, :], -lr * scale, decay)
        assert torch.equal(P, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_both_kernels_run_on_the_callers_stream_and_device() -> None:
    """A side stream whose earlier work is delayed (``torch.cuda._sleep``) then writes the
    inputs: the kernels launched on that stream read what it wrote, not what was there (a
    launch on another stream or device would race the write), and give the torch ops' bits."""
    pytest.importorskip("triton")
    from shardmuon.ops.fused_normalize import normalize_into, normalize_into_reference

    device = torch.device("cuda", torch.cuda.device_count() - 1)  # not the current one if 2+
    X = torch.zeros(4, 64, 96, device=device, dtype=torch.bfloat16)
    P = torch.zeros(4, 64, 96, device=device)
    fresh_x = torch.randn(4, 64, 96, device=device).bfloat16()
    fresh_p = torch.randn(4, 64, 96, device=device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms before the writes
        X.copy_(fresh_x)
        P.copy_(fresh_p)
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float64)
        out = torch.empty_like(X)
        flags = torch.empty(4, dtype=torch.bool, device=device)
        normalize_into(X, norm, 1e-8, out, flags)
        update_into(P, out, -0.02, 0.999)
    side.synchronize()
    want_out = torch.empty_like(out)
    want_flags = torch.empty_like(flags)
    normalize_into_reference(fresh_x, norm, 1e-8, want_out, want_flags)
    want_p = fresh_p.clone()
    update_into_reference(want_p, want_out, -0.02, 0.999)
    assert torch.equal(out, want_out) and torch.equal(flags, want_flags)
    assert torch.equal(P, want_p)
