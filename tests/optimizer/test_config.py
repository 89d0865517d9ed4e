"""MuonConfig validation and build_optimizer. Runtime: about 3 s (transformers import)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import transformers
from pydantic import ValidationError
from torch import nn
from transformers import AutoModelForCausalLM

from shardmuon import NS_PRESETS, newton_schulz, resolve_coefficients
from shardmuon.config import QK_CLIP_FIELDS, MuonConfig, build_optimizer
from shardmuon.optimizer import Muon
from shardmuon.routing import build_param_groups

# Muon keywords a config does not carry: what the model gives (params, partitions through
# the routing) and dion's mesh and kernel arguments, which Muon accepts and ignores.
NOT_IN_CONFIG = {
    "self",
    "params",
    "matrix_partitions",
    "distributed_mesh",
    "world_mesh",
    "fsdp_mesh_dim",
    "use_triton",
    "newton_schulz_func",
    "max_concurrent_tasks",  # prime-rl's name for max_in_flight: the config has that one
}
# Where the defaults differ on purpose: Muon is dion's drop-in, the config is the seed's.
# (the config's default, the constructor's): None for max_in_flight means 3 unless
# max_concurrent_tasks is given.
CONFIG_DEFAULTS = {"adjust_lr": ("rms_norm", "spectral_norm"), "max_in_flight": (3, None)}


def test_config_covers_every_constructor_option_with_its_default() -> None:
    signature = inspect.signature(Muon.__init__).parameters
    fields = MuonConfig().model_dump(exclude=set(QK_CLIP_FIELDS))
    assert set(signature) - NOT_IN_CONFIG == set(fields)
    assert set(MuonConfig().model_dump()) - set(fields) == {"qk_clip_threshold", "qk_clip_alpha"}
    for name, value in fields.items():
        expected_config, expected_muon = CONFIG_DEFAULTS.get(name, (value, value))
        assert value == expected_config, name
        assert signature[name].default == expected_muon, name


def test_every_config_field_reaches_the_optimizer() -> None:
    model = nn.Sequential(nn.Linear(8, 6, bias=False))
    config = MuonConfig(
        flatten=True,
        split_replicas=True,
        rotate_owners=False,
        check_grads="always",
        newton_schulz_impl="unfolded",
        max_in_flight=2,
        update_rms=0.3,
    )
    opt = build_optimizer(model, config)
    assert (opt.split_replicas, opt.rotate_owners, opt.check_grads, opt.max_in_flight) == (
        True,
        False,
        "always",
        2,
    )
    assert opt.update_rms == 0.3
    assert opt.newton_schulz_impl == "unfolded"
    assert all(group["flatten"] for group in opt.param_groups)


BAD_VALUES = [
    ("lr", -0.01, r"lr must be a finite number >= 0, got -0.01"),
    ("lr", float("nan"), r"lr must be a finite number >= 0, got nan"),
    ("lr", True, r"lr must be a finite number >= 0, got True"),
    ("lr", "fast", r"lr must be a finite number >= 0, got 'fast'"),
    ("weight_decay", -1e-4, r"weight_decay must be a finite number >= 0, got -0.0001"),
    ("weight_decay", float("inf"), r"weight_decay must be a finite number >= 0, got inf"),
    # The constructor's range, spelled once (validation.check_epsilon): eps >= float32's
    # smallest normal number.
    ("epsilon", -1e-8, r"epsilon must be a finite number >= 1\.17549435.*, got -1e-08"),
    ("epsilon", 0.0, r"epsilon must be a finite number >= 1\.17549435.*, got 0.0"),
    ("mu", -0.1, r"mu must be a number in \[0, 1\), got -0.1"),
    ("mu", 1.0, r"mu must be a number in \[0, 1\), got 1.0"),
    (
        "betas",
        (0.9, 1.0),
        r"betas\[1\] must be a number in \[0, 1\), got 1.0",
    ),
    ("betas", (-0.1, 0.95), r"betas\[0\] must be a number in \[0, 1\), got -0.1"),
    ("betas", (0.9,), r"betas must be a pair .* got \(0.9,\)"),
    ("betas", 0.9, r"betas must be a pair .* got 0.9"),
    (
        "adjust_lr",
        "rms",
        r"unknown adjust_lr 'rms'; accepted: 'rms_norm', 'spectral_norm', 'keller_muon' or None",
    ),
    ("momentum", 0.9, r"momentum\n  Extra inputs are not permitted"),
    ("flatten", 2, r"Input should be a valid boolean"),
]


@pytest.mark.parametrize(("field", "value", "match"), BAD_VALUES)
def test_bad_values_name_field_value_and_what_is_accepted(field, value, match) -> None:
    with pytest.raises(ValueError, match=match) as info:
        MuonConfig(**{field: value})
    assert isinstance(info.value, ValidationError)
    (error,) = info.value.errors()
    assert error["loc"] == (field,)


@pytest.mark.parametrize("preset", sorted(NS_PRESETS))
def test_preset_name_is_kept_and_resolves(preset: str) -> None:
    config = MuonConfig(newton_schulz_coefficients=preset)
    assert config.newton_schulz_coefficients == preset
    assert resolve_coefficients(config.newton_schulz_coefficients) == NS_PRESETS[preset]


def test_explicit_triples_resolve_like_the_preset() -> None:
    # DeepSeek-V4 written out as TOML would give it: lists of numbers, ints included.
    spec = [[3.4445, -4.7750, 2.0315]] * 8 + [[2, -1.5, 0.5]] * 2
    config = MuonConfig(newton_schulz_coefficients=spec)
    assert config.newton_schulz_coefficients == [tuple(map(float, t)) for t in spec]
    assert resolve_coefficients(config.newton_schulz_coefficients) == NS_PRESETS["deepseek-v4"]


def test_parsed_text_values_are_coerced() -> None:
    config = MuonConfig(lr="0.02", betas=["0.8", 0.99], nesterov=True, adjust_lr=None)
    assert (config.lr, config.betas, config.nesterov, config.adjust_lr) == (
        0.02,
        (0.8, 0.99),
        True,
        None,
    )
    assert config.muon_kwargs()["betas"] == (0.8, 0.99)
    with pytest.raises(ValidationError, match="frozen"):
        config.lr = 0.1


# ---------------------------------------------------------------------- build_optimizer

MOE_I, HIDDEN = 24, 32


def tiny_qwen3_moe() -> nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        moe_intermediate_size=MOE_I,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.get_parameter("model.layers.0.self_attn.q_norm.weight").requires_grad_(False)
    return model


def test_build_optimizer_groups_follow_the_routing() -> None:
    model = tiny_qwen3_moe()
    config = MuonConfig(lr=0.02, mu=0.9, weight_decay=0.1, nesterov=True, epsilon=1e-7)
    opt = build_optimizer(model, config, expert_mesh_name="ep")
    routed = build_param_groups(
        model.named_parameters(), lr=0.02, weight_decay=0.1, expert_mesh_name="ep"
    )
    assert len(opt.param_groups) == len(routed.groups) == 4
    for ours, expected in zip(opt.param_groups, routed.groups):
        assert [id(p) for p in ours["params"]] == [id(p) for p in expected["params"]]
        # The routed keys are kept as given; the rest are the config's (dion fills defaults).
        for key, value in expected.items():
            if key != "params":
                assert ours[key] == value, key
        assert (ours["mu"], ours["nesterov"], ours["epsilon"]) == (0.9, True, 1e-7)
        assert (ours["beta1"], ours["beta2"]) == config.betas


def test_build_optimizer_passes_the_gate_up_partitions() -> None:
    # One step from zero momentum: each (I, I) half of an expert gate_up moves by
    # lr * update_rms * sqrt(max(I, H)) * NS(half of G), computed here half by half.
    model = tiny_qwen3_moe()
    config = MuonConfig(lr=0.02, weight_decay=0.0)
    opt = build_optimizer(model, config)
    gate_up = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=generator)
    before = gate_up.detach().clone()
    opt.step()
    delta = before - gate_up.detach()

    scale = config.lr * config.update_rms * math.sqrt(max(MOE_I, HIDDEN))
    halves = gate_up.grad.split(MOE_I, dim=-2)
    expected = torch.cat([scale * newton_schulz(h).float() for h in halves], dim=-2)
    torch.testing.assert_close(delta, expected, rtol=2e-2, atol=scale * 2e-2)
