"""An independent reference for QK-clip tests: each attention layer's pre-softmax logits
recomputed in float64 from the inputs the layer saw, its own q/k projections (and QK-norm
gains) and its rotary embedding, with the full score matrix and an explicit mask.

``capture_attention_inputs(model)`` records, per attention module, the ``hidden_states`` and
``position_embeddings`` of each forward call; ``reference_max_logits(layer, captured, mask)``
gives the per-head maximum over every captured call.
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from shardmuon.planning.placements import local_tensor

__all__ = ["capture_attention_inputs", "reference_logits", "reference_max_logits", "weight_of"]


def weight_of(param: Tensor | None) -> Tensor | None:
    """A plain tensor's copy of a (possibly DTensor) parameter's full value, float64."""
    if param is None:
        return None
    full = param.full_tensor() if hasattr(param, "full_tensor") else local_tensor(param)
    return full.detach().double().clone()


@contextmanager
def capture_attention_inputs(model: nn.Module, modules: list[nn.Module]):
    """Yield ``{module: [(hidden_states, cos, sin), ...]}`` filled by the forwards run inside."""
    captured: dict[nn.Module, list] = {m: [] for m in modules}

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        captured[module].append((hidden.detach().clone(), cos.detach(), sin.detach()))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def _rms_norm(x: Tensor, gain: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, module: nn.Module) -> Tensor:
    apply = sys.modules[type(module).__module__].apply_rotary_pos_emb
    rotated, _ = apply(x, x, cos.double(), sin.double())
    return rotated


def _project(layer, hidden: Tensor, which: str) -> Tensor:
    """``[batch, heads, seq, head_dim]`` float64 queries or keys of one captured call."""
    module = layer.q_module if which == "q" else layer.k_module
    start = layer.q_start if which == "q" else layer.k_start
    heads = layer.num_heads if which == "q" else layer.num_kv_heads
    rows = slice(start, start + heads * layer.head_dim)
    w = weight_of(module.weight)[rows]
    b = weight_of(getattr(module, "bias", None))
    out = hidden.double() @ w.T + (b[rows] if b is not None else 0)
    batch, seq = hidden.shape[:2]
    out = out.view(batch, seq, heads, layer.head_dim)
    norm = layer.q_norm if which == "q" else layer.k_norm
    if norm is not None:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        out = _rms_norm(out, weight_of(norm.weight), eps)
    return out.transpose(1, 2)


def reference_logits(layer, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``[batch, heads, seq, seq]`` float64 logits ``q_i . k_j / sqrt(head_dim)`` (rotary
    applied, grouped-query keys repeated), unmasked."""
    q = _rotate(_project(layer, hidden, "q"), cos, sin, layer.module)
    k = _rotate(_project(layer, hidden, "k"), cos, sin, layer.module)
    k = k.repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=1)
    scaling = getattr(layer.module, "scaling", layer.head_dim**-0.5)
    return q @ k.transpose(-1, -2) * scaling


def reference_max_logits(
    layer, calls: list, padding: Tensor | None = None, segments: Tensor | None = None
) -> Tensor:
    """Per query head, the largest causal logit over every captured call; ``padding``:
    ``[batch, seq]`` 1 for real tokens, 0 for padding (keys that are padding are masked);
    ``segments``: ``[batch, seq]`` document ids of packed sequences (no logit across two)."""
    best = torch.full((layer.num_heads,), -math.inf, dtype=torch.float64)
    for hidden, cos, sin in calls:
        logits = reference_logits(layer, hidden, cos, sin).cpu()
        seq = logits.shape[-1]
        valid = torch.ones(seq, seq, dtype=torch.bool).tril()
        valid = valid.expand(logits.shape[0], 1, seq, seq)
        if padding is not None:
            valid = valid & padding.bool()[:, None, None, :]
        if segments is not None:
            valid = valid & (segments[:, None, :, None] == segments[:, None, None, :])
        best = torch.maximum(best, logits.masked_fill(~valid, -math.inf).amax(dim=(0, 2, 3)))
    return best
