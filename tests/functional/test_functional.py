"""``shardmuon.functional.muon_update_`` against the optimizer (bitwise) and against an fp64
transcription of its documented math."""

from __future__ import annotations

import pytest
import torch

from shardmuon import Muon
from shardmuon.functional import muon_update_
from shardmuon.ops.newton_schulz import newton_schulz_reference, resolve_coefficients
from shardmuon.ops.update import lr_scale


def _random_params(seed: int, shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(3)]
    return params, grads


SHAPE_SETS = [
    [(32, 48), (8, 24, 16), (40, 40)],  # distinct shapes: one call per parameter either way
    [(16, 64), (16, 64), (3, 16, 64), (64, 16)],  # shared shapes: Muon stacks them
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shapes", range(len(SHAPE_SETS)))
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm", None])
def test_the_functional_step_equals_the_optimizer_bitwise(seed, shapes, nesterov, adjust_lr):
    shapes = SHAPE_SETS[shapes]
    # Folded is exact to Muon where Muon batches as the functional does (one call per
    # parameter); per-matrix wherever Muon stacks parameters together.
    impl = "folded" if shapes is SHAPE_SETS[0] else "per-matrix"
    params, grads = _random_params(seed, shapes)
    mine = [p.clone() for p in params]
    momenta = [torch.zeros_like(p) for p in params]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = Muon(
        ref, lr=0.02, mu=0.9, nesterov=nesterov, weight_decay=0.1, adjust_lr=adjust_lr,
        newton_schulz_impl=impl,
    )  # fmt: skip
    for step_grads in grads:
        for p, g in zip(ref, step_grads):
            p.grad = g.clone()
        opt.step()
        muon_update_(
            mine, step_grads, momenta, lr=0.02, mu=0.9, nesterov=nesterov, weight_decay=0.1,
            adjust_lr=adjust_lr, newton_schulz_impl=impl,
        )  # fmt: skip
    for p, q, m in zip(mine, ref, momenta):
        assert torch.equal(p, q.detach())
        assert torch.equal(m, opt.state[q]["momentum"])


@pytest.mark.parametrize("seed", range(4))
def test_the_functional_step_is_its_documented_math(seed: int) -> None:
    """fp32 iteration against the formulas in fp64 (the NS reference in fp64)."""
    shapes = [(24, 40), (2, 30, 12)]
    params, grads = _random_params(seed, shapes)
    mine = [p.clone() for p in params]
    momenta = [torch.zeros_like(p) for p in params]
    lr, mu, wd = 0.05, 0.8, 0.2
    expect = [p.double() for p in params]
    moms = [torch.zeros_like(p) for p in expect]
    coeffs = resolve_coefficients(None)
    for step_grads in grads:
        muon_update_(
            mine, step_grads, momenta, lr=lr, mu=mu, nesterov=True, weight_decay=wd,
            newton_schulz_dtype="float32",
        )  # fmt: skip
        for k, g in enumerate(step_grads):
            moms[k] = mu * moms[k] + g.double()
            U = (mu * moms[k] + g.double()).reshape(-1, *g.shape[-2:])
            U = U / (torch.linalg.matrix_norm(U, keepdim=True) + 1e-8)
            ortho = newton_schulz_reference(U, coeffs).reshape(g.shape)
            scale = lr_scale(g.shape[-2], g.shape[-1], "spectral_norm", 0.2)
            expect[k] = expect[k] * (1 - lr * wd) - lr * scale * ortho
    for p, e in zip(mine, expect):
        # the bf16 rounding of the direction bounds the agreement
        assert torch.allclose(p.double(), e, atol=3e-3, rtol=0), (p.double() - e).abs().max()
    for m, e in zip(momenta, moms):
        assert torch.allclose(m.double(), e, atol=1e-5)


def test_bad_input_is_refused_naming_it() -> None:
    p = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="one grad and one momentum per parameter"):
        muon_update_([p], [], [p.clone()], lr=0.1)
    with pytest.raises(ValueError, match=r"parameter 0 must have at least 2 dims.*\(4,\)"):
        muon_update_([torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4)], lr=0.1)
    with pytest.raises(ValueError, match="newton_schulz_impl must be one of"):
        muon_update_([p], [p.clone()], [p.clone()], lr=0.1, newton_schulz_impl="fast")
