"""``shardmuon train --overlap forward`` (issue #32): the same losses as the sequential
step at 1 and 2 ranks (the step hidden behind the next forward changes no bit), and the
summary and ``--json`` say how long ``optimizer.step()`` held the loop and how long the
forward then waited."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from shardmuon.train.cli import main as train_main
from shardmuon.train.config import TrainConfig, optim_settings
from shardmuon.train.run import run_training

BASE = TrainConfig(
    model="tiny-llama",
    num_layers=2,
    optim={"lr": 0.02, "newton_schulz_dtype": "float32"},
    steps=5,
    batch_size=8,
    max_len=6,
    quiet=True,
)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_overlapped_run_has_the_sequential_losses(nproc):
    plain = run_training(dataclasses.replace(BASE, nproc=nproc))
    overlapped = run_training(
        dataclasses.replace(BASE, nproc=nproc, optim=optim_settings(BASE.optim, overlap="forward"))
    )
    assert overlapped.losses == plain.losses
    assert math.isnan(plain.overlap_wait_seconds) is False and plain.overlap_wait_seconds == 0
    assert overlapped.optimizer_seconds > 0 and overlapped.overlap_wait_seconds >= 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layout", "nproc"),
    [
        ("tiny-moe", "ep", 2),
        # 4-process runs (~11 s each): the overlap on these layouts is stepped bitwise in
        # tests/runtime/test_overlap_distributed.py; the training runs under the exhaustive run
        pytest.param("tiny-llama", "fsdp-tp", 4, marks=pytest.mark.exhaustive),
        pytest.param("tiny-moe", "fsdp", 4, marks=pytest.mark.exhaustive),
    ],
)
def test_expert_and_tensor_parallel_runs_overlap_with_the_same_losses(model, layout, nproc):
    """Expert parallelism (experts over the ranks) and FSDP x TP (a 2x2 mesh): the hooks
    wait for DTensor parameters sharded over other meshes, the step's own groups are made
    for those meshes' groups."""
    base = dataclasses.replace(BASE, model=model, layout=layout, nproc=nproc, steps=4)
    plain = run_training(base)
    overlapped = run_training(
        dataclasses.replace(base, optim=optim_settings(base.optim, overlap="forward"))
    )
    assert overlapped.losses == plain.losses


@pytest.mark.slow
def test_the_summary_and_the_json_report_the_hold_and_the_wait(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--model", "tiny-llama", "--layers", "1", "--steps", "3", "--batch-size", "4",
            "--nproc", "1", "--overlap", "forward", "--json", str(out), "--no-progress"]  # fmt: skip
    assert train_main(argv) == 0
    printed = capsys.readouterr().out
    assert "optimizer.step() held the loop" in printed and "then the forward waited" in printed
    data = json.loads(out.read_text())
    assert data["config"]["optim"]["overlap"] == "forward"
    assert data["optimizer_seconds"] > 0 and data["overlap_wait_seconds"] >= 0


def test_a_bad_overlap_flag_is_refused_before_training(capsys):
    assert train_main(["--overlap", "backward", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--overlap: invalid choice: 'backward'" in err and "Traceback" not in err
