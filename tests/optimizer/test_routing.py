"""Parameter routing: dion/prime-rl fixture groups, Hugging Face MoE families, fused weights.

The Hugging Face tests derive the expected label of each parameter from the class of the
module that owns it (``*Router`` / ``*Experts`` classes), not from its name, so they check the
name rules against transformers' own structure. Runtime: about 4 s, mostly importing
transformers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from fixtures import load_case
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from shardmuon.routing import (
    ADAMW,
    MUON,
    MUON_EXPERTS,
    MUON_ROUTER,
    build_param_groups,
    fused_qkv_partition,
    gate_up_partition,
    route_name,
)

LR, WD = 0.02, 0.1


@pytest.fixture(scope="module")
def case_a() -> dict[str, Any]:
    return load_case("case_A.pt")


def fixture_params(case: dict[str, Any], prefix: str = "") -> list[tuple[str, nn.Parameter]]:
    return [(prefix + n, nn.Parameter(torch.zeros(case["shapes"][n]))) for n in case["names"]]


def flat_params(groups: list[dict]) -> list[torch.Tensor]:
    return [p for g in groups for p in g["params"]]


def without_params(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


# ---------------------------------------------------------------------- dion fixture


def test_fixture_routing_matches_dion_groups(case_a: dict[str, Any]) -> None:
    named = fixture_params(case_a)
    routed = build_param_groups(named, lr=LR, weight_decay=WD)

    assert routed.labels == case_a["routing"]
    assert list(routed.labels) == case_a["names"]
    by_id = {id(p): n for n, p in named}
    group_labels = [routed.labels[by_id[id(g["params"][0])]] for g in routed.groups]
    assert group_labels == case_a["group_labels"]

    flat_names = [by_id[id(p)] for p in flat_params(routed.groups)]
    assert flat_names == sorted(case_a["state_index"], key=case_a["state_index"].__getitem__)
    assert {n: i for i, n in enumerate(flat_names)} == case_a["state_index"]

    expected_specs = [
        {k: v for k, v in spec.items() if k not in ("label", "param_names")}
        for spec in case_a["param_group_specs"]
    ]
    assert [without_params(g) for g in routed.groups] == expected_specs
    for group, spec in zip(routed.groups, case_a["param_group_specs"]):
        assert [by_id[id(p)] for p in group["params"]] == spec["param_names"]


def test_fixture_partitions_split_the_expert_gate_up(case_a: dict[str, Any]) -> None:
    named = dict(fixture_params(case_a))
    moe_i = case_a["model_cfg"]["moe_I"]
    routed = build_param_groups(named.items(), lr=LR, weight_decay=WD)
    gate_up = named["model.layers.1.mlp.experts.gate_up_proj"]
    assert routed.partitions == {gate_up: (moe_i, moe_i)}

    plain = build_param_groups(named.items(), lr=LR, weight_decay=WD, partition_fused=False)
    assert plain.partitions == {}
    assert [without_params(g) for g in plain.groups] == [without_params(g) for g in routed.groups]


@pytest.mark.parametrize("prefix", ["_orig_mod.", "module.", "module._orig_mod."])
def test_wrapper_prefixes_do_not_change_routing(case_a: dict[str, Any], prefix: str) -> None:
    named = fixture_params(case_a, prefix)
    routed = build_param_groups(named, lr=LR, weight_decay=WD, expert_mesh_name="ep")
    assert routed.labels == {prefix + n: label for n, label in case_a["routing"].items()}
    assert len(routed.partitions) == 1
    assert routed.groups[1]["distributed_mesh_name"] == "ep"


def test_frozen_and_repeated_params_are_left_out(case_a: dict[str, Any]) -> None:
    named = fixture_params(case_a)
    frozen_name, frozen = named[0]
    frozen.requires_grad_(False)
    repeated = [*named, ("alias.of.lm_head", named[-1][1])]
    routed = build_param_groups(repeated, lr=LR, weight_decay=WD)
    assert frozen_name not in routed.labels
    assert "alias.of.lm_head" not in routed.labels
    flat = flat_params(routed.groups)
    assert all(p is not frozen for p in flat)
    assert len(flat) == len(named) - 1 == len({id(p) for p in flat})


def test_groups_without_members_are_left_out() -> None:
    named = [
        ("model.layers.0.mlp.down_proj.weight", nn.Parameter(torch.zeros(4, 6))),
        ("model.norm.weight", nn.Parameter(torch.zeros(4))),
    ]
    routed = build_param_groups(named, lr=LR, weight_decay=WD, adjust_lr="spectral_norm")
    assert [g["algorithm"] for g in routed.groups] == ["muon", "adamw"]
    assert routed.groups[0]["adjust_lr"] == "spectral_norm"


# ---------------------------------------------------------------------- Hugging Face MoE

_TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
MOE_I = 24


def tiny_config(family: str) -> transformers.PretrainedConfig:
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **_TINY,
            moe_intermediate_size=MOE_I,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
        )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **{**_TINY, "intermediate_size": MOE_I}, num_local_experts=4, num_experts_per_tok=2
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **_TINY,
            moe_intermediate_size=MOE_I,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_group=1,
            topk_group=1,
        )
    if family == "gpt_oss":
        return transformers.GptOssConfig(
            **{**_TINY, "intermediate_size": MOE_I},
            num_local_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
            eos_token_id=1,
        )
    raise AssertionError(family)


def tiny_model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family))


def label_from_module_class(model: nn.Module) -> dict[str, str]:
    """Expected labels from the owning module's class (independent of the name rules)."""
    expected = {}
    for module_name, module in model.named_modules():
        kind = type(module).__name__.lower()
        for pname, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            if param.ndim < 2 or isinstance(module, nn.Embedding) or module is model.lm_head:
                expected[name] = ADAMW
            elif kind.endswith("experts"):
                expected[name] = MUON_EXPERTS
            elif "router" in kind:
                expected[name] = MUON_ROUTER
            else:
                expected[name] = MUON
    return expected


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_hf_moe_routing_follows_module_types(family: str) -> None:
    model = tiny_model(family)
    frozen_name = "model.layers.0.self_attn.o_proj.weight"
    model.get_parameter(frozen_name).requires_grad_(False)
    routed = build_param_groups(model.named_parameters(), lr=LR, weight_decay=WD)

    expected = label_from_module_class(model)
    del expected[frozen_name]
    assert routed.labels == expected
    assert set(routed.labels.values()) == {MUON, MUON_EXPERTS, MUON_ROUTER, ADAMW}
    # Groups are in prime-rl order and hold exactly the params of their label.
    params = dict(model.named_parameters())
    order = [MUON, MUON_EXPERTS, MUON_ROUTER, ADAMW]
    for label, group in zip(order, routed.groups):
        names = [n for n, lab in routed.labels.items() if lab == label]
        assert [id(p) for p in group["params"]] == [id(params[n]) for n in names]
    assert "distributed_mesh_name" in routed.groups[1]


def test_fsdp2_wrapped_model_keeps_the_routing() -> None:
    # fully_shard turns params into DTensors under the same names. One process is enough
    # to check names and DTensor handling (prefixes are covered above).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_model("qwen3_moe")
    plain = build_param_groups(model.named_parameters(), lr=LR, weight_decay=WD)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        routed = build_param_groups(model.named_parameters(), lr=LR, weight_decay=WD)
    finally:
        if started:
            dist.destroy_process_group()
    assert all(isinstance(p, DTensor) for g in routed.groups for p in g["params"])
    assert routed.labels == plain.labels
    assert [without_params(g) for g in routed.groups] == [without_params(g) for g in plain.groups]
    assert sorted(routed.partitions.values()) == sorted(plain.partitions.values())
    assert len(routed.partitions) == 1


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_hf_expert_gate_up_is_split_in_halves(family: str) -> None:
    model = tiny_model(family)
    routed = build_param_groups(model.named_parameters(), lr=LR, weight_decay=WD)
    gate_ups = {n: p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")}
    assert gate_ups
    assert routed.partitions == {p: (MOE_I, MOE_I) for p in gate_ups.values()}


def test_qwen3_moe_gate_up_holds_contiguous_gate_then_up_halves() -> None:
    # The (I, I) partition is right only if HF's forward reads rows [:I] as the gate and
    # rows [I:] as up (not interleaved): recompute one expert with that reading.
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[1].mlp.experts
    x = torch.randn(5, _TINY["hidden_size"])
    top_k_index = torch.full((5, 1), 2)
    top_k_weights = torch.ones(5, 1)
    with torch.no_grad():
        ours = experts(x, top_k_index, top_k_weights)
        w = experts.gate_up_proj[2]
        gate, up = x @ w[:MOE_I].T, x @ w[MOE_I:].T
        reference = (nn.functional.silu(gate) * up) @ experts.down_proj[2].T
    torch.testing.assert_close(ours, reference)


def test_gpt_oss_transposed_gate_up_is_not_split() -> None:
    # GPT-OSS stores gate_up_proj as [E, H, 2I] with interleaved columns: no row split.
    model = tiny_model("gpt_oss")
    routed = build_param_groups(model.named_parameters(), lr=LR, weight_decay=WD)
    assert routed.partitions == {}
    # prime-rl's rule sends the 2-D expert biases to Muon; kept for checkpoint compatibility.
    assert routed.labels["model.layers.0.mlp.experts.gate_up_proj_bias"] == MUON_EXPERTS
    assert routed.labels["model.layers.0.mlp.router.bias"] == ADAMW


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("model.layers.3.mlp.gate.weight", MUON_ROUTER),
        ("model.layers.3.mlp.gate_proj.weight", MUON),
        ("model.layers.3.mlp.gate_up_proj.weight", MUON),
        ("model.layers.3.mlp.shared_expert_gate.weight", MUON),
        ("model.layers.3.mlp.shared_experts.up_proj.weight", MUON),
        ("model.layers.3.mlp.router.weight", MUON_ROUTER),
        ("model.layers.3.feed_forward.router.weight", MUON_ROUTER),
        ("model.layers.3.mlp.gate.wg.weight", MUON_ROUTER),
        ("model.layers.3.block_sparse_moe.gate.weight", MUON_ROUTER),
        ("model.layers.3.feed_forward.experts.down_proj", MUON_EXPERTS),
        ("model.layers.3.block_sparse_moe.experts.0.w1.weight", MUON_EXPERTS),
        ("_fsdp_wrapped_module.model.embed_tokens.weight", ADAMW),
        ("lm_head.weight", ADAMW),
    ],
)
def test_route_name(name: str, label: str) -> None:
    assert route_name(name, 2) == label
    assert route_name(name, 1) == ADAMW


# ---------------------------------------------------------------------- fused weights


def test_dense_gate_up_partition_uses_the_sibling_down_proj() -> None:
    assert gate_up_partition((96, 32)) == (48, 48)
    assert gate_up_partition((96, 32), down_shape=(32, 48)) == (48, 48)
    assert gate_up_partition((4, 32, 96), down_shape=(4, 48, 32)) is None
    assert gate_up_partition((95, 32)) is None


def test_phi3_fused_qkv_and_gate_up_partitions() -> None:
    config = transformers.Phi3Config(
        **{k: v for k, v in _TINY.items() if k != "head_dim"}, pad_token_id=0
    )
    model = AutoModelForCausalLM.from_config(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    routed = build_param_groups(
        model.named_parameters(),
        lr=LR,
        weight_decay=WD,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    params = dict(model.named_parameters())
    expected = {}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        expected[params[f"{layer}.self_attn.qkv_proj.weight"]] = (
            heads * head_dim,
            kv_heads * head_dim,
            kv_heads * head_dim,
        )
        inter = config.intermediate_size
        expected[params[f"{layer}.mlp.gate_up_proj.weight"]] = (inter, inter)
    assert routed.partitions == expected
    # Without head counts the fused QKV stays one matrix.
    routed = build_param_groups(model.named_parameters(), lr=LR, weight_decay=WD)
    assert len(routed.partitions) == config.num_hidden_layers


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "rows", "expected"),
    [
        (8, 2, 16, 192, (128, 32, 32)),
        (8, 2, None, 192, (128, 32, 32)),
        (4, None, None, 96, (32, 32, 32)),
        (6, 1, 4, 32, (24, 4, 4)),
    ],
)
def test_fused_qkv_partition(heads, kv_heads, head_dim, rows, expected) -> None:
    got = fused_qkv_partition(
        "blocks.0.attn.Wqkv.weight",
        (rows, 64),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
    assert got == expected


@pytest.mark.parametrize(
    ("name", "shape", "kwargs", "match"),
    [
        (
            "attn.qkv_proj.weight",
            (200, 64),
            dict(head_dim=16),
            r"does not match the head counts: expected 192 rows .* got 200",
        ),
        (
            "attn.qkv_proj.weight",
            (190, 64),
            {},
            r"190 rows are not a multiple of heads \+ 2\*kv_heads",
        ),
        (
            "attn.qkv.weight",
            (64, 192),
            dict(head_dim=16),
            r"got 64 \(its columns match: the weight looks stored as \[in, out\]",
        ),
        ("h.0.attn.c_attn.weight", (192, 64), {}, r"GPT-2 stores it as Conv1D"),
        (
            "gpt_neox.layers.0.attention.query_key_value.weight",
            (192, 64),
            {},
            r"interleave Q, K and V per head",
        ),
    ],
)
def test_fused_qkv_partition_errors(name, shape, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        fused_qkv_partition(name, shape, num_attention_heads=8, num_key_value_heads=2, **kwargs)


def test_build_param_groups_reports_qkv_mismatch_by_name() -> None:
    named = [("layers.0.attn.qkv_proj.weight", nn.Parameter(torch.zeros(200, 64)))]
    with pytest.raises(ValueError, match=r"'layers.0.attn.qkv_proj.weight' of shape \(200, 64\)"):
        build_param_groups(
            named, lr=LR, weight_decay=WD, num_attention_heads=8, num_key_value_heads=2, head_dim=16
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(adjust_lr="rms"), ValueError, r"adjust_lr must be one of .* got 'rms'"),
        (dict(head_dim=16), ValueError, r"without num_attention_heads"),
        (
            dict(num_attention_heads=0),
            ValueError,
            r"num_attention_heads must be a positive int, got 0",
        ),
        (
            dict(num_attention_heads=8, num_key_value_heads=3),
            ValueError,
            r"multiple of num_key_value_heads=3",
        ),
    ],
)
def test_build_param_groups_rejects_bad_arguments(kwargs, error, match) -> None:
    named = [("attn.qkv_proj.weight", nn.Parameter(torch.zeros(192, 64)))]
    with pytest.raises(error, match=match):
        build_param_groups(named, lr=LR, weight_decay=WD, **kwargs)


def test_build_param_groups_rejects_non_tensor_pairs() -> None:
    with pytest.raises(TypeError, match=r"\(str, Tensor\) pairs, got \(str, list\)"):
        build_param_groups([("w", [1.0])], lr=LR, weight_decay=WD)
