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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_new_kernels_run_on_the_callers_stream_and_device() -> None:
    """A side stream whose earlier work is delayed (``torch.cuda._sleep``) then writes the
    inputs: the momentum, Gram-ready, unit-normalisation and AOL kernels launched on that
    stream read what it wrote, not what was there (a launch on another stream or device
    would race the write), and give the torch ops' bits."""
    pytest.importorskip("triton")
    from shardmuon.ops.fused_aol import (
        aol_fold_,
        aol_fold_reference,
        aol_scale_gram_,
        aol_scale_gram_reference,
    )
    from shardmuon.ops.fused_normalize import (
        gram_ready_into,
        gram_ready_reference,
        normalize_unit_into,
        normalize_unit_into_reference,
    )

    device = torch.device("cuda", torch.cuda.device_count() - 1)  # not the current one if 2+
    gen = torch.Generator(device=device).manual_seed(0)

    def fresh(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    M, G = torch.zeros(3, 32, 48, device=device), torch.zeros(3, 32, 48, device=device)
    A, B = torch.zeros(3, 32, 32, device=device).bfloat16(), torch.zeros(3, 32, 32, device=device)
    new = {"M": fresh(3, 32, 48), "G": fresh(3, 32, 48), "A": fresh(3, 32, 32).bfloat16(),
           "B": fresh(3, 32, 32)}  # fmt: skip
    d = torch.rand(3, 32, generator=gen, device=device) + 0.5
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms before the writes
        for target, name in ((M, "M"), (G, "G"), (A, "A"), (B, "B")):
            target.copy_(new[name])
        D = torch.empty(M.shape, dtype=torch.bfloat16, device=device)
        momentum_direction_into(M, G, 0.9, True, D)
        norm = torch.linalg.vector_norm(D, dim=(-2, -1), dtype=torch.float64)
        ready, flags, floor = (
            D.clone(),
            torch.empty(3, dtype=torch.bool, device=device),
            d[:, 0].clone(),
        )
        gram_ready_into(ready, norm, 1e-8, ready, flags, floor)
        unit, unit_flags, unit_floor = (
            torch.empty_like(D),
            torch.empty_like(flags),
            torch.empty_like(floor),
        )
        normalize_unit_into(D, norm, 1e-8, unit, unit_flags, unit_floor)
        aol_scale_gram_(A, d)
        aol_fold_(B, d, 3.4)
    side.synchronize()
    want_M, want_D = new["M"].clone(), torch.empty_like(D)
    momentum_direction_into_reference(want_M, new["G"], 0.9, True, want_D)
    assert same_bits(M, want_M) and same_bits(D, want_D)
    want_ready, want_flags, want_floor = (
        want_D.clone(),
        torch.empty_like(flags),
        torch.empty_like(floor),
    )
    gram_ready_reference(want_ready, norm, 1e-8, want_ready, want_flags, want_floor)
    assert same_bits(ready, want_ready) and same_bits(floor, want_floor)
    assert torch.equal(flags, want_flags)
    want_unit, want_unit_flags, want_unit_floor = (
        torch.empty_like(D),
        torch.empty_like(flags),
        torch.empty_like(floor),
    )
    normalize_unit_into_reference(want_D, norm, 1e-8, want_unit, want_unit_flags, want_unit_floor)
    assert same_bits(unit, want_unit) and same_bits(unit_floor, want_unit_floor)
    want_A, want_B = new["A"].clone(), new["B"].clone()
    aol_scale_gram_reference(want_A, d)
    aol_fold_reference(want_B, d, 3.4)
    assert same_bits(A, want_A) and same_bits(B, want_B)
