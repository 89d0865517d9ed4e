"""``shardmuon train``: the reverse-text task, FSDP2 training, DCP checkpoints and resumes.

The multi-process runs are shared by the tests through module-scoped fixtures (each spawn
costs seconds on a 2-core machine): one uninterrupted 2-rank run U with checkpoints, its
resume at 2 ranks (must be bitwise identical) and at 3 ranks (same curve within bf16 noise),
and a 2-rank resume from a dion-format file written by a single-process run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from fixtures import load_case

from shardmuon.train import CharTokenizer, CheckpointError, ReverseTextTask, TrainConfig
from shardmuon.train import checkpoint as ckpt_io
from shardmuon.train.cli import main as train_main
from shardmuon.train.config import optim_settings, range_means
from shardmuon.train.data import IGNORE_INDEX, num_target_tokens, rank_slice
from shardmuon.train.dion_format import read_dion_file
from shardmuon.train.loop import build_optimizer, build_training_model, sft_loss_sum
from shardmuon.train.run import run_training

STEPS = 12
HALF = 6
BASE = TrainConfig(
    model="tiny-moe",
    num_layers=2,
    optimizer="muon",
    optim={"lr": 0.01},
    steps=STEPS,
    batch_size=8,
    min_len=2,
    max_len=6,
    nproc=2,
    quiet=True,
)
# Muon's bf16 Newton-Schulz moves an update by ~2% when only its rounding changes (dion
# fixtures README); a few steps later the loss of a re-sharded run may differ by about that.
BF16_LOSS_RTOL = 0.03


def _with(config: TrainConfig, optim=None, **changes) -> TrainConfig:
    """``config`` with ``changes``; ``optim``: MuonConfig fields changed under ``optim``."""
    if optim:
        changes["optim"] = optim_settings(config.optim, **optim)
    return dataclasses.replace(config, **changes)


def _run(**changes) -> dict[int, float]:
    return run_training(_with(BASE, **changes)).losses


def _dcp_tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, unsharded (read without a process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


# ---------------------------------------------------------------------------- task (fast)


def test_reverse_text_batch_is_the_reversed_string():
    tok = CharTokenizer()
    task = ReverseTextTask(min_len=3, max_len=9, seed=7)
    batch = task.batch(step=5, batch_size=6, tokenizer=tok)
    assert batch["input_ids"].shape == (6, task.seq_len)
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        bos, rest = ids[0], ids[1:]
        sep = rest.index(tok.SEP)
        source = tok.decode(rest[:sep])
        target_ids = [t for t in labels if t != IGNORE_INDEX]
        assert bos == tok.BOS
        assert 3 <= len(source) <= 9
        assert tok.decode(target_ids) == source[::-1]
        assert target_ids[-1] == tok.EOS
        # Supervised positions are exactly the ones after <sep> holding the target.
        first = labels.index(target_ids[0])
        assert ids[first - 1] == tok.SEP
        assert ids[first : first + len(target_ids)] == target_ids


def test_batches_depend_only_on_seed_and_step():
    tok = CharTokenizer()
    task = ReverseTextTask(seed=1)
    again = ReverseTextTask(seed=1).batch(9, 4, tok)
    for key, value in task.batch(9, 4, tok).items():
        assert torch.equal(value, again[key])
    assert not torch.equal(task.batch(9, 4, tok)["input_ids"], task.batch(10, 4, tok)["input_ids"])
    assert not torch.equal(
        task.batch(9, 4, tok)["input_ids"], ReverseTextTask(seed=2).batch(9, 4, tok)["input_ids"]
    )


def test_rank_slices_partition_the_global_batch():
    tok = CharTokenizer()
    batch = ReverseTextTask().batch(1, 8, tok)
    for world in (1, 2, 3):
        parts = [rank_slice(batch, r, world) for r in range(world)]
        assert torch.equal(torch.cat([p["labels"] for p in parts]), batch["labels"])
        assert sum(num_target_tokens(p["labels"]) for p in parts) == num_target_tokens(
            batch["labels"]
        )


def test_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match=r"\['A'\]"):
        CharTokenizer().encode("abA")


def test_range_means_only_reports_covered_ranges():
    losses = {s: float(s) for s in range(1, 64)}
    means = range_means(losses)
    assert set(means) == {"1-10", "11-31", "32-62"}
    assert means["11-31"] == pytest.approx(sum(range(11, 32)) / 21)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"optimizer": "sgd"}, "optimizer 'sgd' unknown"),
        ({"batch_size": 1, "nproc": 2}, r"batch_size \(1\) must be >= nproc \(2\)"),
        ({"optim": {"lr": 0.0}}, "lr must be a finite number > 0, got 0.0"),
        ({"optim": {"newton_schulz_coefficients": "nope"}}, "nope"),
        ({"layout": "tp"}, "layout 'tp' unknown"),
        ({"checkpoint_every": 5}, "checkpoint_every needs checkpoint_dir"),
    ],
)
def test_bad_config_is_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        _with(BASE, **changes).validate()


def test_cli_bad_value_exits_2_without_traceback(capsys):
    assert train_main(["--lr", "0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "lr must be a finite number > 0, got 0.0" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------- training runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The shared runs (see the module docstring); returns their losses and paths."""
    tmp = tmp_path_factory.mktemp("train")
    out = {"tmp": tmp}
    out["U"] = _run(checkpoint_dir=str(tmp / "U"), checkpoint_every=HALF)
    out["R"] = _run(
        resume=str(tmp / "U" / f"step-{HALF:06d}"),
        checkpoint_dir=str(tmp / "R"),
        checkpoint_every=HALF,
    )
    out["W3"] = _run(
        nproc=3,
        resume=str(tmp / "U" / f"step-{HALF:06d}"),
        checkpoint_dir=str(tmp / "W3"),
        checkpoint_every=HALF,
    )
    # A single-process run writes the dion-format file (plain optimizer.state_dict()).
    dion_file = tmp / "dion_step6.pt"
    out["single"] = _run(nproc=1, dion_out=str(dion_file), steps=HALF)
    out["single_full"] = _run(nproc=1)
    out["single_resumed"] = _run(nproc=1, resume_dion=str(dion_file))
    out["dion2"] = _run(nproc=2, resume=str(dion_file))  # auto-detected: a file
    out["dion_file"] = dion_file
    return out


@pytest.mark.slow
def test_loss_goes_down(runs):
    losses = runs["U"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values())
    # Held-out check on the saved weights: a fixed batch from another seed, scored by the
    # initial model and by the step-12 checkpoint (less noisy than the training losses).
    tok = CharTokenizer()
    batch = ReverseTextTask(BASE.min_len, BASE.max_len, seed=12345).batch(1, 128, tok)
    tokens = num_target_tokens(batch["labels"][:, 1:])
    model = build_training_model(BASE, tok.vocab_size)
    with torch.no_grad():
        initial = float(sft_loss_sum(model, batch)) / tokens
        saved = _dcp_tensors(runs["tmp"] / "U" / f"step-{STEPS:06d}", runs["tmp"])
        model.load_state_dict(
            {k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.")}
        )
        trained = float(sft_loss_sum(model, batch)) / tokens
    assert initial == pytest.approx(losses[1], rel=0.05)  # both near ln(vocab) at init
    assert trained < initial - 0.2, (initial, trained)


@pytest.mark.slow
def test_offloaded_state_trains_bitwise_like_without(runs):
    tmp = runs["tmp"]
    losses = _run(optim={"offload": "state"}, checkpoint_dir=str(tmp / "O"), checkpoint_every=STEPS)
    assert losses == runs["U"]
    plain = _dcp_tensors(tmp / "U" / f"step-{STEPS:06d}", tmp)
    offloaded = _dcp_tensors(tmp / "O" / f"step-{STEPS:06d}", tmp)
    assert plain.keys() == offloaded.keys()
    for key, value in plain.items():
        assert torch.equal(value, offloaded[key]), key


@pytest.mark.slow
def test_exact_resume_same_world_size(runs):
    tmp = runs["tmp"]
    assert runs["R"] == {s: runs["U"][s] for s in range(HALF + 1, STEPS + 1)}
    uninterrupted = _dcp_tensors(tmp / "U" / f"step-{STEPS:06d}", tmp)
    resumed = _dcp_tensors(tmp / "R" / f"step-{STEPS:06d}", tmp)
    assert uninterrupted.keys() == resumed.keys()
    assert any(k.startswith("optim.state.") and k.endswith("momentum") for k in resumed)
    for key, value in uninterrupted.items():
        assert torch.equal(value, resumed[key]), key
    state = json.loads((tmp / "R" / f"step-{STEPS:06d}" / "trainer_state.json").read_text())
    assert state["step"] == STEPS and state["world_size"] == 2
    # The resumed checkpoint carries the whole loss history, the first half from U's.
    assert {int(k): v for k, v in state["losses"].items()} == runs["U"]


@pytest.mark.slow
def test_resume_at_another_world_size(runs):
    tmp = runs["tmp"]
    reference = {s: runs["U"][s] for s in range(HALF + 1, STEPS + 1)}
    resumed = runs["W3"]
    assert resumed.keys() == reference.keys()
    # The first resumed step runs the same weights on the same batch: only the reduction
    # order of the loss differs.
    assert resumed[HALF + 1] == pytest.approx(reference[HALF + 1], rel=1e-5)
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=BF16_LOSS_RTOL), step
    three = _dcp_tensors(tmp / "W3" / f"step-{STEPS:06d}", tmp)
    two = _dcp_tensors(tmp / "U" / f"step-{STEPS:06d}", tmp)
    name = "model.model.layers.1.mlp.experts.gate_up_proj"
    start = _dcp_tensors(tmp / "U" / f"step-{HALF:06d}", tmp)[name]
    moved = (two[name] - start).norm()
    assert (three[name] - two[name]).norm() < 0.2 * moved


@pytest.mark.slow
def test_dion_format_file_matches_dion_keys(runs):
    blob = read_dion_file(runs["dion_file"])
    reference = load_case("case_A.pt")["state_dict_after_step"][2]
    ours = blob["optimizer"]
    assert [sorted(g) for g in ours["param_groups"]] == [
        sorted(g) for g in reference["param_groups"]
    ]
    assert [g["algorithm"] for g in ours["param_groups"]] == [
        g["algorithm"] for g in reference["param_groups"]
    ]
    assert all(g["step"] == HALF for g in ours["param_groups"])
    ids = [i for g in ours["param_groups"] for i in g["params"]]
    assert ids == list(range(len(blob["model"])))
    adamw_ids = set(ours["param_groups"][-1]["params"])
    for idx, per_param in ours["state"].items():
        wanted = {"momentum", "variance"} if idx in adamw_ids else {"momentum"}
        assert set(per_param) == wanted


@pytest.mark.slow
def test_resume_from_dion_format_state_dict(runs):
    tail = range(HALF + 1, STEPS + 1)
    # Single process: resuming from the dion file reproduces the uninterrupted run exactly.
    assert runs["single_resumed"] == {s: runs["single_full"][s] for s in tail}
    # Two ranks (FSDP2): the same curve within bf16 noise; the first step only differs by
    # the reduction order of the loss.
    resumed = runs["dion2"]
    assert resumed[HALF + 1] == pytest.approx(runs["single_full"][HALF + 1], rel=1e-5)
    for step in tail:
        assert resumed[step] == pytest.approx(runs["single_full"][step], rel=BF16_LOSS_RTOL)


# ---------------------------------------------------------------------------- bad checkpoints


@pytest.mark.slow
def test_checkpoint_from_another_model_is_rejected(runs):
    path = runs["tmp"] / "U" / f"step-{HALF:06d}"
    with pytest.raises(CheckpointError, match=r"another model: missing params .*q_proj"):
        run_training(dataclasses.replace(BASE, model="tiny-dense", resume=str(path)))
    with pytest.raises(CheckpointError, match=r"params this model does not have .*layers\.1\."):
        run_training(dataclasses.replace(BASE, num_layers=1, resume=str(path)))
    key = "model.model.embed_tokens.weight"
    with pytest.raises(
        CheckpointError, match=rf"shapes differ: {key} \(30, 256\) \(this run: \(99, 256\)\)"
    ):
        ckpt_io.check_compatible(path, {key: (99, 256)})


@pytest.mark.slow
def test_missing_optimizer_state_is_named(runs):
    path = runs["tmp"] / "U" / f"step-{HALF:06d}"
    # A run names the setting that differs from the checkpoint's first...
    with pytest.raises(ValueError, match=r"--optimizer 'adamw' \(checkpoint: 'muon'\)"):
        run_training(dataclasses.replace(BASE, optimizer="adamw", resume=str(path)))
    # ... and the tensor check names the state such an optimizer would miss.
    config = dataclasses.replace(BASE, optimizer="adamw")
    model = build_training_model(config, CharTokenizer().vocab_size)
    optimizer = build_optimizer(config, model, None)
    expected = ckpt_io.expected_entries(ckpt_io.training_state_dict(model, optimizer))
    with pytest.raises(CheckpointError, match=r"missing optimizer state: .*exp_avg"):
        ckpt_io.check_compatible(path, expected)


def test_missing_or_foreign_checkpoints_are_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        run_training(dataclasses.replace(BASE, resume=str(tmp_path / "nope")))
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        run_training(dataclasses.replace(BASE, resume=str(tmp_path)))
    optim_only = tmp_path / "optim.pt"
    torch.save({"state": {}, "param_groups": []}, optim_only)
    with pytest.raises(CheckpointError, match="optimizer state_dict only"):
        run_training(dataclasses.replace(BASE, resume_dion=str(optim_only)))


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = ckpt_io.save_checkpoint(tmp_path, 5, model, optimizer, {"step": 5, "world_size": 1})
    before = {p.name: p.read_bytes() for p in first.rglob("*") if p.is_file()}

    def broken_save(state_dict, *, checkpoint_id, **kwargs):
        (Path(checkpoint_id) / "partial.distcp").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", broken_save)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        ckpt_io.save_checkpoint(tmp_path, 5, model, optimizer, {"step": 5, "world_size": 1})
    after = {p.name: p.read_bytes() for p in first.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]


# ---------------------------------------------------------------------------- outputs


def test_plot_command_writes_a_png(tmp_path, capsys):
    from shardmuon.cli import main as project_main

    files = []
    for i, decay in enumerate((0.9, 0.8)):
        path = tmp_path / f"run{i}.json"
        losses = [{"step": s, "loss": 3.0 * decay**s} for s in range(1, 21)]
        path.write_text(json.dumps({"losses": losses}))
        files.append(str(path))
    png = tmp_path / "curve.png"
    assert project_main(["train", "plot", *files, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().err.splitlines() == [f"wrote loss curves (PNG): {png}"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert train_main(["plot", str(bad), "--plot", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_train_outputs_are_announced_one_line_each(tmp_path, capsys):
    ck, csv, png, dion = tmp_path / "ck", tmp_path / "l.csv", tmp_path / "l.png", tmp_path / "d.pt"
    old_json = tmp_path / "old.json"
    argv = ["--model", "tiny-dense", "--layers", "1", "--batch-size", "4", "--max-len", "4",
            "--nproc", "1", "--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
            "--csv", str(csv), "--plot", str(png), "--dion-out", str(dion),
            "--out", str(old_json), "--no-progress"]  # fmt: skip
    assert train_main(argv) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"shardmuon train: warning: --out is deprecated; use --json {old_json}",
        f"wrote 2 checkpoints (step-000002 ... step-000004): {ck}",
        f"wrote dion-format checkpoint: {dion}",
        f"wrote losses and config (JSON): {old_json}",
        f"wrote losses (CSV): {csv}",
        f"wrote loss curve (PNG): {png}",
    ]
    rows = csv.read_text().splitlines()
    assert rows[0] == "step,loss" and [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3", "4"]
    recorded = json.loads(old_json.read_text())
    assert [item["step"] for item in recorded["losses"]] == [1, 2, 3, 4]
    assert recorded["config"]["json_out"] == str(old_json)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
