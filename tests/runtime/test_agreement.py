"""Ranks that disagree get an error on every rank, never an abort, a hang or a wrong update.

Worlds of 2, 3 and 4 gloo ranks run the cases of ``dist_agreement_cases`` (see there); a
collective that does not complete within the plan's collective timeout fails its case
instead of hanging the suite.
"""

from __future__ import annotations

import dist_agreement_cases
import pytest
from dist_harness import WorldPlan

pytestmark = pytest.mark.slow

WORLDS = WorldPlan(
    "dist_agreement_cases:CASES",
    dist_agreement_cases.cases_for,
    (2, 3, 4),
    timeout_s=300.0,
    collective_timeout_s=60.0,
)


@pytest.mark.parametrize(("world", "name"), WORLDS.params())
def test_ranks_that_disagree(worlds, world, name):
    worlds[world].check(name)
