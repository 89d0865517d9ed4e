"""A failure in one rank's overlapped step only (issue #32): that rank raises it at its next
wait; its peer, whose collective can no longer complete, raises ``OverlapError`` at the
process group's timeout (the job's, 5 s here, not torch's 30 minutes) instead of hanging.
A world of its own: the timed-out collective leaves its groups unusable."""

from __future__ import annotations

import dist_overlap_cases
import pytest
from dist_harness import WorldPlan

pytestmark = pytest.mark.slow

WORLDS = WorldPlan(
    "dist_overlap_cases:FAULT_CASES",
    lambda _: list(dist_overlap_cases.FAULT_CASES),
    (2,),
    collective_timeout_s=dist_overlap_cases.FAULT_TIMEOUT_S,
)


@pytest.mark.parametrize("name", list(dist_overlap_cases.FAULT_CASES))
def test_fault(worlds, name):
    worlds[2].check(name)
