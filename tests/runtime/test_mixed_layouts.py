"""Issue #28 item 3: random mixed layouts at worlds 2-4 step bitwise like one process or are
refused for cause, never refused falsely (cases in ``dist_mixed_layout_cases``): a sample of
10 draws a world, the next 10 under the ``exhaustive`` marker.

Worlds are started one at a time, each the first time a test needs it.
"""

from __future__ import annotations

import dist_mixed_layout_cases
import pytest
from dist_harness import WorldPlan

WORLDS = WorldPlan(
    "dist_mixed_layout_cases:CASES",
    dist_mixed_layout_cases.cases_for,
    (2, 3, 4),
    timeout_s=600.0,
    one_at_a_time=True,
    exhaustive=frozenset({"more_random_mixed_layouts"}),
)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), WORLDS.params("{world}-{name}"))
def test_mixed_layouts(worlds, world, name) -> None:
    worlds[world].check(name)
