"""Real clients' layouts and containers on gloo (issue #20): worlds of 2, 4 and 8 ranks, the
cases of ``dist_client_cases``, each under a collective timeout (a hang fails the test)."""

from __future__ import annotations

import dist_client_cases
import pytest
from dist_harness import worlds_running

pytestmark = pytest.mark.slow

WORLD_SIZES = (2, 4, 8)
WORLD_CASES = [
    (world, name) for world in WORLD_SIZES for name in dist_client_cases.cases_for(world)
]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    with worlds_running(
        "dist_client_cases:CASES",
        dist_client_cases.cases_for,
        WORLD_SIZES,
        tmp_path_factory.mktemp,
        collective_timeout_s=60.0,
    ) as running:
        yield running


@pytest.mark.parametrize(("world", "name"), WORLD_CASES, ids=[f"{w}-{n}" for w, n in WORLD_CASES])
def test_distributed(worlds, world, name) -> None:
    worlds[world].check(name)
