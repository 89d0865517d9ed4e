"""QK-clip on gloo (issue #22): worlds of 2 and 4 ranks running the cases of
``dist_qk_clip_cases`` (FSDP2, HSDP 2x2, FSDP2 over TP 2x2; bitwise against one process; one
all-reduce per ``apply()``; disagreeing ranks all raise), under a collective timeout."""

from __future__ import annotations

import dist_qk_clip_cases
import pytest
from dist_harness import worlds_running

pytestmark = pytest.mark.slow

WORLD_SIZES = (2, 4)
WORLD_CASES = [
    (world, name) for world in WORLD_SIZES for name in dist_qk_clip_cases.cases_for(world)
]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    with worlds_running(
        "dist_qk_clip_cases:CASES",
        dist_qk_clip_cases.cases_for,
        WORLD_SIZES,
        tmp_path_factory.mktemp,
        collective_timeout_s=60.0,
    ) as running:
        yield running


@pytest.mark.parametrize(("world", "name"), WORLD_CASES, ids=[f"{w}-{n}" for w, n in WORLD_CASES])
def test_distributed(worlds, world, name) -> None:
    worlds[world].check(name)


def test_every_layout_of_the_issue_has_a_case() -> None:
    names = set(dist_qk_clip_cases.cases_for(2)) | set(dist_qk_clip_cases.cases_for(4))
    assert {"fsdp_llama_gqa", "hsdp_2x2_llama", "fsdp_over_tp_2x2_llama_one_layer"} <= names
