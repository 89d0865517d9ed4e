"""Issue #28 item 3: random mixed layouts at worlds 2-4 step bitwise like one process or are
refused for cause, never refused falsely (cases in ``dist_mixed_layout_cases``).

Worlds are started one at a time, each the first time a test needs it.
"""

from __future__ import annotations

import dist_mixed_layout_cases
import pytest
from dist_harness import launch_world

WORLD_SIZES = (2, 3, 4)
WORLD_CASES = [
    (world, name) for world in WORLD_SIZES for name in dist_mixed_layout_cases.cases_for(world)
]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    launched = {}

    def world(size: int):
        if size not in launched:
            for other in launched.values():
                other.wait()
            launched[size] = launch_world(
                size,
                "dist_mixed_layout_cases:CASES",
                dist_mixed_layout_cases.cases_for(size),
                tmp_path_factory.mktemp(f"mixed_layouts{size}"),
                timeout_s=600.0,
                collective_timeout_s=60.0,
            )
        return launched[size]

    try:
        yield world
    finally:
        for w in launched.values():
            w.kill()


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), WORLD_CASES, ids=[f"{w}-{n}" for w, n in WORLD_CASES])
def test_mixed_layouts(worlds, world, name) -> None:
    worlds(world).check(name)
