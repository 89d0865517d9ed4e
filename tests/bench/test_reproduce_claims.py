"""``scripts/reproduce_claims.py``: each claim's reader takes the figure from its command's
real output (one cheap claim run end to end, the others on outputs of the shape their
commands write), the verdict follows the tolerance, and an unknown claim is refused."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reproduce_claims.py"


@pytest.fixture(scope="module")
def claims():
    spec = importlib.util.spec_from_file_location("reproduce_claims", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_readers_take_the_figures_their_commands_write(claims) -> None:
    ab = {
        "results": [
            {"preset": "dion", "newton_schulz_impl": "folded", "vs_fp64": [0.006, 0.0062]},
            {"preset": "dion", "newton_schulz_impl": "unfolded", "vs_fp64": [0.0161, 0.0160]},
        ]
    }
    ours, shown = claims._bench_ab(ab)
    assert ours == 0.0062 and shown == "0.62% vs 1.61%"
    step = {
        "results": [
            {"impl": "shardmuon", "step_s": 0.150, "padded_over_minimum": 1.43},
            {"impl": "shardmuon-split-replicas", "step_s": 0.120},
        ]
    }
    assert claims._padded(step)[0] == 1.43
    assert claims._split_replicas(step)[0] == pytest.approx(1.25)
    assert (
        claims._transient("noise\nshardmuon world 2: step transient 28.46 MB (max)\n")[0] == 28.46
    )
    assert claims._lm({"comparison": {"score": 0.4, "steps_share": 0.53}})[0] == 0.53
    never = claims._lm({"comparison": {"score": 0.001, "steps_share": None}})
    assert math.isnan(never[0]) and "never" in never[1]
    diverged = claims._lm({"comparison": {"score": None, "diverged": ["adamw"]}})
    assert math.isnan(diverged[0]) and "adamw diverged" in diverged[1]
    hsdp = next(c for c in claims.CLAIMS if c.name == "hsdp")
    assert hsdp.holds(1.5) and hsdp.holds(1.16) and not hsdp.holds(1.05)


@pytest.mark.exhaustive  # a 3-process bench step; the readers are tested above
def test_a_cheap_claim_end_to_end(claims, tmp_path, capsys) -> None:
    out = tmp_path / "claims.json"
    status = claims.main(["--only", "bytes", "--json", str(out)])
    result = json.loads(out.read_text())["bytes"]
    assert result["verdict"] in ("holds", "differs")
    assert status == (1 if result["verdict"] == "differs" else 0)
    assert result["figure"] == pytest.approx(1.43, abs=0.02)  # byte counts: arithmetic
    assert "today:" in capsys.readouterr().out


def test_an_unknown_claim_is_refused_and_the_long_one_waits_for_full(claims, capsys) -> None:
    with pytest.raises(SystemExit):
        claims.main(["--only", "nope"])
    assert "accepted: fp64, bytes" in capsys.readouterr().err
    assert claims.main(["--only", "lm"]) == 0
    assert "not run" in capsys.readouterr().out
