"""The test tree reads like the package (``ops/``, ``planning/``, ``runtime/``,
``optimizer/``, ``clients/``, ``bench/``, ``train/``). Shared helpers live apart from the
pytest modules: ``support/`` (independent references, the dion fixtures, copies) and
``worlds/`` (the multi-process harness). Each multi-process case module (``*_cases.py``)
sits beside the test that runs it. All these folders are on ``sys.path`` here, so that test
modules and the spawned ranks (which get the parent's ``sys.path``) import them by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
CASE_FOLDERS = sorted({path.parent.name for path in HERE.glob("*/*_cases.py")})
for folder in ("support", "worlds", *CASE_FOLDERS):
    path = str(HERE / folder)
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny matrices: much faster than several (no thread
    hand-off, a lot on a busy machine). Every comparison runs its subject and its reference
    under the same setting. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def worlds(request, tmp_path_factory):
    """The gloo worlds of the module's ``WORLDS`` (a ``dist_harness.WorldPlan``), as
    ``{size: World}``, killed at the end of the module. Each world runs the cases of the
    module's tests that take this fixture and were collected, read from their ``world`` and
    ``name`` parameters (``world`` may be left out where the plan has one size); every case
    when none was (a test without those parameters only). A test checks its case with
    ``worlds[world].check(name)``."""
    plan = request.module.WORLDS
    only = plan.sizes[0] if len(plan.sizes) == 1 else None
    selected: dict[int, set[str]] = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is not request.module or callspec is None:
            continue
        if "worlds" not in item.fixturenames or "name" not in callspec.params:
            continue
        world = callspec.params.get("world", only)
        if world is not None:
            selected.setdefault(world, set()).add(callspec.params["name"])
    with plan.running(tmp_path_factory.mktemp, selected) as running:
        yield running
