"""Attacks on the agreement check at 2 and 3 gloo ranks (``dist_disagreement_cases``): ranks
that disagree must all raise the same error naming the field. A collective that does not
complete within the timeout fails its case instead of hanging the suite. The ``RISKY``
cases (which may desynchronise a world) run in a world of their own."""

from __future__ import annotations

import dist_disagreement_cases
import pytest
from dist_harness import WorldPlan

pytestmark = pytest.mark.slow

WORLDS = WorldPlan(
    "dist_disagreement_cases:CASES",
    dist_disagreement_cases.cases_for,
    (2, 3),
    timeout_s=240.0,
    collective_timeout_s=30.0,
)
RISKY_WORLD = WorldPlan(
    "dist_disagreement_cases:RISKY",
    lambda _: list(dist_disagreement_cases.RISKY),
    (2,),
    timeout_s=120.0,
    collective_timeout_s=15.0,
)
RISKY = [pytest.param(name, id=name) for name in dist_disagreement_cases.RISKY]


@pytest.fixture(scope="module")
def risky_world(tmp_path_factory):
    with RISKY_WORLD.running(tmp_path_factory.mktemp) as running:
        yield running[2]


@pytest.mark.parametrize(("world", "name"), WORLDS.params())
def test_ranks_that_disagree_get_one_error(worlds, world, name):
    worlds[world].check(name)


@pytest.mark.parametrize("name", RISKY)
def test_ranks_that_disagree_risky(risky_world, name):
    risky_world.check(name)
