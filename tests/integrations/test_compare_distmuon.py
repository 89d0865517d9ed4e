"""``scripts/compare_distmuon.py``: its fp64 recipe is what DistMuon's and shardmuon's updates
approach (one process, small matrices, the default run), and its gloo worlds run and report
(the exhaustive run)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan's models import it

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_distmuon.py"


def _script():
    spec = importlib.util.spec_from_file_location("compare_distmuon", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _relative(finals: dict, against: dict, initial: dict) -> float:
    num = sum(float((finals[n].double() - against[n]).norm() ** 2) for n in finals)
    den = sum(float((against[n] - initial[n].double()).norm() ** 2) for n in finals)
    return math.sqrt(num / den)


def test_both_updates_approach_the_fp64_recipe_and_differ_from_other_recipes() -> None:
    cmp = _script()
    shapes = {"wide": (24, 40), "tall": (48, 16), "square": (32, 32), "experts": (3, 20, 12)}
    initial = {n: cmp.full_values(s, i, 0.02) for i, (n, s) in enumerate(shapes.items())}
    grads = [{n: cmp.full_values(s, 100 * k + i) for i, (n, s) in enumerate(shapes.items())}
             for k in range(3)]  # fmt: skip
    reference = cmp.fp64_reference(initial, grads)
    distmuon, _ = cmp.distmuon_math(initial, grads)

    params = {n: w.clone().requires_grad_() for n, w in initial.items()}
    optimizer = cmp._shardmuon(list(params.values()), list(params))
    for step_grads in grads:
        for n, p in params.items():
            p.grad = step_grads[n].clone()
        optimizer.step()
    shardmuon = {n: p.detach() for n, p in params.items()}

    assert _relative(distmuon, reference, initial) < 0.02
    assert _relative(shardmuon, reference, initial) < 0.02
    # The reference can tell recipes apart: without Nesterov the update is another one.
    params = {n: w.clone().requires_grad_() for n, w in initial.items()}
    other = cmp._shardmuon(list(params.values()), list(params))
    for group in other.param_groups:
        group["nesterov"] = False
    for step_grads in grads:
        for n, p in params.items():
            p.grad = step_grads[n].clone()
        other.step()
    assert _relative({n: p.detach() for n, p in params.items()}, reference, initial) > 0.1


@pytest.mark.exhaustive
def test_the_script_runs_a_world(tmp_path) -> None:
    out = tmp_path / "comparison.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--worlds", "2", "--steps", "2", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (report,) = json.loads(out.read_text())
    assert report["world"] == 2 and report["muon_parameters"] == 12
    errors = [r["fp64_error"] for r in report["results"].values()]
    assert len(errors) == 2 and all(0 < e < 0.02 for e in errors), report
    assert 0 < report["between"] < 0.03
    assert "DistMuon" in done.stdout and "shardmuon, 2 ranks" in done.stdout
