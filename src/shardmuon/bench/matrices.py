"""Test matrices for Newton–Schulz accuracy: Gaussian, log-spaced spectrum, low rank plus
noise, and the error measure used on them.

``make_input`` is the one-matrix CPU form (``scripts/gram_error.py`` and the tests);
``make_inputs`` builds a batch of a shape on any device (``shardmuon bench ns``), the same
kinds with the same spectra.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["INPUT_KINDS", "make_input", "make_inputs", "relative_error"]

INPUT_KINDS: tuple[str, ...] = ("gaussian", "logspaced", "lowrank")
# Log-spaced singular values span 1e-4..1; low rank is m/8 unit singular values plus noise
# of this size per entry.
_LOG_SPAN = 4.0
_NOISE = 1e-3


def _check_kind(kind: str) -> None:
    if kind not in INPUT_KINDS:
        raise ValueError(f"unknown input kind {kind!r}; accepted: {', '.join(INPUT_KINDS)}")


def _spectrum(kind: str, m: int, device: torch.device | str) -> Tensor:
    if kind == "logspaced":
        return torch.logspace(-_LOG_SPAN, 0, m, dtype=torch.float64, device=device)
    s = torch.zeros(m, dtype=torch.float64, device=device)
    s[: max(1, m // 8)] = 1.0
    return s


def make_input(kind: str, m: int, n: int, seed: int) -> Tensor:
    """One float64 ``[m, n]`` matrix (``m <= n``) of ``kind``, from a CPU generator."""
    _check_kind(kind)
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(m, n, generator=g, dtype=torch.float64)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    out = u @ torch.diag(_spectrum(kind, m, "cpu")) @ v.T
    if kind == "lowrank":
        out = out + _NOISE * torch.randn(m, n, generator=g, dtype=torch.float64)
    return out


def make_inputs(
    kind: str, shape: Sequence[int], seed: int, device: torch.device | str = "cpu"
) -> Tensor:
    """A float64 batch of ``shape`` (``[..., rows, cols]``, either side the short one) of
    ``kind``, generated on ``device`` (QR on the device too: large shapes stay fast)."""
    _check_kind(kind)
    *batch, rows, cols = (int(d) for d in shape)
    m, n = min(rows, cols), max(rows, cols)
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*dims: int) -> Tensor:
        return torch.randn(*batch, *dims, generator=g, dtype=torch.float64, device=device)

    if kind == "gaussian":
        out = normal(m, n)
    else:
        u, _ = torch.linalg.qr(normal(m, m))
        v, _ = torch.linalg.qr(normal(n, m))
        out = (u * _spectrum(kind, m, device)) @ v.mT
        if kind == "lowrank":
            out = out + _NOISE * normal(m, n)
    return out if rows <= cols else out.mT


def relative_error(out: Tensor, ref: Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in float64; ``inf`` when ``out`` is not finite."""
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm())
