"""Rank orders of 2x2 meshes (a sample; every one under the ``exhaustive`` marker), sampled
2x2x2 (an 8-rank world: under the ``exhaustive`` marker too) and 1-D orders, against one
process, with DTensor's round trip as the judge (cases in ``dist_rank_order_cases``).

Worlds are started one at a time (the largest has 8 ranks), each the first time a test
needs it, so that no more processes run at once than the largest world has.
"""

from __future__ import annotations

import dist_rank_order_cases
import pytest
from dist_harness import WorldPlan

WORLDS = WorldPlan(
    "dist_rank_order_cases:CASES",
    dist_rank_order_cases.cases_for,
    (2, 3, 4, 8),
    timeout_s=900.0,
    one_at_a_time=True,
    exhaustive=frozenset({"every_2x2_rank_order", "sampled_2x2x2_rank_orders"}),
)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), WORLDS.params("{world}-{name}"))
def test_rank_orders(worlds, world, name) -> None:
    worlds[world].check(name)
