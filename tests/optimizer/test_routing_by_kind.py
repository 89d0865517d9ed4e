"""Routing by what a parameter is: ``build_param_groups(model, ...)`` finds embeddings and
output heads from the modules (Hugging Face Llama, Qwen3 and GPT-2, a torchtitan-style
Llama, a plain module), the names of other model families are known too, a likely
embedding sent to Muon warns, and ``summary()`` says where everything went and why."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from shardmuon import Muon
from shardmuon.routing import ADAMW, MUON, SINKHORN, build_param_groups

transformers = pytest.importorskip("transformers")


def _hf(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=1200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    if kind == "qwen3":
        config = transformers.Qwen3Config(
            vocab_size=1200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        )  # fmt: skip
        return transformers.Qwen3ForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=1200, n_positions=64, n_embd=32, n_layer=2, n_head=4
    )
    return transformers.GPT2LMHeadModel(config)  # wte tied to lm_head


class _TitanLlama(nn.Module):
    """torchtitan's Llama naming: tok_embeddings, layers.N.attention.wq..., output."""

    def __init__(self, vocab: int = 1500, dim: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict(
            {
                str(i): nn.ModuleDict(
                    {
                        "attention": nn.ModuleDict(
                            {w: nn.Linear(dim, dim, bias=False) for w in ("wq", "wk", "wv", "wo")}
                        ),
                        "feed_forward": nn.ModuleDict(
                            {w: nn.Linear(dim, dim, bias=False) for w in ("w1", "w2", "w3")}
                        ),
                        "attention_norm": nn.LayerNorm(dim),
                    }
                )
                for i in range(2)
            }
        )
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


def _groups_by_label(routed) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, label in routed.labels.items():
        out.setdefault(label, set()).add(name)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hugging_face_models_route_alike_by_module_and_by_name(kind) -> None:
    model = _hf(kind)
    by_module = build_param_groups(model, lr=0.02, weight_decay=0.1)
    by_name = build_param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)
    assert by_module.labels == by_name.labels  # prime-rl's routing, so dion's state ids
    assert [len(g["params"]) for g in by_module.groups] == [
        len(g["params"]) for g in by_name.groups
    ]
    adamw = _groups_by_label(by_module)[ADAMW]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= adamw
    assert (
        "embedding (Embedding model.embed_tokens)" in by_module.reasons["model.embed_tokens.weight"]
    )
    assert "output head" in by_module.reasons["lm_head.weight"]


def test_gpt2_embeddings_and_its_tied_head() -> None:
    model = _hf("gpt2")
    for routed in (
        build_param_groups(model, lr=0.02, weight_decay=0.1),
        build_param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1),
    ):
        assert routed.labels["transformer.wte.weight"] == ADAMW  # tied: lm_head is the same
        assert routed.labels["transformer.wpe.weight"] == ADAMW
        assert "lm_head.weight" not in routed.labels  # routed once, under its first name
        assert routed.labels["transformer.h.0.attn.c_attn.weight"] == MUON
    Muon(build_param_groups(model, lr=0.02, weight_decay=0.1).groups)  # steps as routed


def test_a_torchtitan_llama_by_module_by_name_and_with_sinkhorn() -> None:
    model = _TitanLlama()
    for routed in (
        build_param_groups(model, lr=0.02, weight_decay=0.1),
        build_param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1),
    ):
        assert routed.labels["tok_embeddings.weight"] == ADAMW
        assert routed.labels["output.weight"] == ADAMW
        assert routed.labels["layers.0.attention.wq.weight"] == MUON
    routed = build_param_groups(model, lr=0.02, weight_decay=0.1, embedding_update="sinkhorn")
    assert routed.labels["tok_embeddings.weight"] == SINKHORN
    assert routed.labels["output.weight"] == SINKHORN
    assert "onto the 1500-entry vocabulary" in routed.reasons["output.weight"]


def test_a_plain_module_needs_the_model_and_a_named_head_warns() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(5000, 64)
            self.body = nn.Linear(64, 64)
            self.to_vocab = nn.Linear(64, 5000, bias=False)

    model = Plain()
    routed = build_param_groups(model, lr=0.02, weight_decay=0.1)
    assert routed.labels["table.weight"] == ADAMW
    assert routed.labels["to_vocab.weight"] == ADAMW
    assert routed.labels["body.weight"] == MUON
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # names alone cannot know: no vocabulary, no warning
        by_name = build_param_groups(model.named_parameters(), lr=0.02, weight_decay=0.1)
    assert by_name.labels["table.weight"] == MUON
    # An embedding known by its name gives the vocabulary: a head named otherwise warns.
    named = [
        ("embed_tokens.weight", model.table.weight),
        ("to_vocab.weight", model.to_vocab.weight),
    ]
    with pytest.warns(UserWarning, match=r"vocabulary-sized dim \(\[5000\]\).*to_vocab.weight"):
        build_param_groups(named, lr=0.02, weight_decay=0.1)


def test_names_of_other_families_only_as_whole_components() -> None:
    named = [
        ("bert.embeddings.word_embeddings.weight", torch.zeros(1200, 16)),
        ("bert.encoder.layer.0.attention.output.dense.weight", torch.zeros(16, 16)),
        ("_orig_mod.output.weight", torch.zeros(1200, 16)),  # torchtitan's head, compiled
        ("gpt_neox.embed_in.weight", torch.zeros(1200, 16)),
        ("embed_out.weight", torch.zeros(1200, 16)),
        ("decoder.output_projection.weight", torch.zeros(16, 16)),
    ]
    named = [(n, nn.Parameter(t)) for n, t in named]
    routed = build_param_groups(named, lr=0.02, weight_decay=0.1)
    assert [routed.labels[n] for n, _ in named] == [ADAMW, MUON, ADAMW, ADAMW, ADAMW, MUON]


def test_summary_names_every_parameter_its_group_and_why() -> None:
    routed = build_param_groups(_TitanLlama(), lr=0.02, weight_decay=0.1)
    text = routed.summary()
    lines = text.splitlines()
    assert lines[0].split() == ["parameter", "shape", "group", "why"]
    assert len(lines) == 1 + len(routed.labels)
    output = next(line for line in lines if line.startswith("output.weight"))
    assert "1500x32" in output and "adamw" in output and "output head" in output
    norm = next(line for line in lines if line.startswith("norm.weight"))
    assert "1-D: not a matrix" in norm


def test_an_mlp_as_wide_as_the_vocabulary_is_not_a_head() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=1024, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model says what is what: no guessing
        routed = build_param_groups(transformers.LlamaForCausalLM(config), lr=0.02, weight_decay=0)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert routed.labels[f"model.layers.0.mlp.{proj}.weight"] == MUON
    assert routed.labels["lm_head.weight"] == ADAMW

    class Titan(nn.Module):  # no get_output_embeddings: the root's linear onto the vocabulary
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(1024, 32)
            self.ffn = nn.Sequential(nn.Linear(32, 1024), nn.Linear(1024, 32))
            self.head = nn.Linear(32, 1024, bias=False)

    routed = build_param_groups(Titan(), lr=0.02, weight_decay=0)
    assert routed.labels["ffn.0.weight"] == MUON and routed.labels["head.weight"] == ADAMW


def test_a_position_table_is_no_vocabulary() -> None:
    named = [
        ("wte.weight", torch.zeros(1000, 1024)),
        ("wpe.weight", torch.zeros(1024, 1024)),  # positions: as wide as the model
        ("h.0.mlp.c_fc.weight", torch.zeros(1024, 4096)),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_param_groups([(n, nn.Parameter(t)) for n, t in named], lr=0.02, weight_decay=0)


def test_a_tied_table_goes_by_any_of_its_names() -> None:
    shared = nn.Parameter(torch.zeros(1200, 16))
    named = [("shared.weight", shared), ("encoder.embed_tokens.weight", shared)]
    routed = build_param_groups(named, lr=0.02, weight_decay=0)
    assert routed.labels == {"shared.weight": ADAMW}
    assert "tied to encoder.embed_tokens.weight" in routed.reasons["shared.weight"]


def test_groups_without_an_algorithm_split_by_shape() -> None:
    w, v = nn.Parameter(torch.randn(8, 12)), nn.Parameter(torch.randn(12))
    opt = Muon([w, v], lr=0.02)
    assert [(g["algorithm"], len(g["params"])) for g in opt.param_groups] == [
        ("muon", 1),
        ("adamw", 1),
    ]
    u, b = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4))
    opt.add_param_group({"params": [u, b], "weight_decay": 0.5})
    assert [(g["algorithm"], g["weight_decay"]) for g in opt.param_groups[2:]] == [
        ("muon", 0.5),
        ("adamw", 0.5),
    ]
    for p in (w, v, u, b):
        p.grad = torch.randn(p.shape)
    opt.step()
    with pytest.raises(ValueError, match="empty parameter list"):  # torch's own errors stay
        Muon([])
