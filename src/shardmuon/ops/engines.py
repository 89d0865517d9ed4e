"""The table of Newton–Schulz engines: one entry per ``newton_schulz_impl``, read by the
validation, the optimizer, the workspace estimate, the owner balancing and ``bench``.

Every engine runs the shared frame (:func:`shardmuon.ops.newton_schulz.orthogonalize_with`):
one normalisation (fp32 norm, overflow-safe, non-finite matrices zeroed and flagged), its
own iteration in the requested dtype, the result in that dtype. An entry says what the
engine is and costs:

* ``run(G[B, m, n], coefficients, eps, dtype=, restarts=, overwrite_input=,
  preconditioner=)`` ->
  :class:`~shardmuon.ops.normalize.Normalized` (result, non-finite mask);
* ``dtypes`` it runs in (all three here: none silently runs another);
* ``batch_invariant``: a matrix's bits do not depend on the others in its call;
* ``guard_default``: the divergence guard is on unless ``newton_schulz_guard=False``;
* ``takes_restarts``: ``newton_schulz_restarts`` means something to it;
* ``flops(m, n, coefficients, restarts)``: exact FLOPs per matrix, from the GEMMs it runs;
* ``iteration_bytes(count, m, n, itemsize, chain_itemsize)``: peak bytes its iteration
  allocates for a ``[count, m, n]`` (``m <= n``) normalised input (input excluded, result
  included), for :mod:`shardmuon.planning.workspace`.

Adding an engine is one entry in :data:`ENGINES`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardmuon.ops.newton_schulz import (
    Coefficients,
    compiled_iterate_folded,
    iterate_folded,
    iterate_unfolded,
    orthogonalize_per_matrix,
    orthogonalize_with,
)
from shardmuon.ops.newton_schulz_gram import (
    default_restarts,
    gram_flops,
    gram_gemm_dtype,
    iterate_gram,
    standard_flops,
)
from shardmuon.ops.normalize import Normalized

__all__ = [
    "ENGINES",
    "NS_CHOICES",
    "NS_DTYPES",
    "Engine",
    "resolve_ns_dtype",
    "resolve_restarts",
]

NS_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ALL_DTYPES = tuple(NS_DTYPES.values())


@dataclass(frozen=True)
class Engine:
    """One Newton–Schulz implementation and what it costs and guarantees (module docstring)."""

    name: str
    run: Callable[..., Normalized]
    summary: str
    flops: Callable[[int, int, Coefficients, Sequence[int]], int]
    iteration_bytes: Callable[[int, int, int, int, int], int]
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    batch_invariant: bool = False
    guard_default: bool = False
    takes_restarts: bool = False
    # It may normalise its input in place (the pipeline owns every buffer it orthogonalizes).
    in_place: bool = False


def _standard_flops(m: int, n: int, coefficients: Coefficients, restarts: Sequence[int]) -> int:
    return standard_flops(m, n, len(coefficients))


def _gram_flops(m: int, n: int, coefficients: Coefficients, restarts: Sequence[int]) -> int:
    return gram_flops(m, n, len(coefficients), restarts)


def _folded_bytes(count: int, m: int, n: int, size: int, chain: int) -> int:
    # The normalised X and a spare buffer, two [m, m] Gram buffers per matrix.
    return 2 * size * count * m * n + 2 * size * count * m * m


def _unfolded_bytes(count: int, m: int, n: int, size: int, chain: int) -> int:
    # Each line allocates: a*X, B@X and their sum beside X and the caller's input; A, b*A,
    # A@A, c*(A@A), B on the small side.
    total, small = count * m * n, count * m * m
    return max(5 * size * total + 2 * size * small, 2 * size * total + 4 * size * small)


def _per_matrix_bytes(count: int, m: int, n: int, size: int, chain: int) -> int:
    # The whole output, and one matrix's call (its normalised copy included) at a time.
    return size * count * m * n + size * m * n + _folded_bytes(1, m, n, size, chain)


def _compiled_bytes(count: int, m: int, n: int, size: int, chain: int) -> int:
    # Inductor plans its own buffers; bounded by the unfused textbook iteration's.
    return _unfolded_bytes(count, m, n, size, chain)


def _gram_bytes(count: int, m: int, n: int, size: int, chain: int) -> int:
    if m == n:
        return _folded_bytes(count, m, n, size, chain)
    total, small = count * m * n, count * m * m
    # X_0 in the GEMM dtype beside the input; a restart's (or the end's) Q X_0 in that dtype
    # and rounded to X's; R, P, Q, and a product of each kind in flight.
    return 2 * chain * total + 2 * size * total + 5 * chain * small


def _run_standard(iterate):
    def run(
        G, coefficients, eps, *, dtype, restarts=None, overwrite_input=False, preconditioner=None
    ) -> Normalized:
        return orthogonalize_with(
            iterate,
            G,
            coefficients,
            eps,
            dtype=dtype,
            overwrite_input=overwrite_input,
            preconditioner=preconditioner,
        )

    return run


def _run_per_matrix(
    G, coefficients, eps, *, dtype, restarts=None, overwrite_input=False, preconditioner=None
) -> Normalized:
    return orthogonalize_per_matrix(
        G, coefficients, eps, dtype=dtype, preconditioner=preconditioner
    )


def _run_gram(
    G, coefficients, eps, *, dtype, restarts=None, overwrite_input=False, preconditioner=None
) -> Normalized:
    iterate = functools.partial(iterate_gram, restarts=restarts)
    return orthogonalize_with(
        iterate,
        G,
        coefficients,
        eps,
        dtype=dtype,
        preconditioner=preconditioner,
        gemm_dtype=gram_gemm_dtype(dtype, G.device.type),
    )


ENGINES: dict[str, Engine] = {
    engine.name: engine
    for engine in (
        Engine(
            "folded",
            _run_standard(iterate_folded),
            "the quintic with each line's scale-and-add folded into one GEMM (default)",
            _standard_flops,
            _folded_bytes,
            in_place=True,
        ),
        Engine(
            "unfolded",
            _run_standard(iterate_unfolded),
            "dion's textbook iteration (A@A and B@X rounded before the adds)",
            _standard_flops,
            _unfolded_bytes,
        ),
        Engine(
            "compiled",
            _run_standard(compiled_iterate_folded),
            "the folded iteration through torch.compile (close to, not bitwise, folded)",
            _standard_flops,
            _compiled_bytes,
        ),
        Engine(
            "per-matrix",
            _run_per_matrix,
            "the folded iteration one matrix at a time: bits independent of the batch",
            _standard_flops,
            _per_matrix_bytes,
            batch_invariant=True,
        ),
        Engine(
            "gram",
            _run_gram,
            "the iteration on the small Gram matrix, with restarts (fewer FLOPs when wide)",
            _gram_flops,
            _gram_bytes,
            guard_default=True,
            takes_restarts=True,
        ),
    )
}
# Every ``newton_schulz_impl`` accepted: the engines and the rule that picks one.
NS_CHOICES = (*ENGINES, "auto")
# ``"auto"``'s candidates (the rule is in :mod:`shardmuon.ops.orthogonalizer`).
AUTO_CANDIDATES = ("folded", "gram")


def engines_of(impl: str) -> tuple[Engine, ...]:
    """The engines ``impl`` may run (``"auto"``: its candidates)."""
    return tuple(ENGINES[n] for n in AUTO_CANDIDATES) if impl == "auto" else (ENGINES[impl],)


def resolve_ns_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype or its name (``"bfloat16"``, ``"float16"``, ``"float32"``); ValueError else."""
    if isinstance(dtype, str) and dtype in NS_DTYPES:
        return NS_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in NS_DTYPES.values():
        return dtype
    raise ValueError(
        f"unknown newton_schulz_dtype {dtype!r}; accepted: torch.bfloat16, torch.float16, "
        "torch.float32 (or their names)"
    )


def resolve_restarts(restarts, steps: int) -> tuple[int, ...] | None:
    """``newton_schulz_restarts`` checked: ``None`` (the default schedule) or the sorted
    steps ``1 <= k < steps`` after which Gram restarts; ValueError naming the setting."""
    if restarts is None:
        return None
    kind = type(restarts).__name__
    kind = ("an " if kind[0] in "aeiou" else "a ") + kind
    if isinstance(restarts, (str, bytes)) or not isinstance(restarts, Sequence):
        example = f"({restarts},)" if isinstance(restarts, int) else "(2,)"
        raise ValueError(
            f"newton_schulz_restarts must be None or a sequence of steps >= 1, got "
            f"{restarts!r} ({kind}); write a tuple of steps, e.g. {example}"
        )
    for k in restarts:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"newton_schulz_restarts must be None or a sequence of steps >= 1, got "
                f"{tuple(restarts)!r}"
            )
    late = [k for k in restarts if k >= steps]
    if late:
        raise ValueError(
            f"newton_schulz_restarts {tuple(restarts)!r} names step {late[0]}, but the "
            f"schedule has {steps} steps: a restart comes after one of steps 1..{steps - 1}"
        )
    return tuple(sorted(set(restarts)))


# The longest run of Gram steps without a restart that the guard's certificate covers.
# Measured (tests/ops/test_engine_promises.py, 24 hard 16x160 matrices x 4 presets x 3
# dtypes): with runs of at most 3 steps every Gram result is within 1.1x the default
# engine's error; a 5-step run (``restarts=()``) leaves results inside the band with 10-190x
# the same-dtype standard iteration's error, which no check of the singular values can see.
MAX_STEPS_WITHOUT_RESTART = 3


def check_restart_runs(restarts: Sequence[int] | None, steps: int) -> None:
    """Refuse a Gram restart schedule with a run of more than
    :data:`MAX_STEPS_WITHOUT_RESTART` steps without a restart (ValueError naming it)."""
    marks = [0, *effective_restarts(restarts, steps), steps]
    runs = [b - a for a, b in itertools.pairwise(marks)]
    longest = max(runs)
    if longest > MAX_STEPS_WITHOUT_RESTART:
        start = marks[runs.index(longest)]
        raise ValueError(
            f"newton_schulz_restarts={tuple(restarts)!r} leaves steps {start + 1}..{start + longest} "
            f"of the {steps}-step schedule without a restart; Gram without a restart for more "
            f"than {MAX_STEPS_WITHOUT_RESTART} steps can drift to a wrong result inside the "
            "band, which the divergence guard cannot detect. Restart at least every "
            f"{MAX_STEPS_WITHOUT_RESTART} steps (None: the default schedule "
            f"{default_restarts(steps)!r})"
        )


def effective_restarts(restarts: Sequence[int] | None, steps: int) -> tuple[int, ...]:
    """The restart steps Gram runs: ``restarts`` or the default schedule."""
    return default_restarts(steps) if restarts is None else tuple(restarts)


def chain_itemsize(engine: Engine, dtype: torch.dtype, device_type: str) -> int:
    """Bytes per element of the dtype ``engine``'s GEMMs run in (Gram's chain dtype)."""
    if engine.takes_restarts:
        return gram_gemm_dtype(dtype, device_type).itemsize
    return dtype.itemsize
