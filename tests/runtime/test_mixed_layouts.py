"""Issue #28 item 3: random mixed layouts at worlds 2-4 step bitwise like one process or are
refused for cause, never refused falsely (cases in ``dist_mixed_layout_cases``).

Worlds are started one at a time, each the first time a test needs it.
"""

from __future__ import annotations

import dist_mixed_layout_cases
import pytest
from dist_harness import worlds_one_at_a_time

WORLD_SIZES = (2, 3, 4)
WORLD_CASES = [
    (world, name) for world in WORLD_SIZES for name in dist_mixed_layout_cases.cases_for(world)
]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    with worlds_one_at_a_time(
        "dist_mixed_layout_cases:CASES",
        dist_mixed_layout_cases.cases_for,
        tmp_path_factory.mktemp,
        timeout_s=600.0,
    ) as world:
        yield world


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), WORLD_CASES, ids=[f"{w}-{n}" for w, n in WORLD_CASES])
def test_mixed_layouts(worlds, world, name) -> None:
    worlds(world).check(name)
