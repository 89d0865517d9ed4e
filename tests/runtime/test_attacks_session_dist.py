"""Attacks on the agreement check at 2 and 3 gloo ranks (``dist_attack_cases``): ranks
that disagree must all raise the same error naming the field. A collective that does not
complete within the timeout fails its case instead of hanging the suite. The ``RISKY``
cases (which may desynchronise a world) run in a world of their own."""

from __future__ import annotations

import dist_attack_cases
import pytest
from dist_harness import free_ports, launch_world

pytestmark = pytest.mark.slow

WORLD_SIZES = (2, 3)
CASES = [
    pytest.param(world, name, id=f"world{world}-{name}")
    for world in WORLD_SIZES
    for name in dist_attack_cases.cases_for(world)
]
RISKY = [pytest.param(name, id=name) for name in dist_attack_cases.RISKY]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    launched = {}
    try:
        ports = free_ports(len(WORLD_SIZES) + 1)
        for world, port in zip(WORLD_SIZES, ports):
            launched[world] = launch_world(
                world,
                "dist_attack_cases:CASES",
                dist_attack_cases.cases_for(world),
                tmp_path_factory.mktemp(f"attacks{world}"),
                port=port,
                timeout_s=240.0,
                collective_timeout_s=30.0,
            )
        launched["risky"] = launch_world(
            2,
            "dist_attack_cases:RISKY",
            list(dist_attack_cases.RISKY),
            tmp_path_factory.mktemp("attacks_risky"),
            port=ports[-1],
            timeout_s=120.0,
            collective_timeout_s=15.0,
        )
        yield launched
    finally:
        for world in launched.values():
            world.kill()


@pytest.mark.parametrize(("world", "name"), CASES)
def test_ranks_that_disagree_get_one_error(worlds, world, name):
    worlds[world].check(name)


@pytest.mark.parametrize("name", RISKY)
def test_ranks_that_disagree_risky(worlds, name):
    worlds["risky"].check(name)
