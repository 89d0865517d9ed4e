"""``TrainConfig`` holds a ``MuonConfig`` (issue #30 item 5): one validation path from flag to
constructor, the settings recorded nested and read back from old flat checkpoints too.
Fast: no training."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from shardmuon.config import MuonConfig
from shardmuon.train.cli import _config_from_args, add_parser
from shardmuon.train.cli_flags import OPTIM_FLAGS
from shardmuon.train.config import TrainConfig, config_dict, optim_settings, task_config
from shardmuon.train.resume import (
    RESUME_FIXED,
    flag_name,
    recorded_settings,
    settings_conflicts,
)


def _parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["train", *argv])


def test_the_optimizer_settings_are_one_muon_config():
    config = TrainConfig()
    assert isinstance(config.optim, MuonConfig)
    assert (config.optim.weight_decay, config.optim.newton_schulz_coefficients) == (0.0, "dion")
    mapped = TrainConfig(optim={"lr": 0.02, "mu": 0.9})
    assert (mapped.optim.lr, mapped.optim.mu, mapped.optim.weight_decay) == (0.02, 0.9, 0.0)
    changed = optim_settings(mapped.optim, newton_schulz_impl="gram")
    assert (changed.lr, changed.newton_schulz_impl) == (0.02, "gram")


def test_a_bad_setting_is_refused_in_one_line_naming_it():
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0, got -1\.0$"):
        optim_settings(lr=-1.0)
    with pytest.raises(ValueError, match=r"^qk_clip_threshold must be a finite number > 0"):
        TrainConfig(optim={"qk_clip_threshold": 0})
    with pytest.raises(ValueError, match=r"^momentum: Extra inputs are not permitted$"):
        optim_settings(momentum=0.9)


def test_flags_reach_the_muon_config():
    args = _parse("--lr", "0.03", "--ns-dtype", "fp32", "--ns-impl", "gram", "--coefficients",
                  "polar-express", "--qk-clip-threshold", "20", "--offload", "state",
                  "--nproc", "1")  # fmt: skip
    optim = _config_from_args(args).optim
    assert (optim.lr, optim.newton_schulz_dtype, optim.newton_schulz_impl) == (
        0.03, "float32", "gram",
    )  # fmt: skip
    assert (optim.newton_schulz_coefficients, optim.qk_clip_threshold) == ("polar-express", 20.0)
    assert optim.offload == "state"
    aol = _config_from_args(_parse("--ns-preconditioner", "aol", "--nproc", "1")).optim
    assert (aol.newton_schulz_preconditioner, aol.newton_schulz_coefficients) == ("aol", "aol")


def test_task_defaults_follow_the_task_and_the_optimizer():
    lm = _config_from_args(_parse("--task", "lm", "--nproc", "1"))
    assert lm == task_config("lm", nproc=1)
    adamw = _config_from_args(_parse("--task", "lm", "--optimizer", "adamw", "--nproc", "1"))
    assert adamw.optim.lr == task_config("lm", "adamw").optim.lr and adamw.adamw_lr is None
    reverse = _config_from_args(_parse("--nproc", "1"))
    assert (reverse.task, reverse.steps, reverse.optim.lr) == ("reverse", 150, 0.01)


def test_the_recorded_config_is_json_with_the_settings_nested():
    config = task_config("lm", optim={"qk_clip_threshold": 30.0})
    recorded = json.loads(json.dumps(config_dict(config)))
    assert recorded["optim"]["qk_clip_threshold"] == 30.0
    assert recorded["optim"]["newton_schulz_dtype"] == "bfloat16"
    assert recorded["task"] == "lm" and "lr" not in recorded


def _checkpoint(tmp_path, config: dict):
    ckpt = tmp_path / "step-000002"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "config": config}))
    return ckpt


def test_old_flat_checkpoints_are_read_through_the_old_names(tmp_path):
    flat = {"optimizer": "muon", "coefficients": "dion", "ns_impl": "folded", "ns_dtype": "bf16",
            "ns_preconditioner": None, "update_rms": 0.2, "lr": 0.02, "weight_decay": 0.0,
            "mu": 0.9, "nesterov": False}  # fmt: skip
    ckpt = _checkpoint(tmp_path, flat)
    config = dataclasses.replace(TrainConfig(), resume=str(ckpt))
    recorded = recorded_settings(config, ckpt)
    assert recorded["optim.newton_schulz_dtype"] == "bfloat16"
    assert (recorded["optim.lr"], recorded["optim.mu"]) == (0.02, 0.9)
    assert settings_conflicts(config, recorded) == [
        "--lr 0.01 (checkpoint: 0.02)",
        "--mu 0.95 (checkpoint: 0.9)",
    ]


def test_new_checkpoints_record_the_nested_settings(tmp_path):
    saved = task_config("lm", optim={"lr": 0.03})
    ckpt = _checkpoint(tmp_path, config_dict(saved))
    config = dataclasses.replace(task_config("lm"), resume=str(ckpt))
    recorded = recorded_settings(config, ckpt)
    assert set(recorded) == set(RESUME_FIXED)
    assert settings_conflicts(config, recorded) == [f"--lr {config.optim.lr!r} (checkpoint: 0.03)"]
    assert [flag_name(name) for name in ("optim.newton_schulz_impl", "warmup_steps")] == [
        "--ns-impl",
        "--warmup",
    ]


NUMERIC_OPTIM_FLAGS = [
    "update_rms",
    "lr",
    "weight_decay",
    "mu",
    "qk_clip_threshold",
    "qk_clip_alpha",
]
EDGES = ["-1", "-0", "0", "1e-300", "0.5", "1", "1.5", "1e300", "nan", "inf"]


@pytest.mark.parametrize("dest", NUMERIC_OPTIM_FLAGS)
def test_optimizer_flags_take_what_the_muon_config_takes(dest):
    """One validation path from flag to constructor: each numeric optimizer flag's type is
    built from its MuonConfig setting (its stated range, its validators), and takes a value
    exactly when the config (and, for --lr, training's lr rule) does."""
    from shardmuon.config import FIELD_RANGES
    from shardmuon.train.cli_flags import SettingNumber
    from shardmuon.train.config import TRAIN_LR_RANGE, check_train_lr

    field = OPTIM_FLAGS[dest]
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    add_parser(subparsers)
    train = subparsers.choices["train"]
    (kind,) = [action.type for action in train._actions if action.dest == dest]
    assert isinstance(kind, SettingNumber), (dest, kind)
    limits = TRAIN_LR_RANGE if dest == "lr" else FIELD_RANGES[field]
    assert (kind.low, kind.high, kind.low_open, kind.high_open) == (
        limits.low, limits.high, limits.low_open, limits.high_open,
    )  # fmt: skip
    for text in EDGES:
        try:
            MuonConfig(**{field: float(text)})
            if dest == "lr":
                check_train_lr("lr", float(text))
            want = True
        except ValueError:
            want = False
        try:
            kind(text)
            got = True
        except argparse.ArgumentTypeError as err:
            assert str(err).startswith("must be ") and ", got " in str(err), err
            got = False
        assert got == want, (dest, text)


def test_the_embedding_update_flag_puts_the_embedding_and_head_in_a_sinkhorn_group():
    import torch

    from shardmuon.train.lm_data import VOCAB_SIZE
    from shardmuon.train.loop import build_optimizer, build_training_model

    assert TrainConfig().embedding_update == "adamw"
    args = _parse("--task", "lm", "--layers", "1", "--embedding-update", "sinkhorn", "--nproc", "1")
    config = _config_from_args(args)
    assert config.embedding_update == "sinkhorn"
    assert config_dict(config)["embedding_update"] == "sinkhorn"
    torch.manual_seed(0)
    model = build_training_model(config, VOCAB_SIZE)
    optimizer = build_optimizer(config, model, None)
    names = {id(p): n for n, p in model.named_parameters()}
    algorithm = {names[id(p)]: g["algorithm"] for g in optimizer.param_groups for p in g["params"]}
    assert algorithm["model.embed_tokens.weight"] == algorithm["lm_head.weight"] == "sinkhorn"
    assert algorithm["model.norm.weight"] == "adamw"
    assert algorithm["model.layers.0.self_attn.q_proj.weight"] == "muon"
    (sinkhorn,) = [g for g in optimizer.param_groups if g["algorithm"] == "sinkhorn"]
    assert sinkhorn["lr"] == config.optim.lr  # Muon's lr, not adamw_lr
    # The default keeps prime-rl's routing: both in the AdamW group.
    plain = task_config("lm", num_layers=1, nproc=1)
    groups = build_optimizer(plain, build_training_model(plain, VOCAB_SIZE), None).param_groups
    assert [g["algorithm"] for g in groups] == ["muon", "adamw"]
    # A few steps with finite losses.
    ids = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    before = model.lm_head.weight.detach().clone()
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert not torch.equal(model.lm_head.weight, before)


def test_a_bad_embedding_update_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^embedding_update 'sgd' unknown; accepted: "):
        task_config("lm", embedding_update="sgd", nproc=1).validate()
    adamw = task_config("lm", "adamw", embedding_update="sinkhorn", nproc=1)
    with pytest.raises(ValueError, match=r"^embedding_update 'sinkhorn' is how Muon updates"):
        adamw.validate()
    with pytest.raises(SystemExit):
        _parse("--embedding-update", "sgd")


def test_a_resume_takes_the_checkpoints_embedding_update(tmp_path):
    saved = task_config("lm", embedding_update="sinkhorn")
    ckpt = _checkpoint(tmp_path, config_dict(saved))
    config = dataclasses.replace(task_config("lm"), resume=str(ckpt))
    assert recorded_settings(config, ckpt)["embedding_update"] == "sinkhorn"
    assert settings_conflicts(config, recorded_settings(config, ckpt)) == [
        "--embedding-update 'adamw' (checkpoint: 'sinkhorn')"
    ]
