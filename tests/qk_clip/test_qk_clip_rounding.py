"""QK-clip's bound against rounding: with bf16, fp16 or fp32 weights, after ``apply()`` every
head's max logit on the inputs it saw, recomputed in float64 from the rounded weights
(``tests/support/attention_reference.py``), is at most the threshold itself, not "about" it.

Before the rounding slack, a head clipped to exactly tau landed up to 0.8% above it in bf16
(the maxima are measured on bf16 activations, and the scaled rows are rounded to bf16) and a
few fp32 roundoffs above it in fp32.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import capture_attention_inputs, reference_max_logits
from qk_models import make_model, tokens

from shardmuon.qk_clip import QKClip
from shardmuon.qk_clip.logits import rounding_slack, unit_roundoff

SEEDS = range(6)
# Thresholds as fractions of the layer's smallest and largest head maximum: below every
# head, between them, and just under the largest (a head that barely exceeds tau).
FRACTIONS = (0.5, 0.8, 0.999)


pytestmark = pytest.mark.usefixtures("no_leftover_clips")


def _worst_ratio(kind: str, kv_heads: int, dtype: torch.dtype, alpha: float) -> float:
    """The largest fp64 max logit after ``apply()`` over the threshold, over every seed,
    threshold and head; asserts along the way that each threshold below every head clipped."""
    worst = 0.0
    for seed in SEEDS:
        model = make_model(kind, kv_heads=kv_heads, layers=1, seed=seed).to(dtype)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        x = tokens(batch=2, seq=12, seed=100 + seed)
        clip = QKClip(model, threshold=1.0, alpha=alpha)
        try:
            layer = clip.layers[0]
            for fraction in FRACTIONS:
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        param.copy_(initial[name])
                with capture_attention_inputs(model, [layer.module]) as captured:
                    model(x)
                before = reference_max_logits(layer, captured[layer.module])
                low, high = float(before.min()), float(before.max())
                clip.threshold = low * fraction if fraction < 0.9 else high * fraction
                stats = clip.apply()
                after = reference_max_logits(layer, captured[layer.module])
                worst = max(worst, float(after.max()) / clip.threshold)
                # Just under the largest head, its measured maximum may fall below tau.
                assert stats.clipped_heads > 0 or fraction > 0.9, (kind, seed, fraction)
        finally:
            clip.remove()
    return worst


@pytest.mark.parametrize("kind", ["llama", "llama-bias", "qwen3", "phi3"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_no_head_ends_above_the_threshold_whatever_the_weights_dtype(kind, kv_heads, dtype):
    """Every head, seed and threshold: the rounded weights' fp64 logits are <= tau, with no
    tolerance (a head just above tau included)."""
    worst = _worst_ratio(kind, kv_heads, dtype, alpha=0.5)
    assert worst <= 1.0, f"{kind} {dtype}: a head ended at {worst:.6f} x the threshold"


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_the_bound_holds_in_bf16_when_one_side_takes_the_whole_scale(alpha):
    assert _worst_ratio("llama", 2, torch.bfloat16, alpha) <= 1.0


@pytest.mark.parametrize(
    ("weights", "activations", "expected"),
    [
        (torch.float32, torch.float32, 2**-16),  # the floor
        (torch.bfloat16, torch.bfloat16, 4 * (2**-8 + 2**-8)),
        (torch.float16, torch.float16, 4 * (2**-11 + 2**-11)),
        (torch.float32, torch.bfloat16, 4 * (2**-8 + 2**-24)),  # fp32 weights, bf16 autocast
    ],
)
def test_the_slack_follows_the_unit_roundoffs(weights, activations, expected):
    slack = rounding_slack(unit_roundoff(activations), unit_roundoff(weights))
    assert slack == pytest.approx(expected, rel=1e-12)


def test_bf16_activations_on_fp32_weights_aim_the_clip_lower():
    """Autocast: fp32 weights, bf16 logits. The recorder's precision, not the weights',
    sets the slack, and the fp32 weights' fp64 logits on the same inputs end below tau."""
    model = make_model("llama", kv_heads=2, layers=1)
    clip = QKClip(model, threshold=1.0)
    try:
        layer = clip.layers[0]
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        with capture_attention_inputs(model, [layer.module]) as captured, autocast:
            model(tokens(batch=2, seq=12))
        before = reference_max_logits(layer, captured[layer.module])
        clip.threshold = 0.8 * float(before.min())
        stats = clip.apply().layers[0]
        assert stats.clipped_heads == layer.num_heads
        assert stats.target == pytest.approx(clip.threshold * (1 - 4 * (2**-8 + 2**-24)))
        after = reference_max_logits(layer, captured[layer.module])
        assert (after <= clip.threshold).all(), after / clip.threshold
        assert layer.q_module.weight.dtype == torch.float32
    finally:
        clip.remove()
