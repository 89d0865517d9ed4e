"""The fused decay-and-update kernel (``ops/fused_update.py``) gives ``weight_update_``'s bits:
the Triton kernel under Triton's interpreter on a CPU (a fresh process) on random fp32
parameters (strided row ranges included), bf16/fp32/fp16 results, decayed or not; the custom
op's torch implementation is ``weight_update_``'s own sequence."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

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
    program = tmp_path / "interpret.py"
    program.write_text(PROGRAM.format(tests=os.path.dirname(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "checked 36" in done.stdout


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
