"""torchtitan's trainer reaches shardmuon through its own config machinery: a registry
function wrapped by ``with_muon`` loads with torchtitan's ``ConfigManager`` (``--module``,
``--config``), its optimizer config builds :class:`MuonOptimizers` the way the trainer calls
it, the AdamW settings of the registry's config carry over, and torchtitan's scheduler drives
both kinds of group. The 4-rank FSDP2 x TP x EP form is ``torchtitan_recipe_fsdp_tp_ep_bitwise``
in ``tests/clients/dist_client_cases.py``."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan's models import it

from shardmuon import Muon
from shardmuon.integrations.torchtitan import (
    ADAMW_PATTERN,
    MuonOptimizers,
    muon_param_groups,
    with_muon,
)

REGISTRY = textwrap.dedent(
    """
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from shardmuon.integrations.torchtitan import with_muon


    def llama3_debugmodel_muon():
        config = with_muon(llama3_debugmodel(), lr=0.03, weight_decay=0.05, max_in_flight=2)
        config.model_spec.model.layers = config.model_spec.model.layers[:1]
        return config
    """
)


@pytest.fixture
def registry_config(tmp_path, monkeypatch):
    from torchtitan.config.manager import ConfigManager

    (tmp_path / "muon_configs.py").write_text(REGISTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "muon_configs", raising=False)
    return ConfigManager().parse_args(
        ["--module", "muon_configs", "--config", "llama3_debugmodel_muon"]
    )


def test_a_registry_config_builds_muon_as_the_trainer_does(registry_config) -> None:
    config = registry_config
    assert isinstance(config.optimizer, MuonOptimizers.Config)
    adamw, muon = (g.optimizer_kwargs for g in config.optimizer.param_groups)
    # llama3_debugmodel's own AdamW: lr 8e-4, betas, eps kept (in shardmuon's names); no
    # decay on AdamW's group.
    assert adamw == {"lr": 8e-4, "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8,
                     "weight_decay": 0.0, "algorithm": "adamw"}  # fmt: skip
    assert muon == {"lr": 0.03, "weight_decay": 0.05, "algorithm": "muon"}

    spec = config.model_spec
    spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=None)
    optimizers = config.optimizer.build(model_parts=[model])  # the trainer's call
    schedulers = config.lr_scheduler.build(
        optimizers=optimizers, training_steps=config.training.steps
    )
    (muon_opt,) = optimizers.optimizers
    assert type(muon_opt) is Muon and muon_opt.max_in_flight == 2
    routed = {n: g["algorithm"] for g in muon_opt.param_groups for n in g["param_names"]}
    assert {n for n, a in routed.items() if a == "adamw"} == {
        "tok_embeddings.weight", "lm_head.weight", "norm.weight",
        "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
    }  # fmt: skip
    assert len(routed) == len(list(model.parameters()))

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lrs = [[g["lr"] for g in muon_opt.param_groups]]  # the warm-up's first factor
    for _ in range(4):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        lrs.append([g["lr"] for g in muon_opt.param_groups])
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # Warm-up, stable, decay: the scheduler moves both kinds of group in proportion.
    assert len({tuple(lr) for lr in lrs}) == 4, lrs
    ratios = {round(m / a, 6) for a, m in lrs}
    assert ratios == {round(0.03 / 8e-4, 6)}


def test_the_pattern_routes_torchtitan_names() -> None:
    import re

    adamw = re.compile(ADAMW_PATTERN)
    to_adamw = [
        "tok_embeddings.weight", "lm_head.weight", "output.weight", "norm.weight",
        "layers.3.attention_norm.weight", "layers.3.attention.q_norm.weight",
        "layers.0._checkpoint_wrapped_module.ffn_norm.weight", "_orig_mod.lm_head.weight",
        "layers.1.attention.wqkv.bias", "layers.0.attention.sinks",
        "layers.0.moe.experts.mlp1_bias_EG", "layers.0.moe.experts.mlp2_bias_ED",
    ]  # fmt: skip
    to_muon = [
        "layers.0.attention.qkv_linear.wqkv.weight", "layers.0.attention.wo.weight",
        "layers.0.feed_forward.w1.weight", "layers.0.moe.router.gate.weight",
        "layers.0.moe.routed_experts.inner_experts.w1_EFD",
        "layers.0.moe.routed_experts.inner_experts.w2_EDF",
        "layers.2.moe.shared_experts.w3.weight", "layers.0.attention.output_gate.weight",
    ]  # fmt: skip
    assert [n for n in to_adamw if not adamw.search(n)] == []
    assert [n for n in to_muon if adamw.search(n)] == []
    groups = muon_param_groups(muon={"lr": 0.02}, adamw={"lr": 1e-3})
    assert [(g.pattern, g.optimizer_kwargs["algorithm"]) for g in groups] == [
        (ADAMW_PATTERN, "adamw"),
        (".*", "muon"),
    ]


def test_the_adamw_settings_carry_over_in_shardmuons_names_and_survive_a_second_call() -> None:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    (group,) = config.optimizer.param_groups
    group.optimizer_kwargs.update(lr=5e-4, betas=(0.5, 0.6), eps=1e-2)
    with_muon(config, lr=0.03)
    adamw = config.optimizer.param_groups[0].optimizer_kwargs
    want = {"lr": 5e-4, "beta1": 0.5, "beta2": 0.6, "epsilon": 1e-2}
    assert {k: adamw[k] for k in want} == want and "betas" not in adamw
    with_muon(config, lr=0.01)  # a registry function built on another Muon one
    adamw = config.optimizer.param_groups[0].optimizer_kwargs
    assert {k: adamw[k] for k in want} == want
    assert config.optimizer.param_groups[1].optimizer_kwargs["lr"] == 0.01


def test_overlap_hooks_each_model_part_when_the_trainer_builds_the_optimizers(
    monkeypatch,
) -> None:
    hooked = []
    monkeypatch.setattr(Muon, "overlap_with", lambda self, model: hooked.append(model))
    parts = [torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.nn.Sequential(torch.nn.Linear(8, 4))]
    config = MuonOptimizers.Config(
        param_groups=muon_param_groups(muon={"lr": 0.02}, adamw={"lr": 1e-3}),
        optimizer_factory_kwargs_by_name={"shardmuon": {"overlap": "forward"}},
    )
    optimizers = config.build(model_parts=parts)
    assert [o.overlap for o in optimizers.optimizers] == ["forward", "forward"]
    assert hooked == parts
