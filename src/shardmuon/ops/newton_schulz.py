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
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from shardmuon.ops.fused_aol import aol_fold_, aol_scale_gram_, fused_aol_supported
from shardmuon.ops.fused_normalize import fused_normalize_available
from shardmuon.ops.normalize import Normalized, gram_ready, normalize, normalize_unit

__all__ = [
    "NS_PRESETS",
    "Coefficients",
    "aol_rescale_",
    "check_preconditioner",
    "compiled_iterate_folded",
    "iterate_folded",
    "iterate_unfolded",
    "newton_schulz",
    "newton_schulz_per_matrix",
    "newton_schulz_reference",
    "newton_schulz_unfolded",
    "orthogonalize_per_matrix",
    "orthogonalize_with",
    "resolve_coefficients",
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
# Turbo-Muon's 4-step schedule for an AOL-preconditioned input (Boissin, Massena, Mamalet,
# Serrurier, arXiv:2512.04632; the set published with thib-s/flash-newton-schulz).
_TURBO_MUON: Coefficients = (
    (4.6051, -9.6552, 5.6769),
    (4.7505, -6.0861, 2.1790),
    (2.7763, -2.3190, 0.5523),
    (2.4231, -2.2861, 0.8193),
)


def with_input_scaled(coefficients: Coefficients, scale: float) -> Coefficients:
    """The schedule that, on ``X``, computes what ``coefficients`` compute on ``X / scale``.

    The first step ``a X + b X^3 + c X^5`` of ``X / scale`` is ``(a / s) X + (b / s^3) X^3 +
    (c / s^5) X^5``: folding a normalisation factor into the first triple costs nothing at
    run time and leaves the later steps as they are (exact in exact arithmetic; the one
    difference is where ``eps`` sits, ``||X|| s + s eps`` instead of ``||X|| s + eps``).
    """
    (a, b, c), rest = coefficients[0], coefficients[1:]
    return ((a / scale, b / scale**3, c / scale**5), *rest)


# The Newton-Schulz coefficient presets by name, one (a, b, c) triple per iteration: what
# ``newton_schulz_coefficients="<name>"`` runs (``"dion"`` when none is given).
NS_PRESETS: dict[str, Coefficients] = {
    "dion": _DION,
    "keller": _KELLER,
    "deepseek-v4": _DEEPSEEK_V4,
    # The paper's schedule with the references' 1.02 normalisation margin folded in.
    "polar-express": with_input_scaled(POLAR_EXPRESS_PAPER, POLAR_EXPRESS_SAFETY),
    # Four steps after AOL: what ``newton_schulz_preconditioner="aol"`` runs by default.
    # Chosen by scripts/aol_error.py (docs/benchmarks.md, "AOL"): the paper's set, against
    # dion's first or last four steps and Keller's (1.4-11x farther on some input kind) and
    # a refit of the paper's set to these inputs (at most 3% closer).
    "aol": _TURBO_MUON,
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


def orthogonalize_with(
    iterate: Callable[[Tensor, Coefficients], Tensor],
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
    *,
    dtype: torch.dtype = torch.bfloat16,
    overwrite_input: bool = False,
    preconditioner: str | None = None,
    gemm_dtype: torch.dtype | None = None,
) -> Normalized:
    """The frame every engine shares: ``G[..., m, n]`` turned wide (``m <= n``) and 3-D,
    normalised once (:func:`shardmuon.ops.normalize.normalize`: fp32 norm, overflow-safe,
    non-finite matrices zeroed), ``iterate(X[B, m, n], coefficients)`` run on it in
    ``dtype`` (with ``preconditioner="aol"``: normalised to unit norm instead,
    :func:`shardmuon.ops.normalize.normalize_unit`, and :func:`aol_rescale_` on its first
    Gram matrix with the floor ``||G|| / (||G|| + eps)``, passed as ``eps_floor``), and the
    result put back in ``G``'s shape.

    Returns the result (``dtype``, ``[..., m, n]``) and the ``[B]`` mask of matrices that
    held a non-finite entry (their result is zero). With ``overwrite_input=True`` a
    contiguous wide ``G`` already in ``dtype`` is normalised in place (its contents are
    lost) and becomes the iteration's first buffer. ``gemm_dtype``: what ``iterate``'s
    GEMMs run in when not ``dtype`` (Gram's chain): AOL takes its input without a
    normalisation pass only where neither is fp16, whose range an unscaled Gram matrix
    leaves.
    """
    _check_matrix(G)
    coeffs = resolve_coefficients(coefficients)
    if G.numel() == 0:
        count = math.prod(G.shape[:-2])
        return Normalized(G.to(dtype), torch.zeros(count, dtype=torch.bool, device=G.device))
    X, transposed = _as_wide(G)
    X, shape = _as_batch3d(X)
    in_place = overwrite_input and X.dtype == dtype and X.is_contiguous() and not transposed
    out = X if in_place else None
    if check_preconditioner(preconditioner) == "aol":
        # Turbo-Muon's AOL: no normalisation pass (the scaling does not depend on X's scale;
        # only matrices out of the Gram's range are scaled), fp16 excepted.
        narrow = torch.float16 in (dtype, gemm_dtype)
        prepare = normalize_unit if narrow else gram_ready
        (X, nonfinite), floor = prepare(X, eps, dtype, out=out)
        X = iterate(X, coeffs, preconditioner="aol", eps_floor=floor)
    else:
        X, nonfinite = normalize(X, eps, dtype, out=out)
        X = iterate(X, coeffs, preconditioner=preconditioner)
    X = X.reshape(shape)
    return Normalized(X.mT if transposed else X, nonfinite)


PRECONDITIONERS = (None, "aol")


def check_preconditioner(preconditioner: str | None) -> str | None:
    """``None`` or ``"aol"``; ValueError naming ``newton_schulz_preconditioner`` else."""
    if preconditioner not in PRECONDITIONERS:
        raise ValueError(
            f"unknown newton_schulz_preconditioner {preconditioner!r}; accepted: None, 'aol'"
        )
    return preconditioner


def aol_rescale_(X: Tensor, A: Tensor, eps_floor: Tensor | None = None) -> None:
    """AOL preconditioning, in place: ``X <- D X`` and ``A <- D A D`` with
    ``D = f diag((sum_j |A_ij|)^-1/2)``, where ``A = X X^T`` (``X[..., m, n]``, ``m <= n``)
    and ``f`` is ``eps_floor`` (one fp32 factor per matrix, ``X.shape[:-2]``; ``None``: 1).

    ``||D X||_2 <= f`` (the row sums of ``|A|`` bound its largest eigenvalue after the
    diagonal scaling: Prach & Lampert's almost-orthogonal layers), and the scaling evens
    the rows out, so the iteration starts better conditioned than from the Frobenius
    normalisation (Boissin et al., Turbo-Muon, arXiv:2512.04632). The scaled Gram matrix
    is the first iteration's ``A``: no GEMM is added. ``D`` is computed in fp32; ``X`` and
    ``A`` are rounded once each. A zero row stays zero.

    The row scaling does not depend on ``X``'s scale, but its row sums do: they must come
    from a Gram matrix that has not underflowed in ``X``'s dtype. The engines therefore
    pass a unit-norm ``X`` (:func:`shardmuon.ops.normalize.normalize_unit`) and the
    normalisation's eps floor ``f = ||G|| / (||G|| + eps)``: a gradient far below ``eps``
    is damped as without AOL (``||D X||_2 <= f``, ``~||G|| / eps``) instead of the Gram
    matrix of ``G / eps`` underflowing (fp16 below ``||G|| ~ 1e-10``, bf16 and fp32 below
    ``~1e-26``) and ``D`` losing its bound.
    """
    d = aol_row_scales_(X, A, eps_floor)
    if X.device.type == "cpu" and X.dtype != d.dtype:
        X.copy_(X.to(d.dtype).mul_(d.unsqueeze(-1)))  # see aol_row_scales_: the CPU route
    else:
        X.mul_(d.unsqueeze(-1))


def aol_row_scales_(X: Tensor, A: Tensor, eps_floor: Tensor | None = None) -> Tensor:
    """:func:`aol_rescale_`'s ``D`` and its Gram half: ``A <- D A D`` in place, ``X`` left as
    it is; returns the fp32 (fp64 for fp64) row scales ``d`` (``X.shape[:-1]``), for a caller
    that applies ``D`` to ``X`` itself (:func:`iterate_folded` folds it into the first
    iteration's ``m x m`` factor instead of a pass over ``X``)."""
    wide = torch.float64 if A.dtype == torch.float64 else torch.float32
    # On a CPU, A is scaled through an fp32 copy (below), which also gives the row sums:
    # summing bf16 with dtype=fp32 there converts first anyway, ~10x slower.
    on_cpu = A.device.type == "cpu" and A.dtype != wide
    A_wide = A.to(wide) if on_cpu else None
    # The 1-norm of each row: one reduction, no |A| materialised.
    row_sums = (
        torch.linalg.vector_norm(A_wide, ord=1, dim=-1)
        if on_cpu
        else torch.linalg.vector_norm(A, ord=1, dim=-1, dtype=wide)
    )
    narrow = X.dtype == torch.float16
    if narrow:
        # fp16's exponent range: a small row's Gram entries underflow to 0 (and its scale
        # would come out 1e19). Its diagonal ||x_i||^2 is taken from X in fp32 instead, and
        # written back after the scaling, where it is representable again.
        squares = torch.linalg.vector_norm(X, dim=-1, dtype=wide).square_()
        # An off-diagonal entry below fp16's normal range is rounded to a multiple of 2^-24
        # (or to 0, two small rows' products): it may have lost up to 2^-25. Adding that for
        # each of the m - 1 keeps every row sum an upper bound, so the bound holds whatever
        # the rows' relative sizes (at most 2^-25 m against row sums of about n^-1/2).
        lost = (A.size(-1) - 1) * 2.0**-25
        row_sums += squares - A.diagonal(dim1=-2, dim2=-1).abs().to(wide) + lost
    # The row sums hold each row's own ||x_i||^2 (exactly, in fp16 too), so d_i <= 1/||x_i||
    # and every scaled row stays within norm 1: no scale can overflow X's dtype.
    d = row_sums.clamp_min_(torch.finfo(wide).tiny).rsqrt_()
    if eps_floor is not None:
        d.mul_(eps_floor.unsqueeze(-1))  # [..., m]: one small kernel
    # In fp32, rounded once: rounding d, or D A D's scales, to bf16 first costs 1.2-1.8x
    # the error (A must stay the Gram matrix of the scaled X).
    if on_cpu:
        # On a CPU a mixed-dtype in-place multiply runs ~8x slower than widening, scaling
        # in place and writing back (the same fp32 temporary: the mixed one makes it too).
        # D A D as (a d_i) d_j here, a (d_i d_j) below: both fp32, rounded once into A.
        A.copy_(A_wide.mul_(d.unsqueeze(-1)).mul_(d.unsqueeze(-2)))
    elif _fused_aol(A, d):
        aol_scale_gram_(A, d)  # one kernel, the same bits
    else:
        A.mul_(d.unsqueeze(-1) * d.unsqueeze(-2))
    if narrow:
        A.diagonal(dim1=-2, dim2=-1).copy_(squares * d * d)
    return d


def _fused_aol(M: Tensor, d: Tensor) -> bool:
    """Whether AOL's ``m x m`` passes on ``M`` run as one Triton kernel each
    (``ops/fused_aol.py``): on an accelerator with Triton, fp32 scales, a contiguous bf16 or
    fp32 ``[B, m, m]``."""
    return (
        fused_normalize_available(M.device) and d.dtype == torch.float32 and fused_aol_supported(M)
    )


def _fold_row_scales_(B: Tensor, d: Tensor, a: float) -> None:
    """``B <- (B + a I) D`` in place (``D = diag(d)`` scales the columns), in ``d``'s dtype and
    rounded once: the first AOL iteration's ``a D X + B D X`` becomes one product with the
    unscaled ``X``, an ``m x m`` pass instead of an ``m x n`` one."""
    if _fused_aol(B, d):
        aol_fold_(B, d, a)  # one kernel, the same bits
        return
    wide = B if B.dtype == d.dtype else B.to(d.dtype)
    wide.diagonal(dim1=-2, dim2=-1).add_(a)
    wide.mul_(d.unsqueeze(-2))
    if wide is not B:
        B.copy_(wide)


def _iteration_buffers(X: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The folded iteration's scratch: ``A`` and ``B`` (``X``'s ``[..., m, m]``, two views of
    one allocation) and a spare ``X`` of its own (the result may end in it, and must not
    keep the Gram matrices alive after the call)."""
    gram_shape = (*X.shape[:-1], X.size(-2))
    grams = X.new_empty((2, *gram_shape))
    return grams[0], grams[1], torch.empty_like(X)


def iterate_folded(
    X: Tensor,
    coefficients: Coefficients,
    preconditioner: str | None = None,
    eps_floor: Tensor | None = None,
) -> Tensor:
    """The folded quintic on a normalised wide ``X[B, m, n]`` (``m <= n``), in ``X``'s dtype.

    For each ``(a, b, c)``: ``A = X X^T``; ``B = b A + c A A``; ``X = a X + B X``, the last
    two each one ``baddbmm`` with one rounding. ``X`` is used as one of the two buffers (its
    contents are lost); returns ``[B, m, n]``. ``preconditioner="aol"``:
    :func:`aol_rescale_` on the first ``A``, with ``eps_floor`` (``[B]``).
    """
    # One matrix goes through the 2-D kernels: on an AVX2 CPU, bf16 bmm with a batch of 1
    # can be several times slower than mm. Neither gives the bits of a larger batch for
    # every matrix (the per-matrix engine has batch-independent bits).
    single = X.size(0) == 1
    if single:
        X, matmul, matmul_add = X[0], torch.mm, torch.addmm
        eps_floor = None if eps_floor is None else eps_floor[0]
    else:
        matmul, matmul_add = torch.bmm, torch.baddbmm
    A, B, spare = _iteration_buffers(X)
    for step, (a, b, c) in enumerate(coefficients):
        matmul(X, X.mT, out=A)
        if step == 0 and preconditioner == "aol" and X.dtype != torch.float16:
            # D folded into the first iteration: a D X + B D X = ((B + a I) D) X, an m x m
            # pass instead of one over X. (fp16 scales X itself: (B + a I) D can leave fp16's
            # range where a row of X is tiny and its d large.)
            d = aol_row_scales_(X, A, eps_floor)
            matmul_add(A, A, A, beta=b, alpha=c, out=B)
            _fold_row_scales_(B, d, a)
            matmul(B, X, out=spare)
        else:
            if step == 0 and preconditioner == "aol":
                aol_rescale_(X, A, eps_floor)
            matmul_add(A, A, A, beta=b, alpha=c, out=B)
            matmul_add(X, B, X, beta=a, alpha=1.0, out=spare)
        X, spare = spare, X
    del A, B, spare
    return X.unsqueeze(0) if single else X


def iterate_unfolded(
    X: Tensor,
    coefficients: Coefficients,
    preconditioner: str | None = None,
    eps_floor: Tensor | None = None,
) -> Tensor:
    """The textbook quintic (dion's recipe) on a normalised wide ``X[B, m, n]``: ``A @ A``
    and ``B @ X`` rounded to ``X``'s dtype before the scale-and-adds."""
    for step, (a, b, c) in enumerate(coefficients):
        A = X @ X.mT
        if step == 0 and preconditioner == "aol":
            aol_rescale_(X, A, eps_floor)  # the normalised input is the iteration's own
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X


def newton_schulz(
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
    *,
    overwrite_input: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    preconditioner: str | None = None,
) -> Tensor:
    """Orthogonalize each matrix of ``G[..., m, n]`` in bfloat16 (or ``dtype``: fp16,
    fp32); returns ``[..., m, n]`` in that dtype.

    ``X = G / (||G||_F + eps)`` (norm in float32, per matrix, overflow-safe; a matrix with
    a non-finite entry gives zeros), then :func:`iterate_folded`. Any float dtype is
    accepted as input; matrices of one call are processed as one batch, so stack
    same-shape matrices before calling.

    Memory, for a bf16 input of ``S`` bytes with ``m <= n``: the norm is one reduction
    (no copy); the division writes the bf16 ``X`` (``S``) through fp32 slices of at most
    16 MiB; then the iteration holds two ``X`` buffers and ``A``, ``B`` (``2 S + 4 B m^2``
    bytes for ``B`` matrices), reused across iterations. No fp32 copy of ``X`` lives
    through the iteration (``planning.workspace``). With ``overwrite_input=True`` a
    contiguous bf16 ``G`` is normalised in place and becomes one of the iteration's
    buffers (its contents are lost): one bf16 copy less, same bits.
    """
    return orthogonalize_with(
        iterate_folded,
        G,
        coefficients,
        eps,
        dtype=dtype,
        overwrite_input=overwrite_input,
        preconditioner=preconditioner,
    ).X


def orthogonalize_per_matrix(
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
    *,
    dtype: torch.dtype = torch.bfloat16,
    preconditioner: str | None = None,
) -> Normalized:
    """:func:`orthogonalize_with` the folded iteration, one matrix of ``G[..., m, n]`` at a
    time (normalisation included): the result and the ``[B]`` non-finite mask."""
    _check_matrix(G)
    options = dict(dtype=dtype, preconditioner=preconditioner)
    if G.numel() == 0:
        return orthogonalize_with(iterate_folded, G, coefficients, eps, **options)
    stack, shape = _as_batch3d(G)
    if stack.size(0) <= 1:
        return orthogonalize_with(iterate_folded, G, coefficients, eps, **options)
    out = torch.empty(stack.shape, dtype=dtype, device=G.device)
    flags = []
    for i in range(stack.size(0)):
        one = orthogonalize_with(iterate_folded, stack[i : i + 1], coefficients, eps, **options)
        out[i] = one.X[0]
        flags.append(one.nonfinite)
    return Normalized(out.reshape(shape), torch.cat(flags))


def newton_schulz_per_matrix(
    G: Tensor,
    coefficients: str | Sequence[Sequence[float]] | None = None,
    eps: float = 1e-8,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """:func:`newton_schulz` of each matrix of ``G[..., m, n]`` on its own; ``dtype`` out.

    A batched GEMM may pick another kernel for another batch size (on the AVX-512 CPU of
    ``docs/benchmarks.md``, about 1 in 200 small random matrices rounds differently alone
    and inside a batch), so a matrix's bits under the batched :func:`newton_schulz` depend
    on which others share its batch. One matrix at a time makes them depend on the matrix
    alone: the same bits on any layout, world size and workspace budget, for the cost of
    the batching (the GEMMs of small matrices are launched one by one).
    """
    return orthogonalize_per_matrix(G, coefficients, eps, dtype=dtype).X


_compiled_iterate = None


def compiled_iterate_folded(
    X: Tensor,
    coefficients: Coefficients,
    preconditioner: str | None = None,
    eps_floor: Tensor | None = None,
) -> Tensor:
    """:func:`iterate_folded` through ``torch.compile`` (compiled on first use, per shape
    and dtype). Inductor may fuse and reorder, so results are close to, not bitwise equal
    to, the eager iteration; the first call of each shape pays the compilation (seconds)."""
    global _compiled_iterate
    if _compiled_iterate is None:
        _compiled_iterate = torch.compile(iterate_folded, dynamic=False)
    return _compiled_iterate(X, coefficients, preconditioner, eps_floor)


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
