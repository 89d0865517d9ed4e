"""Hugging Face ``transformers.Trainer`` end to end in one process: Muon through the
Trainer's optimizer factory (``MuonFactory``) and as a plain class (groups split by shape),
trained on a tiny Llama, and a resume from the Trainer's own checkpoint bitwise the
uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from shardmuon import Muon
from shardmuon.integrations.hf import MuonFactory
from shardmuon.routing import ADAMW, MUON

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_trainer_ddp_program import Tokens, tiny_llama  # noqa: E402

_Tokens, _model = Tokens, tiny_llama


def _trainer(tmp_path, optimizer, max_steps: int = 4, **args):
    model = _model()
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
        learning_rate=0.02, weight_decay=0.1, save_steps=2, save_strategy="steps",
        logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, **args,
    )  # fmt: skip
    return transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=_Tokens(),
        optimizer_cls_and_kwargs=optimizer,
    )


FACTORY = (MuonFactory, {"lr": 0.02, "weight_decay": 0.1})


def test_the_factory_routes_the_model_and_trains(tmp_path) -> None:
    trainer = _trainer(tmp_path, FACTORY, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    opt = (
        trainer.optimizer.optimizer
        if hasattr(trainer.optimizer, "optimizer")
        else (trainer.optimizer)
    )
    assert isinstance(opt, Muon)
    labels = opt.routing.labels
    assert labels["model.embed_tokens.weight"] == ADAMW and labels["lm_head.weight"] == ADAMW
    assert labels["model.layers.0.self_attn.q_proj.weight"] == MUON
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    model = trainer.model
    assert decay[id(model.model.norm.weight)] == 0.0  # the Trainer's convention: no vector
    assert decay[id(model.model.embed_tokens.weight)] == 0.1
    assert opt.last_step_stats.matrices_orthogonalized > 0
    for n, p in trainer.model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n  # every parameter trained


def test_muon_as_a_plain_class_splits_the_trainers_groups_by_shape(tmp_path) -> None:
    trainer = _trainer(tmp_path, (Muon, {"lr": 0.02}), max_steps=1)
    trainer.train()
    opt = (
        trainer.optimizer.optimizer
        if hasattr(trainer.optimizer, "optimizer")
        else (trainer.optimizer)
    )
    algorithms = {g["algorithm"] for g in opt.param_groups}
    assert algorithms == {"muon", "adamw"}
    for group in opt.param_groups:
        ndims = {p.ndim for p in group["params"]}
        assert (ndims <= {0, 1}) == (group["algorithm"] == "adamw"), (group["algorithm"], ndims)


def test_a_resume_from_the_trainers_checkpoint_is_bitwise(tmp_path) -> None:
    whole = _trainer(tmp_path / "whole", FACTORY)
    whole.train()
    want = {n: p.detach().clone() for n, p in whole.model.named_parameters()}
    first = _trainer(tmp_path / "resumed", FACTORY)
    first.train()  # saves at steps 2 and 4
    resumed = _trainer(tmp_path / "resumed", FACTORY)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p.detach(), want[n]), n


def test_the_factory_passes_its_routing_settings_on() -> None:
    opt = MuonFactory()(_model(), adjust_lr="spectral_norm", lr=0.01)
    muon = [g for g in opt.param_groups if g["algorithm"] == "muon"]
    assert muon and all(g["adjust_lr"] == "spectral_norm" for g in muon)
    model = _model()
    q = model.model.layers[0].self_attn.q_proj.weight  # 32 rows: two blocks of 16
    opt = MuonFactory()(model, matrix_partitions={q: (16, 16)})
    assert opt.routing.labels["model.layers.0.self_attn.q_proj.weight"] == "muon"
