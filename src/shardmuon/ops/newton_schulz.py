"""Newton–Schulz orthogonalization: the pure math, on plain tensors.

``newton_schulz`` maps a batch of matrices ``G[..., m, n]`` to an approximation of the
orthogonal polar factor ``U V^T`` of each matrix (its singular values pushed towards 1)
with a quintic iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``.

Precision: the iteration runs in bfloat16 on ``[..., min, max]`` matrices (tall ones
are transposed so that the Gram matrix ``A`` is the small one). Each line of the
iteration is one GEMM with the scale-and-add folded in (``baddbmm``), so each line
rounds to bf16 once instead of three times (``A @ A`` rounded, ``c * .`` rounded,
``+ b A`` rounded). The Frobenius normalisation is computed in float32. Together this
roughly halves the distance to an fp64 iteration with the same coefficients
(see ``docs/benchmarks.md``).

``newton_schulz_unfolded`` is the textbook bf16 recipe (dion's), kept for the benchmark
and for tests; ``newton_schulz_reference`` is the float64 reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "NS_PRESETS",
    "POLAR_EXPRESS_PAPER",
    "POLAR_EXPRESS_SAFETY",
    "Coefficients",
    "newton_schulz",
    "newton_schulz_compiled",
    "newton_schulz_per_matrix",
    "newton_schulz_reference",
    "newton_schulz_unfolded",
    "normalized",
    "resolve_coefficients",
    "with_input_scaled",
]

Coefficients = tuple[tuple[float, float, float], ...]

# dion's quintic schedule (microsoft/dion, dion/newton_schulz_triton.py
# zeropower_via_newtonschulz5; samsja/dion@3c4bce5 dion/muon.py), one triple per iteration.
_DION: Coefficients = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
# Keller Jordan's quintic (KellerJordan/Muon, muon.py), repeated 5 times.
_KELLER: Coefficients = ((3.4445, -4.7750, 2.0315),) * 5
# DeepSeek-V4: 8 Keller steps to converge fast, then 2 steps of the cubic-like
# (2, -1.5, 0.5) that pull singular values to 1 (singular values 0.998-1.003 as DeepSeek-V4 reports).
_DEEPSEEK_V4: Coefficients = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
# Polar Express, 5 steps: Amsel, Persson, Musco, Gower, "The Polar Express: Optimal
# Matrix Sign Methods and Their Application to the Muon Algorithm", arXiv:2505.16932
# (2025); the set computed for num_iters=5, safety_factor=2e-2, cushion=2, as shipped
# by microsoft/dion (dion/polar_express.py). Those coefficients assume the input's spectral
# norm is at most 1 with a margin: the reference implementations (microsoft/dion,
# modded-nanogpt) divide by ||X||_F * (1 + 2e-2), not by ||X||_F.
POLAR_EXPRESS_PAPER: Coefficients = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02


def with_input_scaled(coefficients: Coefficients, scale: float) -> Coefficients:
    """The schedule that, on ``X``, computes what ``coefficients`` compute on ``X / scale``.

    The first step ``a X + b X^3 + c X^5`` of ``X / scale`` is ``(a / s) X + (b / s^3) X^3 +
    (c / s^5) X^5``: folding a normalisation factor into the first triple costs nothing at
    run time and leaves the later steps as they are (exact in exact arithmetic; the one
    difference is where ``eps`` sits, ``||X|| s + s eps`` instead of ``||X|| s + eps``).
    """
    (a, b, c), rest = coefficients[0], coefficients[1:]
    return ((a / scale, b / scale**3, c / scale**5), *rest)


NS_PRESETS: dict[str, Coefficients] = {
    "dion": _DION,
    "keller": _KELLER,
    "deepseek-v4": _DEEPSEEK_V4,
    # The paper's schedule with the references' 1.02 normalisation margin folded in.
    "polar-express": with_input_scaled(POLAR_EXPRESS_PAPER, POLAR_EXPRESS_SAFETY),
}
DEFAULT_PRESET = "dion"


def resolve_coefficients(spec: str | Sequence[Sequence[float]] | None) -> Coefficients:
    """Turn a preset name, a list of ``(a, b, c)`` triples or ``None`` into a checked tuple.

    ``None`` means the ``"dion"`` preset. Raises ``ValueError`` for an unknown preset, an
    empty list, an entry that is not a triple, or a non-finite coefficient, and
    ``TypeError`` for a value that is not a string or a sequence.
    """
    if spec is None:
        return NS_PRESETS[DEFAULT_PRESET]
    if isinstance(spec, str):
        if spec not in NS_PRESETS:
            raise ValueError(
                f"unknown Newton-Schulz preset {spec!r}; accepted presets: "
                f"{', '.join(sorted(NS_PRESETS))}, or a list of (a, b, c) triples"
            )
        return NS_PRESETS[spec]
    if isinstance(spec, Tensor) or not isinstance(spec, Sequence):
        raise TypeError(
            "newton_schulz_coefficients must be a preset name or a list of (a, b, c) "
            f"triples, got {type(spec).__name__}"
        )
    if len(spec) == 0:
        raise ValueError(
            "newton_schulz_coefficients is empty; give at least one (a, b, c) triple "
            "or a preset name"
        )
    triples = []
    for i, entry in enumerate(spec):
        if isinstance(entry, str) or not isinstance(entry, Sequence) or len(entry) != 3:
            raise ValueError(
                f"newton_schulz_coefficients[{i}] must be an (a, b, c) triple of numbers, "
                f"got {entry!r}"
            )
        try:
            triple = tuple(float(v) for v in entry)
        except (TypeError, ValueError):
            raise ValueError(
                f"newton_schulz_coefficients[{i}] must hold numbers, got {entry!r}"
            ) from None
        if not all(math.isfinite(v) for v in triple):
            raise ValueError(f"newton_schulz_coefficients[{i}] must be finite, got {triple!r}")
        triples.append(triple)
    return tuple(triples)


def _as_wide(X: Tensor) -> tuple[Tensor, bool]:
    """Return ``X`` with its last two dims ordered ``(min, max)`` and whether it was transposed."""
    transposed = X.size(-2) > X.size(-1)
    return (X.mT if transposed else X), transposed


def _as_batch3d(X: Tensor) -> tuple[Tensor, torch.Size]:
    """View ``[..., m, n]`` as ``[B, m, n]`` (``baddbmm`` takes exactly 3-D)."""
    return X.reshape(-1, X.size(-2), X.size(-1)), X.shape


def _check_matrix(G: Tensor) -> None:
    if G.dim() < 2:
        raise ValueError(
            f"newton_schulz needs a matrix or a batch of matrices [..., m, n], got shape "
            f"{tuple(G.shape)}"
        )


# Elements of one float32 temporary in the normalisation (16 MiB): the fp32 copy of a
# large matrix is never made whole, only this much of it at a time.
NORMALIZE_CHUNK_ELEMENTS = 4 * 2**20


def frobenius_norm_fp32(X: Tensor) -> Tensor:
    """``||X||_F`` of each matrix of ``X[B, m, n]``, in fp32, shape ``[B, 1, 1]``, without
    overflow.

    The sum of squares of a gradient scaled by 1e18 overflows fp32 (and the update would
    silently be zero). Each matrix is scaled by the power of two that brings its largest
    entry into ``[0.5, 1)`` before the reduction and unscaled after: scaling by a power of
    two is exact, so wherever the plain fp32 reduction does not overflow (or underflow)
    the result is the same bits. Takes one fp32 copy of ``X``, as the reduction did.
    """
    largest = torch.linalg.vector_norm(
        X, ord=math.inf, dim=(-2, -1), keepdim=True, dtype=torch.float32
    )
    _, exponent = torch.frexp(largest)
    # 0 (an all-zero matrix) gives exponent 0; the clamp keeps 2^-exponent a normal fp32.
    exponent.clamp_(-120, 120)
    scale = torch.ldexp(torch.ones_like(largest), -exponent)
    scaled = X.to(torch.float32, copy=True).mul_(scale)
    norm = torch.linalg.vector_norm(scaled, dim=(-2, -1), keepdim=True)
    del scaled
    return norm.div_(scale)


def normalized(
    X: Tensor, eps: float, dtype: torch.dtype = torch.bfloat16, out: Tensor | None = None
) -> Tensor:
    """``X / (||X||_F + eps)`` per matrix of ``X[B, m, n]``, computed in fp32, in ``dtype``.

    The norm is reduced in fp32 (bitwise what ``vector_norm(X.float())`` gives); the
    division is element-wise, so doing it in slices of at most
    ``NORMALIZE_CHUNK_ELEMENTS`` elements gives the same bits as doing it whole, while the
    fp32 temporary stays small. Writes into ``out`` (which may be ``X`` itself: each slice
    is read before it is written) or a new contiguous bf16 ``[B, m, n]`` tensor.
    """
    if X.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        X = X.float()  # wider inputs are rounded to fp32 first
    denom = frobenius_norm_fp32(X)
    denom.add_(eps)
    # A matrix with an inf or NaN entry gets a zero direction (its update is skipped, not
    # spread as NaN over the whole matrix; the pipeline counts these).
    nonfinite = ~torch.isfinite(denom)
    if out is None:
        out = torch.empty(X.shape, dtype=dtype, device=X.device)
    batch, rows, cols = X.shape

    def divide_into(target: Tensor, source: Tensor, divisor: Tensor) -> None:
        # One fp32 copy, divided in place (a mixed-dtype div would add a second one).
        target.copy_(source.to(torch.float32, copy=True).div_(divisor))

    if X.numel() <= NORMALIZE_CHUNK_ELEMENTS:
        divide_into(out, X, denom)
    elif rows * cols <= NORMALIZE_CHUNK_ELEMENTS:
        step = NORMALIZE_CHUNK_ELEMENTS // (rows * cols)
        for b in range(0, batch, step):
            divide_into(out[b : b + step], X[b : b + step], denom[b : b + step])
    else:
        step = max(1, NORMALIZE_CHUNK_ELEMENTS // cols)
        for b in range(batch):
            for r in range(0, rows, step):
                divide_into(out[b, r : r + step], X[b, r : r + step], denom[b])
    return out.masked_fill_(nonfinite, 0.0)


def newton_schulz(
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
    *,
    overwrite_input: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Orthogonalize each matrix of ``G[..., m, n]`` in bfloat16 (or ``dtype``: fp16,
    fp32); returns ``[..., m, n]`` in that dtype.

    ``X = G / (||G||_F + eps)`` (norm in float32, per matrix), then for each ``(a, b, c)``:
    ``A = X X^T``; ``B = b A + c A A``; ``X = a X + B X``, the last two each a single
    ``baddbmm`` with one bf16 rounding. Any float dtype is accepted as input; matrices of
    one call are processed as one batch, so stack same-shape matrices before calling.
    Results do not depend on which other matrices share the batch (each GEMM of a batch
    is an independent matrix product).

    Memory, for a bf16 input of ``S`` bytes with ``m <= n``: the norm's reduction takes an
    fp32 copy (2 ``S``, freed at once); the division writes the bf16 ``X`` (``S``) through
    fp32 slices of at most 16 MiB; then the iteration holds two ``X`` buffers and ``A``,
    ``B`` (``2 S + 4 B m^2`` bytes for ``B`` matrices), reused across iterations. No fp32
    copy of ``X`` lives through the iteration (``workspace.newton_schulz_bytes``). With
    ``overwrite_input=True`` a contiguous bf16 ``G`` is normalised in place and becomes one
    of the iteration's buffers (its contents are lost): one bf16 copy less, same bits.
    """
    _check_matrix(G)
    coeffs = resolve_coefficients(coefficients)
    if G.numel() == 0:
        return G.to(dtype)
    X, transposed = _as_wide(G)
    X, shape = _as_batch3d(X)
    in_place = overwrite_input and X.dtype == dtype and X.is_contiguous() and not transposed
    X = normalized(X, eps, dtype, out=X if in_place else None)
    # One matrix goes through the 2-D kernels: on an AVX2 CPU, bf16 bmm with a batch of 1
    # can be several times slower than mm. Neither gives the bits of a larger batch for
    # every matrix (newton_schulz_per_matrix has batch-independent bits).
    if X.size(0) == 1:
        X, matmul, matmul_add = X[0], torch.mm, torch.addmm
    else:
        matmul, matmul_add = torch.bmm, torch.baddbmm
    gram_shape = (*X.shape[:-1], X.size(-2))
    A = X.new_empty(gram_shape)
    B = X.new_empty(gram_shape)
    spare = torch.empty_like(X)
    for a, b, c in coeffs:
        matmul(X, X.mT, out=A)
        matmul_add(A, A, A, beta=b, alpha=c, out=B)
        matmul_add(X, B, X, beta=a, alpha=1.0, out=spare)
        X, spare = spare, X
    del A, B, spare
    X = X.reshape(shape)
    return X.mT if transposed else X


def newton_schulz_per_matrix(
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """:func:`newton_schulz` of each matrix of ``G[..., m, n]`` on its own; bf16 out.

    A batched GEMM may pick another kernel for another batch size (on the AVX-512 CPU of
    ``docs/benchmarks.md``, about 1 in 200 small random matrices rounds differently alone
    and inside a batch), so a matrix's bits under the batched :func:`newton_schulz` depend
    on which others share its batch. One matrix at a time makes them depend on the matrix
    alone: the same bits on any layout, world size and workspace budget, for the cost of
    the batching (the GEMMs of small matrices are launched one by one).
    """
    _check_matrix(G)
    stack, shape = _as_batch3d(G)
    if stack.size(0) <= 1:
        return newton_schulz(G, coefficients, eps)
    out = torch.empty(stack.shape, dtype=torch.bfloat16, device=G.device)
    for i in range(stack.size(0)):
        out[i] = newton_schulz(stack[i : i + 1], coefficients, eps)[0]
    return out.reshape(shape)


_compiled_newton_schulz = None


def newton_schulz_compiled(
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """:func:`newton_schulz` through ``torch.compile`` (compiled on first use, per shape).

    A compiled Newton-Schulz as fast Muon implementations ship: the same iteration, but inductor
    may fuse and reorder, so results are close to, not bitwise equal to, the eager
    :func:`newton_schulz`; the first call of each shape pays the compilation (seconds).
    """
    global _compiled_newton_schulz
    if _compiled_newton_schulz is None:
        _compiled_newton_schulz = torch.compile(newton_schulz, dynamic=False)
    return _compiled_newton_schulz(G, resolve_coefficients(coefficients), eps)


def newton_schulz_unfolded(
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """dion's bf16 recipe, unfolded: bf16 norm, ``A@A`` and ``B@X`` rounded before the adds.

    Same contract as :func:`newton_schulz`. Kept as the benchmark baseline and to show in
    tests that folding is closer to the float64 reference.
    """
    _check_matrix(G)
    coeffs = resolve_coefficients(coefficients)
    X, transposed = _as_wide(G.to(torch.bfloat16))
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for a, b, c in coeffs:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if transposed else X


def newton_schulz_reference(
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """The same iteration in float64 with no bf16 casts; returns float64 ``[..., m, n]``."""
    _check_matrix(G)
    coeffs = resolve_coefficients(coefficients)
    X, transposed = _as_wide(G.to(torch.float64))
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + eps)
    for a, b, c in coeffs:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if transposed else X
