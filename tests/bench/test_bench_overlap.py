"""``shardmuon bench step --overlap forward`` (issue #32): each shardmuon impl gets an
``IMPL+overlap`` row beside it (with ``+offload`` too), whose "held ms" is the time
``step()`` held the caller; the overlapped step moves as many bytes as the sequential one."""

from __future__ import annotations

import json

import pytest

from shardmuon.bench.optimizers import shardmuon_options
from shardmuon.bench.step import with_overlap
from shardmuon.cli import main


def test_overlap_rows_sit_beside_each_shardmuon_impl() -> None:
    impls = ["shardmuon", "shardmuon+offload", "adamw"]
    assert with_overlap(impls, "none") == impls
    assert with_overlap(impls, "forward") == [
        "shardmuon", "shardmuon+overlap", "shardmuon+offload", "shardmuon+offload+overlap",
        "adamw",
    ]  # fmt: skip
    assert shardmuon_options("shardmuon+offload+overlap") == {
        "offload": "state",
        "overlap": "forward",
    }
    assert shardmuon_options("shardmuon-gram+overlap") == {
        "newton_schulz_impl": "gram",
        "overlap": "forward",
    }
    assert shardmuon_options("shardmuon+fast") is None
    assert shardmuon_options("adamw+overlap") is None


def test_a_bad_overlap_is_refused_with_what_is_accepted(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step", "--overlap", "backward", "--nproc", "1"])
    assert exc.value.code == 2
    assert "--overlap: invalid choice: 'backward'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_overlap_row_reports_the_time_step_held_the_caller(tmp_path, capsys) -> None:
    out = tmp_path / "overlap.json"
    code = main(
        [
            "bench", "step", "--model", "tiny-moe", "--layers", "1", "--nproc", "2",
            "--impl", "shardmuon", "--overlap", "forward", "--ns-dtype", "fp32",
            "--steps", "3", "--ns-repeats", "1", "--no-progress", "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    assert "held" in capsys.readouterr().out
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    plain, overlapped = rows["shardmuon"], rows["shardmuon+overlap"]
    assert "held_s" not in plain
    assert 0 < overlapped["held_s"] <= overlapped["step_s"]
    assert overlapped["a2a_gb_per_rank"] == plain["a2a_gb_per_rank"] > 0
