"""The step runner's owner hook on 2 gloo ranks (run by ``test_stepper.py``): the hook runs
on the owner, on whole matrices, and a distributed step with it is bitwise the one-process
step with it."""

from __future__ import annotations

from collections.abc import Callable

from dist_checks import (
    S0,
    S1,
    Context,
    Spec,
    compare_states,
    make_context,
    make_optimizer,
    place,
    random_tensors,
    set_placed_random_grads,
)
from torch import Tensor, nn

__all__ = ["CASES", "make_context", "scaled_owner_update"]

SPECS = [
    Spec((12, 8), (S0,)),  # exchanged, rows sharded
    Spec((10, 6), (S1,)),  # exchanged, columns sharded
    Spec((3, 8, 6), (S0,)),  # an expert stack sharded on its batch dim: local matrices
    Spec((16,), (S0,), algorithm="adamw"),
]


def scaled_owner_update(seen: list[tuple[int, int]], factor: float = 0.5) -> Callable:
    """An owner update that records the matrices it is handed and returns Newton–Schulz's
    result times ``factor`` (a power of two: exact in bf16)."""

    def owner_update(ctx, U: Tensor, batch) -> Tensor:
        seen.extend([(U.size(1), U.size(2))] * U.size(0))
        return ctx.newton_schulz(U, batch) * factor

    return owner_update


def owner_update_sees_whole_matrices_and_matches_one_process(ctx: Context) -> None:
    init = random_tensors([s.shape for s in SPECS], 0)
    params = [nn.Parameter(place(ctx, s, t)) for s, t in zip(SPECS, init)]
    reference = [nn.Parameter(t.clone()) for t in init]
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": True}
    opt, ref = make_optimizer(params, SPECS, **kwargs), make_optimizer(reference, SPECS, **kwargs)
    seen: list[tuple[int, int]] = []
    opt.runner.owner_update = scaled_owner_update(seen)
    ref.runner.owner_update = scaled_owner_update([])
    for step in range(3):
        set_placed_random_grads(ctx, params, SPECS, 10 + step, reference)
        opt.step()
        ref.step()
    problems = compare_states(SPECS, opt, params, ref, reference, "owner update")
    assert not problems, "\n".join(problems)
    # Each rank owns whole matrices only (the two exchanged ones go to one owner each; the
    # stack's local matrices stay with their rank).
    assert seen and set(seen) <= {(12, 8), (10, 6), (8, 6)}, (ctx.rank, seen)


CASES: dict[str, Callable[[Context], None]] = {
    "owner_update_sees_whole_matrices_and_matches_one_process": (
        owner_update_sees_whole_matrices_and_matches_one_process
    ),
}
