"""Real clients' layouts and containers on gloo (issue #20): worlds of 2, 4 and 8 ranks, the
cases of ``dist_client_cases``, each under a collective timeout (a hang fails the test)."""

from __future__ import annotations

import dist_client_cases
import pytest
from dist_harness import WorldPlan

pytestmark = pytest.mark.slow

WORLDS = WorldPlan(
    "dist_client_cases:CASES", dist_client_cases.cases_for, (2, 4, 8), collective_timeout_s=60.0
)


@pytest.mark.parametrize(("world", "name"), WORLDS.params("{world}-{name}"))
def test_distributed(worlds, world, name) -> None:
    worlds[world].check(name)
