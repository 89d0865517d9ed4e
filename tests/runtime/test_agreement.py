"""Ranks that disagree get an error on every rank, never an abort, a hang or a wrong update.

Worlds of 2, 3 and 4 gloo ranks run the cases of ``dist_agreement_cases`` (see there); a
collective that does not complete within ``COLLECTIVE_TIMEOUT_S`` fails its case instead of
hanging the suite.
"""

from __future__ import annotations

import dist_agreement_cases
import pytest
from dist_harness import free_ports, launch_world

pytestmark = pytest.mark.slow

WORLD_SIZES = (2, 3, 4)
WORLD_TIMEOUT_S = 300.0
COLLECTIVE_TIMEOUT_S = 60.0
CASES = [
    pytest.param(world, name, id=f"world{world}-{name}")
    for world in WORLD_SIZES
    for name in dist_agreement_cases.cases_for(world)
]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    launched = {}
    try:
        for world, port in zip(WORLD_SIZES, free_ports(len(WORLD_SIZES))):
            launched[world] = launch_world(
                world,
                "dist_agreement_cases:CASES",
                dist_agreement_cases.cases_for(world),
                tmp_path_factory.mktemp(f"agreement{world}"),
                port=port,
                timeout_s=WORLD_TIMEOUT_S,
                collective_timeout_s=COLLECTIVE_TIMEOUT_S,
            )
        yield launched
    finally:
        for world in launched.values():
            world.kill()


@pytest.mark.parametrize(("world", "name"), CASES)
def test_ranks_that_disagree(worlds, world, name):
    worlds[world].check(name)
