"""QK-clip on gloo (issue #22): worlds of 2 and 4 ranks running the cases of
``dist_qk_clip_cases`` (FSDP2, HSDP 2x2, FSDP2 over TP 2x2; bitwise against one process; one
all-reduce per ``apply()``; disagreeing ranks all raise), under a collective timeout."""

from __future__ import annotations

import dist_qk_clip_cases
import pytest
from dist_harness import WorldPlan

pytestmark = pytest.mark.slow

WORLDS = WorldPlan(
    "dist_qk_clip_cases:CASES", dist_qk_clip_cases.cases_for, (2, 4), collective_timeout_s=60.0
)


@pytest.mark.parametrize(("world", "name"), WORLDS.params("{world}-{name}"))
def test_distributed(worlds, world, name) -> None:
    worlds[world].check(name)


def test_every_layout_of_the_issue_has_a_case() -> None:
    names = set(dist_qk_clip_cases.cases_for(2)) | set(dist_qk_clip_cases.cases_for(4))
    assert {"fsdp_llama_gqa", "hsdp_2x2_llama", "fsdp_over_tp_2x2_llama_one_layer"} <= names
