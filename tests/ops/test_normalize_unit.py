"""``ops.normalize.normalize_unit``, AOL's normalisation: ``X / ||X||`` and the eps floor
``||X|| / (||X|| + eps)`` against fp64 written out, on both branches (the CPU's and the
accelerator's fp64-norm branch, run here on CPU tensors), at every scale: the unit matrix
must be O(1) however small ``X`` is (its Gram matrix is AOL's row sums), a zero matrix stays
zero with floor 0, and a non-finite one is zeroed and flagged with floor 0 (a NaN floor
would turn its zero rows into NaN in ``aol_rescale_``)."""

from __future__ import annotations

import pytest
import torch

from shardmuon.ops import normalize as normalize_module
from shardmuon.ops.normalize import normalize, normalize_unit

BRANCHES = ["cpu-branch", "accelerator-branch"]


def _unit(X: torch.Tensor, eps: float, dtype: torch.dtype, branch: str):
    if branch == "cpu-branch":
        return normalize_unit(X, eps, dtype)
    out = torch.empty(X.shape, dtype=dtype)
    # The branch a CUDA tensor takes, run on CPU tensors.
    return normalize_module._normalize_without_sync(X, eps, out, unit=True)


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_unit_matrix_and_the_floor_at_every_scale(branch, dtype) -> None:
    base = torch.randn(3, 6, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for scale in (1e-45, 1e-38, 1e-30, 1e-11, 1e-8, 1.0, 1e20, 1e38):
        X = (base * scale).float()  # 1e-45: fp32 subnormals
        (unit, nonfinite), floor = _unit(X, 1e-8, dtype, branch)
        norm = X.double().norm(dim=(-2, -1))
        assert not nonfinite.any() and unit.dtype == dtype and floor.dtype == torch.float32
        want = (X.double() / norm[:, None, None]).to(dtype)
        # the quotient rounded once or twice (fp32 then dtype): within one ulp of dtype
        ulp = torch.finfo(dtype).eps
        assert (unit.double() - want.double()).abs().max() <= 2 * ulp, scale
        torch.testing.assert_close(floor.double(), norm / (norm + 1e-8), rtol=1e-6, atol=0)


@pytest.mark.parametrize("branch", BRANCHES)
def test_the_product_is_what_normalize_gives(branch) -> None:
    """``unit * floor`` is :func:`normalize`'s ``X / (||X|| + eps)`` (to fp32 rounding)."""
    X = torch.randn(4, 8, 12, generator=torch.Generator().manual_seed(1)) * 3e-9
    (unit, _), floor = _unit(X, 1e-8, torch.float32, branch)
    plain = normalize(X, 1e-8, torch.float32).X
    torch.testing.assert_close(unit * floor[:, None, None], plain, rtol=1e-6, atol=0)


@pytest.mark.parametrize("aliased", [False, True], ids=["new-output", "in-place"])
@pytest.mark.parametrize("branch", BRANCHES)
def test_zero_and_non_finite_matrices(branch, aliased) -> None:
    X = torch.randn(4, 5, 7, generator=torch.Generator().manual_seed(2))
    X[1] = 0.0
    X[2, 1, 3] = float("nan")
    X[3, 0, 0] = float("inf")
    if branch == "cpu-branch" and aliased:
        (unit, nonfinite), floor = normalize_unit(X, 1e-8, torch.float32, out=X)
        assert unit is X
    else:
        (unit, nonfinite), floor = _unit(X.clone(), 1e-8, torch.float32, branch)
    assert nonfinite.tolist() == [False, False, True, True]
    assert torch.isfinite(unit).all() and torch.isfinite(floor).all()
    assert not unit[1:].any() and floor[1:].tolist() == [0.0, 0.0, 0.0]
    assert 0.99 < float(floor[0]) <= 1.0


def test_a_zero_norm_takes_the_rare_path_on_a_cpu() -> None:
    """Entries of 1e-30 square to 0 in fp32: the plain norm is 0. ``normalize`` may divide by
    ``eps`` alone there (the same quotient); the unit matrix needs the true norm."""
    X = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(3)) * 1e-30
    assert torch.linalg.vector_norm(X[0]) == 0  # what the plain path would see
    (unit, _), floor = normalize_unit(X, 1e-8, torch.float32)
    norm = X.double().norm(dim=(-2, -1))
    torch.testing.assert_close(unit.double(), X.double() / norm[:, None, None])
    torch.testing.assert_close(floor.double(), norm / (norm + 1e-8), rtol=1e-6, atol=0)


@pytest.mark.parametrize("branch", BRANCHES)
def test_a_zero_matrix_with_eps_zero_has_floor_zero(branch) -> None:
    """The engines take ``eps=0`` (the optimizer does not): ``0 / (0 + 0)`` must not make
    the floor NaN, which ``aol_rescale_`` would spread over the zero rows."""
    X = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(4))
    X[0] = 0.0
    (unit, nonfinite), floor = _unit(X, 0.0, torch.float32, branch)
    assert not nonfinite.any() and not unit[0].any() and floor.tolist() == [0.0, 1.0]
