"""The GPU-path features on gloo, at their edges: warm-up (``runtime/warmup.py``), the groups
``planning/groups.py`` makes, the overlapped step's groups and waits (``runtime/overlap.py``)
and the divergence guard with its telemetry (``ops/newton_schulz_guard.py``,
``runtime/telemetry.py``).

The multi-process cases are in ``tests/runtime/dist_groups_warmup_cases.py``: ``CASES`` share
one gloo world, each ``RISKY`` case (one that may hang or leave its world out of step) runs
in a world of its own with a short collective timeout.
"""

from __future__ import annotations

import threading
import types

import dist_groups_warmup_cases
import pytest
import torch
import torch.distributed as dist
from dist_harness import WorldPlan

from shardmuon.planning import groups as groups_module

SPEC = "dist_groups_warmup_cases:CALLABLES"

WORLDS = WorldPlan(
    SPEC,
    lambda size: [n for n, (_, s) in dist_groups_warmup_cases.CASES.items() if s == size],
    tuple(sorted({s for _, s in dist_groups_warmup_cases.CASES.values()})),
    timeout_s=240.0,
    collective_timeout_s=30.0,
)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), WORLDS.params())
def test_case(worlds, world, name):
    worlds[world].check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(dist_groups_warmup_cases.RISKY))
def test_risky_case(tmp_path_factory, name):
    """One world per case: a hang fails only this case, at the collective timeout."""
    size = dist_groups_warmup_cases.RISKY[name][1]
    plan = WorldPlan(SPEC, lambda _: [name], (size,), timeout_s=150.0, collective_timeout_s=20.0)
    with plan.running(tmp_path_factory.mktemp) as running:
        running[size].check(name)


# ------------------------------------------------------------ groups.py, one process


def test_a_second_thread_never_sees_the_world_rebound_inside_the_unbinding_block(monkeypatch):
    """``_not_split_from_the_world`` reads ``bound_device_id`` before taking its lock. Thread
    A clears the binding; thread B, entering meanwhile, reads ``None`` and runs its block
    without the lock; A leaves and restores the binding while B is still inside: B's
    ``new_group`` would then split from the world (``ncclCommSplit``, which every rank of
    the world must call: the hang the block exists to avoid). Right: while any thread is
    inside the block the world reads unbound (read the binding under the lock and restore
    it when the last thread leaves), and afterwards it is bound again."""
    world = types.SimpleNamespace(bound_device_id=torch.device("cuda", 0))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: world)
    a_inside, a_may_leave = threading.Event(), threading.Event()
    b_inside, b_may_leave = threading.Event(), threading.Event()
    seen_by_b: list = []

    def a() -> None:
        with groups_module._not_split_from_the_world():
            a_inside.set()
            a_may_leave.wait(10)

    def b() -> None:
        a_inside.wait(10)
        with groups_module._not_split_from_the_world():
            b_inside.set()
            b_may_leave.wait(10)
            seen_by_b.append(world.bound_device_id)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    a_inside.wait(10)
    b_inside.wait(0.5)  # a correct block makes B wait for A here; the flawed one does not
    a_may_leave.set()
    threads[0].join(10)
    b_may_leave.set()
    threads[1].join(10)
    assert seen_by_b == [None], f"inside the block, thread B saw the world bound to {seen_by_b}"
    assert world.bound_device_id == torch.device("cuda", 0)


# ------------------------------------------------------------ the divergence guard


def _with_top_singular_value(m: int, n: int, top: float, seed: int) -> torch.Tensor:
    """An ``m x n`` fp64 matrix with singular values spread over ``[0.7, 1] * top``."""
    generator = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=generator))
    V, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
    k = min(m, n)
    s = torch.linspace(0.7, 1.0, k, dtype=torch.float64) * top
    return U[:, :k] @ torch.diag(s) @ V[:, :k].T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_guard_verdict_at_dtype_edges_matches_an_fp64_svd(dtype):
    """Guard (passes): one batch mixing results just inside and just outside the slack, 1xN
    and Nx1 shapes, and single entries at the dtype's edges (its largest finite value, a
    subnormal, +-inf, NaN). Each matrix is flagged exactly when its fp64 top singular value
    over the band exceeds the slack (or it is non-finite), the ratio of a flagged finite
    one is exact, and every final result lies inside the slack."""
    from shardmuon.ops.newton_schulz import (
        iterate_folded,
        orthogonalize_with,
        resolve_coefficients,
    )
    from shardmuon.ops.newton_schulz_guard import GUARD_SLACK, band_high, guarded

    coefficients = resolve_coefficients(None)
    band = band_high(coefficients)
    info = torch.finfo(dtype)
    for m, n in [(1, 16), (16, 1), (8, 24)]:
        results = []
        for i, factor in enumerate((0.9, 1.1, 1.2, 3.0)):
            results.append(_with_top_singular_value(m, n, factor * band, seed=i))
        for value in (
            info.max / 4,
            info.smallest_normal / 4,
            float("inf"),
            -float("inf"),
            float("nan"),
        ):
            edited = _with_top_singular_value(m, n, band, seed=7)
            edited[0, 0] = value
            results.append(edited)
        crafted = torch.stack(results).to(dtype)
        G = torch.randn(crafted.shape, generator=torch.Generator().manual_seed(1))
        out, verdict = guarded(G, lambda _, c=crafted: c.clone(), coefficients, 1e-8)
        exact = crafted.double()
        finite = torch.isfinite(exact).flatten(1).all(dim=1)
        sigma = torch.linalg.matrix_norm(exact.nan_to_num(0.0, 0.0, 0.0), ord=2) / band
        expected = ~finite | (sigma > GUARD_SLACK)
        assert verdict.fallbacks == int(expected.sum()), (m, n, sigma.tolist())
        for i in range(crafted.size(0)):
            # The standard fp32 iteration on this matrix alone (as the guard runs it).
            alone = orthogonalize_with(
                iterate_folded, G[i : i + 1].float(), coefficients, 1e-8, dtype=torch.float32
            )
            want = alone.X[0].to(dtype) if expected[i] else crafted[i]
            assert torch.equal(out[i], want), (m, n, i)
        final = torch.linalg.matrix_norm(out.double(), ord=2) / band
        assert bool((final <= GUARD_SLACK).all()), final.tolist()
