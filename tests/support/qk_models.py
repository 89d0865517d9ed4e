"""Tiny Hugging Face models for the QK-clip tests (``tests/qk_clip``), their inputs, and the
float64 reference maxima of what a forward saw (``attention_reference.py``)."""

from __future__ import annotations

import torch
import transformers
from attention_reference import capture_attention_inputs, reference_max_logits

from shardmuon.qk_clip import find_attention_layers

VOCAB = 96


def make_model(kind: str = "llama", *, heads=4, kv_heads=4, layers=2, seed=0, impl="sdpa"):
    """A tiny Hugging Face model; its first layer's q/k weights blown up so that its logits
    run to ~30 (far above the thresholds used here) while layer 1 stays small."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    if kind == "llama":
        config = transformers.LlamaConfig(head_dim=16, **common)
    elif kind == "llama-bias":
        config = transformers.LlamaConfig(head_dim=16, attention_bias=True, **common)
    elif kind == "qwen3":  # QK-norm
        config = transformers.Qwen3Config(head_dim=16, **common)
    elif kind == "phi3":  # fused [Q; K; V]
        config = transformers.Phi3Config(pad_token_id=0, **common)
    else:
        raise ValueError(kind)
    config._attn_implementation = impl
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layer = find_attention_layers(model)[0]
    with torch.no_grad():
        if layer.qk_norm:
            layer.q_norm.weight.mul_(6.0)
            layer.k_norm.weight.mul_(6.0)
        else:
            for module in {layer.q_module, layer.k_module}:
                module.weight.mul_(16.0)
                # Different heads, different sizes: some clipped, some not.
                rows = torch.linspace(0.3, 1.5, module.weight.shape[0] // 16).repeat_interleave(16)
                module.weight.mul_(rows[:, None])
    model.train()
    return model


def tokens(batch=3, seq=10, seed=1):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def record(model, clip, *batches, **kwargs):
    """Run the forwards with inputs captured; return ``{layer name: reference maxima}``."""
    layers = clip.layers
    with capture_attention_inputs(model, [lay.module for lay in layers]) as captured:
        for batch in batches:
            model(batch, **kwargs)
    mask = kwargs.get("attention_mask")
    return {lay.name: reference_max_logits(lay, captured[lay.module], mask) for lay in layers}, {
        lay.name: captured[lay.module] for lay in layers
    }
