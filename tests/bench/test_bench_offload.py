"""``shardmuon bench step --offload``: argument handling and the offload rows."""

from __future__ import annotations

import json

import pytest

from shardmuon.bench.step import parse_offload, with_offload
from shardmuon.cli import main


def test_offload_modes_expand_shardmuon_impls_only() -> None:
    impls = ["shardmuon", "shardmuon-unfolded", "adamw"]
    assert with_offload(impls, ["none"]) == impls
    assert with_offload(impls, ["state"]) == ["shardmuon+offload", "shardmuon-unfolded+offload"]
    assert with_offload(impls, parse_offload("none,state")) == [
        "shardmuon",
        "shardmuon+offload",
        "shardmuon-unfolded",
        "shardmuon-unfolded+offload",
        "adamw",
    ]
    with pytest.raises(ValueError, match="none of the chosen --impl are shardmuon's"):
        with_offload(["adamw"], ["state"])


@pytest.mark.parametrize("bad", ["", "cpu", "state,gpu", ","])
def test_bad_offload_is_refused_with_what_is_accepted(bad, capsys) -> None:
    assert main(["bench", "step", "--offload", bad, "--nproc", "1"]) == 2
    assert "accepted: none, state, or none,state" in capsys.readouterr().err


@pytest.mark.slow
def test_offload_rows_report_the_state_streamed(tmp_path, capsys) -> None:
    out = tmp_path / "offload.json"
    code = main(
        [
            "bench", "step", "--model", "tiny-moe", "--layers", "1", "--nproc", "1",
            "--layout", "none", "--impl", "shardmuon", "--offload", "none,state",
            "--steps", "2", "--ns-repeats", "1", "--no-progress", "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "optimizer-state offload" in printed and "shardmuon+offload" in printed
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    plain, offloaded = rows["shardmuon"], rows["shardmuon+offload"]
    assert plain["host_device_gb_per_rank"] == 0
    assert offloaded["host_device_gb_per_rank"] > 0
    # the state streams both ways once; only part of it is ever on the device
    streamed = offloaded["host_device_gb_per_rank"] * 1e9
    assert 0 < offloaded["offload_workspace_peak_bytes"] < streamed / 2
