"""Issue #19's escapes, on gloo worlds of 2, 3, 4 and 8 ranks (cases in ``dist_escape_cases``).

Every distributed case runs under a collective timeout, so a hang fails the test instead of
stalling the suite.
"""

from __future__ import annotations

import dist_escape_cases
import pytest
from dist_harness import worlds_running

WORLD_SIZES = (2, 3, 4, 8)
WORLD_CASES = [
    (world, name) for world in WORLD_SIZES for name in dist_escape_cases.cases_for(world)
]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    spec = "dist_escape_cases:CASES"
    with worlds_running(
        spec,
        dist_escape_cases.cases_for,
        WORLD_SIZES,
        tmp_path_factory.mktemp,
        collective_timeout_s=30.0,
    ) as running:
        yield running


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), WORLD_CASES, ids=[f"{w}-{n}" for w, n in WORLD_CASES])
def test_distributed(worlds, world, name) -> None:
    worlds[world].check(name)
