"""The fused momentum-and-direction pass (``ops/fused_momentum.py``): its torch reference is
the step's own ops (``momentum_update_``, ``direction``, the bf16 cast), and the Triton
kernel gives the reference's bits under Triton's interpreter on a CPU, on random inputs:
fp32/bf16/fp16 grads (strided too), Nesterov or not, several ``mu``, scales up to overflow,
NaN and inf; the fake runs on meta tensors."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from checks import same_bits
from triton_interpreter import run_interpreted

from shardmuon.ops.fused_momentum import (
    momentum_direction_into,
    momentum_direction_into_reference,
)
from shardmuon.ops.update import direction, momentum_update_


def _cases(seed: int):
    gen = torch.Generator().manual_seed(seed)
    for k in range(24):
        batch, rows, cols = (int(v) for v in torch.randint(1, 6, (3,), generator=gen))
        rows, cols = rows * 3, cols * 7
        scale = [1e-30, 1e-3, 1.0, 1e3, 1e37][k % 5]
        M = torch.randn(batch, rows, cols, generator=gen) * scale
        G = (torch.randn(batch, rows, cols, generator=gen) * scale).to(
            (torch.float32, torch.bfloat16, torch.float16)[k % 3]
        )
        if k % 4 == 1:
            G[0, 0, 0] = float(["nan", "inf", "-inf"][k % 3])
        if k % 5 == 3:
            G = G.mT.contiguous().mT
        yield M, G, [0.95, 0.9, 0.0, 0.5][k % 4], bool(k % 2)


def test_the_reference_is_the_steps_own_ops_and_the_fake_runs_on_meta() -> None:
    for M, G, mu, nesterov in _cases(0):
        want_M = M.clone()
        momentum_update_(want_M, G, mu)
        want_D = direction(want_M, G, mu, nesterov).to(torch.bfloat16)
        D = torch.empty(M.shape, dtype=torch.bfloat16)
        momentum_direction_into_reference(M, G, mu, nesterov, D)
        assert same_bits(M, want_M) and same_bits(D, want_D)
    meta = torch.empty(2, 3, 4, device="meta")
    momentum_direction_into(meta, meta, 0.9, True, meta.to(torch.bfloat16))


PROGRAM = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from checks import same_bits
    from test_fused_momentum import _cases
    from shardmuon.ops.fused_momentum import launch, momentum_direction_into_reference

    checked = 0
    for seed in (1, 2):
        for M, G, mu, nesterov in _cases(seed):
            want_M, want_D = M.clone(), torch.empty(M.shape, dtype=torch.bfloat16)
            momentum_direction_into_reference(want_M, G, mu, nesterov, want_D)
            D = torch.full(M.shape, 7.0, dtype=torch.bfloat16)
            launch(M, G, mu, nesterov, D)
            if not (same_bits(M, want_M) and same_bits(D, want_D)):
                sys.exit(f"{{G.dtype}} {{tuple(M.shape)}} mu={{mu}} nesterov={{nesterov}}")
            checked += 1
    print("checked", checked)
    """
)


def test_the_kernel_gives_the_torch_ops_bits_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("triton")
    stdout = run_interpreted(PROGRAM.format(tests=os.path.dirname(__file__)), tmp_path)
    assert "checked 48" in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_kernel_gives_the_torch_ops_bits() -> None:
    pytest.importorskip("triton")
    from shardmuon.ops.fused_momentum import launch

    for M, G, mu, nesterov in _cases(3):
        M, G = M.cuda(), G.cuda()
        want_M, want_D = M.clone(), torch.empty(M.shape, dtype=torch.bfloat16, device="cuda")
        momentum_direction_into_reference(want_M, G, mu, nesterov, want_D)
        D = torch.empty_like(want_D)
        launch(M, G, mu, nesterov, D)
        assert same_bits(M, want_M) and same_bits(D, want_D)
