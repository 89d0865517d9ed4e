"""Two-dimensional shards (issue #13) on gloo: worlds 4 and 8, the cases of ``dist_tp_cases``.

Each world is spawned once per module and runs every case registered for it; each (world,
case) is reported as its own test. The cases log their all-to-all bytes against the minimum
(``TRAFFIC`` lines in rank 0's log); the last test collects them, checks every traffic case
logged a ratio of exactly 1, and prints them (``pytest -s``).
"""

from __future__ import annotations

import os
import re

import dist_tp_cases
import pytest
from dist_harness import WorldPlan

pytestmark = pytest.mark.slow

WORLD_TIMEOUT_S = float(os.environ.get("SHARDMUON_DIST_TIMEOUT", "600"))
TRAFFIC_LINE = re.compile(r"^TRAFFIC case=(\S+) world=(\d+) sent=(\d+) minimum=(\d+) ratio=(\S+)$")

# Only the worlds and cases some collected test needs are launched (all of them when only the
# summary test was selected).
WORLDS = WorldPlan(
    "dist_tp_cases:CASES", dist_tp_cases.cases_for, (4, 8), timeout_s=WORLD_TIMEOUT_S
)


@pytest.mark.parametrize(("world", "name"), WORLDS.params())
def test_case(worlds, world, name):
    worlds[world].check(name)


def test_every_layout_logs_minimum_traffic(worlds):
    """Every traffic case that passed logged world bytes equal to the minimum; printed."""
    missing, off = [], []
    for world in sorted(worlds):
        results = worlds[world].wait()
        log = worlds[world].out_dir / "rank0.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        logged = {}
        for line in lines:
            match = TRAFFIC_LINE.match(line)
            if match:
                print(line)
                logged[match.group(1)] = (int(match.group(3)), int(match.group(4)))
        for name in worlds[world].case_names:
            if name not in dist_tp_cases.TRAFFIC_CASES:
                continue
            if name not in logged:
                if all(r.ok for r in results.get(name, {}).values()) and results.get(name):
                    missing.append(f"world {world} {name}")
                continue
            sent, minimum = logged[name]
            if sent != minimum:
                off.append(f"world {world} {name}: sent {sent}, minimum {minimum}")
    assert not missing, f"traffic cases that passed without logging: {missing}"
    assert not off, f"traffic above the minimum: {off}"


def test_worlds_have_their_cases():
    assert "tp_torchtitan_fsdp_tp" in dist_tp_cases.cases_for(4)
    assert "tp_hsdp_tp" in dist_tp_cases.cases_for(8)
    assert not set(dist_tp_cases.cases_for(4)) & set(dist_tp_cases.cases_for(8))
