"""``Muon(overlap="forward")`` on gloo worlds of 2 and 4 ranks: the cases are in
``tests/runtime/dist_overlap_cases.py`` (every layout bitwise the sequential step over 20
steps under random per-rank delays; a failure raised alike on every rank)."""

from __future__ import annotations

import dist_overlap_cases
import pytest
from dist_harness import WorldPlan

pytestmark = pytest.mark.slow

WORLDS = WorldPlan(
    "dist_overlap_cases:CASES",
    lambda size: list(dist_overlap_cases.CASES_BY_WORLD[size]),
    (2, 4),
    one_at_a_time=True,
)


@pytest.mark.parametrize(("world", "name"), WORLDS.params())
def test_case(worlds, world, name):
    worlds[world].check(name)
