"""Distribution from DTensor placements: world sizes 1-4 on gloo (CPU), many cases per world.

Each world size is spawned once (all of them at the same time, only those whose tests were
collected) and runs every collected case registered for it in ``dist_cases``; each
(world, case) is then reported here as its own test, with the rank and message of every
failing rank. A world has a wall-clock limit (``SHARDMUON_DIST_TIMEOUT`` seconds, default
600), so a hang fails the cases it blocked instead of blocking CI.

Below the world tests, the harness checks itself on a throwaway world of 2: a failure on
one rank only, and a collective that never completes, are both reported per rank.
"""

from __future__ import annotations

import os

import dist_cases
import pytest
from dist_harness import WorldPlan, launch_world

pytestmark = pytest.mark.slow

WORLD_SIZES = (1, 2, 3, 4)
WORLD_TIMEOUT_S = float(os.environ.get("SHARDMUON_DIST_TIMEOUT", "600"))
WORLDS = WorldPlan(
    "dist_cases:CASES",
    dist_cases.cases_for,
    WORLD_SIZES,
    timeout_s=WORLD_TIMEOUT_S,
    collective_timeout_s=90.0,
)


@pytest.mark.parametrize(("world", "name"), WORLDS.params())
def test_case(worlds, world, name):
    worlds[world].check(name)


def test_every_world_runs_cases():
    """The 2x2 cases exist only at world size 4; every size has the layout and error cases."""
    for world in WORLD_SIZES:
        names = dist_cases.cases_for(world)
        assert "fsdp2_tiny_moe" in names
        assert "layout_empty_shards" in names
        assert ("layout_hsdp_2x2" in names) == (world == 4)


# ------------------------------------------------------------ harness self-check


def _fails_on_rank_1(ctx):
    if ctx.rank == 1:
        raise AssertionError("planted failure")


def _passes(ctx):
    pass


def _collective_on_rank_0_only(ctx):
    import torch
    import torch.distributed as dist

    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))


SELF_CHECK_CASES = {
    "fails_on_rank_1": _fails_on_rank_1,
    "passes": _passes,
    "collective_on_rank_0_only": _collective_on_rank_0_only,
    "after_the_hang": _passes,
}


def test_harness_reports_rank_failures_and_hangs(tmp_path):
    """Per-rank failures, a stranded collective, and cases never reached all come back."""
    world = launch_world(
        2,
        "test_distributed:SELF_CHECK_CASES",
        list(SELF_CHECK_CASES),
        tmp_path,
        timeout_s=WORLD_TIMEOUT_S,
        collective_timeout_s=3,
    )
    try:
        first = world.failures("fails_on_rank_1")
        assert len(first) == 1
        assert "rank 1" in first[0]
        assert "planted failure" in first[0]
        assert world.failures("passes") == []
        hang = world.failures("collective_on_rank_0_only")
        assert hang, "a collective entered by rank 0 alone was not reported"
        assert any("rank 0" in message for message in hang)
    finally:
        world.kill()


def _sleeps(ctx):
    import time

    time.sleep(3600)


def test_harness_kills_a_world_past_its_limit(tmp_path):
    """A rank stuck outside any collective is killed at the world limit and reported."""
    world = launch_world(1, "test_distributed:SELF_CHECK_SLEEP", ["sleeps"], tmp_path, timeout_s=3)
    try:
        failures = world.failures("sleeps")
        assert len(failures) == 1
        assert "rank 0" in failures[0]
        assert "3 s limit" in failures[0]
        assert not any(p.is_alive() for p in world.processes)
    finally:
        world.kill()


SELF_CHECK_SLEEP = {"sleeps": _sleeps}
