"""Model presets for benchmarks and training: Hugging Face causal LMs from a config, random init.

Nothing is downloaded: each preset is a config written out here. The tiny presets are
sized for CPU runs (``tiny-qwen3-moe``, the widest, is the step-memory and overhead workload);
``qwen3-30b-a3b`` and ``glm-4.5-air`` carry the published ``config.json`` values of
Qwen/Qwen3-30B-A3B and zai-org/GLM-4.5-Air, for GPU machines (cut them with ``num_layers``).
For those, :func:`param_shapes` gives the parameter shapes without allocating anything (the
model is built on the ``meta`` device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "MODEL_PRESETS",
    "attention_dims",
    "build_model",
    "model_config",
    "param_shapes",
]


@dataclass(frozen=True)
class ModelPreset:
    """A transformers config class name plus the keyword arguments that define the model."""

    config_class: str
    config: dict[str, Any] = field(default_factory=dict)
    description: str = ""


MODEL_PRESETS: dict[str, ModelPreset] = {
    "tiny-moe": ModelPreset(
        "Qwen3MoeConfig",
        dict(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            # A dense first layer, like GLM's first_k_dense_replace, so that both MLP kinds
            # (plain 2-D weights and 3-D expert stacks) are present.
            mlp_only_layers=[0],
            max_position_embeddings=512,
            tie_word_embeddings=False,
        ),
        "small Qwen3-MoE: 4 layers (first dense), hidden 256, 8 experts; for CPU runs",
    ),
    # The step-memory workload: a tiny Qwen3-MoE whose Muon matrices are 256-1024 wide,
    # so that Newton-Schulz dominates the step as it does at scale.
    "tiny-qwen3-moe": ModelPreset(
        "Qwen3MoeConfig",
        dict(
            vocab_size=1024,
            hidden_size=512,
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            max_position_embeddings=512,
            tie_word_embeddings=False,
        ),
        "tiny Qwen3-MoE: 4 layers (first dense), hidden 512, 8 experts of 256, vocab 1024",
    ),
    "tiny-dense": ModelPreset(
        "Qwen3Config",
        dict(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        ),
        "tiny Qwen3: 2 layers, hidden 128; for tests",
    ),
    # No QK-norm (unlike the Qwen3 presets): its logits grow with its q/k weights, which is
    # what QK-clip bounds (the qk-clip demo in docs/training.md).
    "tiny-llama": ModelPreset(
        "LlamaConfig",
        dict(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        ),
        "tiny Llama: 2 layers, hidden 128, GQA 4/2 heads, no QK-norm; for QK-clip runs",
    ),
    # shardmuon train --task lm's model: byte-level (256 bytes and an end-of-text id), a
    # sequence of 256, sized so that 300 steps at 2 CPU ranks take a few minutes
    # (docs/training.md has the measured step time).
    "lm-llama": ModelPreset(
        "LlamaConfig",
        dict(
            vocab_size=257,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
        "small Llama for byte-level LM: 3 layers, hidden 128, GQA 4/2 heads, sequence 256",
    ),
    # Qwen/Qwen3-30B-A3B config.json.
    "qwen3-30b-a3b": ModelPreset(
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            attention_bias=False,
            tie_word_embeddings=False,
        ),
        "Qwen3-30B-A3B shapes (48 layers, 128 experts); GPU",
    ),
    # zai-org/GLM-4.5-Air config.json.
    "glm-4.5-air": ModelPreset(
        "Glm4MoeConfig",
        dict(
            vocab_size=151552,
            hidden_size=4096,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=46,
            num_attention_heads=96,
            num_key_value_heads=8,
            head_dim=128,
            n_routed_experts=128,
            n_shared_experts=1,
            num_experts_per_tok=8,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            attention_bias=True,
            use_qk_norm=False,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "partial_rotary_factor": 0.5,
            },
            tie_word_embeddings=False,
        ),
        "GLM-4.5-Air shapes (46 layers, 128 experts + 1 shared); GPU",
    ),
}


def _check_preset(name: str) -> ModelPreset:
    if name not in MODEL_PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; accepted: {', '.join(sorted(MODEL_PRESETS))}"
        )
    return MODEL_PRESETS[name]


def _check_positive(label: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be a positive int or None, got {value!r}")
    if value < 1:
        raise ValueError(f"{label} must be >= 1, got {value}")


# Width keys a ``scale`` divides (layer, head and expert counts stay: the plan keeps the full
# model's matrices per batch, only smaller).
SCALED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "head_dim",
)


def model_config(
    name: str,
    *,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    scale: int = 1,
):
    """The transformers config of preset ``name``, optionally cut to ``num_layers`` layers
    and with its widths (:data:`SCALED_KEYS`, the vocabulary included) divided by ``scale``."""
    preset = _check_preset(name)
    _check_positive("num_layers", num_layers)
    _check_positive("vocab_size", vocab_size)
    _check_positive("scale", scale)
    import transformers

    kwargs = dict(preset.config)
    for key in SCALED_KEYS:
        if key in kwargs and scale > 1:
            kwargs[key] = max(1, kwargs[key] // scale)
    if num_layers is not None:
        kwargs["num_hidden_layers"] = num_layers
        if "mlp_only_layers" in kwargs:
            kwargs["mlp_only_layers"] = [i for i in kwargs["mlp_only_layers"] if i < num_layers]
        if "first_k_dense_replace" in kwargs:
            kwargs["first_k_dense_replace"] = min(kwargs["first_k_dense_replace"], num_layers)
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    return getattr(transformers, preset.config_class)(**kwargs)


def attention_dims(name: str) -> dict[str, int]:
    """``num_attention_heads``, ``num_key_value_heads`` and ``head_dim`` of preset ``name``."""
    cfg = _check_preset(name).config
    return {k: cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}


def build_model(
    name: str,
    *,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Build preset ``name`` as ``AutoModelForCausalLM.from_config`` with random init (seeded).

    The same ``seed`` gives the same weights on every process, so that every rank of a
    distributed run can build the full model and keep its own shards.
    """
    config = model_config(name, num_layers=num_layers, vocab_size=vocab_size)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def param_shapes(
    name: str, num_layers: int | None = None, *, vocab_size: int | None = None, scale: int = 1
) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of preset ``name`` (widths divided by ``scale``), built on the
    ``meta`` device (no memory)."""
    config = model_config(name, num_layers=num_layers, vocab_size=vocab_size, scale=scale)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
